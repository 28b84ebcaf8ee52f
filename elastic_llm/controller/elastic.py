"""Elastic width: grow into new room, move replicas off draining nodes, shrink when there is no room.

Owns: the look at the cluster after each step (draining nodes that host the run's stages, and
every ``elastic.grow_check_s`` whether there is room for one more replica), and carrying out a change of the data-parallel width at a step boundary, where every replica
holds the same state: growing by one replica (placed whole, state copied from a healthy
replica), evacuating the replicas that have stages on draining nodes (a new replica placed
elsewhere takes the state of an unaffected peer, or of the replica itself while its node still
lives, then the old one goes), and dropping replicas. Nothing rolls back: the state moves actor
to actor. Before the membership changes, the snapshot versions in flight get to commit.
Never decides *whether* to resize or move (the controller's pure transitions do, and
:func:`shrink_instead` when there is no room) and never touches the data stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.controller.actor_group import ActorGroup, CapacityUnavailable
from elastic_llm.controller.drains import Drain, draining_nodes
from elastic_llm.snapshot.records import ShardKey

SETTLE_S = 60.0  # how long versions in flight get to commit before the membership changes


@dataclass(frozen=True)
class ResizeOutcome:
    from_dp: int
    to_dp: int
    seconds: float
    reason: str


@dataclass(frozen=True)
class Evacuation:
    """What a drain did: stage actors moved off the draining nodes, replicas dropped instead
    (no room elsewhere), replicas left in place (no room and nothing to shrink to)."""

    moved: int
    dropped: int
    stayed: int
    from_dp: int
    to_dp: int
    seconds: float


def shrink_instead(width: int, min_width: int) -> bool:
    """No room to move a replica off a draining node: drop it if the run keeps at least
    ``min_width`` replicas (and one at all), else leave it until its node goes. Pure."""
    return width - 1 >= max(1, min_width)


class ElasticExecutor:
    def __init__(self, group: ActorGroup, snapshots: Any, min_width: int, cfg: RunConfig | None = None) -> None:
        self.group = group
        self.snapshots = snapshots
        self.min_width = min_width
        self.cfg = cfg
        self._last_grow_look = 0.0

    def look(self, seen: set[str]) -> tuple[tuple[Drain, ...], int | None]:
        """One cheap look at the cluster at a step boundary: the draining nodes that host this
        run's stages and were not acted on yet (``seen``), and, every ``elastic.grow_check_s``,
        whether free resources away from draining nodes look like room for one more replica
        (the width to grow to, or None). Tells the snapshot coordinator to avoid draining nodes."""
        if self.cfg is None:
            return (), None
        el = self.cfg.elastic
        draining = draining_nodes() if el.drains else {}
        if self.snapshots is not None:
            self.snapshots.avoid = frozenset(draining)
        hosting = set(self.group.nodes.values())
        drains = tuple(d for n, d in sorted(draining.items()) if n in hosting and n not in seen)
        grow_to = None
        now = time.monotonic()
        if self.group.width < el.bounds(self.cfg.parallel.dp)[1] and now - self._last_grow_look >= el.grow_check_s:
            self._last_grow_look = now
            if self.group.room_for_replica(avoid=frozenset(draining)):
                grow_to = self.group.width + 1
        return drains, grow_to

    def _settle_snapshots(self) -> None:
        if self.snapshots is not None:
            self.snapshots.poll(block=True, timeout=SETTLE_S)

    def grow(self) -> ResizeOutcome:
        """One more replica with the state of replica 0. Raises :class:`CapacityUnavailable`
        (and changes nothing) if it cannot be placed."""
        t0 = time.perf_counter()
        width = self.group.width
        self._settle_snapshots()
        r = self.group.add_replica()
        try:
            self.group.copy_stages([(ShardKey(s, 0), ShardKey(s, r)) for s in range(self.group.stages)])
            self.group.set_width()
        except BaseException:
            self.group.drop_replicas([r])
            raise
        return ResizeOutcome(width, self.group.width, time.perf_counter() - t0, "capacity")

    def evacuate(self, nodes: frozenset[str]) -> Evacuation:
        """Move every replica with a stage on ``nodes`` elsewhere (highest index first, so the
        indices still to handle do not shift), or drop it when there is no room."""
        t0 = time.perf_counter()
        width = self.group.width
        affected = self.group.replicas_on(nodes)
        if affected:
            self._settle_snapshots()
        moved = dropped = stayed = 0
        for r in sorted(affected, reverse=True):
            peers = [p for p in range(self.group.width) if p not in affected]
            source = peers[0] if peers else r
            try:
                self._move(r, source)
                moved += self.group.stages
            except CapacityUnavailable:
                if shrink_instead(self.group.width, self.min_width):
                    self.group.drop_replicas([r])
                    self.group.set_width()
                    dropped += 1
                else:
                    stayed += 1
        return Evacuation(moved, dropped, stayed, width, self.group.width, time.perf_counter() - t0)

    def _move(self, r: int, source: int) -> None:
        """A new replica (placed by Ray away from draining nodes) takes ``source``'s state; then
        replica ``r`` goes. The new one is last in the order: which actor takes which slice of the
        batch does not change the math, as every replica holds the same state."""
        new = self.group.add_replica()
        try:
            self.group.copy_stages([(ShardKey(s, source), ShardKey(s, new)) for s in range(self.group.stages)])
        except BaseException:
            self.group.drop_replicas([new])
            raise
        self.group.drop_replicas([r])
        self.group.set_width()
