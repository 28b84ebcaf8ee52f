"""``elastic-llm bench rehome``: seconds from a burst of notices to a protected snapshot, on loopback.

A ``ray.cluster_utils.Cluster`` on 127.0.0.1 (a head without CPUs, 6 worker nodes of 1 CPU and
1 GiB of object store) trains the config (default ``jobs/tiny.yaml``: 2 stages, one replica, erasure
groups of 3, parity 1, a snapshot every 20 steps, so the committed version stays the one the
notices hit). Per round, once a version has committed, two nodes of one erasure group (the node of
stage 0 and another member) are drained at once with a 20 s notice (``ray drain-node``'s API, as
the spot watcher asks): beyond the group's parity. The run re-homes their parts of the committed
version onto the other nodes; from its metrics: the seconds from when the run saw the notice until
no group of the version depended on the draining nodes beyond parity (``reprotect`` with ``how:
rehome``), and per part copied its bytes and copy seconds. The drained nodes are then removed and
replaced before the next round.

Side by side, per round, a single-stage drain (what the spot watcher asks of one node): a fresh
run, once it has taken three steps, gets the same 20 s notice for stage 0's node alone; from its
``drain`` line, the seconds from the notice until the stage had moved (``notice_to_moved_s``, the
line's own time) against the notice's length (``moved_vs_notice``). Tests do not bound this time
(a loaded machine); this is where it is measured.

The peer, in the same run: Ray's own object transfer of the same bytes to the same target node
(an actor on another live node puts them, since a draining node takes no new actor; an actor on
the target gets them and puts its own copy, as a manager's ``adopt`` does, without the checksums
and the bookkeeping), and a plain ``memcpy`` of them in this process. Reported as ratios. Must never reach anything but 127.0.0.1
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is required) or judge its result (BENCHMARKS.md does).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.common import MID_RUN, machine_info, ratio

if TYPE_CHECKING:
    from elastic_llm.config import RunConfig
    from elastic_llm.controller.trainer import Trainer

WORKERS = 6
NOTICE_S = 20.0
STORE = 1 << 30


def _events(path: Path, kind: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            x = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if x.get("event") == kind:
            out.append(x)
    return out


def _peer_transfer_s(source: str, target: str, nbytes: int) -> float:
    """Seconds for ``nbytes`` put on ``source`` to be fetched and put again on ``target`` (Ray's
    object transfer between the two nodes, as an adopting manager pulls a part)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class Holder:
        def put(self, n: int) -> list[Any]:
            return [ray.put(np.ones(n, dtype=np.uint8))]

        def take(self, refs: list[Any]) -> float:
            t = time.perf_counter()
            arr = ray.get(refs[0])
            self.kept = ray.put(np.asarray(arr))
            return time.perf_counter() - t

    a = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(source, soft=False)).remote()
    b = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(target, soft=False)).remote()
    try:
        refs = ray.get(a.put.remote(nbytes), timeout=120)
        return float(ray.get(b.take.remote(refs), timeout=120))
    finally:
        ray.kill(a)
        ray.kill(b)


def _memcpy_s(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = src  # warm
    t = time.perf_counter()
    dst[:] = src
    return time.perf_counter() - t


def run_rehome_bench(config: str = "jobs/tiny.yaml", rounds: int = 3, overrides: list[str] | None = None) -> dict[str, Any]:
    import ray

    from elastic_llm.config import load_config
    from elastic_llm.runtime.drains import request_drain
    from elastic_llm.runtime.ray_runtime import ray_trainer
    from elastic_llm.runtime.session import loopback_cluster
    from elastic_llm.snapshot.records import ShardKey

    sets = ["parallel.stages=2", "parallel.dp=1", "parallel.cpus_per_actor=1", "parallel.placement_strategy=SPREAD", "train.eval_every=0",
            "snapshot.group_size=3", "snapshot.parity=1", "snapshot.every=20", "elastic.min_replicas=1", "elastic.max_replicas=1",
            "recovery.standby=0", MID_RUN, *(overrides or [])]
    cluster = loopback_cluster(WORKERS, 1, STORE)
    rows: list[dict[str, Any]] = []
    singles: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            with tempfile.TemporaryDirectory(prefix="bench-rehome-") as tmp:
                metrics = Path(tmp) / "metrics.jsonl"
                t = ray_trainer(load_config(config, sets), cluster=cluster, metrics_out=metrics)
                thread = threading.Thread(target=t.fit, args=(10**6,), daemon=True)
                thread.start()
                try:
                    _wait(partial(_past_a_committed_version, t), thread, f"round {r}: no committed snapshot")
                    rec = t.parts.snapshots.committed
                    first = t.group.nodes[ShardKey(0, 0)]
                    victims = [first, next(n for n in rec.group_of(first) if n != first)]
                    for v in victims:
                        request_drain(v, NOTICE_S, "bench rehome")
                    asked = time.monotonic()
                    while not [x for x in _events(metrics, "reprotect") if x.get("how") == "rehome"] and time.monotonic() - asked < NOTICE_S:
                        time.sleep(0.1)
                    time.sleep(1.0)  # the other parts' lines
                    moved = [m for m in _events(metrics, "rehome") if m["version"] == rec.version]
                    protect = [x for x in _events(metrics, "reprotect") if x.get("how") == "rehome"]
                    target = moved[0]["target"] if moved else None
                    nbytes = max((m["bytes"] for m in moved), default=0)
                    other = next((n.node_id for n in cluster.worker_nodes if n.node_id not in set(victims) and n.node_id != target), None)
                    peer = _peer_transfer_s(other, target, nbytes) if moved and nbytes and other else None  # (a draining node takes no new actor)
                    copy = max((m["copy_s"] for m in moved if m["bytes"] == nbytes), default=None)
                    rows.append({
                        "round": r, "version": rec.version, "parts_moved": len(moved), "bytes": sum(m["bytes"] for m in moved),
                        "notice_to_protected_s": round(protect[0]["seconds"], 3) if protect else None,
                        "largest_part_bytes": nbytes, "largest_part_copy_s": copy, "ray_transfer_s": peer, "memcpy_s": _memcpy_s(nbytes) if nbytes else None,
                        "copy_vs_ray_transfer": ratio(copy, peer), "copy_vs_memcpy": None, "reprotections": [x.get("how") for x in _events(metrics, "reprotect")],
                    })
                    rows[-1]["copy_vs_memcpy"] = ratio(copy, rows[-1]["memcpy_s"], 1)
                finally:
                    t.request_stop()
                    thread.join(timeout=120)
                    t.shutdown()
                _replace_nodes(cluster, set(victims))
                singles.append({"round": r, **_single_drain(cluster, load_config(config, sets), r)})
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"bench": "rehome", "machine": machine_info(), "config": config, "overrides": sets, **summary(rows, singles, NOTICE_S)}


def _past_a_committed_version(t: Trainer) -> bool:
    snapshots = t.parts.snapshots if t.parts is not None else None
    return snapshots is not None and snapshots.committed is not None and t.step > snapshots.committed.version


def _wait(done: Callable[[], bool], thread: threading.Thread, what: str, limit_s: float = 300.0) -> None:
    """Poll ``done`` until true; RuntimeError naming ``what`` if the run's thread ended or
    ``limit_s`` passed first (a hang guard: a healthy run gets there in seconds)."""
    give_up = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > give_up or not thread.is_alive():
            raise RuntimeError(f"{what} within {limit_s:.0f} s")
        time.sleep(0.1)


def _replace_nodes(cluster: Any, gone: set[str]) -> None:
    """Remove the nodes ``gone`` (their notices' deadline) and add fresh ones back to ``WORKERS``."""
    from elastic_llm.runtime.session import add_loopback_node

    for node in [n for n in cluster.worker_nodes if n.node_id in gone]:
        cluster.remove_node(node)
    while len(cluster.worker_nodes) < WORKERS:
        add_loopback_node(cluster, 1, STORE)
    cluster.wait_for_nodes()


def _single_drain(cluster: Any, cfg: RunConfig, r: int) -> dict[str, Any]:
    """A fresh run of ``cfg`` that, after three steps, gets a ``NOTICE_S`` notice for stage 0's
    node alone; :func:`single_drain_row` of its ``drain`` line. The node is then replaced."""
    from elastic_llm.runtime.drains import request_drain
    from elastic_llm.runtime.ray_runtime import ray_trainer
    from elastic_llm.snapshot.records import ShardKey

    with tempfile.TemporaryDirectory(prefix="bench-drain-") as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        t = ray_trainer(cfg, cluster=cluster, metrics_out=metrics)
        thread = threading.Thread(target=t.fit, args=(10**6,), daemon=True)
        thread.start()
        try:
            _wait(lambda: t.group is not None and ShardKey(0, 0) in t.group.nodes and t.step >= 3, thread, f"round {r}: no three steps")
            victim = t.group.nodes[ShardKey(0, 0)]
            asked = time.time()  # wall clock, as the drain line's own time
            request_drain(victim, NOTICE_S, "bench rehome: a single-stage drain")
            _wait(lambda: bool(_events(metrics, "drain")), thread, f"round {r}: no drain line", 10 * NOTICE_S)
            row = single_drain_row(_events(metrics, "drain"), asked, NOTICE_S)
        finally:
            t.request_stop()
            thread.join(timeout=120)
            t.shutdown()
    _replace_nodes(cluster, {victim})
    return row


def single_drain_row(drains: list[dict[str, Any]], asked: float, notice_s: float) -> dict[str, Any]:
    """From a single-stage drain's ``drain`` lines and the wall-clock instant ``asked`` of its
    notice: the seconds from the notice until the run had moved the node's stage (the first line's
    own time) and that against the notice's length ``notice_s`` (< 1: moved before the deadline)."""
    if not drains:
        return {"notice_to_moved_s": None, "notice_s": notice_s, "moved_vs_notice": None, "moved": 0, "how": None, "rollback_steps": None}
    d = drains[0]
    secs = round(d["time"] - asked, 3)
    return {"notice_to_moved_s": secs, "notice_s": notice_s, "moved_vs_notice": ratio(secs, notice_s), "moved": d["moved"], "how": d["how"],
            "rollback_steps": d["rollback_steps"], "drain_s": d["seconds"]}


def summary(rows: list[dict[str, Any]], singles: list[dict[str, Any]], notice_s: float) -> dict[str, Any]:
    """The report's figures: the bursts' rounds and the single-stage drains, each with its median
    (``statistics.median``), the drains' also against the notice's length."""
    secs = [x["notice_to_protected_s"] for x in rows if x["notice_to_protected_s"] is not None]
    moved = [x["notice_to_moved_s"] for x in singles if x["notice_to_moved_s"] is not None]
    moved_median = statistics.median(moved) if moved else None
    return {"notice_s": notice_s, "rounds": rows, "notice_to_protected_s_median": statistics.median(secs) if secs else None,
            "protected_rounds": len(secs), "single_drains": singles, "single_drain_notice_to_moved_s_median": moved_median,
            "single_drain_moved_vs_notice": ratio(moved_median, notice_s), "single_drains_moved": len(moved)}


if __name__ == "__main__":
    from benchmarks.common import main

    raise SystemExit(main("rehome"))
