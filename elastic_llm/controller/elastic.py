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
Each look is observe (:meth:`ElasticExecutor.observe`, a frozen :class:`ElasticView`), decide (the
pure :func:`decide`: which spares to start or give up, which drains are due, whether to grow) and
act (:meth:`ElasticExecutor.act`). A drain waiting for its spares is acted on once its deadline
is within :data:`DRAIN_MARGIN_S` plus the time to the next look (:class:`LookTimer`: with steps of
seconds, as on large models, waiting one more step can miss the deadline). While a step runs,
:meth:`ElasticExecutor.notice` makes the same look when a new notice arrives and only starts
what its drain needs (the spares' start is what a notice must not lose to a long step). Never decides *whether* to resize or move outside that policy
(the controller's pure transitions act on what a look returns) and never touches the data stream.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from elastic_llm import events
from elastic_llm.clock import Clock
from elastic_llm.config import RunConfig
from elastic_llm.controller.drains import Drain
from elastic_llm.controller.ports import CapacityUnavailable, Nodes, SpareRef, StageActors
from elastic_llm.recovery.failure import During, StepFailure
from elastic_llm.snapshot.coordinator import SnapshotCoordinator
from elastic_llm.snapshot.records import ShardKey

SETTLE_S = 60.0  # how long versions in flight get to commit before the membership changes
DRAIN_MARGIN_S = 5.0  # act on a drain this long before its deadline even if its spares have not started
MOVE_S = 2.0  # a move (state copy, new width) must start at least this long before the drain's deadline
SPARE_START_S = 60.0  # a spare that has not started in this long is given up (its room went away)
log = logging.getLogger("elastic_llm.controller")


@dataclass(frozen=True)
class ResizeOutcome:
    from_dp: int
    to_dp: int
    seconds: float
    reason: str


@dataclass(frozen=True)
class Evacuation:
    """What a drain did: stage actors moved off the draining nodes, replicas left in place (no
    room, or spares too late: they train on until the last look before the nodes go), and how
    the moves went (``stages``: just the affected actors, ``replica``: whole replicas, ``none``).
    A drain drops no replica: what stayed is given up at that last look
    (:meth:`ElasticExecutor.give_up`) and the recovery drops the fewest that make room."""

    moved: int
    stayed: int
    from_dp: int
    to_dp: int
    seconds: float
    how: str = "none"
    settle: str = ""  # versions in flight before whole replicas moved: "" none, "committed", "cut" (dropped at the bound), "skipped" (no time left)


def drain_records(drains: Iterable[Drain], ev: Evacuation, step: int, now: float, spans: dict[str, float]) -> list[events.Drain]:
    """The metrics lines of an evacuation, one per draining node (logged too). Pure but for the log."""
    out = []
    for d in drains:
        left = d.seconds_left(now)
        log.info("node %s is draining (%s): %d stage actors moved, %d replicas left in place, %.1f s%s", d.node_id[:12],
                 "no deadline" if left is None else f"{left:.0f} s left", ev.moved, ev.stayed, ev.seconds, SETTLED.get(ev.settle, ""))
        out.append(events.Drain(step=step, node=d.node_id, deadline_s=left, moved=ev.moved, dropped=0,
                                stayed=ev.stayed, seconds=ev.seconds, rollback_steps=0, how=ev.how, settle=ev.settle, spans=spans))
    return out


class Move(enum.Enum):
    """How one replica with actors on draining nodes leaves them."""

    STAGES = "stages"  # only its actors on the draining nodes move, each to a new bundle elsewhere
    REPLICA = "replica"  # the whole replica moves onto a spare replica
    STAY = "stay"  # no room: it trains on until the last look before its node goes, then it is given up and recovered (the recovery drops the fewest replicas)


def spare_nodes(group: StageActors) -> set[str]:
    """The nodes of ``group``'s spare replicas and stage spares (started, not in the width yet)."""
    sp = group.spares
    return {n for s in [*sp.replicas(), *sp.of().values()] for n in sp.nodes(s)}


def drain_moves(on_drain: dict[int, int], stages: int, free_slots: int, spare_ready: bool) -> dict[int, Move]:
    """For each affected replica (``on_drain``: replica -> its actors on draining nodes), how it
    leaves: a started spare replica takes the first one whole (no process to start); otherwise
    moving just the affected actors is cheaper than a whole replica when they are fewer than its
    stages and the live nodes have room for them; a whole replica when there is room for one.
    A replica without room stays and trains on until the last look before its nodes go, where
    what is on them is given up and the recovery drops the fewest replicas that make room for the
    others (:func:`~elastic_llm.recovery.policy.fewest_drops`).
    Dropping at the notice instead cost the simulated 256-node fleet the notice's length at a
    narrower width (liveput 0.933 against 0.956 with 120 s notices). Pure."""
    out: dict[int, Move] = {}
    free = free_slots
    for r in sorted(on_drain):
        k = on_drain[r]
        if spare_ready:
            out[r], spare_ready = Move.REPLICA, False
        elif k < stages and free >= k:
            out[r], free = Move.STAGES, free - k
        elif free >= stages:
            out[r], free = Move.REPLICA, free - stages
        else:
            out[r] = Move.STAY
    return out


def drain_due(spares_ready: int, needed: int, started_any: bool, seconds_left: float | None, margin_s: float) -> bool:
    """Whether to act on a drain now: every replica to move has a started spare, or no spare
    could be started at all (no room: the replicas stay, at once), or the deadline is within
    ``margin_s``. Otherwise the run trains on while the spares start. Pure."""
    if spares_ready >= needed or not started_any:
        return True
    return seconds_left is not None and seconds_left <= margin_s


@dataclass(frozen=True)
class SpareView:
    """A spare replica (``key`` None) or stage spare as one look saw it."""

    handle: SpareRef  # the group's Spare / StageSpare (opaque to the policy)
    key: ShardKey | None
    nodes: frozenset[str]  # where its bundles are placed (empty while unplaced)
    age_s: float  # since it was started
    ready: bool  # every actor of it has started


@dataclass(frozen=True)
class ElasticView:
    """What one look at the cluster saw after a step (:meth:`ElasticExecutor.observe`)."""

    draining: tuple[Drain, ...]  # every draining node, by node id
    nodes: tuple[tuple[ShardKey, str], ...]  # the run's actors and their nodes
    width: int
    stages: int
    spares: tuple[SpareView, ...]
    stage_spares: tuple[SpareView, ...]
    free_slots: int | None = None  # free actor slots off the draining nodes ; None: not looked at
    room_for_replicas: int | None = None  # whole replicas the free slots hold; None: not looked at (not time to, no growing, or a spare still waits for room)
    wall: float = 0.0  # time.time() of the look (drain deadlines are wall-clock)
    step_s: float = 0.0  # how far off the next look is (about one step): a drain due before then is acted on now
    last_looked: frozenset[str] = frozenset()  # draining nodes that had their last look (ElasticExecutor.give_up): not due again


@dataclass(frozen=True)
class ElasticPlan:
    """What a look decided (:func:`decide`), for :meth:`ElasticExecutor.act` to carry out."""

    avoid: frozenset[str] = frozenset()  # draining nodes: snapshots and new actors keep off them
    cancel: tuple[SpareView, ...] = ()  # spares given up (on a draining node, never started, or no longer wanted)
    start_stage_spares: tuple[ShardKey, ...] = ()
    start_spare: bool = False  # one spare replica (a drain's whole-replica move)
    drains: tuple[Drain, ...] = ()  # drains to act on now
    grow_to: int | None = None  # the width to grow to now
    note: str | None = None  # what to log
    start_spares: int = 0  # spare replicas to grow into (every one the room allows)


def decide(view: ElasticView, seen: set[str] | frozenset[str], max_width: int) -> ElasticPlan:
    """The elastic policy of one look (pure): give up spares on draining nodes or that never
    started; for draining nodes that host the run's stages, not acted on yet (``seen``), start
    the spares their moves need (:func:`drain_moves`) and act once they have started or the
    deadline is near (:func:`drain_due`), and again at the last look before they go where
    stages stayed on them (:func:`ending`); otherwise grow by one replica once a spare has
    started, or start one when the look found room."""
    draining = {d.node_id for d in view.draining}
    avoid = frozenset(draining)
    nodes = dict(view.nodes)
    cancel = [sp for sp in view.spares if sp.nodes & draining or (sp.age_s > SPARE_START_S and not sp.ready)]
    cancel += [sp for sp in view.stage_spares  # a late one for a key still on a drained node is kept: a move later, or the recovery's
               if sp.nodes & draining or sp.key is None or (nodes.get(sp.key) not in draining and nodes.get(sp.key) not in seen)
               or (sp.age_s > SPARE_START_S and not sp.ready)]
    spares = [sp for sp in view.spares if sp not in cancel]
    stage_spares = [sp for sp in view.stage_spares if sp not in cancel]
    hosting = set(nodes.values())
    drains = tuple(d for d in view.draining if d.node_id in hosting and d.node_id not in seen)
    drains += late_moves(view, seen, stage_spares)
    ends = tuple(d for d in ending(view, seen) if d not in drains)  # due again: what stayed on them is given up now
    if drains or ends:
        on = {d.node_id for d in drains}
        keys = [k for k, n in view.nodes if n in on]
        on_drain = {r: sum(1 for k in keys if k.replica == r) for r in {k.replica for k in keys}}
        start: list[ShardKey] = []
        start_spare, note = False, None
        if drains and not stage_spares and not any(sp.ready for sp in spares):
            moves = drain_moves(on_drain, view.stages, view.free_slots or 0, False)
            start = [k for k in keys if moves[k.replica] is Move.STAGES]
            start_spare = any(m is Move.REPLICA for m in moves.values()) and not spares
            note = f"nodes {[n[:12] for n in sorted(on)]} are draining: {', '.join(f'replica {r}: {m.value}' for r, m in sorted(moves.items()))}"
        wanted = [sp for sp in stage_spares if sp.key in keys]
        ready = sum(1 for sp in wanted if sp.ready) + sum(1 for sp in spares if sp.ready)
        needed = len(wanted) + len(start) + (1 if spares or start_spare else 0)
        lefts = [x for x in (d.seconds_left(view.wall) for d in drains) if x is not None]
        due = drain_due(ready, needed, needed > 0, min(lefts) if lefts else None, DRAIN_MARGIN_S + view.step_s)
        return ElasticPlan(avoid, tuple(cancel), tuple(start), start_spare, (drains if due else ()) + ends, None, note)
    if view.width >= max_width:  # spares started for a drain that needed fewer
        return ElasticPlan(avoid, tuple(cancel) + tuple(spares))
    started = [sp for sp in spares if sp.ready]
    if started and all(sp.ready for sp in spares if sp.nodes):  # every placed spare has started: they join at once
        return ElasticPlan(avoid, tuple(cancel), grow_to=min(max_width, view.width + len(started)))
    more = min(view.room_for_replicas or 0, max_width - view.width - len(spares))
    if more > 0:
        first = view.width + len(spares) + 1
        which = f"replica {first}" if more == 1 else f"replicas {first}-{first + more - 1}"
        return ElasticPlan(avoid, tuple(cancel), start_spares=more, note=f"room for {which}: starting {'it' if more == 1 else 'them'} in the background")
    return ElasticPlan(avoid, tuple(cancel))


SETTLED = {"cut": " (the snapshot versions in flight were dropped at the time the nodes left them)",
           "skipped": " (no time was left to let the snapshot versions in flight commit: dropped, the committed one stands)"}


def settle_within(drains: Iterable[Drain], now: float) -> float:
    """How long the snapshot versions in flight may take to commit before a drain moves whole
    replicas: :data:`SETTLE_S`, cut to the time the first of ``drains``' nodes has left less the
    :data:`MOVE_S` its moves need (0: none left). Pure."""
    end = first_end(drains)
    return SETTLE_S if end is None else max(0.0, min(SETTLE_S, end - now - MOVE_S))


def first_end(drains: Iterable[Drain]) -> float | None:
    """The earliest deadline among ``drains`` (None: none has one). Pure."""
    return min((d.deadline for d in drains if d.deadline is not None), default=None)


def ending(view: ElasticView, seen: set[str] | frozenset[str]) -> tuple[Drain, ...]:
    """Drains acted on already (``seen``) whose nodes still host the run's stages (they stayed: no
    room) and go before the next look (:data:`MOVE_S` plus the time to it): the next step would
    fail when they go, so they are due again and what stayed on them is given up at this step
    boundary (:meth:`ElasticExecutor.give_up`). Pure."""
    hosting, going = {n for _, n in view.nodes}, going_before_next_look(view.draining, view.wall, view.step_s)
    return tuple(d for d in view.draining if d.node_id in going and d.node_id in seen and d.node_id in hosting and d.node_id not in view.last_looked)


def going_before_next_look(drains: Iterable[Drain], now: float, step_s: float) -> dict[str, float]:
    """The nodes of ``drains`` that go before the next look (``step_s`` away) and a move's
    :data:`MOVE_S` would end, with their seconds left. Pure."""
    return {d.node_id: left for d in drains if (left := d.seconds_left(now)) is not None and left <= step_s + MOVE_S}


def late_moves(view: ElasticView, seen: set[str] | frozenset[str], stage_spares: list[SpareView]) -> tuple[Drain, ...]:
    """Drains acted on already (``seen``) whose nodes still host stages that now each have a
    started stage spare, with time left for the move (:data:`MOVE_S` plus the next look): they
    are acted on again, so the late spares take over while the nodes live (no rollback, no
    recovery). Pure."""
    ready = {sp.key for sp in stage_spares if sp.ready}
    on: dict[str, list[ShardKey]] = {}
    for k, n in view.nodes:
        on.setdefault(n, []).append(k)
    out = []
    for d in view.draining:
        if d.node_id not in seen:
            continue
        keys = on.get(d.node_id, [])
        left = d.seconds_left(view.wall)
        if keys and all(k in ready for k in keys) and (left is None or left > MOVE_S + view.step_s):
            out.append(d)
    return tuple(out)


class LookTimer:
    """How far off the next look is: the shortest of the last few intervals between looks after
    different steps (looks come once per step; one long pause, a recovery or a resize, does not
    count, and a second look after the same step, as after a drain, is no interval)."""

    def __init__(self, keep: int = 3) -> None:
        self.last: float | None = None
        self.last_step: int | None = None
        self.intervals: deque[float] = deque(maxlen=keep)

    def peek(self) -> float:
        """The estimate :meth:`look` would give, without counting a look (a look between steps)."""
        return min(self.intervals, default=0.0)

    def look(self, now: float, step: int | None = None) -> float:
        if step is not None and step == self.last_step:
            return self.peek()
        if self.last is not None:
            self.intervals.append(now - self.last)
        self.last, self.last_step = now, step
        return self.peek()


class ElasticExecutor:
    """Carries the elastic policy out on the run's :class:`~elastic_llm.controller.ports.StageActors`
    (whatever runtime provides them): the same code on Ray and in a simulation."""

    def __init__(self, group: StageActors, snapshots: SnapshotCoordinator | None, cfg: RunConfig, nodes: Nodes, clock: Clock) -> None:
        self.group = group
        self.snapshots = snapshots
        self.cfg = cfg
        self.nodes = nodes
        self.clock = clock
        self._last_grow_look = float("-inf")
        self.timer = LookTimer()
        self.noticed: set[str] = set()  # draining nodes acted on between steps (notice)
        self.last_looked: set[str] = set()  # draining nodes given their last look (give_up): what stays on them is left to the recovery at their end
        self.joined: Callable[[], None] = lambda: None  # called once a grow's spares joined the width, before their state is copied (fault injection's ``resize`` point)

    def look(self, seen: set[str] | frozenset[str], step: int | None = None) -> tuple[tuple[Drain, ...], int | None]:
        """One cheap look at the cluster at the boundary after ``step``: :meth:`observe`, the pure
        :func:`decide`, then :meth:`act`. Returns the draining nodes that host this run's stages,
        not acted on yet (``seen``), once it is time to act on them, and the width to grow to
        once a spare has started (else None)."""
        self.group.spares.tend(self.avoid(self.nodes.draining() if self.cfg.elastic.drains else {}))  # placed spares start; lost ones start over
        view = self.observe(seen, step=step)
        plan = decide(view, seen, self.cfg.elastic.bounds(self.cfg.parallel.dp)[1])
        if self.snapshots is not None:
            self.snapshots.ends_at = first_end(view.draining)
        self.act(plan)
        return plan.drains, plan.grow_to

    def notice(self, seen: set[str] | frozenset[str]) -> None:
        """Between step boundaries (while a step runs): when a node hosting the run's actors
        announced its end since the last look, start what its drain needs now (stage spares or a
        spare replica; snapshots keep off it), so a notice that arrives mid-step loses none of its
        time to the step. The moves themselves are made at the step boundary (:meth:`look`),
        with the spares' head start; no growing here."""
        if not self.cfg.elastic.drains:
            return
        draining = self.nodes.draining()
        if self.snapshots is not None:  # the committed version's parts on them are re-homed now (and the copies read as they end)
            self.snapshots.ends_at = first_end(draining.values())
            self.snapshots.avoid = frozenset(draining)
        hosting = set(self.group.nodes.values())
        new = {n for n in draining if n in hosting and n not in seen and n not in self.noticed}
        if not new:
            return
        self.noticed |= new
        self.group.spares.tend(self.avoid(draining))
        plan = decide(self.observe(seen, between=True), seen, self.cfg.elastic.bounds(self.cfg.parallel.dp)[1])
        self.act(replace(plan, start_spares=0))

    def protect(self) -> None:
        """While a recovery waits for new processes: the committed version's parts on nodes that
        announced their end since are re-homed now (and copies that ended are read). Nothing else
        starts: the recovery's plan stands, spares wait for the next look."""
        if self.cfg.elastic.drains and self.snapshots is not None:
            draining = self.nodes.draining()
            self.snapshots.ends_at = first_end(draining.values())
            self.snapshots.avoid = self.avoid(draining)

    def avoid(self, draining: dict[str, Drain]) -> frozenset[str]:
        """Nodes nothing new goes to: draining ones and the node probes' suspects."""
        return frozenset(draining) | frozenset(self.nodes.suspects())

    def observe(self, seen: set[str] | frozenset[str], between: bool = False, step: int | None = None) -> ElasticView:
        """What the policy needs: draining nodes, the run's actors, its spares (a spare whose
        bundles were placed since the last look gets its actors started: the start it was made
        for), and, only when they matter, the free slots for a drain's moves and whether there is
        room for one more replica (every ``elastic.grow_check_s``)."""
        g, el, sp = self.group, self.cfg.elastic, self.group.spares
        draining = self.nodes.draining() if el.drains else {}
        now = self.clock.monotonic()
        replicas, by_key = sp.replicas(), sp.of()
        alive = self.nodes.alive() if replicas or by_key else set()  # a spare on a node the run knows dead is not ready, whatever Ray's placement table says yet
        spares = tuple(SpareView(s, None, ns, sp.age(s), sp.ready(s) and ns <= alive) for s in replicas for ns in [sp.nodes(s)])
        stage_spares = tuple(SpareView(s, k, ns, sp.age(s), sp.ready(s) and ns <= alive) for k, s in by_key.items() for ns in [sp.nodes(s)])
        avoid = self.avoid(draining)
        affected = {k.replica for k in g.keys() if g.nodes.get(k) in draining and g.nodes[k] not in seen}
        free = g.placement.free_slots(avoid) if affected else None
        room = None
        placed = all(sp.nodes for sp in spares)  # a spare still waiting for room would be counted twice
        if (not between and not affected and placed and g.width + len(spares) < el.bounds(self.cfg.parallel.dp)[1]
                and now - self._last_grow_look >= el.grow_check_s):
            self._last_grow_look = now
            room = g.placement.free_slots(avoid) // g.stages
        self.last_looked &= set(draining)  # a node that went (or stopped draining) is forgotten
        return ElasticView(tuple(d for _, d in sorted(draining.items())), tuple((k, g.nodes[k]) for k in g.keys() if k in g.nodes),
                           g.width, g.stages, spares, stage_spares, free, room, self.clock.time(),
                           self.timer.peek() if between else self.timer.look(now, step), frozenset(self.last_looked))

    def act(self, plan: ElasticPlan) -> None:
        """Carry out a look's plan: snapshots avoid the draining nodes, spares are given up and
        started as it says."""
        g = self.group
        if self.snapshots is not None:
            self.snapshots.avoid = plan.avoid
        for sp in plan.cancel:
            g.spares.cancel(sp.handle)
        avoid = plan.avoid | frozenset(self.nodes.suspects())
        for key in plan.start_stage_spares:
            g.spares.start(key, avoid)
        for _ in range(plan.start_spares + plan.start_spare):
            g.spares.start(None, avoid)
        if plan.note:
            log.info(plan.note)

    def _settle_snapshots(self, within_s: float = SETTLE_S) -> str:
        """Let the snapshot versions in flight commit before the membership changes, for at most
        ``within_s``; what is still in flight then is dropped (the committed version stands).
        Returns how it went (:attr:`Evacuation.settle`)."""
        sn = self.snapshots
        if sn is None or not sn.inflight:
            return ""
        if within_s > 0:
            sn.poll(block=True, timeout=within_s, drop=False)
            if not sn.inflight:
                return "committed"
        sn.poll(block=True, timeout=0.0)  # drops what is left
        return "cut" if within_s > 0 else "skipped"

    def _ready_spare(self) -> SpareRef | None:
        """A spare replica that has started, if any (no waiting)."""
        sp = self.group.spares
        return next((s for s in sp.replicas() if sp.ready(s)), None)

    def grow(self, to: int | None = None) -> ResizeOutcome:
        """The started spares join at once (at most up to width ``to``), each with the state of
        a replica of the run (round robin: one round of copies, spread over the sources). A spare on
        a node the run knows dead is left out (Ray re-places it once its table follows). Raises
        :class:`CapacityUnavailable` (and changes nothing) if no spare has started after all."""
        t0 = self.clock.perf_counter()
        width, alive = self.group.width, self.nodes.alive()
        sp = self.group.spares
        ready = [s for s in sp.replicas() if sp.ready(s) and sp.nodes(s) <= alive]
        if to is not None:
            ready = ready[: max(1, to - width)]
        if not ready:
            raise CapacityUnavailable(self.group.placement.capacity(replicas=1))
        self._settle_snapshots()
        self._join(ready, [i % width for i in range(len(ready))], self.joined)
        return ResizeOutcome(width, self.group.width, self.clock.perf_counter() - t0, "capacity")

    def _join(self, spares: list[SpareRef], sources: list[int], joined: Callable[[], None] = lambda: None) -> list[int]:
        """Adopt ``spares`` as the last replicas, each with the state of its replica in
        ``sources`` (different ones spread the copies' fan-out); ``joined`` is called between."""
        new: list[int] = []
        try:
            for spare in spares:
                new.append(self.group.resize.adopt(spare))
            joined()
            self.group.state.copy_stages([(ShardKey(s, src), ShardKey(s, r)) for r, src in zip(new, sources) for s in range(self.group.stages)])
            self.group.resize.set_width()
        except BaseException:
            self.group.resize.drop_replicas(new)
            raise
        return new

    def evacuate(self, drains: Iterable[Drain]) -> Evacuation:
        """Move every replica with a stage on the nodes of ``drains`` off them (highest index first, so the
        indices still to handle do not shift): just its affected actors onto their started stage
        spares (state from the actors themselves, alive until their node goes), or whole onto a
        started spare replica, or leave it in place when neither has started (no waiting: the
        whole run would wait; a late spare is kept and moves it at a later look, or takes its
        lost actors' places in the recovery; waiting cost the simulated fleet 1.6% of its time)."""
        now, drains = self.clock.time(), tuple(drains)
        nodes = frozenset(d.node_id for d in drains)
        movable = frozenset(d.node_id for d in drains if (left := d.seconds_left(now)) is None or left > MOVE_S)  # a move needs MOVE_S: the rest is given up (give_up)
        t0 = self.clock.perf_counter()
        g = self.group
        width = g.width
        affected = g.replicas_on(movable)
        on_nodes = [k for k in g.keys() if g.nodes.get(k) in movable]
        if affected and not all(k in g.spares.of() for k in on_nodes) and self._ready_spare() is not None:
            # whole replicas change: let the versions in flight commit first. Per-stage moves do
            # not wait: a version whose copy of a moved actor was not collected yet is discarded
            # (the committed one stays), so the pause is only the state copy; nor does a drain
            # that moves nothing whole (no spare replica has started: they stay). Never past the
            # time the nodes have left (less a move's): what has not committed by then is dropped
            settle = self._settle_snapshots(settle_within(drains, now))
        else:
            settle = ""
        moved = stayed = 0
        hows: set[str] = set()
        swaps, swapped = [], set()  # every replica's stages that move onto their started spares: one batch of copies
        for r in sorted(affected, reverse=True):
            spares = self._ready_stage_spares([k for k in g.keys() if k.replica == r and g.nodes.get(k) in nodes])
            if spares is not None:
                swaps += spares
                swapped.add(r)
        if swaps:
            g.resize.swap_in(swaps)
            moved += len(swaps)
            hows.add(Move.STAGES.value)
        for r in sorted(affected, reverse=True):  # a swapped replica keeps its number: the others still shift in order
            if r in swapped:
                continue
            peers = [p for p in range(g.width) if p not in affected]
            spare = self._ready_spare()
            if spare is not None:
                self._join([spare], [peers[0] if peers else r])
                g.resize.drop_replicas([r])
                g.resize.set_width()
                moved += g.stages
                hows.add(Move.REPLICA.value)
            else:  # no room (it trains on until the last look before its nodes go), or its spares are late (kept: they move it later, or take its lost actors' places)
                stayed += 1
        for k, sp in g.spares.of().items():  # prepared for actors that moved another way
            if g.nodes.get(k) not in nodes:
                g.spares.cancel(sp)
        return Evacuation(moved, stayed, width, g.width, self.clock.perf_counter() - t0, "+".join(sorted(hows)) or "none", settle)

    def give_up(self, drains: Iterable[Drain], step: int) -> StepFailure | None:
        """After a drain's moves: the stage actors still on its nodes that go before the next
        look (:data:`MOVE_S` plus the time to it: step ``step`` would fail when they go) are
        ended now, at the step boundary, and the failure to recover from is returned (None:
        nothing to give up). The recovery then drops or merges their replicas as it would after
        the loss, without the failed step's lost work and the node watch's delay (fleet seed 1
        at 30 s notices: 22 of 23 failures were of nodes noticed and stayed). Only while every
        stage keeps an actor elsewhere (a data-parallel peer holds its state: lossless)."""
        g = self.group
        going = going_before_next_look(drains, self.clock.time(), self.timer.peek())
        self.last_looked |= set(going)
        keys = [k for k in g.keys() if g.nodes.get(k) in going]
        if not keys or {k.stage for k in g.keys() if k not in keys} != set(range(g.stages)):
            return None
        where = sorted({g.nodes[k] for k in keys})
        for k in keys:
            g.kill(k)
        log.info("%d stage actor(s) on draining node(s) %s that go before the next step could end are given up now", len(keys), [n[:12] for n in where])
        return StepFailure(step, keys[0].stage, keys[0].replica, f"NodeEnding: {len(keys)} stage actor(s) on {len(where)} draining node(s) that go in "
                           f"{min(going[n] for n in where):.1f} s, before the next step could end (no room to move them), given up at the step boundary",
                           during=During.DRAIN)

    def _ready_stage_spares(self, keys: list[ShardKey]) -> list[SpareRef] | None:
        """The started stage spares of every one of ``keys``; None if a key has none or one is
        still starting (no waiting: the whole run would wait with it; a late spare is kept)."""
        sp, by_key = self.group.spares, self.group.spares.of()
        if not keys or any(k not in by_key for k in keys):
            return None
        spares = [by_key[k] for k in keys]
        alive = self.nodes.alive()
        return spares if all(sp.ready(s) and sp.nodes(s) <= alive for s in spares) else None
