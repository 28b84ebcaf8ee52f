"""The multi-host harness itself (elastic_llm.hosts): hosts in network namespaces on a switch of
their own, their links cut whole, one way or from some peers only, slowed and healed, and the
removal of everything a lab made, also after its owner was SIGKILLed (a Ray cluster on its hosts:
test_partitions). Real namespaces, veth pairs, nftables and tc: skipped
with the reason where this machine cannot make them (no root, no iproute2 or nftables)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from elastic_llm.hosts import lab as lab_mod
from elastic_llm.hosts.lab import SUBNET, Lab, LabError, reap_stale, unavailable

WHY = unavailable(directional=True)
SERVED = 2_500_000  # bytes the "serve" listener sends on each connection
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"the multi-host harness cannot run here: {WHY}"), pytest.mark.timeout(180)]

LISTEN = textwrap.dedent("""
    import socket, sys
    kind, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])  # addr: the lab host's own address
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if kind == "udp" else socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    print("ready", flush=True)
    if kind == "udp":
        s.settimeout(float(sys.argv[4]))
        try:
            print(s.recv(64).decode(), flush=True)
        except socket.timeout:
            print("nothing", flush=True)
    elif kind == "serve":  # every connection gets argv[3] bytes, then EOF
        s.listen()
        block = b"x" * (1 << 16)
        while True:
            c, _ = s.accept()
            left = int(sys.argv[4])
            while left > 0:
                left -= c.send(block[:left])
            c.close()
    else:
        s.listen()
        n = 0
        while True:
            c, _ = s.accept()
            while (d := c.recv(1 << 20)):
                n += len(d)
            c.close()
            print("got", n, flush=True)
""")


def _in(lab: Lab, host: str, code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", lab.hosts[host].ns, sys.executable, "-c", code, *args],
                          capture_output=True, text=True, timeout=timeout)


def connects(lab: Lab, src: str, dst: str, port: int = 7000, nbytes: int = 1000) -> bool:
    """A TCP connection from ``src`` to ``dst``'s listener carries ``nbytes`` (1 s to connect)."""
    code = ("import socket, sys\ntry:\n s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0)\n"
            " s.settimeout(30); s.sendall(b'x' * int(sys.argv[3])); s.close(); print('ok')\nexcept OSError as e:\n print('no', e)")
    return _in(lab, src, code, lab.hosts[dst].addr, str(port), str(nbytes)).stdout.startswith("ok")


def fetch_seconds(lab: Lab, src: str, dst: str, port: int = 7002) -> float:
    """Seconds ``src`` takes to receive all of what ``dst``'s server sends on a connection,
    timed by the receiver from its first byte to the server's close."""
    code = ("import socket, sys, time\ns = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)\n"
            "first = s.recv(1 << 16); t0 = time.monotonic(); n = len(first)\nwhile (d := s.recv(1 << 20)):\n n += len(d)\n"
            "print(n, time.monotonic() - t0)")
    n, seconds = _in(lab, src, code, lab.hosts[dst].addr, str(port), timeout=60).stdout.split()
    assert int(n) == SERVED, n
    return float(seconds)


def datagram_arrives(lab: Lab, src: str, dst: str, port: int = 7001) -> bool:
    """One UDP datagram from ``src`` reaches ``dst`` (a one-way check: no answer needed)."""
    rx = lab.popen(dst, [sys.executable, "-c", LISTEN, "udp", lab.hosts[dst].addr, str(port), "1.5"], stdout=subprocess.PIPE)
    assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
    _in(lab, src, "import socket, sys; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hello', (sys.argv[1], int(sys.argv[2])))",
        lab.hosts[dst].addr, str(port))
    out, _ = rx.communicate(timeout=10)
    return out.strip() == "hello"


@pytest.fixture(scope="module")
def lab():
    with Lab.create() as lab:
        for name in ("a", "b", "c"):
            lab.add_host(name)
        for argv in (["tcp", "7000"], ["serve", "7002", str(SERVED)]):
            server = lab.popen("a", [sys.executable, "-c", LISTEN, argv[0], lab.hosts["a"].addr, *argv[1:]], stdout=subprocess.PIPE)
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield lab


def test_hosts_reach_each_other_over_the_switch_and_the_machine_is_not_connected(lab):
    assert [h.addr for h in lab.hosts.values()] == [f"{SUBNET}.1", f"{SUBNET}.2", f"{SUBNET}.3"]
    assert connects(lab, "b", "a") and connects(lab, "c", "a")
    own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert SUBNET not in own  # the machine's own namespace has no address on the lab's subnet
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert not any(h.port in links for h in lab.hosts.values())  # nor any end of the lab's veth pairs
    assert all(lab.pids(h) == [] or h == "a" for h in lab.hosts)  # only a's listener runs


def test_a_cut_link_carries_nothing_either_way_until_it_heals(lab):
    lab.cut("a")
    try:
        assert not connects(lab, "b", "a")
        assert not datagram_arrives(lab, "a", "b")
    finally:
        lab.heal("a")
    assert connects(lab, "b", "a") and datagram_arrives(lab, "a", "b")


def test_a_link_cut_one_way_drops_only_that_way(lab):
    lab.cut("a", "out")
    try:
        assert datagram_arrives(lab, "b", "a") and not datagram_arrives(lab, "a", "b")
    finally:
        lab.heal("a")
    lab.cut("a", "in")
    try:
        assert not datagram_arrives(lab, "b", "a") and datagram_arrives(lab, "a", "b")
    finally:
        lab.heal("a")
    assert datagram_arrives(lab, "b", "a") and datagram_arrives(lab, "a", "b")


def test_a_cut_from_some_peers_leaves_the_others_connected(lab):
    lab.cut("a", peers=["b"])
    try:
        assert not connects(lab, "b", "a") and connects(lab, "c", "a")
        assert not datagram_arrives(lab, "a", "b") and datagram_arrives(lab, "a", "c")
    finally:
        lab.heal("a")
    assert connects(lab, "b", "a")


def test_a_slowed_link_moves_bytes_no_faster_than_its_rate(lab):
    """2.5 MB at 20 Mbit/s take at least 1 s however idle the machine is (a lower bound, timed
    by the receiver: a loaded machine only makes it slower); healed, the link is not capped."""
    lab.slow("a", 20)
    try:
        slow_s = fetch_seconds(lab, "b", "a")
    finally:
        lab.heal("a")
    assert slow_s >= 0.9 * SERVED * 8 / 20e6, slow_s
    qdiscs = subprocess.run(["ip", "netns", "exec", lab.hosts["a"].ns, "tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
    assert "tbf" not in qdiscs and fetch_seconds(lab, "b", "a") > 0


def test_bad_fault_arguments_name_the_fix(lab):
    with pytest.raises(LabError, match="cut direction 'sideways': use one of both, in, out"):
        lab.cut("a", "sideways")
    with pytest.raises(LabError, match="slow link rate 0 Mbit/s: give a positive rate"):
        lab.slow("a", 0)
    with pytest.raises(LabError, match="host name 'a': give a new alphanumeric name"):
        lab.add_host("a")


OWNER = textwrap.dedent("""
    import signal, sys
    from elastic_llm.hosts.lab import Lab
    lab = Lab.create()
    lab.add_host("x")
    lab.add_host("y")
    lab.popen("x", [sys.executable, "-c", "import signal; signal.pause()"])  # a process the lab leaves behind
    print(lab.run, flush=True)
    signal.pause()  # until the test SIGKILLs it
""")


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed process whose parent died waits for the
    machine's init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_a_lab_whose_owner_was_sigkilled_is_removed_at_the_next_start_and_a_live_one_is_not(lab):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    run = owner.stdout.readline().strip()
    ns_x = f"{lab_mod.PREFIX}{run}-x"
    sleeper = [int(p) for p in subprocess.run(["ip", "netns", "pids", ns_x], capture_output=True, text=True).stdout.split()]
    assert len(sleeper) == 1 and run not in reap_stale()  # its owner lives: not stale
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert ns_x in namespaces() and running(sleeper[0])  # a SIGKILL of the owner leaves it all behind
    assert run in reap_stale()
    assert f"{lab_mod.PREFIX}{run}-" not in namespaces()
    assert not running(sleeper[0]) and not (lab_mod.STATE_DIR / f"{run}.json").exists()
    assert not (lab_mod.TMP_ROOT / run).exists()
    assert lab.hosts["a"].ns in namespaces() and connects(lab, "b", "a")  # this module's own lab lives on
