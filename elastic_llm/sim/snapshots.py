"""The snapshot tiers of a simulation: the real coordinator on simulated managers, and a durable tier.

Owns: :class:`SimSnapshots` (the real :class:`~elastic_llm.snapshot.coordinator.SnapshotCoordinator`
with one simulated manager per live node: its two-phase commits, erasure groups, census of lost
parts and restores run as they do on Ray), the simulated managers' restore calls (their shards,
a parity rebuild, each ready after the cost model's time) and :class:`SimFlusher` (the durable
tier as the coordinator and a recovery see it: which commits are flushed, how long a flush takes,
the newest durable checkpoint). Never decides which version to keep or restore: the coordinator
and the recovery policy do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.sim.world import SimManager, SimRef, World, _Call
from elastic_llm.snapshot.coordinator import SnapshotCoordinator
from elastic_llm.snapshot.records import ShardKey


class SimSnapshots(SnapshotCoordinator):
    """The real coordinator with simulated managers: one per live node with actor slots."""

    def __init__(self, cfg: RunConfig, world: World, calls: Any) -> None:
        super().__init__(cfg, "sim", "sim", calls=calls, clock=world.clock)
        self.world = world
        self.grace_s = 0.0

    def ensure_managers(self) -> dict[str, Any]:
        alive = set(self.world.fleet.alive())
        for node in [n for n in self.managers if n not in alive]:
            del self.managers[node]
        for node in sorted(alive - set(self.managers)):
            self.managers[node] = _RestoringManager(node, self.world)
        return self.managers

    def shutdown(self) -> None:
        self.managers.clear()
        self.inflight.clear()


@dataclass
class _SimFlush:
    record: Any  # the VersionRecord being written
    done_s: float
    nodes: frozenset[str]


class SimFlusher:
    """The durable tier as the coordinator and a recovery see it (its :class:`Flusher` protocol and
    ``latest``): every ``every``-th committed version is written, by each node's manager in
    parallel at the cost model's ``flush_mb_s``; one at a time; a flush whose node goes first fails."""

    def __init__(self, world: World, every: int) -> None:
        self.world, self.every = world, every
        self.since = 0
        self.inflight: _SimFlush | None = None
        self.done: tuple[int, str] | None = None  # (step, name) of the newest committed checkpoint
        self.flushes = 0

    def wants(self, record: Any) -> bool:
        self.poll()
        self.since += 1
        return self.inflight is None and self.since >= self.every

    def start(self, record: Any) -> None:
        w = self.world
        self.since = 0
        per_node: dict[str, int] = {}
        for info in record.shards:
            per_node[info.node_id] = per_node.get(info.node_id, 0) + 1
        busiest = max(per_node.values(), default=0)
        self.inflight = _SimFlush(record, w.clock.now + busiest * w.shard_mb / w.costs.flush_mb_s, frozenset(per_node))

    def poll(self) -> None:
        f, w = self.inflight, self.world
        if f is None or w.clock.now < f.done_s:
            return
        self.inflight = None
        if not any(w.fleet.removed_by(n, f.done_s) for n in f.nodes):
            self.done = (f.record.version, f"step-{f.record.version:08d}")
            self.flushes += 1

    def latest(self) -> tuple[int, str] | None:
        self.poll()
        return self.done

    def reset(self) -> None:
        self.inflight = None
        self.since = 0


class _RestoringManager(SimManager):
    """A simulated manager that also answers a restore's calls (its shards, a parity rebuild)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.shard_parts = _Call(self._shard_parts, self.world.charged)
        self.rebuild_shard = _Call(self._rebuild_shard, self.world.charged)

    def _shard_parts(self, version: int, key: ShardKey) -> SimRef:
        c = self.world.costs
        piece = SimRef(self.world.clock.now + self.world.shard_mb / c.restore_mb_s, self.node, None, self.world.fleet)
        return self._ref(0.0, [piece])

    def _rebuild_shard(self, version: int, key: ShardKey, n: int, parity: int, lost: list[int], index: int, peers: list[Any], infos: list[Any]) -> SimRef:
        c = self.world.costs
        seconds = self.world.shard_mb * (n - len(lost)) / c.network_mb_s + self.world.shard_mb * n / c.parity_mb_s
        piece = SimRef(self.world.clock.now + seconds, self.node, None, self.world.fleet)
        return self._ref(0.0, [piece])
