"""Probes of the links between the run's nodes, made from the nodes themselves (Ray tasks pinned
to each node, or a small actor on each for the rates): which pairs cannot reach each other
(:func:`cut_pairs`) and how fast each pair moves bytes over a plain TCP connection
(:func:`link_rates`).

Owns: these two probes, each bounded by its deadline. A node whose probe task does not answer in
time tells nothing (it is left out, never counted as cut or slow from its own side). The
driver's own link to a node is the node watch's business (:mod:`.liveness`); what the run does
with a cut or slow pair is the controller's (:mod:`elastic_llm.controller.links`). Never moves
an actor and never declares anything to Ray.
"""

from __future__ import annotations

import socket
import threading
import time
from itertools import combinations

from elastic_llm.controller.drains import Outcome
from elastic_llm.pipeline.transport import _read_exact
from elastic_llm.remote import remote_of
from elastic_llm.runtime.liveness import RayNodeTable, tcp_probe

CUT_PROBE_S = 1.0  # one node's connection to another's raylet: longer is a cut link
CUT_WAIT_S = 20.0  # longest the probes of :func:`cut_pairs` take in all (a node's probe task may need a worker process started)
RATE_BYTES = 4 << 20  # what :func:`link_rates` sends over each pair (4 MiB: 0.34 s at 100 Mbit/s)
RATE_WAIT_S = 60.0  # longest the transfers of :func:`link_rates` take in all


def _reach(targets: dict[str, tuple[str, int]], timeout: float) -> list[str]:  # runs on a node (a Ray task): the targets it cannot reach
    return [n for n, (host, port) in targets.items() if tcp_probe(host, port, timeout) is not Outcome.OK]


class _Prober:
    """A probe's actor on one node: a listening socket on the node's address, and sends to a peer's."""

    def __init__(self) -> None:
        import ray

        self.listener = socket.create_server((ray.util.get_node_ip_address(), 0))
        threading.Thread(target=self._serve, daemon=True).start()

    def address(self) -> tuple[str, int]:
        host, port = self.listener.getsockname()[:2]
        return str(host), int(port)

    def _serve(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            with conn:
                want = int.from_bytes(_read_exact(conn, 8), "little")
                got = 0
                while got < want:
                    chunk = conn.recv(min(1 << 20, want - got))
                    if not chunk:
                        break
                    got += len(chunk)
                conn.sendall(b"\x01")

    def send(self, address: tuple[str, int], nbytes: int, timeout: float) -> float:
        """Seconds to send ``nbytes`` to the prober at ``address`` and hear that all arrived."""
        body = bytes(nbytes)
        with socket.create_connection(address, timeout=timeout) as conn:
            t0 = time.perf_counter()
            conn.sendall(nbytes.to_bytes(8, "little") + body)
            _read_exact(conn, 1)
            return time.perf_counter() - t0


def _on(node: str) -> dict[str, object]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def cut_pairs(nodes: frozenset[str], wait_s: float = CUT_WAIT_S) -> frozenset[tuple[str, str]]:
    """The pairs of ``nodes`` (live worker nodes) whose link is cut: from each node, a task
    pinned there opens a connection to every other's raylet (at most :data:`CUT_PROBE_S` each);
    a pair is cut when either side cannot reach the other."""
    import ray

    table = {n: a for n, a in RayNodeTable().workers().items() if n in nodes}
    if len(table) < 2:
        return frozenset()
    probe = remote_of(_reach, num_cpus=0, max_retries=0)
    refs = {probe.options(**_on(n)).remote({m: a for m, a in table.items() if m != n}, CUT_PROBE_S): n for n in table}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
    cut: set[tuple[str, str]] = set()
    for ref in ready:
        try:
            unreached = ray.get(ref, timeout=0)
        except ray.exceptions.RayError:  # its node went meanwhile: the recovery sees that on its own
            continue
        n = refs[ref]
        cut |= {(n, m) if n <= m else (m, n) for m in unreached}
    for ref in set(refs) - set(ready):
        ray.cancel(ref, force=True)
    return frozenset(cut)


def link_rates(nodes: frozenset[str], nbytes: int = RATE_BYTES, wait_s: float = RATE_WAIT_S) -> dict[tuple[str, str], float]:
    """Bytes per second of each pair of ``nodes`` (live worker nodes): a small actor on each
    node listens on the node's address, and for each pair the smaller id's sends ``nbytes`` to
    the other's, timed until the receiver says all arrived. The pairs go one after the other (a
    transfer shares no link with another's); a pair whose transfer did not end in time is left
    out, and the actors end with the probe."""
    import ray

    live = sorted(n for n in RayNodeTable().workers() if n in nodes)
    if len(live) < 2:
        return {}
    actor = remote_of(_Prober, num_cpus=0, max_restarts=0)
    probers = {n: actor.options(**_on(n)).remote() for n in live}  # type: ignore[attr-defined]
    out: dict[tuple[str, str], float] = {}
    deadline = time.monotonic() + wait_s
    try:
        at = dict(zip(live, ray.get([probers[n].address.remote() for n in live], timeout=wait_s)))
        for a, b in combinations(live, 2):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                seconds = float(ray.get(probers[a].send.remote(at[b], nbytes, left), timeout=left))
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                continue
            out[(a, b)] = nbytes / max(seconds, 1e-6)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):  # a prober did not start in time: what was measured stands
        pass
    finally:
        for p in probers.values():
            ray.kill(p)
    return out
