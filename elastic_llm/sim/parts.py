"""The simulated executors the real controller drives: stage actors, steps, recovery, elastic width.

Owns: :class:`SimGroup` (the stage actors' placement on the fleet's actor slots, spare replicas
and stage spares starting in the background, warm standbys per node), :class:`SimExecutor`
(a step takes the cost model's 1F1B time and fails when a node hosting the run, or a stage
process, dies within it), :class:`SimRecovery` (observes through the real snapshot coordinator's
census and the real :func:`~elastic_llm.controller.recovery.build_observation`, then carries a
plan out in simulated time: process starts or standby adoptions, state from managers, parity,
peers or neighbours) and :class:`SimElastic` (builds the :class:`ElasticView` of a look and
runs the real elastic policy :func:`~elastic_llm.controller.elastic.decide` and
:func:`~elastic_llm.controller.elastic.drain_moves`). Never decides what the controller
decides (the plan's sources, whether to grow, drain or shrink come from the real policies); it
only answers what the world looks like and how long each side effect takes.

Why ~490 lines: one simulated counterpart for each of the four executor protocols the
controller is built on (:mod:`elastic_llm.controller.parts`), and the placement they share (the
snapshot tiers are in :mod:`elastic_llm.sim.snapshots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elastic_llm.config import RunConfig
from elastic_llm.controller.actor_group import CapacityUnavailable
from elastic_llm.controller.drains import Drain
from elastic_llm.controller.elastic import MOVE_S, SETTLE_S, ElasticPlan, LookTimer, ElasticView, Evacuation, Move, ResizeOutcome, SpareView, decide, evacuation_drops, shrink_instead
from elastic_llm.controller.recovery import COMMIT_S, RecoveryOutcome, build_observation
from elastic_llm.controller.states import Capacity
from elastic_llm.model import count_parameters
from elastic_llm.pipeline.executor import StepFailed, StepResult
from elastic_llm.recovery.policy import LOSSY, Observation, RecoveryPlan, RollbackFrom, Source
from elastic_llm.sim.snapshots import SimFlusher, SimSnapshots
from elastic_llm.sim.world import EPOCH, Charged, SimRef, World
from elastic_llm.snapshot.coordinator import StageMember
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.sources import Mode
from elastic_llm.stream import StreamPosition


@dataclass
class SimSpare:
    """A spare replica (``key`` None) or stage spare starting in the background."""

    key: ShardKey | None
    nodes: list[str]  # one per stage (a stage spare: one)
    started: float
    ready_s: float


@dataclass
class Standbys:
    """Warm standby processes per node: ``per_node`` each, one used comes back after a process start."""

    per_node: int
    start_s: float
    refill: dict[str, list[float]] = field(default_factory=dict)  # node -> seconds its used standbys are back

    def ready(self, node: str, now: float, added_s: float) -> int:
        if self.per_node <= 0 or now < added_s + self.start_s:
            return 0
        back = [t for t in self.refill.get(node, []) if t > now]
        self.refill[node] = back
        return max(0, self.per_node - len(back))

    def use(self, node: str, now: float) -> None:
        self.refill.setdefault(node, []).append(now + self.start_s)


class SimGroup:
    """The stage actors ``actors[replica][stage]`` (each a :class:`ShardKey`) on the fleet's slots."""

    def __init__(self, cfg: RunConfig, world: World, charged: Charged) -> None:
        self.cfg, self.world, self.charged = cfg, world, charged
        self.stages = cfg.parallel.stages
        self.width = cfg.parallel.dp
        self.actors: list[list[Any]] = []
        self.ready: set[ShardKey] = set()
        self.nodes: dict[ShardKey, str] = {}
        self.pids: dict[ShardKey, int] = {}
        self.dead: set[ShardKey] = set()  # processes that died on nodes that live
        self.spares: list[SimSpare] = []
        self.stage_spares: dict[ShardKey, SimSpare] = {}
        self.standbys = Standbys(int(cfg.recovery.standby) if cfg.recovery.standby != "auto" else 1, world.costs.actor_start_s)
        self.parameters = count_parameters(cfg.model.shape())
        self._members: tuple[tuple[tuple[ShardKey, str], ...], list[StageMember]] = ((), [])

    # ------------------------------------------------------------------ slots
    def _used(self) -> dict[str, int]:
        used = dict(self.world.host_counts)
        for sp in self.spares + list(self.stage_spares.values()):
            for n in sp.nodes:
                used[n] = used.get(n, 0) + 1
        return used

    def _free(self, avoid: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """(node, free slots) of the live nodes not under notice and not in ``avoid``, by node id."""
        fleet, used = self.world.fleet, self._used()
        draining = fleet.draining()
        return [(n, x.slots - used.get(n, 0)) for n, x in sorted(fleet.nodes.items())
                if x.alive and n not in draining and n not in avoid and x.slots > used.get(n, 0)]

    def free_slots(self, avoid: frozenset[str] = frozenset()) -> int:
        return sum(f for _, f in self._free(avoid))

    def _take(self, count: int, avoid: frozenset[str] = frozenset()) -> list[str]:
        """``count`` slots packed onto the fewest nodes; CapacityUnavailable if there are fewer."""
        out: list[str] = []
        if count <= 0:
            return out
        for n, f in self._free(avoid):
            out += [n] * min(f, count - len(out))
            if len(out) == count:
                return out
        raise CapacityUnavailable(self.capacity(count))

    def _host(self, key: ShardKey, node: str | None) -> None:
        old = self.nodes.pop(key, None)
        if old is not None:
            self.world.host_counts[old] -= 1
        if node is not None:
            self.nodes[key] = node
            self.world.host_counts[node] += 1

    def _homeless(self, keys: list[ShardKey]) -> list[ShardKey]:
        fleet = self.world.fleet
        return [k for k in keys if k not in self.nodes or not fleet.is_alive(self.nodes[k])]

    # ------------------------------------------------------------------ the Group protocol
    def keys(self) -> list[ShardKey]:
        return [ShardKey(s, r) for r in range(self.width) for s in range(self.stages)]

    def place(self, at_once: bool = False) -> None:
        with self.charged:
            need = len(self._homeless(self.keys()))
            if need > self.free_slots():
                raise CapacityUnavailable(self.capacity(need))

    def placed(self) -> bool:
        with self.charged:
            return len(self._homeless(self.keys())) <= self.free_slots()

    def capacity(self, replicas: int | None = None) -> Capacity:
        need = replicas if replicas is not None else self.stages * self.width
        alive = self.world.fleet.alive()
        return Capacity(need=f"{need} actor slot(s)", have=f"{self.free_slots()} free slot(s) on {len(alive)} live node(s)")

    def spawn_all(self) -> None:
        with self.charged:
            keys = self.keys()
            for k, n in zip(keys, self._take(len(keys))):
                self._host(k, n)
            self.actors = [[ShardKey(s, r) for s in range(self.stages)] for r in range(self.width)]
            self.ready = set(keys)
            self.pids = {k: 1 for k in keys}
            self._shard_size()
        self.world.clock.sleep(self.world.costs.actor_start_s)

    def replace(self, keys: list[ShardKey], adopt: dict[ShardKey, str] | None = None) -> None:
        """New processes for ``keys`` (a standby's where the plan adopts one); the clock moves
        by the slowest start."""
        with self.charged:
            adopt = adopt or {}
            now = self.world.clock.now
            homeless = self._homeless(keys)
            slots = iter(self._take(len(homeless)))
            start = 0.0
            for k in keys:
                node = next(slots) if k in homeless else self.nodes[k]
                self._host(k, node)
                self.dead.discard(k)
                self.ready.add(k)
                if adopt.get(k) is not None:
                    self.standbys.use(node, now)
                    start = max(start, self.world.costs.adopt_s)
                else:
                    start = max(start, self.world.costs.actor_start_s)
        self.world.clock.sleep(start)

    def members(self) -> list[StageMember]:
        with self.charged:
            key = tuple(self.nodes.items())
            if self._members[0] != key:
                self._members = (key, [StageMember(k, None, n) for k, n in key])
            return self._members[1]

    def shutdown(self) -> None:
        pass

    # ------------------------------------------------------------------ what recovery and elastic need
    def _shard_size(self) -> None:
        self.world.shard_mb = self.world.costs.shard_mb(self.parameters, self.stages, self.width)

    def lost(self) -> list[ShardKey]:
        fleet = self.world.fleet
        return [k for k in self.keys() if k in self.dead or not fleet.is_alive(self.nodes.get(k, ""))]

    def drop_replicas(self, drop: tuple[int, ...] | list[int]) -> None:
        """Remove replicas ``drop``; the others are renumbered 0..w-1 in order."""
        with self.charged:
            kept = [r for r in range(self.width) if r not in set(drop)]
            old = dict(self.nodes)
            for k in list(self.nodes):
                self._host(k, None)
            dead = set(self.dead)
            self.dead.clear()
            for new, r in enumerate(kept):
                for s in range(self.stages):
                    if ShardKey(s, r) in old:
                        self._host(ShardKey(s, new), old[ShardKey(s, r)])
                    if ShardKey(s, r) in dead:
                        self.dead.add(ShardKey(s, new))
            self.width = len(kept)
            self.actors = [[ShardKey(s, r) for s in range(self.stages)] for r in range(self.width)]
            self.ready = set(self.keys())
            self._shard_size()

    def add_replica(self, nodes: list[str]) -> None:
        with self.charged:
            r = self.width
            self.width += 1
            for s, n in enumerate(nodes):
                self._host(ShardKey(s, r), n)
            self.actors.append([ShardKey(s, r) for s in range(self.stages)])
            self.ready |= set(self.actors[-1])
            self._shard_size()

    def unplaceable(self, lost: list[ShardKey]) -> frozenset[int]:
        """Replicas that lost actors with their node and cannot all be placed now (greedy, by replica)."""
        homeless = [k for k in lost if not self.world.fleet.is_alive(self.nodes.get(k, ""))]
        free, out = self.free_slots(), set()
        for r in sorted({k.replica for k in homeless}):
            need = sum(1 for k in homeless if k.replica == r)
            if need <= free:
                free -= need
            else:
                out.add(r)
        return frozenset(out)

    def standbys_ready(self) -> dict[str, int]:
        now, fleet = self.world.clock.now, self.world.fleet
        return {n: c for n, x in fleet.nodes.items() if x.alive and (c := self.standbys.ready(n, now, x.added_s)) > 0}

    def bundle_nodes(self, lost: list[ShardKey]) -> dict[ShardKey, str | None]:
        """Where each lost actor would start: its own node if it lives, else the next free slot."""
        homeless = self._homeless(lost)
        try:
            slots = iter(self._take(len(homeless)))
        except CapacityUnavailable:
            return {k: self.nodes.get(k) for k in lost if k not in homeless}
        return {k: next(slots) if k in homeless else self.nodes[k] for k in lost}


class SimExecutor:
    """A step in simulated time; fails at the first death of a node or process it runs on."""

    def __init__(self, group: SimGroup, cfg: RunConfig) -> None:
        self.group, self.cfg = group, cfg
        self.world = group.world

    def start(self, step: int, x: Any, y: Any, snapshot: StreamPosition | None = None, faults: Any = None) -> int:
        if snapshot is not None:
            self.world.positions[step] = snapshot
        return step

    def finish(self, pending: int) -> StepResult:
        g, w, p = self.group, self.world, self.cfg.parallel
        with g.charged:
            took = w.costs.step_s(g.stages, p.microbatches, self.cfg.train.batch_size, g.width)
            death = w.fleet.first_death(set(g.nodes.values()), set(g.nodes), w.clock.now + took)
        if death is None:
            w.clock.advance(w.clock.now + took)
            loss = float(10.0 / np.sqrt(pending))
            return StepResult(loss=loss, grad_norms=[1.0] * g.stages, lr=self.cfg.train.lr)
        t, node, key = death
        if key is not None:
            g.dead.add(key)
            detect = w.costs.detect_process_s
        else:
            key = min(k for k, n in g.nodes.items() if n == node)
            detect = w.costs.detect_node_s
        w.clock.advance(t + detect)
        why = f"node {node} was removed" if node is not None else f"the process of {key} died"
        raise StepFailed(RuntimeError(f"simulated: {why}"), key.stage, key.replica, "forward")

    def settle(self) -> None:
        pass

    def eval_loss(self, x: Any, y: Any) -> float:
        return 0.0


def sim_executor(group: SimGroup) -> Any:
    return lambda actors, cfg: SimExecutor(group, cfg)


class SimRecovery:
    def __init__(self, group: SimGroup, snapshots: SimSnapshots | None, min_width: int, durable: SimFlusher | None = None) -> None:
        self.group, self.snapshots, self.min_width, self.durable = group, snapshots, min_width, durable
        self.world = group.world

    def observe(self, executor: Any, failed_step: int) -> Observation:
        g, sn, fleet = self.group, self.snapshots, self.world.fleet
        with g.charged:
            alive = set(fleet.alive())
            lost = set(g.lost())
            steps = {k: (None if k in lost else failed_step - 1) for k in g.keys()}
        dead_managers: frozenset[str] = frozenset()
        if sn is not None:
            sn.abandon_pending(from_version=failed_step)
            sn.poll(block=True, timeout=COMMIT_S)
            sn.abandon_pending()
            dead_managers = frozenset(sn.lost_parts(alive))
        latest = self.durable.latest() if self.durable is not None else None
        with g.charged:
            lost_keys = sorted(lost)
            unplaceable, standbys, bundles = g.unplaceable(lost_keys), g.standbys_ready(), g.bundle_nodes(lost_keys)
        return build_observation(steps, dict(g.nodes), alive, dead_managers, sn, self.group.cfg.snapshot.parity, self.min_width, unplaceable,
                                 Mode.LOSSLESS, self.group.cfg.mirrors, None, latest[0] if latest else None, standbys, bundles, True, frozenset())

    def execute(self, plan: RecoveryPlan, obs: Observation, step: int) -> RecoveryOutcome:
        g, sn, w = self.group, self.snapshots, self.world
        c = w.costs
        if plan.drop_replicas:
            g.drop_replicas(plan.drop_replicas)
        lost = [ShardKey(a.stage, a.replica) for a in plan.actions]
        if sn is not None:
            sn.ensure_managers()
        g.place(at_once=True)
        pieces: list[SimRef] = []
        sources: dict[ShardKey, Source] = {}
        fetched = w.clock.now
        if plan.rollback_to is not None and plan.rollback_from is RollbackFrom.SNAPSHOT:
            assert sn is not None
            for k in g.keys():
                src = sn.fetch_stage_state(k.stage, k.replica, obs.dead_managers)
                pieces += list(src.refs)
                sources[k] = src.source
            fetched = w.clock.now
        g.replace(lost, {ShardKey(a.stage, a.replica): a.adopt for a in plan.actions if a.adopt is not None})
        if plan.rollback_to is not None and plan.rollback_from is RollbackFrom.DURABLE:  # everyone reads its part from storage
            assert self.durable is not None and sn is not None
            self.durable.reset()
            sn.forget_all()
            w.clock.sleep(w.shard_mb / c.flush_mb_s)
            position = w.positions.get(plan.rollback_to)
            restored = tuple((ShardKey(a.stage, a.replica), a.source) for a in plan.actions)
            return RecoveryOutcome(plan, plan.rollback_to, step - plan.rollback_to, restored, 0, position)
        if plan.rollback_to is not None:  # the pieces load once the new processes are up
            assert sn is not None and sn.committed is not None
            w.clock.sleep(max((p.ready_s for p in pieces), default=fetched) - fetched)
            raw = sn.committed.shard(ShardKey(0, 0)).data_position()
            position = StreamPosition.of(raw) if raw else None
            restored = tuple((ShardKey(a.stage, a.replica), sources.get(ShardKey(a.stage, a.replica), a.source)) for a in plan.actions)
            return RecoveryOutcome(plan, plan.rollback_to, step - plan.rollback_to, restored, 0, position)
        stage_mb = c.stage_mb(g.parameters, g.stages)
        copy = [stage_mb / c.network_mb_s * (2 if a.source in LOSSY else 1) for a in plan.actions if a.source in LOSSY or a.source is Source.DP_PEER]
        w.clock.sleep(max(copy, default=0.0))
        return RecoveryOutcome(plan, step, 0, tuple((ShardKey(a.stage, a.replica), a.source) for a in plan.actions), 0, None)


class SimElastic:
    def __init__(self, group: SimGroup, snapshots: SimSnapshots | None, cfg: RunConfig, min_width: int) -> None:
        self.group, self.snapshots, self.cfg, self.min_width = group, snapshots, cfg, min_width
        self.world = group.world
        self._last_grow_look = float("-inf")
        self.timer = LookTimer()

    def look(self, seen: set[str] | frozenset[str]) -> tuple[tuple[Drain, ...], int | None]:
        view = self.observe(seen)
        plan = decide(view, seen, self.cfg.elastic.bounds(self.cfg.parallel.dp)[1], self.min_width)
        self.act(plan)
        return plan.drains, plan.grow_to

    def _view(self, sp: SimSpare, now: float) -> SpareView:
        return SpareView(sp, sp.key, frozenset(sp.nodes), now - sp.started, now >= sp.ready_s)

    def observe(self, seen: set[str] | frozenset[str]) -> ElasticView:
        g, el = self.group, self.cfg.elastic
        with g.charged:
            now = self.world.clock.now
            draining = {n: Drain(n, EPOCH + t) for n, t in self.world.fleet.draining().items()} if el.drains else {}
            avoid = frozenset(draining)
            affected = {k.replica for k, n in g.nodes.items() if n in draining and n not in seen}
            free = g.free_slots(avoid) if affected else None
            room = None
            if not affected and not g.spares and g.width < el.bounds(self.cfg.parallel.dp)[1] and now - self._last_grow_look >= el.grow_check_s:
                self._last_grow_look = now
                room = g.free_slots(avoid) >= g.stages
            return ElasticView(tuple(d for _, d in sorted(draining.items())), tuple(g.nodes.items()), g.width, g.stages,
                               tuple(self._view(sp, now) for sp in g.spares), tuple(self._view(sp, now) for sp in g.stage_spares.values()),
                               free, room, self.world.clock.time(), self.timer.look(now))

    def act(self, plan: ElasticPlan) -> None:
        g = self.group
        if self.snapshots is not None:
            self.snapshots.avoid = plan.avoid
        with g.charged:
            for v in plan.cancel:
                if v.key is None:
                    g.spares.remove(v.handle)
                else:
                    g.stage_spares.pop(v.key, None)
            now, start = self.world.clock.now, self.world.costs.actor_start_s
            for key in plan.start_stage_spares:
                try:
                    g.stage_spares[key] = SimSpare(key, g._take(1, plan.avoid), now, now + start)
                except CapacityUnavailable:
                    pass
            if plan.start_spare:
                try:
                    g.spares.append(SimSpare(None, g._take(g.stages, plan.avoid), now, now + start))
                except CapacityUnavailable:
                    pass

    def _settle(self) -> None:
        if self.snapshots is not None:
            self.snapshots.poll(block=True, timeout=SETTLE_S)

    def _copy_s(self) -> float:
        c = self.world.costs
        return c.stage_mb(self.group.parameters, self.group.stages) / c.network_mb_s

    def grow(self) -> ResizeOutcome:
        g, clock = self.group, self.world.clock
        t0, width = clock.now, g.width
        spare = next((sp for sp in g.spares if clock.now >= sp.ready_s), None)
        if spare is None:
            raise CapacityUnavailable(g.capacity(g.stages))
        self._settle()
        g.spares.remove(spare)
        g.add_replica(spare.nodes)
        clock.sleep(self._copy_s())
        return ResizeOutcome(width, g.width, clock.now - t0, "capacity")

    def _wait_ready(self, spares: list[SimSpare], until: float | None) -> bool:
        """Wait (simulated) until every spare has started, at most until ``until`` (wall)."""
        clock = self.world.clock
        ready = max((sp.ready_s for sp in spares), default=clock.now)
        if ready <= clock.now:
            return True
        if until is None or EPOCH + ready > until:
            return False
        clock.advance(ready)
        return True

    def evacuate(self, nodes: frozenset[str], deadline: float | None = None) -> Evacuation:
        g, clock = self.group, self.world.clock
        t0, width = clock.now, g.width
        until = None if deadline is None else deadline - MOVE_S
        affected = sorted({k.replica for k, n in g.nodes.items() if n in nodes}, reverse=True)
        on_nodes = [k for k, n in g.nodes.items() if n in nodes]
        if affected and not all(k in g.stage_spares for k in on_nodes):
            self._settle()
        moved = dropped = stayed = 0
        hows: set[str] = set()
        no_room, drop = evacuation_drops(affected, on_nodes, set(g.stage_spares), len(g.spares), g.stages, g.free_slots(nodes), g.width, self.min_width)
        for r in affected:
            keys = [k for k, n in g.nodes.items() if k.replica == r and n in nodes]
            spares = [g.stage_spares[k] for k in keys if k in g.stage_spares]
            if keys and len(spares) == len(keys) and self._wait_ready(spares, until):
                for sp in spares:
                    assert sp.key is not None
                    g._host(sp.key, sp.nodes[0])
                    del g.stage_spares[sp.key]
                clock.sleep(self._copy_s())
                moved += len(keys)
                hows.add(Move.STAGES.value)
                continue
            spare = next(iter(g.spares), None)
            if spare is not None and self._wait_ready([spare], until):
                g.spares.remove(spare)
                g.add_replica(spare.nodes)
                clock.sleep(self._copy_s())
                g.drop_replicas([r])
                moved += g.stages
                hows.add(Move.REPLICA.value)
            elif (r in drop or r not in no_room) and shrink_instead(g.width, self.min_width):
                g.drop_replicas([r])
                dropped += 1
            else:
                stayed += 1
        g.stage_spares.clear()
        return Evacuation(moved, dropped, stayed, width, g.width, clock.now - t0, "+".join(sorted(hows)) or "none")
