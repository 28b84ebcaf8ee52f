"""Hosts on one machine: network namespaces wired to a virtual switch, and their links' faults.

Owns: one run's namespaces (a switch: a bridge in a namespace of its own; one namespace per host,
joined to the bridge by a veth pair, with a private address on :data:`SUBNET`), what runs in
them (:meth:`Lab.popen`, :meth:`Lab.pids`, :meth:`Lab.kill`: a host's processes found by its
namespace, never by name), its links' faults (:meth:`Lab.cut` whole or one way or from some
peers only, :meth:`Lab.slow`, :meth:`Lab.heal`) and their removal: :meth:`Lab.close`, and at the
next :meth:`Lab.create` anywhere on the machine, :func:`reap_stale` for a run whose owner died
(SIGKILL included) before it closed.

The host's own namespace is never connected: nothing a lab runs can reach the machine's network
or anything beyond it, and nothing outside reaches it. Names carry the run's id
(``elh<id>-sw``, ``elh<id>-<host>``), and the run's owner (its process id and start time) is
written to :data:`STATE_DIR`, so a stale run is told apart from a live one however it ended.

Faults are made with iproute2 (a link down at the switch: every packet to and from the host
vanishes), ``tc``'s token bucket (a slow link, both ways) and nftables in the host's namespace
(drops one way, or to and from some peers only): packets are dropped, never refused, as on a
real network. Needs root, ``ip`` and, for the one-way and per-peer cuts, ``nft``:
:func:`unavailable` says why not where they are missing.

Never starts Ray (:mod:`elastic_llm.runtime.lab_cluster` does) and never decides a fault: callers do.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Union

Output = Union[int, IO[str], None]  # where a process's output goes: subprocess.PIPE, STDOUT, a file, or inherited

SUBNET = "10.213.0"  # /24 on the lab's own bridge; the host's namespace never sees it
PREFIX = "elh"
STATE_DIR = Path("/run/elastic-llm-hosts")
TMP_ROOT = Path("/tmp/elh")  # the runs' scratch (Ray's session folders): short, for Ray's socket paths
DIRECTIONS = ("both", "in", "out")
CMD_S = 20.0  # longest one ip/tc/nft command may take


class LabError(RuntimeError):
    """A lab command failed; the message names the command and what it printed."""


class LabUnavailable(LabError):
    """Namespaces cannot be made here; the message says what is missing and the fix."""


@dataclass(frozen=True)
class Host:
    """One host of a lab: its name (``h1``), namespace, address and its veth's switch end."""

    name: str
    ns: str
    addr: str
    port: str  # the veth's end in the switch's namespace, on the bridge


def unavailable(directional: bool = False) -> str | None:
    """Why a lab cannot run on this machine (None: it can), found by making a namespace (and
    with ``directional``, for the one-way and per-peer cuts, an nftables table in it)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container that grants CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2's ip and tc are missing (apt-get install -y iproute2)"
    if directional and shutil.which("nft") is None:
        return "one-way and per-peer cuts need nftables (apt-get install -y nftables)"
    return _probe(directional)


@functools.cache
def _probe(directional: bool) -> str | None:
    ns = f"elprobe{os.getpid()}"  # not a lab's name: reap_stale leaves it alone
    made = _run(["ip", "netns", "add", ns], check=False)
    if made.returncode != 0:
        return f"this machine refuses to make a network namespace ({made.stderr.strip()[:200]}): run as root with CAP_SYS_ADMIN and CAP_NET_ADMIN"
    try:
        if directional:
            nft = _run(_in(ns, "nft", "add", "table", "inet", "probe"), check=False)
            if nft.returncode != 0:
                return f"nftables does not work in a namespace here ({nft.stderr.strip()[:200]}): one-way and per-peer cuts need it"
        return None
    finally:
        _run(["ip", "netns", "delete", ns], check=False)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LabError(f"{' '.join(argv)}: {e}") from None
    if check and p.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[:400]}")
    return p


def _in(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it is gone: a
    process id is reused, the pair is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _lab_namespaces() -> dict[str, list[str]]:
    """Run id -> its namespaces, of every lab on this machine."""
    p = _run(["ip", "netns", "list"], check=False)
    runs: dict[str, list[str]] = {}
    for line in p.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX) and "-" in name:
            runs.setdefault(name[len(PREFIX):].split("-", 1)[0], []).append(name)
    return runs


def _owner_alive(run: str) -> bool:
    try:
        owner = json.loads((STATE_DIR / f"{run}.json").read_text())
    except (OSError, ValueError):
        return False
    return _start_time(int(owner.get("pid", -1))) == owner.get("start")


def _ns_pids(ns: str) -> list[int]:
    p = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _kill_all(namespaces: Iterable[str], wait_s: float = 10.0) -> None:
    """SIGKILL every process in ``namespaces``, until none is left (at most ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = [pid for ns in namespaces for pid in _ns_pids(ns)]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _remove_run(run: str, namespaces: Iterable[str]) -> None:
    namespaces = list(namespaces)
    _kill_all(namespaces)
    for ns in sorted(namespaces, key=lambda n: n.endswith("-sw")):  # hosts first, the switch last
        _run(["ip", "netns", "delete", ns], check=False)
    (STATE_DIR / f"{run}.json").unlink(missing_ok=True)
    shutil.rmtree(TMP_ROOT / run, ignore_errors=True)


def reap_stale() -> list[str]:
    """Remove the labs whose owner is gone (it ended without closing: a crash, a SIGKILL): their
    processes, namespaces, state file and scratch. Returns their run ids."""
    namespaces = _lab_namespaces()
    state_files = [f.stem for f in STATE_DIR.glob("*.json")] if STATE_DIR.is_dir() else []
    scratch = [d.name for d in TMP_ROOT.iterdir()] if TMP_ROOT.is_dir() else []
    stale = {run: namespaces.get(run, []) for run in {*namespaces, *state_files, *scratch} if not _owner_alive(run)}
    for run, nss in stale.items():
        _remove_run(run, nss)
    return sorted(stale)


class Lab:
    """One run's switch and hosts. :meth:`create` makes it (after reaping stale runs),
    :meth:`attach` joins it from another process of the same run (a driver in one of its
    hosts, which strikes its links); only the creator's :meth:`close` removes it."""

    def __init__(self, run: str, hosts: Mapping[str, Host] | None = None, owner: bool = False) -> None:
        self.run = run
        self.switch = f"{PREFIX}{run}-sw"
        self.hosts: dict[str, Host] = dict(hosts or {})
        self.owner = owner
        self.tmp = TMP_ROOT / run

    # ---------------------------------------------------------------- making and removing
    @classmethod
    def create(cls) -> Lab:
        """A new lab with its switch and no host yet; :class:`LabUnavailable` where it cannot run."""
        why = unavailable()
        if why:
            raise LabUnavailable(why)
        reap_stale()
        lab = cls(secrets.token_hex(3), owner=True)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        lab.tmp.mkdir(parents=True, exist_ok=True)
        lab._save()
        try:
            _run(["ip", "netns", "add", lab.switch])
            _run(_in(lab.switch, "ip", "link", "set", "lo", "up"))
            _run(_in(lab.switch, "ip", "link", "add", "br0", "type", "bridge"))
            _run(_in(lab.switch, "ip", "link", "set", "br0", "up"))
        except LabError:
            lab.close()
            raise
        return lab

    @classmethod
    def attach(cls, state: str | os.PathLike[str]) -> Lab:
        """The lab whose state file is ``state`` (``ELASTIC_LLM_LAB`` in its hosts' environment)."""
        doc = json.loads(Path(state).read_text())
        return cls(doc["run"], {n: Host(**h) for n, h in doc["hosts"].items()})

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.run}.json"

    def _save(self) -> None:
        doc = {"run": self.run, "pid": os.getpid(), "start": _start_time(os.getpid()),
               "hosts": {n: h.__dict__ for n, h in self.hosts.items()}}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.state_file)

    def add_host(self, name: str) -> Host:
        """A new host ``name`` on the switch, with the next free address; its loopback is up."""
        if name in self.hosts or not name.isalnum() or len(name) > 5:
            raise LabError(f"host name {name!r}: give a new alphanumeric name of at most 5 characters")
        used = {int(h.addr.rsplit(".", 1)[1]) for h in self.hosts.values()}
        last = next(i for i in range(1, 255) if i not in used)
        host = Host(name, f"{PREFIX}{self.run}-{name}", f"{SUBNET}.{last}", f"{PREFIX}{self.run}{name}")
        _run(["ip", "netns", "add", host.ns])
        self.hosts[name] = host
        self._save()
        _run(["ip", "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.ns])
        _run(["ip", "link", "set", host.port, "netns", self.switch])
        _run(_in(self.switch, "ip", "link", "set", host.port, "master", "br0", "up"))
        _run(_in(host.ns, "ip", "addr", "add", f"{host.addr}/24", "dev", "eth0"))
        _run(_in(host.ns, "ip", "link", "set", "eth0", "up"))
        _run(_in(host.ns, "ip", "link", "set", "lo", "up"))
        return host

    def remove_host(self, name: str) -> None:
        """Kill what runs on host ``name`` and remove it (its veth pair goes with it)."""
        host = self.hosts.pop(name)
        _kill_all([host.ns])
        _run(["ip", "netns", "delete", host.ns], check=False)
        self._save()

    def close(self) -> None:
        """Kill everything the lab runs and remove it all; only its creator does."""
        if self.owner:
            _remove_run(self.run, [self.switch, *(h.ns for h in self.hosts.values())])
            self.hosts.clear()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- processes
    def popen(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, *, stdout: Output = None,
              stderr: Output = None, cwd: str | None = None) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``name`` (text output); ``ELASTIC_LLM_LAB`` in its environment
        names the lab's state file (:meth:`attach`)."""
        full = {**os.environ, **(env or {}), "ELASTIC_LLM_LAB": str(self.state_file)}
        return subprocess.Popen(_in(self.hosts[name].ns, *argv), env=full, stdout=stdout, stderr=stderr, cwd=cwd, text=True)

    def pids(self, name: str) -> list[int]:
        """The processes running on host ``name``, by its namespace."""
        return _ns_pids(self.hosts[name].ns)

    def kill(self, name: str) -> None:
        """SIGKILL every process on host ``name`` (a machine that dies); the host stays."""
        _kill_all([self.hosts[name].ns])

    # ---------------------------------------------------------------- links
    def cut(self, name: str, direction: str = "both", peers: Iterable[str] | None = None) -> None:
        """Cut host ``name``'s link: ``both`` ways with every peer (its veth is set down at the
        switch), or only ``in`` (nothing reaches it) or ``out`` (nothing it sends arrives), or
        only to and from ``peers`` (host names). Cuts add up until :meth:`heal`."""
        if direction not in DIRECTIONS:
            raise LabError(f"cut direction {direction!r}: use one of {', '.join(DIRECTIONS)}")
        host = self.hosts[name]
        if direction == "both" and peers is None:
            _run(_in(self.switch, "ip", "link", "set", host.port, "down"))
            return
        why = unavailable(directional=True)
        if why:
            raise LabUnavailable(why)
        addrs = [self.hosts[p].addr for p in peers] if peers is not None else [f"{SUBNET}.0/24"]
        script = ["table inet elh {", " chain inbound { type filter hook input priority 0; }", " chain outbound { type filter hook output priority 0; }", "}"]
        for a in addrs:
            if direction in ("both", "in"):
                script.append(f"add rule inet elh inbound ip saddr {a} drop")
            if direction in ("both", "out"):
                script.append(f"add rule inet elh outbound ip daddr {a} drop")
        self._nft(host, "\n".join(script))

    def _nft(self, host: Host, script: str) -> None:
        p = subprocess.run(_in(host.ns, "nft", "-f", "-"), input=script, capture_output=True, text=True, timeout=CMD_S, check=False)
        if p.returncode != 0:
            raise LabError(f"nft in {host.ns} failed: {p.stderr.strip()[:400]}")

    def slow(self, name: str, mbit: float) -> None:
        """Host ``name``'s link at ``mbit`` Mbit/s each way (a token bucket on both veth ends)."""
        if not mbit > 0:
            raise LabError(f"slow link rate {mbit!r} Mbit/s: give a positive rate")
        host = self.hosts[name]
        rate = f"{mbit:g}mbit"
        burst = max(131_072, int(mbit * 1e6 / 8 / 250))  # 4 ms of the rate, at least two of veth's 64 KiB segments (a smaller bucket drops them whole)
        limit = max(64_000, int(mbit * 1e6 / 8 / 10))  # 100 ms queued before a drop
        for ns, dev in ((host.ns, "eth0"), (self.switch, host.port)):
            _run(_in(ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "limit", str(limit)))

    def heal(self, name: str) -> None:
        """Undo every cut and slowing of host ``name``'s link."""
        host = self.hosts[name]
        _run(_in(self.switch, "ip", "link", "set", host.port, "up"))
        if shutil.which("nft"):
            _run(_in(host.ns, "nft", "delete", "table", "inet", "elh"), check=False)  # absent if it was never cut one way
        for ns, dev in ((host.ns, "eth0"), (self.switch, host.port)):
            _run(_in(ns, "tc", "qdisc", "del", "dev", dev, "root"), check=False)  # absent if it was never slowed
