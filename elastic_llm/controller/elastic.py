"""Elastic width: grow into new room, move replicas off draining nodes, shrink when there is no room.

Owns: the look at the cluster after each step (draining nodes that host the run's stages, and
every ``elastic.grow_check_s`` whether there is room for one more replica), the spare replicas
it starts in the background when it sees room or a drain (their processes start while the run
trains on, so a resize waits for no process start), and carrying out a change of the
data-parallel width at a step boundary, where every replica holds the same state: growing by one
replica (a started spare takes the state of replica 0), evacuating the replicas that have stages
on draining nodes (a spare placed elsewhere takes the state of an unaffected peer, or of the
replica itself while its node still lives, then the old one goes), and dropping replicas.
Nothing rolls back: the state moves actor to actor. Before the membership changes, the snapshot
versions in flight get to commit.
Never decides *whether* to resize or move (the controller's pure transitions do, and
:func:`shrink_instead` when there is no room) and never touches the data stream.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.controller.actor_group import ActorGroup, CapacityUnavailable, Spare, StageSpare
from elastic_llm.controller.drains import Drain, draining_nodes
from elastic_llm.controller.session import log
from elastic_llm.snapshot.records import ShardKey

SETTLE_S = 60.0  # how long versions in flight get to commit before the membership changes
DRAIN_MARGIN_S = 5.0  # act on a drain this long before its deadline even if its spares have not started
MOVE_S = 2.0  # a move (state copy, new width) must start at least this long before the drain's deadline
SPARE_START_S = 60.0  # a spare that has not started in this long is given up (its room went away)


@dataclass(frozen=True)
class ResizeOutcome:
    from_dp: int
    to_dp: int
    seconds: float
    reason: str


@dataclass(frozen=True)
class Evacuation:
    """What a drain did: stage actors moved off the draining nodes, replicas dropped instead
    (no room elsewhere), replicas left in place (no room and nothing to shrink to), and how the
    moves went (``stages``: just the affected actors, ``replica``: whole replicas, ``none``)."""

    moved: int
    dropped: int
    stayed: int
    from_dp: int
    to_dp: int
    seconds: float
    how: str = "none"


class Move(enum.Enum):
    """How one replica with actors on draining nodes leaves them."""

    STAGES = "stages"  # only its actors on the draining nodes move, each to a new bundle elsewhere
    REPLICA = "replica"  # the whole replica moves onto a spare replica
    DROP = "drop"  # no room: the replica goes (the run narrows)
    STAY = "stay"  # no room and nothing to narrow to: it stays and is recovered when its node goes


def drain_moves(on_drain: dict[int, int], stages: int, free_slots: int, spare_ready: bool, width: int, min_width: int) -> dict[int, Move]:
    """For each affected replica (``on_drain``: replica -> its actors on draining nodes), how it
    leaves: a started spare replica takes the first one whole (no process to start); otherwise
    moving just the affected actors is cheaper than a whole replica when they are fewer than its
    stages and the live nodes have room for them; a whole replica when there is room for one; else
    drop it if the width allows (:func:`shrink_instead`), else stay. Pure."""
    out: dict[int, Move] = {}
    free, w = free_slots, width
    for r in sorted(on_drain):
        k = on_drain[r]
        if spare_ready:
            out[r], spare_ready = Move.REPLICA, False
        elif k < stages and free >= k:
            out[r], free = Move.STAGES, free - k
        elif free >= stages:
            out[r], free = Move.REPLICA, free - stages
        elif shrink_instead(w, min_width):
            out[r], w = Move.DROP, w - 1
        else:
            out[r] = Move.STAY
    return out


def shrink_instead(width: int, min_width: int) -> bool:
    """No room to move a replica off a draining node: drop it if the run keeps at least
    ``min_width`` replicas (and one at all), else leave it until its node goes. Pure."""
    return width - 1 >= max(1, min_width)


def drain_due(spares_ready: int, needed: int, started_any: bool, seconds_left: float | None, margin_s: float) -> bool:
    """Whether to act on a drain now: every replica to move has a started spare, or no spare
    could be started at all (no room: shrink or stay at once), or the deadline is within
    ``margin_s``. Otherwise the run trains on while the spares start. Pure."""
    if spares_ready >= needed or not started_any:
        return True
    return seconds_left is not None and seconds_left <= margin_s


class ElasticExecutor:
    def __init__(self, group: ActorGroup, snapshots: Any, min_width: int, cfg: RunConfig | None = None) -> None:
        self.group = group
        self.snapshots = snapshots
        self.min_width = min_width
        self.cfg = cfg
        self._last_grow_look = 0.0

    def look(self, seen: set[str]) -> tuple[tuple[Drain, ...], int | None]:
        """One cheap look at the cluster at a step boundary. Returns the draining nodes that
        host this run's stages, not acted on yet (``seen``), once it is time to act on them (see
        :func:`drain_due`), and the width to grow to once a spare has started (else None).
        Starts spares where there is room (one per look), gives up spares on draining nodes or
        that never started, and tells the snapshot coordinator to avoid draining nodes."""
        if self.cfg is None:
            return (), None
        g, el = self.group, self.cfg.elastic
        draining = draining_nodes() if el.drains else {}
        if self.snapshots is not None:
            self.snapshots.avoid = frozenset(draining)
        now = time.monotonic()
        for spare in list(g.spares):
            if g.spare_nodes(spare) & set(draining) or (now - spare.started > SPARE_START_S and not g.spare_ready(spare)):
                g.cancel(spare)
        for key, sp in list(g.stage_spares.items()):  # their drain went, or their room did
            if g.spare_nodes_of(sp) & set(draining) or g.nodes.get(key) not in draining or (now - sp.started > SPARE_START_S and not g.stage_spare_ready(sp)):
                g.cancel_stage_spare(sp)
        hosting = set(g.nodes.values())
        drains = tuple(d for n, d in sorted(draining.items()) if n in hosting and n not in seen)
        if drains:
            nodes = {d.node_id for d in drains}
            keys = [k for k in g.keys() if g.nodes.get(k) in nodes]
            on_drain = {r: sum(1 for k in keys if k.replica == r) for r in {k.replica for k in keys}}
            if not g.stage_spares and not any(g.spare_ready(sp) for sp in g.spares):
                avoid = frozenset(draining)
                # free CPUs, plus bundles the affected replicas hold that no actor uses any more
                free = g.free_slots(avoid) + sum(g.placed_orphans(r, avoid) for r in on_drain)
                moves = drain_moves(on_drain, g.stages, free, False, g.width, self.min_width)
                for k in keys:
                    if moves[k.replica] is Move.STAGES:
                        g.start_stage_spare(k, avoid)
                if any(m is Move.REPLICA for m in moves.values()) and not g.spares:
                    g.start_spare()
                log(f"nodes {[n[:12] for n in sorted(nodes)]} are draining: {', '.join(f'replica {r}: {m.value}' for r, m in sorted(moves.items()))}")
            wanted = [sp for k, sp in g.stage_spares.items() if k in keys]
            ready = sum(1 for sp in wanted if g.stage_spare_ready(sp)) + sum(1 for sp in g.spares if g.spare_ready(sp))
            needed = len(wanted) + (1 if g.spares else 0)
            lefts = [x for x in (d.seconds_left(time.time()) for d in drains) if x is not None]
            if drain_due(ready, needed, needed > 0, min(lefts) if lefts else None, DRAIN_MARGIN_S):
                return drains, None
            return (), None
        if g.width >= el.bounds(self.cfg.parallel.dp)[1]:
            for spare in list(g.spares):  # spares started for a drain that needed fewer
                g.cancel(spare)
            return (), None
        if any(g.spare_ready(sp) for sp in g.spares):
            return (), g.width + 1
        if not g.spares and now - self._last_grow_look >= el.grow_check_s:
            self._last_grow_look = now
            if g.room_for_replica(avoid=frozenset(draining)):
                g.start_spare()
                log(f"room for replica {g.width + 1}: starting it in the background")
        return (), None

    def _settle_snapshots(self) -> None:
        if self.snapshots is not None:
            self.snapshots.poll(block=True, timeout=SETTLE_S)

    def _ready_spare(self, until: float | None = None) -> Spare | None:
        """A started spare; with ``until`` (a ``time.time()`` instant), wait until then for one
        that is still starting (the deadline of a drain is near: moving late beats not moving)."""
        while True:
            spare = next((sp for sp in self.group.spares if self.group.spare_ready(sp)), None)
            if spare is not None or until is None or not self.group.spares or time.time() >= until:
                return spare
            time.sleep(0.2)

    def grow(self) -> ResizeOutcome:
        """A started spare joins with the state of replica 0. Raises :class:`CapacityUnavailable`
        (and changes nothing) if no spare has started after all."""
        t0 = time.perf_counter()
        width = self.group.width
        spare = self._ready_spare()
        if spare is None:
            raise CapacityUnavailable(self.group.capacity(replicas=1))
        self._settle_snapshots()
        self._join(spare, 0)
        return ResizeOutcome(width, self.group.width, time.perf_counter() - t0, "capacity")

    def _join(self, spare: Spare, source: int) -> int:
        """Adopt ``spare`` as the last replica with the state of replica ``source``."""
        r = self.group.adopt(spare)
        try:
            self.group.copy_stages([(ShardKey(s, source), ShardKey(s, r)) for s in range(self.group.stages)])
            self.group.set_width()
        except BaseException:
            self.group.drop_replicas([r])
            raise
        return r

    def evacuate(self, nodes: frozenset[str], deadline: float | None = None) -> Evacuation:
        """Move every replica with a stage on ``nodes`` off them (highest index first, so the
        indices still to handle do not shift): just its affected actors onto their started stage
        spares (state from the actors themselves, alive until their node goes), or whole onto a
        started spare replica, or drop it when neither is there. Spares still starting are waited
        for until ``MOVE_S`` before ``deadline`` (``time.time()``)."""
        t0 = time.perf_counter()
        g = self.group
        width = g.width
        affected = g.replicas_on(nodes)
        on_nodes = [k for k in g.keys() if g.nodes.get(k) in nodes]
        if affected and not all(k in g.stage_spares for k in on_nodes):
            # whole replicas change: let the versions in flight commit first. Per-stage moves do
            # not wait: a version whose copy of a moved actor was not collected yet is discarded
            # (the committed one stays), so the pause is only the state copy
            self._settle_snapshots()
        moved = dropped = stayed = 0
        hows: set[str] = set()
        for r in sorted(affected, reverse=True):
            keys = [k for k in g.keys() if k.replica == r and g.nodes.get(k) in nodes]
            spares = self._ready_stage_spares(keys, None if deadline is None else deadline - MOVE_S)
            if spares is not None:
                for sp in spares:
                    g.swap_in(sp)
                moved += len(spares)
                hows.add(Move.STAGES.value)
                continue
            peers = [p for p in range(g.width) if p not in affected]
            spare = self._ready_spare(None if deadline is None else deadline - MOVE_S)
            if spare is not None:
                self._join(spare, peers[0] if peers else r)
                g.drop_replicas([r])
                g.set_width()
                moved += g.stages
                hows.add(Move.REPLICA.value)
            elif shrink_instead(g.width, self.min_width):
                g.drop_replicas([r])
                g.set_width()
                dropped += 1
            else:
                stayed += 1
        for sp in list(g.stage_spares.values()):  # prepared for actors that moved another way
            g.cancel_stage_spare(sp)
        return Evacuation(moved, dropped, stayed, width, g.width, time.perf_counter() - t0, "+".join(sorted(hows)) or "none")

    def _ready_stage_spares(self, keys: list[ShardKey], until: float | None) -> list[StageSpare] | None:
        """The started stage spares of every one of ``keys``, waiting until ``until`` for ones
        still starting; None if any key has none (or it did not start in time)."""
        g = self.group
        if not keys or any(k not in g.stage_spares for k in keys):
            return None
        while True:
            spares = [g.stage_spares[k] for k in keys]
            if all(g.stage_spare_ready(sp) for sp in spares):
                return spares
            if until is None or time.time() >= until:
                return None
            time.sleep(0.05)
