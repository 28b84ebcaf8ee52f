"""The stage actors of a run: ``actors[replica][stage]``, one placement group per replica.

Owns: the placement groups (one per data-parallel replica, one bundle per stage, so a replica
can be added, dropped or moved whole), spawning an actor on its bundle, replacing lost ones,
describing them (node, pid), resetting the survivors of a failed step, changing the width
(add a replica, drop replicas and renumber the rest), spare replicas started in the background
(so that growing or moving off a draining node waits for no process start), and saying what capacity is missing when
bundles cannot be placed. Every wait has a deadline: a placement that does not happen within
``PLACE_S`` raises :class:`CapacityUnavailable` (the controller then shrinks or waits for
capacity, visibly) instead of blocking.
Never decides anything: the controller says which actors to place, replace, add or drop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.controller.states import Capacity
from elastic_llm.snapshot.coordinator import StageMember
from elastic_llm.snapshot.records import ShardKey

PLACE_S = 5.0  # how long a placement may stay pending before the run waits for capacity instead
START_S = 300.0  # longest an actor may take to start once placed (imports torch, builds the model)
PROBE_S = 60.0  # longest the survivors of a failed step may take to reset
COPY_S = 600.0  # longest a state copy from one actor to another may take
WIDTH_S = 60.0  # longest the actors may take to learn a new width


@dataclass(frozen=True, eq=False)
class Spare:
    """A replica started in the background: its placement group, actors and their ``info`` calls."""

    pg: Any
    actors: tuple[Any, ...]
    infos: tuple[Any, ...]
    started: float  # time.monotonic()


class CapacityUnavailable(RuntimeError):
    """The placement group's bundles cannot all be placed now; ``capacity`` says what is missing."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        super().__init__(str(capacity))


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


class ActorGroup:
    def __init__(self, cfg: RunConfig, run_id: str) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.stages = cfg.parallel.stages
        self.pgs: list[Any] = []  # one placement group per replica (bundle i: stage i)
        self.actors: list[list[Any]] = []  # [replica][stage]; the width is len(actors) once spawned
        self.nodes: dict[ShardKey, str] = {}
        self.pids: dict[ShardKey, int] = {}
        self.ready: set[ShardKey] = set()  # actors that answered since they were spawned
        self.generation = 0
        self.width = cfg.parallel.dp
        self.spares: list[Spare] = []  # replicas started in the background, not yet in the width
        self._cls: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.width, self.stages)

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

    def place(self, wait_s: float = PLACE_S) -> None:
        """Create the replicas' placement groups (once) and make sure all their bundles are
        placed; raises :class:`CapacityUnavailable` if they are not within ``wait_s``. Ray
        re-places the bundles of a lost node by itself once capacity appears."""
        while len(self.pgs) < self.width:
            self.pgs.append(self._new_pg())
        if self.unplaced_replicas(range(self.width), wait_s):
            raise CapacityUnavailable(self.capacity())

    def unplaced_replicas(self, replicas: Any, wait_s: float) -> set[int]:
        """Those of ``replicas`` whose placement group is still not fully placed after up to
        ``wait_s`` seconds (one deadline for all)."""
        from ray.util.placement_group import placement_group_table

        deadline = time.monotonic() + wait_s
        pending = set(replicas)
        while True:
            pending = {r for r in pending if placement_group_table(self.pgs[r]).get("state") != "CREATED"}
            if not pending or time.monotonic() >= deadline:
                return pending
            time.sleep(0.2)

    def placed(self) -> bool:
        """Whether every bundle is placed now (no waiting)."""
        return bool(self.pgs) and not self.unplaced_replicas(range(self.width), 0)

    def capacity(self, replicas: int | None = None) -> Capacity:
        """What is missing: bundles not placed (all of them before the first placement; or a
        whole ``replicas`` more, when asked about growing) and what the cluster has free."""
        import ray
        from ray.util.placement_group import placement_group_table

        if replicas is not None:
            missing = replicas * self.stages
        else:
            missing = (self.width - len(self.pgs)) * self.stages
            for pg in self.pgs[: self.width]:
                placed = placement_group_table(pg).get("bundles_to_node_id", {})
                missing += sum(1 for i in range(self.stages) if not placed.get(i))
        free = ray.available_resources()
        nodes = sum(1 for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0)
        have = f"{free.get('CPU', 0.0):g} CPUs free on {nodes} node{'s' if nodes != 1 else ''}"
        if "GPU" in self.bundle:
            have += f", {free.get('GPU', 0.0):g} GPUs free"
        return Capacity(f"{missing} x {_fmt(self.bundle)}", have)

    def room_for_replica(self, avoid: set[str] | frozenset[str] = frozenset()) -> bool:
        """Whether the free resources of the live nodes not in ``avoid`` (draining ones) look
        like they fit one more replica (a cheap look, no reservation; the placement decides)."""
        import ray

        per_node = ray._private.state.state.available_resources_per_node()
        fit = 0
        for node, free in per_node.items():
            if node in avoid:
                continue
            n = int(free.get("CPU", 0.0) // self.bundle["CPU"] + 1e-9)
            if "GPU" in self.bundle:
                n = min(n, int(free.get("GPU", 0.0) // self.bundle["GPU"] + 1e-9))
            fit += n
        return fit >= self.stages

    # ------------------------------------------------------------------ actors
    def spawn_all(self) -> None:
        self.actors = [[None] * self.stages for _ in range(self.width)]
        self.replace(self.keys())

    def actor(self, key: ShardKey) -> Any:
        return self.actors[key.replica][key.stage]

    def replace(self, keys: list[ShardKey]) -> None:
        """Kill whatever runs as ``keys`` and start fresh actors on their bundles; returns once
        they answer (raises :class:`CapacityUnavailable` if their bundles cannot be placed)."""
        self.generation += 1
        for key in keys:
            self.kill(key)
            self.actors[key.replica][key.stage] = self._spawn(key, self.pgs[key.replica])
        self.describe(keys)

    def _spawn(self, key: ShardKey, pg: Any) -> Any:
        """Start the actor of ``key`` on bundle ``key.stage`` of ``pg`` (returns at once)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from elastic_llm.pipeline.stage import StageWorker

        if self._cls is None:
            # "status": state() answers while a step runs (elastic-llm status); "control": abort_step
            # wakes a step blocked on a peer
            self._cls = ray.remote(concurrency_groups={"snapshot": 1, "status": 1, "control": 1})(StageWorker)
        par = self.cfg.parallel
        return self._cls.options(
            name=f"stage-{self.run_id}-{key.stage}-{key.replica}.{self.generation}",
            num_cpus=par.cpus_per_actor,
            num_gpus=par.gpus_per_actor,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=key.stage),
        ).remote(self.cfg.to_dict(), key.stage, key.replica, self.width, self.run_id)

    def describe(self, keys: list[ShardKey]) -> list[Any]:
        """Wait (with deadlines) until ``keys`` answer; record their nodes and pids."""
        import ray

        refs = {self.actor(k).info.remote(): k for k in keys}
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

        loads = []
        for src, dst in pairs:
            buf, manifest = self.actor(src).capture_state.options(num_returns=2).remote()
            loads.append(self.actor(dst).load_state.remote(buf, manifest))
        ray.get(loads, timeout=COPY_S)

    def replicas_on(self, nodes: set[str] | frozenset[str]) -> list[int]:
        """Replicas with at least one actor on ``nodes``."""
        return sorted({k.replica for k in self.keys() if self.nodes.get(k) in nodes})

    # ------------------------------------------------------------------ width
    def drop_replicas(self, replicas: list[int] | set[int]) -> dict[int, int]:
        """Kill the actors of ``replicas``, release their placement groups and renumber the rest
        (keeping their order). Returns old replica index -> new one, for the survivors. The
        survivors learn their new place with :meth:`set_width`."""
        from ray.util import remove_placement_group

        gone = set(replicas)
        for r in sorted(gone, reverse=True):
            for s in range(self.stages):
                self.kill(ShardKey(s, r))
            try:
                remove_placement_group(self.pgs[r])
            except Exception:
                pass
            self._forget(r)
        return {old: new for new, old in enumerate(r for r in range(self.width + len(gone)) if r not in gone)}

    def _forget(self, r: int) -> None:
        """Remove replica ``r`` from the bookkeeping, shifting the ones after it down by one."""
        del self.pgs[r]
        del self.actors[r]
        self.width -= 1
        for table in (self.nodes, self.pids):
            moved = {(ShardKey(k.stage, k.replica - 1) if k.replica > r else k): v for k, v in table.items() if k.replica != r}
            table.clear()
            table.update(moved)
        self.ready = {ShardKey(k.stage, k.replica - 1) if k.replica > r else k for k in self.ready if k.replica != r}

    # ------------------------------------------------------------------ spare replicas
    def start_spare(self) -> Spare:
        """Place one more replica and start its actors in the background (nothing waits): the
        run trains on while the processes start. Not part of the width until :meth:`adopt`."""
        self.generation += 1
        pg = self._new_pg()
        actors = [self._spawn(ShardKey(s, self.width), pg) for s in range(self.stages)]
        spare = Spare(pg, tuple(actors), tuple(a.info.remote() for a in actors), time.monotonic())
        self.spares.append(spare)
        return spare

    def spare_ready(self, spare: Spare) -> bool:
        """Whether every actor of ``spare`` has started (no waiting)."""
        import ray

        done, _ = ray.wait(list(spare.infos), num_returns=len(spare.infos), timeout=0)
        return len(done) == len(spare.infos)

    def spare_nodes(self, spare: Spare) -> set[str]:
        """Nodes the bundles of ``spare`` are placed on (empty while unplaced)."""
        from ray.util.placement_group import placement_group_table

        return {n for n in placement_group_table(spare.pg).get("bundles_to_node_id", {}).values() if n}

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
            self.ready.add(ShardKey(s, r))
        return r

    def cancel(self, spare: Spare) -> None:
        """Stop a spare's actors and release its placement group."""
        import ray

        if spare in self.spares:
            self.spares.remove(spare)
        for a in spare.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        try:
            ray.util.remove_placement_group(spare.pg)
        except Exception:
            pass

    def set_width(self) -> None:
        """Tell every actor its replica index and the width (after adding or dropping replicas)."""
        import ray

        calls = [self.actor(k).set_width.remote(k.replica, self.width) for k in self.keys()]
        ray.get(calls, timeout=WIDTH_S)

    def shutdown(self) -> None:
        import ray

        for spare in list(self.spares):
            self.cancel(spare)
        for key in self.keys() if self.actors else []:
            self.kill(key)
        for pg in self.pgs:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:
                pass
        self.actors, self.pgs = [], []
