"""Probes of the links between the run's nodes, made from the nodes themselves (Ray tasks pinned
to each node): which pairs cannot reach each other (:func:`cut_pairs`) and how fast each pair
moves bytes (:func:`link_rates`).

Owns: these two probes, each bounded by its deadline. A node whose probe task does not answer in
time tells nothing (it is left out, never counted as cut or slow from its own side). The
driver's own link to a node is the node watch's business (:mod:`.liveness`); what the run does
with a cut or slow pair is the controller's (:mod:`elastic_llm.controller.links`). Never moves
an actor and never declares anything to Ray.
"""

from __future__ import annotations

import time
from itertools import combinations

import numpy as np

from elastic_llm.controller.drains import Outcome
from elastic_llm.runtime.liveness import RayNodeTable, tcp_probe

CUT_PROBE_S = 1.0  # one node's connection to another's raylet: longer is a cut link
CUT_WAIT_S = 20.0  # longest the probes of :func:`cut_pairs` take in all (a node's probe task may need a worker process started)
RATE_BYTES = 4 << 20  # what :func:`link_rates` moves over each pair (4 MiB: 0.3 s at 100 Mbit/s)
RATE_WAIT_S = 60.0  # longest the transfers of :func:`link_rates` take in all


def _reach(targets: dict[str, tuple[str, int]], timeout: float) -> list[str]:  # runs on a node (a Ray task): the targets it cannot reach
    return [n for n, (host, port) in targets.items() if tcp_probe(host, port, timeout) is not Outcome.OK]


def _block(nbytes: int) -> np.ndarray:  # runs on the sending node: the bytes stay in its object store
    return np.ones(nbytes, dtype=np.uint8)


def _pull(refs: list[object]) -> float:  # runs on the receiving node: seconds to fetch the block from the sender's object store
    import ray

    t0 = time.perf_counter()
    ray.get(refs[0])
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
    probe = ray.remote(num_cpus=0, max_retries=0)(_reach)
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
    """Bytes per second of each pair of ``nodes`` (live worker nodes): the smaller id's node
    makes a block of ``nbytes`` in its object store (every block made before any transfer), the
    other pulls it, timed where it lands. The pairs go one after the other (a transfer shares no
    link with another's). A pair whose transfer did not end in time is left out."""
    import ray

    live = sorted(n for n in RayNodeTable().workers() if n in nodes)
    block = ray.remote(num_cpus=0, max_retries=0)(_block)
    pull = ray.remote(num_cpus=0, max_retries=0)(_pull)
    out: dict[tuple[str, str], float] = {}
    deadline = time.monotonic() + wait_s
    blocks = {n: block.options(**_on(n)).remote(nbytes) for n in live[:-1]}  # made first: a pull times the transfer alone
    ray.wait(list(blocks.values()), num_returns=len(blocks), timeout=wait_s, fetch_local=False)
    for a, b in combinations(live, 2):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ref = pull.options(**_on(b)).remote([blocks[a]])
        try:
            seconds = float(ray.get(ref, timeout=left))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            ray.cancel(ref, force=True)
            continue
        out[(a, b)] = nbytes / max(seconds, 1e-6)
    return out
