"""The stage actors of a run: ``actors[replica][stage]``, one placement group per replica.

Owns: the placement groups (one per data-parallel replica, one bundle per stage, so a replica
can be added, dropped or moved whole), spawning an actor on its bundle, replacing lost ones,
describing them (node, pid), resetting the survivors of a failed step, changing the width
(add a replica, drop replicas and renumber the rest), spare replicas started in the background
(so that growing or moving off a draining node waits for no process start), and saying what capacity is missing when
bundles cannot be placed. Every wait has a deadline: a placement that does not happen within
``PLACE_S`` raises :class:`CapacityUnavailable` (the controller then shrinks or waits for
capacity, visibly) instead of blocking.
Also: which bundle reserves which actor (an actor moved alone by a drain keeps a one-bundle group,
or an orphan bundle of its replica's group), warm standbys adopted in place of new processes
(:mod:`.standby` keeps the pool), and single stage actors started in the background for per-stage
drain moves.
Never decides anything: the controller says which actors to place, replace, add or drop, and the
recovery plan which actor adopts a standby.

Why ~620 lines: every Ray placement and actor-lifecycle call of the run lives here, so the
controller, recovery and elastic executors stay free of Ray's placement-group bookkeeping; the
reservations (bundles, orphans, patches) and the three kinds of actors started ahead (spare
replicas, spare stages, adopted standbys) share that bookkeeping and would leak if split apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.controller.standby import StandbyPool
from elastic_llm.controller.states import Capacity
from elastic_llm.snapshot.coordinator import StageMember
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.spans import Spans

PLACE_S = 5.0  # how long a placement may stay pending before the run waits for capacity instead
START_S = 300.0  # longest an actor may take to start once placed (imports torch, builds the model)
PROBE_S = 60.0  # longest the survivors of a failed step may take to reset
COPY_S = 600.0  # longest a state copy from one actor to another may take
WIDTH_S = 60.0  # longest the actors may take to learn a new width


@dataclass(eq=False)
class Spare:
    """A replica started in the background: its placement group and, once that is placed, its
    actors (warm standbys adopted on the bundles' nodes, or new processes) and the calls that
    answer when they have started."""

    pg: Any
    started: float  # time.monotonic()
    actors: tuple[Any, ...] = ()
    infos: tuple[Any, ...] = ()
    adopted: int = 0  # how many of its actors are adopted standbys


@dataclass(eq=False)
class StageSpare:
    """One stage actor started in the background to take over ``key`` (a per-stage drain move):
    a one-bundle placement group and, once placed, its actor and the call that answers once it
    has started."""

    key: ShardKey
    pg: Any
    started: float
    actor: Any = None
    info: Any = None
    adopted: bool = False
    bundle: int = 0  # the bundle of ``pg`` it is on
    owned: bool = True  # ``pg`` was made for it (released with it); else an orphan bundle of its replica's group


class PlanNotFollowed(RuntimeError):
    """The executor could not carry out what the plan said (e.g. the standby it names is gone):
    nothing was decided instead; the controller observes again and re-plans."""


class CapacityUnavailable(RuntimeError):
    """The placement group's bundles cannot all be placed now; ``capacity`` says what is missing."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        super().__init__(str(capacity))


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


class ActorGroup:
    def __init__(self, cfg: RunConfig, run_id: str, pool: StandbyPool | None = None) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.pool = pool  # warm standbys: replacements adopt one where the plan says so
        self.spans = Spans()  # "actor" (start or adopt replacements), "state" (copies between actors)
        self.stages = cfg.parallel.stages
        self.pgs: list[Any] = []  # one placement group per replica (bundle i: stage i)
        self.actors: list[list[Any]] = []  # [replica][stage]; the width is len(actors) once spawned
        self.nodes: dict[ShardKey, str] = {}
        self.pids: dict[ShardKey, int] = {}
        self.gpus: dict[ShardKey, tuple[int, ...]] = {}  # devices of each actor (GPU runs): a standby adopted in its place takes them
        self.ready: set[ShardKey] = set()  # actors that answered since they were spawned
        self.generation = 0
        self.width = cfg.parallel.dp
        self.spares: list[Spare] = []  # replicas started in the background, not yet in the width
        self.stage_spares: dict[ShardKey, StageSpare] = {}  # single stages started in the background (drain moves)
        # actors moved alone: their reservation (placement group, bundle): a one-bundle group of their
        # own, or a bundle of their replica's group that no stage uses any more (an "orphan": the
        # bundle of a moved actor, re-placed by Ray once its node went)
        self.patches: dict[ShardKey, tuple[Any, int]] = {}
        self._cls: Any = None

    # ------------------------------------------------------------------ placement
    @property
    def bundle(self) -> dict[str, float]:
        par = self.cfg.parallel
        b = {"CPU": par.cpus_per_actor}
        if par.gpus_per_actor:
            b["GPU"] = par.gpus_per_actor
        return b

    def keys(self) -> list[ShardKey]:
        return [ShardKey(s, r) for r in range(self.width) for s in range(self.stages)]

    def _new_pg(self) -> Any:
        from ray.util.placement_group import placement_group

        return placement_group([dict(self.bundle) for _ in range(self.stages)], strategy=self.cfg.parallel.placement_strategy)

    def place(self, wait_s: float = PLACE_S, at_once: bool = False) -> None:
        """Create the replicas' placement groups (once) and make sure all their bundles are
        placed; raises :class:`CapacityUnavailable` when they are not within ``wait_s``, or
        (``at_once``, in a recovery) at once when the cluster has no room for the pending ones. Ray
        re-places the bundles of a lost node by itself once capacity appears."""
        while len(self.pgs) < self.width:
            self.pgs.append(self._new_pg())
        if at_once:
            from elastic_llm.controller.drains import draining_nodes

            pending = self.unplaceable(range(self.width), avoid=frozenset(draining_nodes()), wait_s=wait_s)
        else:
            pending = self.unplaced_replicas(range(self.width), wait_s)
        if pending:
            raise CapacityUnavailable(self.capacity())

    def unplaced_replicas(self, replicas: Any, wait_s: float) -> set[int]:
        """Those of ``replicas`` with a reservation (a stage's bundle) still not placed after up to
        ``wait_s`` seconds (one deadline for all)."""
        deadline = time.monotonic() + wait_s
        pending = set(replicas)
        while True:
            pending = {r for r in pending if any(n is None for n in self.bundle_nodes([ShardKey(s, r) for s in range(self.stages)]).values())}
            if not pending or time.monotonic() >= deadline:
                return pending
            time.sleep(0.1)

    def reservation(self, key: ShardKey) -> tuple[Any, int]:
        """(placement group, bundle index) that reserves ``key``'s resources."""
        if key in self.patches:
            return self.patches[key]
        return self.pgs[key.replica], key.stage

    def orphans(self, replica: int) -> list[int]:
        """Bundles of ``replica``'s placement group that reserve no actor (their actor moved
        alone): room the run already holds, for moving another of the replica's actors."""
        used = {self.reservation(ShardKey(s, replica)) for s in range(self.stages)}
        pg = self.pgs[replica]
        return [i for i in range(self.stages) if (pg, i) not in used]

    def bundle_nodes(self, keys: list[ShardKey]) -> dict[ShardKey, str | None]:
        """Where the bundle (the reservation) of each of ``keys`` is placed now (None: not
        placed). No waiting."""
        from ray.util.placement_group import placement_group_table

        tables: dict[Any, dict[int, str]] = {}
        out: dict[ShardKey, str | None] = {}
        for k in keys:
            if k.replica >= len(self.pgs):
                out[k] = None
                continue
            pg, i = self.reservation(k)
            if pg.id not in tables:
                tables[pg.id] = placement_group_table(pg).get("bundles_to_node_id", {})
            out[k] = tables[pg.id].get(i) or None
        return out

    def rehome(self, keys: list[ShardKey], avoid: set[str] | frozenset[str] = frozenset()) -> list[ShardKey]:
        """Lost actors whose reservation is not placed (its node went) take a placed orphan bundle
        of their replica's group instead, where there is one on a node not in ``avoid``: room the
        run already holds. Changes only which bundle reserves which actor; returns the keys moved."""
        moved = []
        where = self.bundle_nodes([k for k in keys if k.replica < len(self.pgs)])
        for key in keys:
            if key.replica >= len(self.pgs) or where.get(key):
                continue
            pg = self.pgs[key.replica]
            placed = self.bundle_nodes_of(pg)
            spare = next((i for i in self.orphans(key.replica) if placed.get(i) and placed[i] not in avoid), None)
            if spare is None:
                continue
            previous = self.patches.get(key)
            self.patches[key] = (pg, spare)
            if previous is not None and previous[0] is not pg:
                self._release([], previous[0])
            moved.append(key)
        return moved

    def placed_orphans(self, replica: int, avoid: set[str] | frozenset[str] = frozenset()) -> int:
        """Orphan bundles of ``replica``'s group placed on live nodes not in ``avoid``: room the
        run holds for moving that replica's actors."""
        where = self.bundle_nodes_of(self.pgs[replica])
        return sum(1 for i in self.orphans(replica) if where.get(i) and where[i] not in avoid)

    def free_slots(self, avoid: set[str] | frozenset[str] = frozenset()) -> int:
        """How many more bundles like a stage actor's the live nodes not in ``avoid`` have free
        room for now, by Ray's view of available resources (no waiting, no reservation)."""
        import ray

        fit = 0
        for node, free in ray._private.state.state.available_resources_per_node().items():
            if node in avoid:
                continue
            n = int(free.get("CPU", 0.0) // self.bundle["CPU"] + 1e-9)
            if "GPU" in self.bundle:
                n = min(n, int(free.get("GPU", 0.0) // self.bundle["GPU"] + 1e-9))
            fit += n
        return fit

    def unplaceable(self, replicas: Any, avoid: set[str] | frozenset[str] = frozenset(), wait_s: float = PLACE_S) -> set[int]:
        """Those of ``replicas`` whose lost bundles cannot be placed, decided from Ray's view at
        once: bundles still pending when the free room of the live nodes (not in ``avoid``) cannot
        hold them are unplaceable now; when the room is there, Ray is placing them and they get up
        to ``wait_s`` (a strict placement strategy may still refuse)."""

        pending = self.unplaced_replicas(replicas, 0)
        if not pending:
            return set()
        missing = sum(1 for n in self.bundle_nodes([ShardKey(s, r) for r in pending for s in range(self.stages)]).values() if n is None)
        if self.free_slots(avoid) < missing:
            return pending
        return self.unplaced_replicas(pending, wait_s)

    def placed(self) -> bool:
        """Whether every bundle is placed now (no waiting)."""
        return bool(self.pgs) and not self.unplaced_replicas(range(self.width), 0)

    def capacity(self, replicas: int | None = None) -> Capacity:
        """What is missing: bundles not placed (all of them before the first placement; or a
        whole ``replicas`` more, when asked about growing) and what the cluster has free."""
        import ray

        if replicas is not None:
            missing = replicas * self.stages
        else:
            missing = (self.width - len(self.pgs)) * self.stages
            missing += sum(1 for n in self.bundle_nodes([k for k in self.keys() if k.replica < len(self.pgs)]).values() if n is None)
        free = ray.available_resources()
        nodes = sum(1 for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0)
        have = f"{free.get('CPU', 0.0):g} CPUs free on {nodes} node{'s' if nodes != 1 else ''}"
        if "GPU" in self.bundle:
            have += f", {free.get('GPU', 0.0):g} GPUs free"
        if self.pool is not None and self.pool.enabled:
            ready, starting = self.pool.count()
            have += f", {ready} warm standby process{'es' if ready != 1 else ''}" + (f" ({starting} starting)" if starting else "")
        return Capacity(f"{missing} x {_fmt(self.bundle)}", have)

    def room_for_replica(self, avoid: set[str] | frozenset[str] = frozenset()) -> bool:
        """Whether the free resources of the live nodes not in ``avoid`` (draining ones) look
        like they fit one more replica (a cheap look, no reservation; the placement decides)."""
        return self.free_slots(avoid) >= self.stages

    # ------------------------------------------------------------------ actors
    def spawn_all(self) -> None:
        self.actors = [[None] * self.stages for _ in range(self.width)]
        self.replace(self.keys())

    def actor(self, key: ShardKey) -> Any:
        return self.actors[key.replica][key.stage]

    def replace(self, keys: list[ShardKey], adopt: dict[ShardKey, str] | None = None) -> None:
        """Kill whatever runs as ``keys`` and put fresh actors on their bundles: for a key in
        ``adopt``, the warm standby of that node becomes it (no process start), for the others a
        new actor process starts in the bundle. Returns once they answer (raises
        :class:`CapacityUnavailable` if their bundles cannot be placed, :class:`PlanNotFollowed`
        if a named node has no standby left)."""
        with self.spans.span("actor"):
            self._replace(keys, adopt or {})

    def _replace(self, keys: list[ShardKey], adopt: dict[ShardKey, str]) -> None:
        self.generation += 1
        calls: dict[ShardKey, Any] = {}
        for key in keys:
            self.kill(key)
            node = adopt.get(key)
            if node is None:
                self.actors[key.replica][key.stage] = self._spawn(key, *self.reservation(key))
                continue
            sb = self.pool.take(node) if self.pool is not None else None
            if sb is None:
                raise PlanNotFollowed(f"the plan has stage {key.stage} replica {key.replica} adopt a warm standby on node {node[:12]}, but none is left there")
            self.actors[key.replica][key.stage] = sb.actor
            calls[key] = sb.actor.adopt.remote(key.stage, key.replica, self.width, self._devices_for(key))
        self.describe(keys, calls)

    def _devices_for(self, key: ShardKey) -> tuple[int, ...] | None:
        """The GPU ids a standby adopted as ``key`` takes: the dead actor's (GPU runs whose
        standbys hold no device of their own), else None."""
        if not self.cfg.parallel.gpus_per_actor or self.cfg.recovery.standby_gpus:
            return None
        return self.gpus.get(key) or None

    def _spawn(self, key: ShardKey, pg: Any, bundle: int | None = None) -> Any:
        """Start the actor of ``key`` on bundle ``bundle`` (default ``key.stage``) of ``pg``
        (returns at once)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from elastic_llm.pipeline.stage import CONCURRENCY_GROUPS, StageWorker

        if self._cls is None:
            # "status": state() answers while a step runs (elastic-llm status); "control": abort_step
            # wakes a step blocked on a peer
            self._cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(StageWorker)
        par = self.cfg.parallel
        return self._cls.options(
            name=f"stage-{self.run_id}-{key.stage}-{key.replica}.{self.generation}",
            num_cpus=par.cpus_per_actor,
            num_gpus=par.gpus_per_actor,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=key.stage if bundle is None else bundle),
        ).remote(self.cfg, key.stage, key.replica, self.width, self.run_id)

    def describe(self, keys: list[ShardKey], calls: dict[ShardKey, Any] | None = None) -> list[Any]:
        """Wait (with deadlines) until ``keys`` answer (their ``info``, or the given ``calls``
        returning it, e.g. an adoption); record their nodes, pids and devices."""
        import ray

        calls = calls or {}
        refs = {(calls[k] if k in calls else self.actor(k).info.remote()): k for k in keys}
        pending = list(refs)
        replicas = {k.replica for k in keys}
        start = time.monotonic()
        unplaced_since: float | None = None
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            if not pending:
                break
            now = time.monotonic()
            if not self.unplaced_replicas(replicas, 0):
                unplaced_since = None
            elif unplaced_since is None:
                unplaced_since = now
            elif now - unplaced_since > PLACE_S:
                raise CapacityUnavailable(self.capacity())
            if now - start > START_S:
                raise TimeoutError(f"{len(pending)} stage actors were placed but did not start within {START_S:.0f} s")
        infos = ray.get(list(refs), timeout=START_S)
        for info, key in zip(infos, refs.values()):
            self.nodes[key] = info.node_id
            self.pids[key] = info.pid
            self.gpus[key] = info.gpu_ids
            self.ready.add(key)
        return infos

    def kill(self, key: ShardKey) -> None:
        import ray

        old = self.actors[key.replica][key.stage] if self.actors else None
        self.ready.discard(key)
        if old is not None:
            try:
                ray.kill(old, no_restart=True)
            except Exception:
                pass

    def reset_survivors(self, alive_nodes: set[str]) -> dict[ShardKey, int | None]:
        """Drop the partial work of a failed step on every live actor; return each actor's
        completed steps (None: dead, never started, or on a dead node). One deadline for all."""
        import ray

        steps: dict[ShardKey, int | None] = {k: None for k in self.keys()}
        asks = {self.actor(k).reset_step.remote(): k for k in self.keys() if k in self.ready and self.nodes.get(k) in alive_nodes}
        ray.wait(list(asks), num_returns=len(asks), timeout=PROBE_S)
        for ref, key in asks.items():
            try:
                steps[key] = ray.get(ref, timeout=0)
            except Exception:
                self.ready.discard(key)
        return steps

    def members(self) -> list[StageMember]:
        return [StageMember(k, self.actor(k), self.nodes[k]) for k in self.keys()]

    def copy_stages(self, pairs: list[tuple[ShardKey, ShardKey]]) -> None:
        """For each (source, target): the target actor takes the whole state of the source (a
        live actor holding the state wanted). Object refs only: the bytes go actor to actor."""
        import ray

        with self.spans.span("state"):
            loads = []
            for src, dst in pairs:
                buf, manifest = self.actor(src).capture_state.options(num_returns=2).remote()
                loads.append(self.actor(dst).load_state.remote(buf, manifest))
            ray.get(loads, timeout=COPY_S)

    def replicas_on(self, nodes: set[str] | frozenset[str]) -> list[int]:
        """Replicas with at least one actor on ``nodes``."""
        return sorted({k.replica for k in self.keys() if self.nodes.get(k) in nodes})

    # ------------------------------------------------------------------ width
    def drop_replicas(self, replicas: Iterable[int]) -> dict[int, int]:
        """Kill the actors of ``replicas``, release their placement groups and renumber the rest
        (keeping their order). Returns old replica index -> new one, for the survivors. The
        survivors learn their new place with :meth:`set_width`."""
        from ray.util import remove_placement_group

        gone = set(replicas)
        for r in sorted(gone, reverse=True):
            for s in range(self.stages):
                self.kill(ShardKey(s, r))
            own = [self.patches.pop(ShardKey(s, r))[0] for s in range(self.stages) if ShardKey(s, r) in self.patches]
            for pg in {id(p): p for p in [self.pgs[r], *own]}.values():
                try:
                    remove_placement_group(pg)
                except Exception:
                    pass
            self._forget(r)
        return {old: new for new, old in enumerate(r for r in range(self.width + len(gone)) if r not in gone)}

    def _forget(self, r: int) -> None:
        """Remove replica ``r`` from the bookkeeping, shifting the ones after it down by one."""
        del self.pgs[r]
        del self.actors[r]
        self.width -= 1
        tables: tuple[dict[ShardKey, Any], ...] = (self.nodes, self.pids, self.gpus, self.patches)
        for table in tables:
            moved = {(ShardKey(k.stage, k.replica - 1) if k.replica > r else k): v for k, v in table.items() if k.replica != r}
            table.clear()
            table.update(moved)
        self.ready = {ShardKey(k.stage, k.replica - 1) if k.replica > r else k for k in self.ready if k.replica != r}

    # ------------------------------------------------------------------ spare replicas and stages
    def start_spare(self) -> Spare:
        """Place one more replica in the background (nothing waits); :meth:`spare_ready` gives it
        its actors once the placement group is placed. Not part of the width until :meth:`adopt`."""
        spare = Spare(self._new_pg(), time.monotonic())
        self.spares.append(spare)
        return spare

    def _fill(self, pg: Any, keys: list[ShardKey], bundles: list[int], width: int) -> list[tuple[Any, Any, bool]]:
        """Actors for ``keys`` on the placed ``bundles`` of ``pg``: a warm standby of the bundle's
        node where one is ready (adopted: it builds the stage), else a new process in the bundle.
        Returns (actor, call answering its info, adopted) per key."""
        from ray.util.placement_group import placement_group_table

        where = placement_group_table(pg).get("bundles_to_node_id", {})
        out = []
        for key, b in zip(keys, bundles):
            sb = self.pool.take(where[b]) if self.pool is not None and self._standby_fits() else None
            if sb is not None:
                out.append((sb.actor, sb.actor.adopt.remote(key.stage, key.replica, width, None), True))
            else:
                self.generation += 1
                actor = self._spawn(key, pg, b)
                out.append((actor, actor.info.remote(), False))
        return out

    def _standby_fits(self) -> bool:
        """A standby can take a new bundle's place: CPU runs, or standbys holding a GPU of their own
        (a new GPU bundle has no dead actor's device to hand over)."""
        return not self.cfg.parallel.gpus_per_actor or self.cfg.recovery.standby_gpus

    def spare_ready(self, spare: Spare) -> bool:
        """Whether every actor of ``spare`` has started (no waiting; gives it its actors once its
        placement group is placed)."""
        import ray

        if not spare.actors:
            if len(self.bundle_nodes_of(spare.pg)) < self.stages:
                return False
            made = self._fill(spare.pg, [ShardKey(s, self.width) for s in range(self.stages)], list(range(self.stages)), self.width + 1)
            spare.actors = tuple(a for a, _, _ in made)
            spare.infos = tuple(i for _, i, _ in made)
            spare.adopted = sum(1 for _, _, ad in made if ad)
        done, _ = ray.wait(list(spare.infos), num_returns=len(spare.infos), timeout=0)
        return len(done) == len(spare.infos)

    def spare_nodes(self, spare: Spare) -> set[str]:
        """Nodes the bundles of ``spare`` are placed on (empty while unplaced)."""
        return set(self.bundle_nodes_of(spare.pg).values())

    def adopt(self, spare: Spare) -> int:
        """Make a started spare the last replica; returns its index. The caller copies state in
        and then calls :meth:`set_width`."""
        import ray

        self.spares.remove(spare)
        r = self.width
        self.pgs.append(spare.pg)
        self.actors.append(list(spare.actors))
        self.width += 1
        for s, info in enumerate(ray.get(list(spare.infos), timeout=START_S)):
            self.nodes[ShardKey(s, r)], self.pids[ShardKey(s, r)] = info.node_id, info.pid
            self.gpus[ShardKey(s, r)] = info.gpu_ids
            self.ready.add(ShardKey(s, r))
        return r

    def cancel(self, spare: Spare) -> None:
        """Stop a spare's actors and release its placement group."""
        if spare in self.spares:
            self.spares.remove(spare)
        self._release(spare.actors, spare.pg)

    def _release_actors(self, actors: Any) -> None:
        import ray

        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass

    def _release(self, actors: Any, pg: Any) -> None:
        import ray

        self._release_actors(actors)
        try:
            ray.util.remove_placement_group(pg)
        except Exception:
            pass

    def start_stage_spare(self, key: ShardKey, avoid: set[str] | frozenset[str] = frozenset()) -> StageSpare:
        """Reserve room for one more actor of ``key`` elsewhere and start it in the background: an
        orphan bundle of its replica's group placed on a node not in ``avoid``, else a new
        one-bundle placement group (Ray places no new bundle on a draining node)."""
        from ray.util.placement_group import placement_group

        taken = {(sp.pg, sp.bundle) for sp in self.stage_spares.values()}
        pg = self.pgs[key.replica]
        free = self.bundle_nodes_of(pg)
        for i in self.orphans(key.replica):
            if (pg, i) not in taken and free.get(i) and free[i] not in avoid:
                spare = StageSpare(key, pg, time.monotonic(), bundle=i, owned=False)
                break
        else:
            spare = StageSpare(key, placement_group([dict(self.bundle)], strategy="PACK"), time.monotonic())
        self.stage_spares[key] = spare
        return spare

    def bundle_nodes_of(self, pg: Any) -> dict[int, str]:
        from ray.util.placement_group import placement_group_table

        return {i: n for i, n in placement_group_table(pg).get("bundles_to_node_id", {}).items() if n}

    def stage_spare_ready(self, spare: StageSpare) -> bool:
        """Whether the actor of ``spare`` has started (no waiting; gives it its actor once placed)."""
        import ray

        if spare.actor is None:
            if not self.bundle_nodes_of(spare.pg).get(spare.bundle):
                return False
            (actor, info, adopted), = self._fill(spare.pg, [spare.key], [spare.bundle], self.width)
            spare.actor, spare.info, spare.adopted = actor, info, adopted
        done, _ = ray.wait([spare.info], timeout=0)
        return bool(done)

    def spare_nodes_of(self, spare: StageSpare) -> set[str]:
        """The node the bundle of a stage spare is placed on (empty while unplaced)."""
        node = self.bundle_nodes_of(spare.pg).get(spare.bundle)
        return {node} if node else set()

    def cancel_stage_spare(self, spare: StageSpare) -> None:
        if self.stage_spares.get(spare.key) is spare:
            del self.stage_spares[spare.key]
        if spare.owned:
            self._release([spare.actor] if spare.actor is not None else [], spare.pg)
        else:  # an orphan bundle of the replica's group: it stays, only the actor goes
            self._release_actors([spare.actor] if spare.actor is not None else [])

    def swap_in(self, spare: StageSpare) -> None:
        """The started ``spare`` takes over its key: it gets the old actor's whole state (actor to
        actor: the old one still lives), becomes the key's actor with its one-bundle placement
        group as the reservation, and the old actor goes. The caller builds new links."""
        import ray

        key = spare.key
        old = self.actor(key)
        info = ray.get(spare.info, timeout=START_S)
        with self.spans.span("state"):
            buf, manifest = old.capture_state.options(num_returns=2).remote()
            ray.get(spare.actor.load_state.remote(buf, manifest), timeout=COPY_S)
        del self.stage_spares[key]
        previous = self.patches.get(key)
        self.kill(key)
        self.actors[key.replica][key.stage] = spare.actor
        self.patches[key] = (spare.pg, spare.bundle)
        self.nodes[key], self.pids[key], self.gpus[key] = info.node_id, info.pid, info.gpu_ids
        self.ready.add(key)
        if previous is not None and previous[0] is not self.pgs[key.replica]:  # moved before: its own one-bundle group is free now
            self._release([], previous[0])

    def set_width(self) -> None:
        """Tell every actor its replica index and the width (after adding or dropping replicas)."""
        import ray

        calls = [self.actor(k).set_width.remote(k.replica, self.width) for k in self.keys()]
        ray.get(calls, timeout=WIDTH_S)

    def shutdown(self) -> None:
        import ray

        for spare in list(self.spares):
            self.cancel(spare)
        if self.pool is not None:
            self.pool.shutdown()
        for stage_spare in list(self.stage_spares.values()):
            self.cancel_stage_spare(stage_spare)
        for key in self.keys() if self.actors else []:
            self.kill(key)
        for pg in {id(p): p for p in [*self.pgs, *(pg for pg, _ in self.patches.values())]}.values():
            try:
                ray.util.remove_placement_group(pg)
            except Exception:
                pass
        self.actors, self.pgs, self.patches = [], [], {}
