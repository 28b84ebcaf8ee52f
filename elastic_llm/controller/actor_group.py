"""The stage actors of a run: one placement group, ``actors[replica][stage]``.

Owns: the placement group (one bundle per stage actor), spawning an actor on its bundle,
replacing lost ones, describing them (node, pid), resetting the survivors of a failed step, and
saying what capacity is missing when bundles cannot be placed. Every wait has a deadline: a
placement that does not happen within ``PLACE_S`` raises :class:`CapacityUnavailable` (the
controller then waits for capacity, visibly) instead of blocking.
Never decides anything: the controller says which actors to place, replace or kill.
"""

from __future__ import annotations

import time
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.controller.states import Capacity
from elastic_llm.snapshot.coordinator import StageMember
from elastic_llm.snapshot.records import ShardKey

PLACE_S = 5.0  # how long a placement may stay pending before the run waits for capacity instead
START_S = 300.0  # longest an actor may take to start once placed (imports torch, builds the model)
PROBE_S = 60.0  # longest the survivors of a failed step may take to reset


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
        self.pg: Any = None
        par = cfg.parallel
        self.shape = (par.dp, par.stages)
        self.actors: list[list[Any]] = []
        self.nodes: dict[ShardKey, str] = {}
        self.pids: dict[ShardKey, int] = {}
        self.ready: set[ShardKey] = set()  # actors that answered since they were spawned
        self.generation = 0
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
        dp, stages = self.shape
        return [ShardKey(s, r) for r in range(dp) for s in range(stages)]

    def bundle_index(self, key: ShardKey) -> int:
        return key.replica * self.shape[1] + key.stage

    def place(self, wait_s: float = PLACE_S) -> None:
        """Create the placement group (once) and make sure all its bundles are placed; raises
        :class:`CapacityUnavailable` if they are not within ``wait_s``. Ray re-places the bundles
        of a lost node by itself once capacity appears."""
        from ray.util.placement_group import placement_group

        if self.pg is None:
            dp, stages = self.shape
            self.pg = placement_group([dict(self.bundle) for _ in range(dp * stages)], strategy=self.cfg.parallel.placement_strategy)
        if not self.pg.wait(wait_s):
            raise CapacityUnavailable(self.capacity())

    def placed(self) -> bool:
        """Whether every bundle is placed now (no waiting)."""
        from ray.util.placement_group import placement_group_table

        return self.pg is not None and placement_group_table(self.pg).get("state") == "CREATED"

    def capacity(self) -> Capacity:
        """What is missing: bundles not placed (all of them before the first placement) and
        what the cluster has free."""
        import ray
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.pg) if self.pg is not None else {}
        placed = table.get("bundles_to_node_id", {})
        missing = sum(1 for i in range(self.shape[0] * self.shape[1]) if not placed.get(i))
        free = ray.available_resources()
        nodes = sum(1 for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0)
        have = f"{free.get('CPU', 0.0):g} CPUs free on {nodes} node{'s' if nodes != 1 else ''}"
        if "GPU" in self.bundle:
            have += f", {free.get('GPU', 0.0):g} GPUs free"
        return Capacity(f"{missing} x {_fmt(self.bundle)}", have)

    # ------------------------------------------------------------------ actors
    def spawn_all(self) -> None:
        dp, stages = self.shape
        self.actors = [[None] * stages for _ in range(dp)]
        self.replace(self.keys())

    def actor(self, key: ShardKey) -> Any:
        return self.actors[key.replica][key.stage]

    def replace(self, keys: list[ShardKey]) -> None:
        """Kill whatever runs as ``keys`` and start fresh actors on their bundles; returns once
        they answer (raises :class:`CapacityUnavailable` if their bundles cannot be placed)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from elastic_llm.pipeline.stage import StageWorker

        if self._cls is None:
            self._cls = ray.remote(concurrency_groups={"snapshot": 1})(StageWorker)
        par = self.cfg.parallel
        self.generation += 1
        for key in keys:
            self.kill(key)
            self.actors[key.replica][key.stage] = self._cls.options(
                name=f"stage-{self.run_id}-{key.stage}-{key.replica}.{self.generation}",
                num_cpus=par.cpus_per_actor,
                num_gpus=par.gpus_per_actor,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.bundle_index(key)),
            ).remote(self.cfg.to_dict(), key.stage, key.replica)
        self.describe(keys)

    def describe(self, keys: list[ShardKey]) -> list[Any]:
        """Wait (with deadlines) until ``keys`` answer; record their nodes and pids."""
        import ray

        refs = {self.actor(k).info.remote(): k for k in keys}
        pending = list(refs)
        start = time.monotonic()
        unplaced_since: float | None = None
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            if not pending:
                break
            now = time.monotonic()
            if self.placed():
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

    def shutdown(self) -> None:
        import ray

        for key in self.keys() if self.actors else []:
            self.kill(key)
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:
                pass
        self.actors, self.pg = [], None
