"""A Ray cluster whose nodes are hosts of a :class:`~elastic_llm.hosts.lab.Lab`.

Owns: starting the head (host ``h1``, no CPUs, as the loopback cluster's) and worker nodes, one
per host, each with its own address, object store and CPUs; running a driver in a host of its
own (:meth:`RayHosts.driver`), which is a Ray node without CPUs as a real driver's machine is
(Ray's driver moves objects through its own node's object store: with none on its host, a
driver's pulls of objects from other hosts never complete); and
stopping a node the way a machine dies: SIGKILL of the processes in its namespace
(:meth:`RayHosts.stop_node`), never ``ray stop``, which would stop every Ray of the machine.
A node that comes back after its host was stopped joins as a new Ray node (:meth:`RayHosts.add_node`).

Ray's token authentication is on (the token file of the machine's user is shared by every
host); its scratch lives in the lab's own folder, removed with the lab.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from elastic_llm.hosts.lab import Host, Lab, LabError, Output
from elastic_llm.runtime.session import FAST_HEALTH, NODE_STORE_BYTES, ensure_auth_token

GCS_PORT = 6379
START_S = 60.0  # longest ``ray start`` of one node may take on a loaded 2-core machine
DRIVER_STORE_BYTES = 256 << 20  # the driver's node: what the driver itself gets or puts (evaluation, records)
RAY = (sys.executable, "-m", "ray.scripts.scripts")
RAY_ENV = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}


class RayHosts:
    """The head on ``h1``, worker nodes ``w1``, ``w2``... and the driver's host ``d``."""

    def __init__(self, lab: Lab, system_config: Mapping[str, object] | None = None) -> None:
        self.lab = lab
        self.system_config = dict(FAST_HEALTH if system_config is None else system_config)
        self.workers: list[str] = []
        self._count = 0

    @property
    def head(self) -> Host:
        return self.lab.hosts["h1"]

    @property
    def address(self) -> str:
        return f"{self.head.addr}:{GCS_PORT}"

    def start(self, workers: int, cpus_per_node: float, store_bytes: int = NODE_STORE_BYTES, head_store_bytes: int | None = None) -> RayHosts:
        """The head, ``workers`` nodes of ``cpus_per_node`` CPUs and the driver's host."""
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        ensure_auth_token()
        self.lab.add_host("h1")
        self._ray(self.head, ["--head", f"--port={GCS_PORT}", "--num-cpus=0", f"--object-store-memory={head_store_bytes or store_bytes}",
                              "--include-dashboard=false", f"--system-config={json.dumps(self.system_config)}"])
        for _ in range(workers):
            self.add_node(cpus_per_node, store_bytes)
        driver = self.lab.add_host("d")  # a Ray node without CPUs: a driver reaches the object store through its own node's
        self._ray(driver, [f"--address={self.address}", "--num-cpus=0", f"--object-store-memory={DRIVER_STORE_BYTES}"])
        return self

    def add_node(self, cpus: float, store_bytes: int = NODE_STORE_BYTES, labels: Mapping[str, str] | None = None) -> Host:
        """A new host with a Ray worker node of ``cpus`` CPUs joined to the head."""
        self._count += 1
        host = self.lab.add_host(f"w{self._count}")
        extra = [f"--labels={json.dumps(dict(labels))}"] if labels else []
        self._ray(host, [f"--address={self.address}", f"--num-cpus={cpus:g}", f"--object-store-memory={store_bytes}", *extra])
        self.workers.append(host.name)
        return host

    def _ray(self, host: Host, args: Sequence[str]) -> None:
        log = self.lab.tmp / f"{host.name}.start.log"
        argv = [*RAY, "start", f"--node-ip-address={host.addr}", f"--temp-dir={self.lab.tmp / 'ray'}", "--disable-usage-stats", *args]
        with log.open("a") as out:
            env = {**RAY_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}  # a multi-node cluster, on its own addresses
            rc = _exit_code(self.lab.popen(host.name, argv, env=env, stdout=out, stderr=subprocess.STDOUT), START_S)
        if rc != 0:
            tail = log.read_text(errors="replace")[-800:]
            raise LabError(f"ray start on {host.name} ({host.addr}) failed (exit {rc}): {tail}")

    def replace(self, name: str, cpus: float, store_bytes: int = NODE_STORE_BYTES) -> Host:
        """Host ``name`` stopped and removed, and a new worker node (a new host) in its place:
        what an operator does with a machine that was cut off or died."""
        self.stop_node(name)
        self.lab.remove_host(name)
        self.workers.remove(name)
        return self.add_node(cpus, store_bytes)

    def rejoin(self, name: str, cpus: float, grace_s: float = 30.0, store_bytes: int = NODE_STORE_BYTES) -> list[str]:
        """Host ``name``'s Ray node starts again, a new node at the same address: what a node's
        service manager does once the machine is reachable again. Its old processes go first:
        Ray ends a node it declared dead when its link heals; whatever still runs on the host
        after ``grace_s`` is killed. Returns what was killed (each process's name and title)."""
        deadline = time.monotonic() + grace_s
        while self.lab.pids(name) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [_title(pid) for pid in self.lab.pids(name)]
        self.lab.kill(name)
        self._ray(self.lab.hosts[name], [f"--address={self.address}", f"--num-cpus={cpus:g}", f"--object-store-memory={store_bytes}"])
        return left

    def train(self, name: str, config: str, steps: int, overrides: Sequence[str] = (), timeout: float = 300.0,
              cwd: str | None = None) -> list[dict[str, object]]:
        """``elastic-llm train`` of ``config`` for ``steps`` steps on the driver's host (with
        ``--set`` ``overrides``); its metrics lines. Its output goes to ``<name>.log`` in the lab's
        folder; LabError with the log's tail if it fails or outlives ``timeout``."""
        metrics, log = self.lab.tmp / f"{name}.jsonl", self.lab.tmp / f"{name}.log"
        sets = [a for o in overrides for a in ("--set", o)]
        argv = [sys.executable, "-m", "elastic_llm.cli", "train", "--config", config, "--address", self.address,
                "--max-steps", str(steps), "--no-progress", "--metrics-out", str(metrics), *sets]
        with log.open("w") as out:
            rc = _exit_code(self.driver(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd), timeout)
        if rc != 0:
            raise LabError(f"elastic-llm train {name} on the lab failed (exit {rc}): {log.read_text(errors='replace')[-4000:]}")
        return [json.loads(line) for line in metrics.read_text().splitlines()]

    def stop_node(self, name: str) -> None:
        """The host's machine dies: SIGKILL of every process on it (its raylet, object store,
        workers and actors); the host and its link stay (:meth:`Lab.remove_host` removes them)."""
        self.lab.kill(name)

    def driver(self, argv: Sequence[str], env: Mapping[str, str] | None = None, *, stdout: Output = None, stderr: Output = None,
               cwd: str | None = None) -> subprocess.Popen[str]:
        """Run ``argv`` on the driver's host; ``ELASTIC_LLM_RAY`` in its environment is the
        cluster's address."""
        return self.lab.popen("d", argv, env={**RAY_ENV, **(env or {}), "ELASTIC_LLM_RAY": self.address}, stdout=stdout, stderr=stderr, cwd=cwd)

    def dead_workers(self) -> list[str]:
        """The worker hosts Ray no longer lists alive (asked by a driver on the driver's host)."""
        got = self.python("import ray, os, json; ray.init(address=os.environ['ELASTIC_LLM_RAY'], logging_level='ERROR');"
                          "print('ALIVE', json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))", 60)
        if got.returncode != 0:
            raise LabError(f"listing the cluster's nodes from the driver's host failed: {got.stderr[-800:]}")
        line = next((ln for ln in reversed(got.stdout.splitlines()) if ln.startswith("ALIVE ")), None)  # Ray may print to stdout too
        if line is None:
            raise LabError(f"listing the cluster's nodes from the driver's host printed no list: {got.stdout[-800:]}")
        alive = json.loads(line.removeprefix("ALIVE "))
        return [h for h in self.workers if self.lab.hosts[h].addr not in alive]

    def python(self, code: str, timeout: float, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run Python ``code`` as a driver and wait for it (at most ``timeout`` seconds)."""
        p = self.driver([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            return subprocess.CompletedProcess(p.args, -9, out, err + f"\n(killed after {timeout:g} s)")
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _exit_code(p: subprocess.Popen[str], timeout: float) -> int:
    """``p``'s exit code, or -9 once it was killed for outliving ``timeout`` seconds."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return -9


def _title(pid: int) -> str:
    """A process's name and command line (Ray's workers set theirs: ``ray::StageActor``), or why not."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160] or f"pid {pid}"
    except OSError as e:
        return f"pid {pid} ({type(e).__name__})"
