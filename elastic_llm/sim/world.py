"""The simulated world: a clock, a fleet of nodes, and the snapshot managers on them.

Owns: :class:`SimClock` (simulated seconds; ``sleep`` advances them and plays the fleet's events
that fall due), :class:`Fleet` (nodes with actor slots: added, draining with a deadline, removed,
cut off from the driver and healed, from a replay plan's actions; stage processes that die on a
seeded schedule), the simulated
snapshot managers (:class:`SimManager`: the calls the real
:class:`~elastic_llm.snapshot.coordinator.SnapshotCoordinator` makes, each answered after the
cost model's time, failed if its node dies first, never answered while it is cut off), the run's monitor actor (:class:`SimMonitor`) and :class:`SimCalls` (``wait``/``get`` over
their answers, advancing the clock when the coordinator blocks). Never reads the machine's
clock, never sleeps, never decides anything about the run: the real controller does.
"""

from __future__ import annotations

import bisect
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from elastic_llm.replay.trace import ReplayAction
from elastic_llm.sim.costs import CostModel
from elastic_llm.snapshot.introductions import Acquaintances, Known
from elastic_llm.snapshot.ports import ManagerLost
from elastic_llm.snapshot.records import ManagerPart, ManagerPlan, ShardInfo, ShardKey
from elastic_llm.sources import NodeGone

NEVER = float("inf")  # when a node the driver cannot reach answers (until it is healed or removed)

EPOCH = 1.8e9  # what the simulated wall clock (``time()``) reads at simulated second 0


class SimClock:
    """Simulated seconds from 0. Every reading is the same simulated instant; ``sleep`` and
    :meth:`advance` move it forward and let ``on_advance`` play what fell due."""

    def __init__(self) -> None:
        self.now = 0.0
        self.end = float("inf")  # the clock stops here (the end of the trace)
        self.on_advance: Callable[[float], None] = lambda t: None

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return EPOCH + self.now

    def sleep(self, seconds: float) -> None:
        self.advance(self.now + max(0.0, seconds))

    def advance(self, t: float) -> None:
        if t > self.now:
            self.now = min(t, self.end)
        self.on_advance(self.now)


@dataclass
class SimNode:
    node_id: str
    slots: int  # stage actors it holds
    added_s: float
    removed_s: float | None = None
    drain_deadline_s: float | None = None  # simulated second it goes (a notice was given)
    cut_s: float | None = None  # since when the driver cannot reach it (hung, or cut off by the network): alive, silent

    @property
    def alive(self) -> bool:
        return self.removed_s is None


class Fleet:
    """The nodes, played from a replay plan's actions as simulated time passes."""

    def __init__(self, clock: SimClock, initial: tuple[str, ...], actions: tuple[ReplayAction, ...], slots: int,
                 zones: dict[str, str] | None = None) -> None:
        self.clock, self.slots = clock, slots
        self.zones = dict(zones or {})  # node -> its zone (the trace's), the failure domain snapshots spread their groups over
        self.nodes: dict[str, SimNode] = {n: SimNode(n, slots, 0.0) for n in initial}
        self.pending = list(actions)  # sorted by at_s
        self.removals: list[tuple[float, str]] = sorted((a.at_s, a.node) for a in actions if a.kind == "remove")
        self.removal_of = {n: s for s, n in self.removals}
        self.cuts: list[tuple[float, str]] = sorted((a.at_s, a.node) for a in actions if a.kind == "cut")
        self.removed: list[str] = []  # nodes removed so far, in the order they went
        self._alive: list[str] | None = None  # cached until the next action is played
        self.process_deaths: list[tuple[float, ShardKey]] = []  # (second, actor) from the fault schedule
        self.applied = 0
        clock.on_advance = self.apply_until

    def shift(self, t0: float) -> None:
        """Play the plan from simulated second ``t0`` on (the run's start is not part of the trace)."""
        self.pending = [replace(a, at_s=a.at_s + t0) for a in self.pending]
        self.removals = [(s + t0, n) for s, n in self.removals]
        self.cuts = [(s + t0, n) for s, n in self.cuts]
        self.removal_of = {n: s for s, n in self.removals}

    def apply_until(self, t: float) -> None:
        while self.applied < len(self.pending) and self.pending[self.applied].at_s <= t:
            self.applied += 1
            self.play(self.pending[self.applied - 1])

    def play(self, a: ReplayAction) -> None:
        """Play ``a`` (one of the plan's, or a harness's at its own time: a node added, drained,
        removed, cut off from the driver or healed now)."""
        self._alive = None
        x = self.nodes.get(a.node)
        if a.kind == "add":
            self.nodes[a.node] = SimNode(a.node, self.slots, a.at_s)
        elif x is None:
            raise ValueError(f"replay action {a.kind!r} names node {a.node!r}, which was never added")
        elif a.kind == "drain":
            x.drain_deadline_s = a.at_s + (a.deadline_s or 0.0)
        elif a.kind == "remove":
            x.removed_s = a.at_s
            self.removed.append(a.node)
        elif a.kind == "cut":
            x.cut_s = a.at_s if x.cut_s is None else x.cut_s
        elif a.kind == "heal":
            x.cut_s = None
        else:
            raise ValueError(f"unknown replay action {a.kind!r} (add, drain, remove, cut or heal)")

    def alive(self) -> list[str]:
        if self._alive is None:
            self._alive = [n for n, x in self.nodes.items() if x.alive]
        return self._alive

    def draining(self) -> dict[str, float]:
        """Alive nodes under notice: node -> simulated second it goes."""
        return {n: x.drain_deadline_s for n, x in self.nodes.items() if x.alive and x.drain_deadline_s is not None}

    def is_alive(self, node: str) -> bool:
        x = self.nodes.get(node)
        return x is not None and x.alive

    def removed_by(self, node: str, t: float) -> bool:
        """Whether ``node`` is gone at simulated second ``t`` (by the plan, even if not played yet)."""
        x = self.nodes.get(node)
        if x is None:
            return True
        if x.removed_s is not None:
            return x.removed_s <= t
        at = self.removal_of.get(node)  # labels are never reused: a node is removed at most once
        return at is not None and at <= t

    def cut_off(self, node: str) -> bool:
        """Whether the driver cannot reach ``node`` now (it lives, and answers nothing)."""
        x = self.nodes.get(node)
        return x is not None and x.alive and x.cut_s is not None

    def answers_at(self, node: str, t: float) -> float:
        """When an answer ``node`` would give at ``t`` arrives: ``t``; while it is cut off, never,
        or at its planned removal, which fails the call (as on Ray, where the node's death ends
        every call into it)."""
        if not self.cut_off(node):
            return t
        gone = self.removal_of.get(node)
        return gone if gone is not None and gone >= t else NEVER

    def first_cut(self, nodes: set[str], until: float) -> float | None:
        """When the first of ``nodes`` is cut off from the driver in [now, until] (one already
        cut: now); None if none."""
        now = self.clock.now
        if any(self.cut_off(n) for n in nodes):
            return now
        i = bisect.bisect_right(self.cuts, (now, "\uffff"))
        return next((s for s, n in self.cuts[i:] if s <= until and n in nodes), None)

    def first_death(self, nodes: set[str], keys: set[ShardKey], until: float) -> tuple[float, str | None, ShardKey | None] | None:
        """The first of ``nodes`` removed, or of ``keys`` whose process dies, in (now, until]
        (a node already gone: now); None if none."""
        now = self.clock.now
        gone = sorted(n for n in nodes if not self.is_alive(n))
        if gone:
            return now, gone[0], None
        i = bisect.bisect_right(self.removals, (now, "\uffff"))
        for s, n in self.removals[i:]:
            if s > until:
                break
            if n in nodes:
                return s, n, None
        j = bisect.bisect_right(self.process_deaths, (now, ShardKey(10**9, 10**9)))
        for s, k in self.process_deaths[j:]:
            if s > until:
                break
            if k in keys:
                return s, None, k
        return None


@dataclass(eq=False)  # hashed by identity, as Ray's object refs are used as keys
class SimRef:
    """A simulated manager's answer: ready at ``ready_s``; an error if its node is gone by then."""

    ready_s: float
    node: str
    value: Any = None
    fleet: Fleet | None = None
    refused: bool = False  # the answer of a manager the scheduler never placed (its node was gone when it was started)

    def failed(self) -> bool:
        return self.fleet is not None and self.fleet.removed_by(self.node, self.ready_s)


@dataclass(eq=False)
class SimRelayRef(SimRef):
    """A relay's answer (a group's parts): failed if the relaying node or any part's is gone."""

    parts: tuple[SimRef, ...] = ()

    def failed(self) -> bool:
        return super().failed() or any(p.failed() for p in self.parts)

    def culprit(self) -> str:
        return next((p.node for p in self.parts if p.failed()), self.node)


class SimCalls:
    """``wait`` / ``get`` over :class:`SimRef`: what is ready at the clock's now; blocking
    advances the clock (the driver waits in simulated time)."""

    def __init__(self, clock: SimClock, charged: "Charged") -> None:
        self.clock, self.charged = clock, charged

    def wait(self, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        with self.charged:
            return self._wait(refs, num_returns, timeout)

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        with self.charged:
            return self._get(ref, timeout)

    def _wait(self, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        if num_returns > 0 and timeout:
            times = sorted(r.ready_s for r in refs)
            need = times[min(num_returns, len(times)) - 1] if times else self.clock.now
            limit = self.clock.now + timeout if timeout is not None else need
            if need > self.clock.now:
                self.clock.advance(min(need, limit))
        ready = [r for r in refs if r.ready_s <= self.clock.now]
        return ready, [r for r in refs if r.ready_s > self.clock.now]

    def _get(self, ref: Any, timeout: float | None = None) -> Any:
        """``ref``'s value, advancing the clock to it. A call into a node cut off from the driver
        has no answer: it times out after ``timeout`` (at once without one: it would wait for
        ever). An answer the cost model delays past ``timeout`` is waited for (its times are far
        below the controller's timeouts)."""
        if isinstance(ref, list):
            return [self._get(r, timeout) for r in ref]
        if ref.ready_s == NEVER and not ref.failed():
            self.clock.advance(self.clock.now + (timeout or 0.0))
            raise TimeoutError(f"no answer from node {ref.node} within {timeout} s: the driver cannot reach it")
        if ref.ready_s > self.clock.now:
            if timeout == 0:
                raise TimeoutError("not ready")
            if ref.ready_s != NEVER:
                self.clock.advance(ref.ready_s)
        if ref.refused:
            raise NodeGone(frozenset({ref.node}), "the simulated scheduler refused a snapshot manager there")
        if ref.failed():
            node = ref.culprit() if isinstance(ref, SimRelayRef) else ref.node
            raise ManagerLost(RuntimeError(f"the snapshot manager on {node} died (its node was removed)"))  # as Ray's calls raise it
        return ref.value


class _Call:
    """``handle.method.remote(...)`` of a simulated manager; its CPU is the simulation's own."""

    def __init__(self, fn: Callable[..., Any], charged: "Charged") -> None:
        self.fn, self.charged = fn, charged

    def remote(self, *args: Any) -> Any:
        with self.charged:
            self.charged.calls += 1
            return self.fn(*args)


@dataclass
class SimManager:
    """One node's snapshot manager as the coordinator sees it: the calls it makes, answered after
    the cost model's time. ``shard_mb``: megabytes of one stage shard now (set by the group)."""

    node: str
    world: "World"
    versions: dict[int, int] = field(default_factory=dict)  # version held -> attempt
    kept: dict[int, int] = field(default_factory=dict)  # committed version displaced by a newer attempt at it -> its attempt (as the real manager keeps it)

    def __post_init__(self) -> None:
        c = self.world.charged
        self.held = _Call(self._held, c)
        self.snapshot_version = _Call(self._snapshot_version, c)
        self.relay_versions = _Call(self._relay_versions, c)
        self.relay = _Call(self._relay, c)
        self.commit = _Call(self._commit, c)
        self.discard = _Call(self._discard, c)
        self.discard_all = _Call(self._discard_all, c)
        self.unpin = _Call(lambda version: self._ref(0.0), c)
        self.keepalive = _Call(lambda: self._ref(0.0), c)
        self.adopt = _Call(self._adopt, c)
        self.known = Acquaintances()

    refused: bool = False  # started on a node already gone: every answer is the scheduler's refusal
    committed: int = 0  # the newest version committed here
    parts: dict[tuple[int, str], float] = field(default_factory=dict)  # (version, role) -> megabytes of that member's part held here
    link_free_s: float = 0.0  # when this node's link is free of the re-home copies queued on it

    def _ref(self, delay: float, value: Any = None) -> SimRef:
        w = self.world
        return SimRef(w.fleet.answers_at(self.node, w.clock.now + delay), self.node, value, w.fleet, self.refused)

    def _held(self) -> SimRef:
        return self._ref(0.0, tuple(self.versions))

    def _snapshot_version(self, plan: ManagerPlan) -> SimRef:
        w = self.world
        c = w.costs
        mb = w.shard_mb * len(plan.stages)
        group_mb = w.shard_mb * w.stages_on_group(plan.group)
        seconds = mb / c.copy_mb_s + (group_mb / c.parity_mb_s if plan.group else 0.0)
        manifest = w.manifest(plan.version)
        shards = tuple(ShardInfo(key, plan.version, 0, int(w.shard_mb * 1e6), (), manifest, seconds, self.node) for key, _ in plan.stages)
        old = self.versions.get(plan.version)
        if old is not None and old < plan.attempt and plan.version <= self.committed:
            self.kept[plan.version] = old
        self.versions[plan.version] = plan.attempt
        k = len(plan.group) - plan.parity
        self.parts[(plan.version, self.node)] = mb + (group_mb / k * plan.parity / len(plan.group) if plan.group and k > 0 else 0.0)
        return self._ref(seconds, ManagerPart(self.node, shards, (), 0.0, attempt=plan.attempt))

    def _adopt(self, version: int, role: str, source: "SimManager") -> "SimRelayRef":
        """Member ``role``'s part of ``version`` copied from ``source`` at the profile's network
        rate, each node's link carrying one copy at a time; failed if either node goes first."""
        w = self.world
        mb = source.parts.get((version, role), 0.0)
        start = max(w.clock.now, source.link_free_s, self.link_free_s)
        ready = start + mb / w.costs.network_mb_s
        source.link_free_s = self.link_free_s = ready
        self.versions.setdefault(version, 0)
        self.parts[(version, role)] = mb
        return SimRelayRef(ready, self.node, int(mb * 1e6), w.fleet, self.refused, parts=(SimRef(ready, source.node, None, w.fleet),))

    def _relay_versions(self, calls: tuple[tuple[Known, ManagerPlan], ...]) -> "SimRelayRef":
        """The group's parts started by this manager (members' calls are not the driver's): ready
        when the last is; failed if this node or a member's is gone by then. A member the plan
        names by id only is one this manager was sent before (:mod:`elastic_llm.snapshot.introductions`)."""
        parts = tuple(self.known.handle(member, plan.attempt)._snapshot_version(plan) for member, plan in calls)
        return SimRelayRef(max(p.ready_s for p in parts), self.node, tuple(p.value for p in parts), self.world.fleet, parts=parts)

    def _relay(self, method: str, args: tuple[Any, ...], handles: list["SimManager"]) -> SimRef:
        """``commit`` or ``discard`` passed on to ``handles`` (this one first); the members on
        nodes already gone do not take it, nor any if this node is gone (the driver re-sends)."""
        if not self.world.fleet.removed_by(self.node, self.world.clock.now):
            for h in handles:
                if not self.world.fleet.removed_by(h.node, self.world.clock.now):
                    getattr(h, f"_{method}")(*args)
        return self._ref(0.0)

    # ``floor`` (the driver's membership generation) is taken and not checked: a simulated node that goes never comes back as a zombie
    def _commit(self, version: int, flush: bool, keep: tuple[int, ...], floor: int = 0) -> SimRef:
        self.versions = {v: a for v, a in self.versions.items() if v >= version or v in keep}
        self.kept = {v: a for v, a in self.kept.items() if v > version}
        self.parts = {vr: mb for vr, mb in self.parts.items() if vr[0] >= version or vr[0] in keep}
        self.committed = max(self.committed, version)
        return self._ref(0.0)

    def _discard(self, version: int, attempt: int, floor: int = 0) -> SimRef:
        if self.versions.get(version) == attempt:
            del self.versions[version]
        if version in self.kept and version not in self.versions:  # the attempt that displaced it failed: it is back
            self.versions[version] = self.kept.pop(version)
        return self._ref(0.0)

    def _discard_all(self, floor: int = 0) -> SimRef:
        self.versions.clear()
        self.kept.clear()
        self.parts.clear()
        return self._ref(0.0)


class SimMonitor:
    """The run's monitor actor as the controller's feed sees it (``publish``, ``record``,
    ``stop``): the calls are made and counted, nothing is kept."""

    def __init__(self, charged: "Charged") -> None:
        self.publish = _Call(lambda status: None, charged)
        self.record = _Call(lambda event: None, charged)
        self.stop = _Call(lambda: None, charged)


class World:
    """What the simulated parts share: the clock, the fleet, the cost model, the data positions
    the steps were given with a snapshot (the managers' manifests carry them) and the size of a
    shard now."""

    def __init__(self, clock: SimClock, fleet: Fleet, costs: CostModel, charged: "Charged") -> None:
        self.clock, self.fleet, self.costs, self.charged = clock, fleet, costs, charged
        self.positions: dict[int, Any] = {}  # step -> data position after its batch (steps that took a snapshot)
        self.shard_mb = 0.0
        self.host_counts: dict[str, int] = defaultdict(int)  # node -> stage actors on it (the group keeps it)
        self._manifests: dict[int, str] = {}
        # process starts in the background (warm standbys, spares): (from, to, processes); kept
        # only on shared cores (costs.cores > 0), where they take CPU from the steps
        self.background: list[tuple[float, float, int]] = []

    def starting(self, t0: float, t1: float, processes: int) -> None:
        """``processes`` start in the background from ``t0`` to ``t1``."""
        if self.costs.cores > 0 and processes > 0 and t1 > t0:
            self.background.append((t0, t1, processes))

    def step_end(self, start: float, seconds: float, processes: int) -> float:
        """When a step that takes ``seconds`` on an otherwise idle machine ends. On shared cores
        the machine's CPU is shared fairly among runnable processes: while k processes start in
        the background, the step's ``processes`` stage processes get ``processes / (processes +
        k)`` of it. Elsewhere (each actor on its own device) a start costs a step nothing."""
        self.background = [b for b in self.background if b[1] > start]
        if not self.background:
            return start + seconds
        t, work = start, seconds
        cuts = sorted({x for a, b, _ in self.background for x in (a, b) if x > start})
        for cut in [*cuts, float("inf")]:
            k = sum(n for a, b, n in self.background if a <= t < b)
            rate = processes / (processes + k)
            if t + work / rate <= cut:
                return t + work / rate
            work -= (cut - t) * rate
            t = cut
        return t

    def manifest(self, version: int) -> str:
        if version not in self._manifests:
            pos = self.positions.get(version)
            self._manifests[version] = json.dumps({"step": version, "data_position": pos.to_dict() if pos is not None else None})
        return self._manifests[version]

    def stages_on_group(self, group: tuple[str, ...]) -> int:
        return sum(self.host_counts.get(n, 0) for n in group)


class Charged:
    """Counts the process CPU seconds of the simulation's own code (``with charged:``), so the
    controller's CPU is what the run's handlers took minus this."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_state: dict[str, float] = defaultdict(float)  # by the controller's state at the time
        self.calls = 0  # calls the controller made to simulated snapshot managers (each a Ray actor call for real)
        self.state_of: Callable[[], str] = lambda: ""
        self._depth = 0
        self._t = 0.0
        self._gc_t: float | None = None

    def __enter__(self) -> None:
        if self._depth == 0:
            self._t = time.process_time()
        self._depth += 1

    def gc(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` hook: a full collection (generation 2) walks the simulated world's
        whole heap (its fleet, metrics, timeline), which a real driver does not hold: its pause
        is the simulation's own time (one took 118 ms inside a 155 ms plan at 64 x 16)."""
        if info.get("generation") != 2 or self._depth:
            return
        if phase == "start":
            self._gc_t = time.process_time()
        elif self._gc_t is not None:
            took, self._gc_t = time.process_time() - self._gc_t, None
            self.seconds += took
            self.by_state[self.state_of()] += took

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            took = time.process_time() - self._t
            self.seconds += took
            self.by_state[self.state_of()] += took
