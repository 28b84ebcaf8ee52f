"""The snapshot tiers of a simulation: simulated managers for the real coordinator, and a durable tier.

Owns: :class:`SimManagers` (the :class:`~elastic_llm.snapshot.coordinator.ManagerFleet` the real
:class:`~elastic_llm.snapshot.coordinator.SnapshotCoordinator` runs on: one simulated manager per
live node, so its two-phase commits, erasure groups, census of lost parts and restores run as they
do on Ray), the simulated managers' restore calls (their shards, ready after the cost model's
time) and :class:`SimFlusher` (the durable tier: which commits are flushed,
how long a flush takes, the newest durable checkpoint). Never decides which version to keep or
restore: the coordinator and the recovery policy do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_llm.cadence import FlushTurns
from elastic_llm.sim.world import SimManager, SimRef, World, _Call
from elastic_llm.snapshot.records import ShardKey


class SimManagers:
    """The :class:`~elastic_llm.snapshot.coordinator.ManagerFleet` of a simulated fleet: one
    simulated manager per live node; the real coordinator drives them."""

    def __init__(self, world: World, calls: Any) -> None:
        self.world, self.calls = world, calls

    def nodes(self) -> set[str]:
        return set(self.world.fleet.alive())

    def domains(self) -> dict[str, str]:
        """The zone of each node, where the trace gave one."""
        return dict(self.world.fleet.zones)

    def start(self, node: str, name: str, run_id: str, grace_s: float) -> Any:
        """A manager on ``node``; on a node already gone, one the scheduler refuses (as Ray's
        does: its answers raise :class:`~elastic_llm.sources.NodeGone`)."""
        return _RestoringManager(node, self.world, refused=not self.world.fleet.is_alive(node))

    def end(self, handle: Any) -> None:
        pass


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
        self.world = world
        self.turns = FlushTurns(every)
        self.inflight: _SimFlush | None = None
        self.done: tuple[int, str] | None = None  # (step, name) of the newest committed checkpoint
        self.flushes = 0

    def wants(self, record: Any) -> bool:
        self.poll()
        return self.turns.wants(self.inflight is not None)

    def start(self, record: Any) -> None:
        w = self.world
        self.turns.started()
        per_node: dict[str, int] = {}
        for info in record.shards:
            node = record.home(info.node_id)
            per_node[node] = per_node.get(node, 0) + 1
        busiest = max(per_node.values(), default=0)
        self.inflight = _SimFlush(record, w.clock.now + busiest * w.shard_mb / w.costs.flush_mb_s, frozenset(per_node))

    def poll(self, block: bool = False) -> None:
        f, w = self.inflight, self.world
        if f is None or w.clock.now < f.done_s:
            return
        self.inflight = None
        if not any(w.fleet.removed_by(n, f.done_s) for n in f.nodes):
            self.done = (f.record.version, f"step-{f.record.version:08d}")
            self.flushes += 1

    @property
    def every(self) -> int:
        return self.turns.every

    def latest(self) -> tuple[int, str] | None:
        self.poll()
        return self.done

    def reset(self) -> None:
        self.inflight = None
        self.turns.started()

    def observe(self, step_s: float, elapsed_s: float, failures: int) -> None:
        pass  # a fixed interval (--durable-every): nothing to measure

    def finish(self) -> None:
        pass  # a simulation's end is the trace's: the flush in flight is not waited for

    def checkpoint(self, name: str) -> tuple[str, Any]:
        step = int(name.rsplit("-", 1)[-1])
        return "sim://durable", self.world.positions.get(step)


class _RestoringManager(SimManager):
    """A simulated manager that also answers a restore's calls (its shards; a parity rebuild is
    the restored stage's, :meth:`~elastic_llm.sim.actors.SimActors.load_parts`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.shard_parts = _Call(self._shard_parts, self.world.charged)

    def _shard_parts(self, version: int, key: ShardKey) -> SimRef:
        c = self.world.costs
        piece = SimRef(self.world.clock.now + self.world.shard_mb / c.restore_mb_s, self.node, None, self.world.fleet)
        return self._ref(0.0, [piece])
