"""The stage actors of a run on Ray: ``actors[replica][stage]``, on the reservations of :mod:`.placement`.

Owns: spawning an actor on its bundle, replacing lost ones (a warm standby adopted where the plan
says so, :mod:`.standby` keeps the pool), describing them (node, pid, devices), resetting the
survivors of a failed step, changing the width (add a replica, drop replicas, borrow, install a
started spare: the processes and placement groups behind each change; the bookkeeping is the
one :class:`~elastic_llm.controller.membership.Membership` table both runtimes keep), and what
fault injection does to the actors. Spares started ahead are :mod:`.spares`'; the calls that move
state :mod:`.stage_calls`'. This is the Ray implementation of
:class:`~elastic_llm.controller.ports.StageActors` and its small ports (``Placement``,
``Resizes``, ``StateMoves``, ``Handover``, chaos's ``StageHits``). Every wait has a deadline.
Never decides anything: the controller says which actors to place, replace, add or drop, and the
recovery plan which actor adopts a standby.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterable
from typing import Any

from elastic_llm.clock import SYSTEM, Clock
from elastic_llm.config import RunConfig
from elastic_llm.controller.membership import Column, Members, Membership
from elastic_llm.controller.ports import RESET_S, CapacityUnavailable, PlanNotFollowed, SpareRef, Standbys, Roster
from elastic_llm.controller.states import Capacity
from elastic_llm.runtime import handover
from elastic_llm.runtime.placement import PLACE_S, Reservations, kill_actor
from elastic_llm.runtime.spares import RaySpares, Spare, StageSpare, own
from elastic_llm.runtime.stage_calls import StateCalls
from elastic_llm.snapshot.coordinator import StageMember
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.spans import Spans

log = logging.getLogger("elastic_llm.runtime")
START_S = 300.0  # longest an actor may take to start once placed (imports torch, builds the model)
WIDTH_S = 60.0  # longest the actors may take to learn a new width


class ActorGroup(Members, StateCalls):
    def __init__(self, cfg: RunConfig, run_id: str, pool: Standbys | None = None, clock: Clock = SYSTEM) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.pool = pool  # warm standbys: replacements adopt one where the plan says so
        self.clock = clock
        self.spans = Spans(clock.perf_counter)  # "actor" (start or adopt replacements), "state" (copies between actors)
        self.stages = cfg.parallel.stages
        self.slots = Reservations(cfg, clock, run_id)
        self.grace_s = cfg.recovery.driver_grace_s if cfg.outlives_driver else 0.0  # > 0: detached actors that outlive the driver this long (elastic_llm.lease)
        self.names: dict[Any, str] = {}  # actor handle -> its Ray name (the roster a next driver takes over)
        self.table = Membership(self.stages, cfg.parallel.dp)  # width, nodes, ready, fresh (late stage spares in lost keys' places)
        self.handles: Column[Any] = self.table.column()  # each key's actor handle
        self.pids: Column[int] = self.table.column()
        self.gpus: Column[tuple[str, ...]] = self.table.column()  # devices of each actor (GPU runs): a standby adopted in its place takes them
        self.spawned = False
        self.generation = 0  # actors started: part of each one's name (a SIGKILLed actor's name is released late)
        self.spares = RaySpares(self)  # replicas and single stages started in the background, not yet in the width


    @property
    def actors(self) -> list[list[Any]]:
        """``[replica][stage]`` handles once spawned (None where none runs), else empty."""
        return [[self.handles.get(ShardKey(s, r)) for s in range(self.stages)] for r in range(self.width)] if self.spawned else []

    def actor(self, key: ShardKey) -> Any:
        return self.handles.get(key)

    def hold(self, key: ShardKey, actor: Any, name: str) -> None:
        """``actor`` (Ray name ``name``) runs as ``key`` from now on."""
        self.handles[key] = actor
        self.names[actor] = name

    def record(self, key: ShardKey, info: Any) -> None:
        """``key``'s actor answered with ``info`` (a :class:`~elastic_llm.pipeline.stage.StageInfo`): its node, pid, devices."""
        self.table.host(key, info.node_id)
        self.pids[key], self.gpus[key] = info.pid, info.gpu_ids
        self.table.ready.add(key)

    # ------------------------------------------------------------------ slots (see placement.py)
    def place(self, at_once: bool = False, avoid: frozenset[str] = frozenset(), wait_s: float = PLACE_S) -> None:
        """Make sure every replica's bundles are placed; raises :class:`CapacityUnavailable` when
        they are not within ``wait_s``, or (``at_once``, in a recovery) at once when the nodes not
        in ``avoid`` have no room for the pending ones. Ray re-places a lost node's bundles once
        there is room."""
        self.slots.ensure(self.width, avoid)
        if at_once:
            pending = self.slots.unplaceable(range(self.width), avoid=avoid, wait_s=wait_s)
        else:
            pending = self.slots.unplaced(range(self.width), wait_s)
        if pending:
            raise CapacityUnavailable(self.capacity())

    def placed(self) -> bool:
        return bool(self.slots.groups) and not self.slots.unplaced(range(self.width), 0)

    def capacity(self, replicas: int | None = None) -> Capacity:
        standbys = self.pool.count() if self.pool is not None and self.pool.enabled else None
        return self.slots.capacity(self.width, replicas, standbys)

    def free_slots(self, avoid: frozenset[str] = frozenset()) -> int:
        return self.slots.free_slots(avoid)

    def free_per_node(self, avoid: frozenset[str] = frozenset()) -> dict[str, int]:
        return {n: f for n, f in self.slots.free_per_node(avoid).items() if f > 0}

    def bundle_nodes(self, keys: list[ShardKey]) -> dict[ShardKey, str | None]:
        return self.slots.bundle_nodes(keys)

    def renew(self, keys: list[ShardKey], avoid: frozenset[str] = frozenset()) -> list[ShardKey]:
        return self.slots.renew(keys, avoid)

    # ------------------------------------------------------------------ actors
    def spawn_all(self) -> None:
        self.spawned = True
        self.replace(self.keys())

    def replace(self, keys: list[ShardKey], adopt: dict[ShardKey, str] | None = None, meanwhile: Callable[[], None] | None = None) -> None:
        """Kill whatever runs as ``keys`` and put fresh actors on their bundles: for a key in
        ``adopt``, the warm standby of that node becomes it (no process start), for the others a
        new actor process starts in the bundle. Returns once they answer, calling ``meanwhile``
        about every second until then (raises
        :class:`CapacityUnavailable` if their bundles cannot be placed, :class:`PlanNotFollowed`
        if a named node has no standby left)."""
        import ray

        adopt = adopt or {}
        with self.spans.span("actor"):
            calls: dict[ShardKey, Any] = {}
            widths = []
            for key in keys:
                if key in self.table.fresh:  # a late stage spare took its place (take_stage_spares): started, no state yet
                    self.table.fresh.pop(key)
                    widths.append(self.actor(key).set_width.remote(key.replica, self.width))
                    continue
                self.kill(key)
                node = adopt.get(key)
                if node is None:
                    self._spawn(key, self.slots.groups[key])
                    continue
                sb = self.pool.take(node) if self.pool is not None else None
                if sb is None:
                    raise PlanNotFollowed(f"the plan has stage {key.stage} replica {key.replica} adopt a warm standby on node {node[:12]}, but none is left there")
                adopted: Any = sb.actor  # a Ray actor handle
                self.hold(key, adopted, sb.name)
                calls[key] = adopted.adopt.remote(key.stage, key.replica, self.width, self._devices_for(key))
            self.describe(keys, calls, meanwhile)
            ray.get(widths, timeout=WIDTH_S)

    def _devices_for(self, key: ShardKey) -> tuple[str, ...] | None:
        """The GPU ids a standby adopted as ``key`` takes: the dead actor's (GPU runs whose
        standbys hold no device of their own), else None."""
        if not self.cfg.parallel.gpus_per_actor or self.cfg.recovery.standby_gpus:
            return None
        return self.gpus.get(key) or None

    def _spawn(self, key: ShardKey, pg: Any, spare: bool = False) -> Any:
        """Start an actor for ``key`` in the one-bundle group ``pg`` (returns at once): ``key``'s
        own unless ``spare`` (a spare's, not held as ``key`` until it is installed)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from elastic_llm.pipeline.stage_actor import remote_stage_class

        par = self.cfg.parallel
        self.generation += 1
        name = f"stage-{self.run_id}-{key.stage}-{key.replica}.{self.generation}"
        actor = remote_stage_class().options(  # "status": state() answers while a step runs; "control": abort_step wakes a step blocked on a peer
            name=name,
            num_cpus=par.cpus_per_actor,
            num_gpus=par.gpus_per_actor,
            max_restarts=0,
            lifetime="detached" if self.grace_s > 0 else None,  # outlives a dead driver (see elastic_llm.runtime.handover)
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote(self.cfg, key.stage, key.replica, self.width, self.run_id, self.grace_s)
        if spare:
            self.names[actor] = name
        else:
            self.hold(key, actor, name)
        return actor

    def describe(self, keys: list[ShardKey], calls: dict[ShardKey, Any] | None = None, meanwhile: Callable[[], None] | None = None) -> list[Any]:
        """Wait (with deadlines) until ``keys`` answer (their ``info``, or the given ``calls``
        returning it, e.g. an adoption), calling ``meanwhile`` at each second's wake-up; record
        their nodes, pids and devices."""
        import ray

        calls = calls or {}
        refs = {(calls[k] if k in calls else self.actor(k).info.remote()): k for k in keys}
        pending = list(refs)
        replicas = {k.replica for k in keys}
        start = self.clock.monotonic()
        unplaced_since: float | None = None
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            if not pending:
                break
            if meanwhile is not None:
                meanwhile()
            now = self.clock.monotonic()
            if not self.slots.unplaced(replicas, 0):
                unplaced_since = None
            elif unplaced_since is None:
                unplaced_since = now
            elif now - unplaced_since > PLACE_S:
                raise CapacityUnavailable(self.capacity())
            if now - start > START_S:
                raise TimeoutError(f"{len(pending)} stage actors were placed but did not start within {START_S:.0f} s")
        infos = ray.get(list(refs), timeout=START_S)
        for info, key in zip(infos, refs.values()):
            self.record(key, info)
        return infos

    def kill(self, key: ShardKey) -> None:
        old = self.handles.get(key)
        self.table.forget(key)
        if old is not None:
            self.names.pop(old, None)
            kill_actor(old)

    def reset_survivors(self, alive_nodes: set[str]) -> dict[ShardKey, int | None]:
        """Drop the partial work of a failed step on every live actor; return each actor's
        completed steps (None: dead, never started, on a dead node, or not answering within
        :data:`~elastic_llm.controller.ports.RESET_S`). An actor whose reset raised is logged with its error and counted lost."""
        import ray

        steps: dict[ShardKey, int | None] = {k: None for k in self.keys()}
        asks = {self.actor(k).reset_step.remote(): k for k in self.keys() if k in self.ready and self.nodes.get(k) in alive_nodes}
        ray.wait(list(asks), num_returns=len(asks), timeout=RESET_S)
        for ref, key in asks.items():
            try:
                steps[key] = ray.get(ref, timeout=0)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # died, or did not answer in time
                self.table.ready.discard(key)
            except ray.exceptions.RayTaskError as e:  # its reset raised: a fault of its own, not a death
                log.warning("%s could not reset after the failed step (%s); it is replaced", key, (str(e.cause) or type(e.cause).__name__).splitlines()[0])
                self.table.ready.discard(key)
        return steps

    def members(self) -> list[StageMember]:
        return [StageMember(k, self.actor(k), self.nodes[k]) for k in self.keys()]

    # ------------------------------------------------------------------ width
    def borrow(self, pairs: list[tuple[ShardKey, ShardKey]]) -> None:
        """Borrow and merge: each giver's actor (of a replica dropped next) becomes the taker's
        (a lost actor of a kept replica), with its process, state and placement group; whatever ran
        as the taker (a late stage spare) is killed and its group goes with the giver's replica.
        The actor learns its new number with :meth:`set_width`, its links with the next executor."""
        for giver, taker in pairs:
            self.kill(taker)
            groups = self.slots.groups
            mine, theirs = groups.pop(giver, None), groups.pop(taker, None)
            if mine is not None:
                groups[taker] = mine
            if theirs is not None:
                groups[giver] = theirs
        self.table.borrow(pairs)

    def drop_replicas(self, replicas: Iterable[int]) -> dict[int, int]:
        """Kill the actors of ``replicas``, release their placement groups and renumber the rest
        (keeping their order). Returns old replica index -> new one, for the survivors. The
        survivors learn their new place with :meth:`set_width`."""
        gone = set(replicas)
        for r in sorted(gone, reverse=True):
            for s in range(self.stages):
                self.kill(ShardKey(s, r))
            self.slots.drop(r)
        return self.table.drop_replicas(gone)

    def set_width(self) -> None:
        """Tell every actor its replica index and the width (after adding or dropping replicas)."""
        import ray

        ray.get([self.actor(k).set_width.remote(k.replica, self.width) for k in self.keys()], timeout=WIDTH_S)

    # ------------------------------------------------------------------ spares (see spares.py): starting them, installing them
    def fill(self, pgs: tuple[Any, ...], keys: list[ShardKey], width: int) -> list[tuple[Any, Any, bool]]:
        """Actors for ``keys`` in the placed one-bundle groups ``pgs``: a warm standby of the
        group's node where one is ready (adopted: it builds the stage), else a new process in the
        group. Returns (actor, call answering its info, adopted) per key."""
        where = self.slots.nodes_of(pgs)
        out = []
        for key, pg in zip(keys, pgs):
            node = where[pg]
            sb = self.pool.take(node) if node is not None and self.pool is not None and self._standby_fits() else None
            if sb is not None:
                standby: Any = sb.actor  # a Ray actor handle
                self.names[standby] = sb.name
                out.append((standby, standby.adopt.remote(key.stage, key.replica, width, None), True))
            else:
                actor = self._spawn(key, pg, spare=True)
                out.append((actor, actor.info.remote(), False))
        return out

    def _standby_fits(self) -> bool:
        """A standby can take a new bundle's place: CPU runs, or standbys holding a GPU of their own
        (a new GPU bundle has no dead actor's device to hand over)."""
        return not self.cfg.parallel.gpus_per_actor or self.cfg.recovery.standby_gpus

    def adopt(self, ref: SpareRef) -> int:
        """Make a started spare the last replica; returns its index. The caller copies state in
        and then calls :meth:`set_width`."""
        import ray

        spare = own(ref)
        assert isinstance(spare, Spare), "adopt takes a spare replica"

        infos = ray.get(list(spare.infos), timeout=START_S)
        self.spares.taken(spare)
        r = self.table.add_replica([info.node_id for info in infos])
        self.slots.groups.update({ShardKey(s, r): pg for s, pg in enumerate(spare.pgs)})
        for s, (actor, info) in enumerate(zip(spare.actors, infos)):
            self.handles[ShardKey(s, r)] = actor
            self.record(ShardKey(s, r), info)
        return r

    def swap_in(self, refs: list[SpareRef]) -> None:
        """The started ``spares`` take over their keys: each gets its old actor's whole state
        (actor to actor: the old ones still live; all copies at once), becomes the key's actor
        with its group as the reservation, and the old actor and its group go. The caller builds
        new links."""
        import ray

        from elastic_llm.runtime.stage_calls import stream_states

        spares = [sp for sp in map(own, refs) if isinstance(sp, StageSpare)]
        assert len(spares) == len(refs), "swap_in takes stage spares"
        infos = ray.get([sp.info for sp in spares], timeout=START_S)
        with self.spans.span("state"):
            stream_states([(self.actor(sp.key), sp.key, sp.actor) for sp in spares], self.cfg.redundant)
        for sp, info in zip(spares, infos):
            self._install(sp)
            self.record(sp.key, info)

    def _install(self, spare: StageSpare) -> None:
        """``spare`` becomes its key's actor and its group the key's reservation; the old actor
        and its group go."""
        key = spare.key
        self.spares.taken(spare)
        self.kill(key)
        self.slots.release(key)
        self.handles[key] = spare.actor
        self.slots.groups[key] = spare.pg

    def take_stage_spares(self, keys: list[ShardKey]) -> list[ShardKey]:
        """Lost ``keys`` whose stage spare (started for a drain, late for the move) is placed on a
        live node: the spare becomes the key's actor, without state, and its group the key's
        reservation (the old one goes with its node). :meth:`replace` then starts no process for
        them; the recovery gives them their state. Returns the keys taken."""
        taken, spares = [], self.spares.of()
        for key in keys:
            spare = spares.get(key)
            node = self.slots.node_of(spare.pg) if spare is not None else None
            if spare is None or node is None or self.slots.lost([spare.pg]):
                continue
            self.spares.fill_stage(spare)  # placed: it starts now if it has not
            self._install(spare)
            self.table.install(key, node, up_at=0.0)
            taken.append(key)
        return taken

    # ------------------------------------------------------------------ fault injection (chaos.StageHits)
    def kill_process(self, key: ShardKey, how: str) -> None:
        import ray

        if how == "sigkill":
            os.kill(self.pids[key], signal.SIGKILL)
        else:
            ray.kill(self.actor(key), no_restart=True)

    def inject_error(self, key: ShardKey, message: str) -> None:
        import ray

        ray.get(self.actor(key).inject_error.remote(message), timeout=WIDTH_S)

    def corrupt_own_copies(self, key: ShardKey) -> None:
        import ray

        ray.get(self.actor(key).corrupt_own_copies.remote(), timeout=WIDTH_S)

    def kill_standbys(self, node: str) -> int:
        pids = self.pool.pids(node) if self.pool is not None else []
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return len(pids)

    # ------------------------------------------------------------------ driver failover (see handover.py)
    def roster(self) -> Roster:
        return handover.roster(self)

    def take_over(self, roster: Roster) -> set[ShardKey]:
        adopted, ended = handover.take_over(self, roster)
        for actor in ended:
            kill_actor(actor)
        return adopted

    def leased(self) -> list[tuple[Any, str | None]]:
        return handover.leased(self)

    def shutdown(self) -> None:
        spares: list[SpareRef] = [*self.spares.replicas(), *self.spares.of().values()]
        for spare in spares:
            self.spares.cancel(spare)
        if self.pool is not None:
            self.pool.shutdown()
        for key in self.keys() if self.spawned else []:
            self.kill(key)
        self.slots.release_all()
        self.spawned = False
