"""The Ray runtime: the controller's ports implemented on a Ray cluster, and the composition root.

Owns: :class:`RayRuntime` (starting or joining Ray, the driver's node watch, the snapshot managers
as detached actors, the stage actors' group on placement groups, warm standbys, the run's monitor
actor, the durable tier, the step executor, fault injection) and :func:`ray_trainer`, which
builds a :class:`~elastic_llm.controller.trainer.Trainer` on it. This is the only place where the
controller meets Ray; everything above the ports (:mod:`elastic_llm.controller`) is the same code
that :mod:`elastic_llm.sim` runs on a simulated fleet.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from elastic_llm.chaos import Chaos, ChaosExecutor, FaultTargets
from elastic_llm.clock import SYSTEM, Clock
from elastic_llm.config import RunConfig
from elastic_llm.config.rules import SPOT_LABEL, spot_warning
from elastic_llm.controller.drains import Drain, NodeDeath, Outcome
from elastic_llm.controller.ports import ActorRef, DurableTier, Standbys
from elastic_llm.monitor import RunStatus, start_monitor
from elastic_llm.pipeline.executor import RayStepExecutor, StepExecutor
from elastic_llm.runtime.actors import ActorGroup
from elastic_llm.runtime.failover import RayRegistry
from elastic_llm.runtime.liveness import NodeWatch, RayNodeTable, tcp_hold
from elastic_llm.runtime.session import NAMESPACE, start_ray, store_warnings
from elastic_llm.runtime.managers import RayManagers
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.spans import Spans

if TYPE_CHECKING:
    from elastic_llm.controller.metrics import MetricsWriter
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator

GENERATION_BITS = 40  # a driver's link generations: its epoch << GENERATION_BITS, then one more per membership

log = logging.getLogger("elastic_llm.runtime")


class RayNodes:
    """The :class:`~elastic_llm.controller.ports.Nodes` of a Ray cluster: its node table, its
    draining nodes, and the driver's node watch (``recovery.node_probe_s``)."""

    def __init__(self) -> None:
        self.watch: NodeWatch | None = None
        self.announced: set[str] = set()  # nodes seen draining
        self.refused: dict[str, str] = {}  # node -> why: nodes Ray's scheduler refused (gone, whatever its node table says yet)
        self._refusals: list[NodeDeath] = []  # their node_dead lines, not taken yet

    def start(self, period_s: float, failures: int, declare: bool) -> None:
        if period_s > 0 and self.watch is None:  # before any actor: a node that dies from now on is noticed
            self.watch = NodeWatch(RayNodeTable(), period_s, failures, declare=declare, hold=tcp_hold)
            self.watch.start()

    def alive(self) -> set[str]:
        """Nodes Ray lists alive, less those the node watch judged dead (Ray's view follows)."""
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]} - self.dead()

    def dead(self) -> set[str]:
        """Nodes this run knows dead before (or without) Ray's table: judged by the node watch, or refused by Ray's scheduler."""
        return (self.watch.dead() if self.watch is not None else set()) | set(self.refused)

    def with_slots(self) -> list[str]:
        import ray

        dead = self.dead()
        return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0 and n["NodeID"] not in dead)

    def declare_gone(self, nodes: frozenset[str], why: str) -> None:
        """Nodes where Ray's scheduler refused to place something pinned to them: dead in this
        run's view from now on (nothing is declared to Ray: its scheduler knows already, and a node
        refused as infeasible is alive for the cluster's other jobs). One ``node_dead`` line each."""
        if self.watch is not None:
            self.watch.known_dead(nodes)
        for node in sorted(nodes - set(self.refused)):
            self.refused[node] = why
            self._refusals.append(NodeDeath(node, "-", Outcome.UNSCHEDULABLE, 1, 0.0))
            log.warning("node %s counts as lost from now on: %s", node[:12], why)

    def draining(self) -> dict[str, Drain]:
        from elastic_llm.runtime.drains import draining_nodes

        now = draining_nodes()
        self.announced |= set(now)
        return now

    def reclaimed(self) -> set[str]:
        """Nodes this run saw draining (they announced their end: a preemption notice or an
        autoscaler's drain). A node that died without notice is not known as a reclaim."""
        return set(self.announced)

    def suspects(self) -> set[str]:
        return self.watch.suspects() if self.watch is not None else set()

    def cut_pairs(self, nodes: frozenset[str]) -> frozenset[tuple[str, str]]:
        from elastic_llm.runtime.link_probes import cut_pairs

        return cut_pairs(nodes)

    def link_rates(self, nodes: frozenset[str]) -> dict[tuple[str, str], float]:
        from elastic_llm.runtime.link_probes import link_rates

        return link_rates(nodes)

    def sweep(self) -> None:
        if self.watch is not None:
            self.watch.sweep(refresh=True)

    def deaths(self) -> list[NodeDeath]:
        refusals, self._refusals = self._refusals, []
        return (self.watch.take() if self.watch is not None else []) + refusals

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None


class ChaosFaults:
    """The :class:`~elastic_llm.controller.ports.Faults` of a Ray run: its ``chaos`` events."""

    def __init__(self, cfg: RunConfig, cluster: Any = None) -> None:
        self.chaos = Chaos(cfg, cluster)

    def fire(self, point: str, step: int, targets: FaultTargets) -> None:
        self.chaos.fire(point, step, targets)

    def observe_step(self, step: int, seconds: float, width: int) -> float | None:
        return self.chaos.observe_step(step, seconds, width)

    def wrap(self, executor: StepExecutor, targets: Callable[[], FaultTargets]) -> StepExecutor:
        return ChaosExecutor(executor, self.chaos, targets)


class RayRuntime:
    """A run on Ray: an embedded single-node Ray, or the cluster at ``address``. ``cluster`` (a
    ``ray.cluster_utils.Cluster``) only for tests and demos: chaos events that remove nodes need it."""

    def __init__(self, cfg: RunConfig, address: str | None = None, dashboard: bool = False, cluster: Any = None,
                 clock: Clock = SYSTEM, rng: random.Random | None = None) -> None:
        import ray

        self.cfg, self.address, self.dashboard = cfg, address, dashboard
        self.clock = clock
        self.rng = rng if rng is not None else random.Random()  # run ids and name tags (seeded from the OS)
        self.errors: tuple[type[BaseException], ...] = (ray.exceptions.RayError, TimeoutError)
        self.nodes = RayNodes()
        self.fleet = RayManagers(NAMESPACE, cfg.snapshot.codec)
        self.registry = RayRegistry(NAMESPACE)
        self.faults = ChaosFaults(cfg, cluster)
        self.owns_ray = False
        self.generations = self._generations()  # link generations: this driver's counter, never the wall clock

    def _generations(self) -> Iterator[int]:
        """Link generations, increasing also across the run's drivers: a driver that took stage
        actors over (``--resume RUN_ID``) links them anew above anything the dead one used (its
        epoch, published with the run, in the high bits; as the snapshot coordinator's attempts)."""
        for n in itertools.count(1):
            yield (self.registry.driver_epoch << GENERATION_BITS) + n

    def start(self, cfg: RunConfig, run_id: str, spans: Spans) -> list[tuple[str, str]]:
        import ray

        with spans.span("ray"):
            self.owns_ray = start_ray(cfg, self.address, self.dashboard) or self.owns_ray
        rc = cfg.recovery
        self.nodes.start(rc.node_probe_s, rc.node_probe_failures, rc.node_probe_declare)
        nodes = ray.nodes()
        out = [("object_store", w) for w in (store_warnings(cfg, nodes) if cfg.snapshots_on else [])]
        spot = spot_warning(cfg, sum(1 for n in nodes if n["Alive"] and (n.get("Labels") or {}).get(SPOT_LABEL) == "spot"))
        return out + ([("spot_without_durable", spot)] if spot else [])

    def standbys(self, cfg: RunConfig, run_id: str) -> Standbys | None:
        from elastic_llm.runtime.standby import StandbyPool

        return StandbyPool(cfg, run_id, NAMESPACE, self.clock, self.nodes.declare_gone) if cfg.recovery.standby != 0 else None

    def group(self, cfg: RunConfig, run_id: str, standbys: Standbys | None) -> ActorGroup:
        return ActorGroup(cfg, run_id, standbys, self.clock)

    def monitor(self, status: RunStatus) -> ActorRef:
        return start_monitor(NAMESPACE, status)

    def durable(self, cfg: RunConfig, snapshots: SnapshotCoordinator, data_dir: str, metrics: MetricsWriter) -> DurableTier | None:
        from elastic_llm.durable.tier import DurableTier as Tier

        return Tier(cfg, snapshots, data_dir, metrics, self.clock) if cfg.durable.storage_path else None

    def executor(self, actors: list[list[Any]], cfg: RunConfig, node_of: Callable[[ShardKey], str | None] | None = None,
                 set_aside: Callable[[], frozenset[str]] = frozenset) -> StepExecutor:
        watch = self.nodes.watch
        ex = RayStepExecutor(actors, cfg.parallel.schedule, cfg.parallel.microbatches, cfg.swapped, cfg.redundant, self.generations,
                             lambda: (self.nodes.dead() if watch is not None else set()) | set_aside(), node_of)
        if watch is not None:  # the run's steps go through this executor from now on: the watch's verdicts reach its step at once
            watch.on_death = ex.nodes_died
        return ex

    def cpu(self) -> float:
        return time.process_time()

    def shutdown(self) -> None:
        import ray

        try:
            self.faults.chaos.join_removals()  # a node removal still under way ends before Ray does
        finally:
            self.nodes.stop()
            if self.owns_ray and ray.is_initialized():
                ray.shutdown()
            self.owns_ray = False


def ray_trainer(cfg: RunConfig, address: str | None = None, metrics_out: str | Path | None = None, progress: bool = False,
                dashboard: bool = False, cluster: Any = None, resume: str | None = None) -> Any:
    """A :class:`~elastic_llm.controller.trainer.Trainer` on Ray (see :class:`RayRuntime`)."""
    from elastic_llm.controller.trainer import Trainer
    from elastic_llm.pipeline.memory import check_up_front

    check_up_front(cfg)  # a GPU run that cannot fit its devices stops here, before Ray starts
    return Trainer(cfg, RayRuntime(cfg, address, dashboard, cluster), metrics_out=metrics_out, progress=progress, resume=resume)
