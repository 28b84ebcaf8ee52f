"""The simulated runtime: the controller's ports on a simulated fleet, in simulated time.

Owns: :class:`SimRuntime` (what :class:`~elastic_llm.controller.trainer.Trainer` runs on in
``elastic-llm simulate``: the world's clock, a seeded random source, the simulated nodes, snapshot
managers, stage actors, warm standbys, durable tier and monitor), :class:`SimNodes` (liveness,
drains, and the node watch's suspects and deaths, from the fleet), :class:`SimStandbys` (warm processes per node, one used coming back after
a process start), :class:`SimExecutor` (a step takes the cost model's 1F1B time and fails at the
first death of a node or process it runs on, or at its deadline when one of its nodes is cut off) and the parts a simulation has none of
(:class:`SimRegistry`, :class:`NoFaults`). These are primitives only: every decision and every
sequence of side effects is the controller's code (:mod:`elastic_llm.controller`), the same that
runs on Ray. Never reads the machine's clock and never sleeps.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from elastic_llm.chaos import FaultTargets
from elastic_llm.config import RunConfig
from elastic_llm.config.rules import spot_warning
from elastic_llm.controller.drains import PROBE_TIMEOUT_S, Drain, NodeDeath, Outcome
from elastic_llm.controller.ports import ActorRef, DurableTier, Standbys, Roster
from elastic_llm.monitor import RunStatus
from elastic_llm.pipeline.executor import Pending, StepExecutor, StepFailed, StepResult
from elastic_llm.pipeline.plan import STEP_DEADLINE_S
from elastic_llm.sim.actors import SimActors, SimLost
from elastic_llm.sim.snapshots import SimFlusher, SimManagers
from elastic_llm.sim.world import EPOCH, NEVER, SimCalls, SimMonitor, SimNode, World
from elastic_llm.snapshot.records import ShardKey, VersionRecord
from elastic_llm.spans import Spans
from elastic_llm.stream import StreamPosition

if TYPE_CHECKING:
    from elastic_llm.controller.metrics import MetricsWriter
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator


class SimNodes:
    """The fleet's nodes as the controller sees them: alive, under notice (a drain with its
    deadline), and what the driver's node watch would say of them (as on Ray, after
    :meth:`start`): a node cut off from the driver (``cut`` in a replay plan: hung, or unreachable
    through the network) times a probe out every ``node_probe_s`` plus the probe's timeout, and one
    more at each :meth:`sweep`; ``node_probe_failures`` in a row make it a suspect, until it is
    healed. A node the fleet removes refuses the next probe: one death each (:meth:`deaths`), as
    are nodes the run found gone itself (:meth:`declare_gone`).

    ``reclaims_known``: the one way this differs from Ray on purpose. True (``elastic-llm
    simulate``'s default): the simulated cloud says which removals were reclaims, so a node the
    trace removes without notice is a reclaim, as its notice would have said (a spot trace's
    removals are); a stage process dying on a live node is not. False: as on Ray, where a node that
    dies without notice is not known as a reclaim (only what was seen draining is), so the failure
    it causes is charged to the failure budget (the contract suite holds both runtimes to that)."""

    def __init__(self, world: World, reclaims_known: bool = True) -> None:
        self.world = world
        self.reclaims_known = reclaims_known
        self.gone: set[str] = set()  # nodes declared gone (a refused placement) before the fleet removed them
        self.announced: set[str] = set()  # nodes seen draining
        self.probe_s = 0.0  # no probes until :meth:`start` (as on Ray)
        self.failures = 1
        self._swept: dict[str, int] = {}  # node -> probes it timed out at sweeps since it was cut off
        self._reported = 0  # removals whose death :meth:`deaths` gave already
        self._deaths: list[NodeDeath] = []

    def start(self, period_s: float, failures: int, declare: bool = True) -> None:
        """The node watch's rounds (``recovery.node_probe_s``; 0: none, so no suspects and no
        deaths of its own, as on Ray)."""
        self.probe_s, self.failures = period_s, max(1, failures)

    def alive(self) -> set[str]:
        return set(self.world.fleet.alive()) - self.gone

    def with_slots(self) -> list[str]:
        return sorted(self.alive())

    def draining(self) -> dict[str, Drain]:
        now = {n: Drain(n, EPOCH + t) for n, t in self.world.fleet.draining().items()}
        self.announced |= set(now)
        return now

    def reclaimed(self) -> set[str]:
        """Nodes seen draining, and (``reclaims_known``) every node the trace removed."""
        fleet = self.world.fleet
        known = {n for n, x in fleet.nodes.items() if not x.alive} if self.reclaims_known else set()
        return known | self.announced | set(fleet.draining())

    def _timeouts(self, x: SimNode, until: float) -> int:
        """Probes of node ``x`` timed out in a row by ``until`` (0 while it answers, or without probes)."""
        if self.probe_s <= 0 or x.cut_s is None:
            return 0
        return int((until - x.cut_s) // (self.probe_s + PROBE_TIMEOUT_S)) + self._swept.get(x.node_id, 0)

    def suspects(self) -> set[str]:
        fleet, now = self.world.fleet, self.world.clock.now
        return {n for n in fleet.alive() if n not in self.gone and self._timeouts(fleet.nodes[n], now) >= self.failures}

    def sweep(self) -> None:
        """One more round now: each node cut off times it out (the round takes that long)."""
        fleet = self.world.fleet
        cut = [n for n in fleet.alive() if self.probe_s > 0 and fleet.cut_off(n)]
        self._swept = {n: self._swept.get(n, 0) + 1 for n in cut}  # a healed node's count starts again
        if cut:
            self.world.clock.sleep(PROBE_TIMEOUT_S)

    def cut_pairs(self, nodes: frozenset[str]) -> frozenset[tuple[str, str]]:
        """None: the simulated fleet models a node cut off from the driver, not a link between two nodes."""
        return frozenset()

    def link_rates(self, nodes: frozenset[str]) -> dict[tuple[str, str], float]:
        """None measured: the simulated fleet models no link's rate."""
        return {}

    def declare_gone(self, nodes: frozenset[str], why: str) -> None:
        for node in sorted(nodes - self.gone):
            self._deaths.append(NodeDeath(node, "-", Outcome.UNSCHEDULABLE, 1, 0.0))
        self.gone |= nodes

    def deaths(self) -> list[NodeDeath]:
        """Deaths since the last call: the run's refusals, and (with probes) each node the fleet
        removed since, judged by the refused probe that follows (the timeouts before it counted)."""
        fleet = self.world.fleet
        out, self._deaths = self._deaths, []
        for node in fleet.removed[self._reported:]:
            x = fleet.nodes[node]
            if self.probe_s > 0 and node not in self.gone:
                end = x.removed_s or 0.0
                timeouts = self._timeouts(x, end)
                out.append(NodeDeath(node, "-", Outcome.REFUSED, timeouts + 1, end - x.cut_s if x.cut_s is not None and timeouts else 0.0))
            self._swept.pop(node, None)
        self._reported = len(fleet.removed)
        return out

    def stop(self) -> None:
        pass


class _Standby:
    """A taken standby: what the group adopts (nothing to hand over in a simulation)."""

    actor = None


class SimStandbys:
    """``per_node`` warm standbys on every node the run asked for them (ready ``start_s`` after
    that); one adopted is replaced when the controller next tops the pool up (:meth:`ensure`, as
    on Ray), ready ``start_s`` after that. Their starts run in the background
    (:meth:`World.starting`)."""

    def __init__(self, world: World, per_node: int) -> None:
        self.world, self.per_node = world, per_node
        self.enabled = per_node > 0
        self.starts_take_step_cpu = world.costs.cores > 0  # shared cores (a loopback cluster's profile); a device per actor: no
        self.adopted = 0
        self.start_s = world.costs.actor_start_s
        self.refill: dict[str, list[float]] = {}  # node -> when its used standbys are back
        self.first: dict[str, float] = {}  # node -> when its first standbys started (the run's first look at it)
        self.used: dict[str, int] = {}  # node -> standbys adopted there and not replaced yet

    def _ready_on(self, node: str, now: float) -> int:
        x = self.world.fleet.nodes.get(node)
        if x is None or not x.alive or node not in self.first or now < self.first[node] + self.start_s:
            return 0
        back = [t for t in self.refill.get(node, []) if t > now]
        self.refill[node] = back
        return max(0, self.per_node - len(back) - self.used.get(node, 0))

    def check(self) -> int:
        return 0

    def resize(self, failures: int, elapsed_s: float) -> None:
        pass

    def ensure(self, nodes: Iterable[str]) -> int:
        """A node's first standbys start when the run first asks for them there (as on Ray), and
        the replacements of those adopted there since. Returns how many started."""
        now = self.world.clock.now
        started = 0
        for n in nodes:
            if n not in self.first:
                self.first[n] = now
                self.world.starting(now, now + self.start_s, self.per_node)
                started += self.per_node
            elif self.used.get(n, 0):
                k = self.used.pop(n)
                self.refill.setdefault(n, []).extend([now + self.start_s] * k)
                self.world.starting(now, now + self.start_s, k)
                started += k
        return started

    def ready(self) -> dict[str, int]:
        now = self.world.clock.now
        return {n: c for n in self.world.fleet.alive() if (c := self._ready_on(n, now)) > 0}

    def count(self) -> tuple[int, int]:
        ready = sum(self.ready().values())
        return ready, self.per_node * len(self.world.fleet.alive()) - ready

    def take(self, node: str) -> Any:
        now = self.world.clock.now
        if self._ready_on(node, now) <= 0:
            return None
        self.used[node] = self.used.get(node, 0) + 1
        self.adopted += 1
        return _Standby()

    def pids(self, node: str) -> list[int]:
        return []

    def take_over(self) -> int:
        return 0

    def actors(self) -> list[Any]:
        return []

    def shutdown(self) -> None:
        pass


class SimRegistry:
    """A simulated run has one driver: nothing is published for a next one (``driver_grace_s`` 0)."""

    def check_same_model(self, run_id: str, config: dict[str, Any]) -> None:
        pass

    def retire_old_driver(self, run_id: str, keep: frozenset[str] = frozenset(), keep_standbys: bool = False) -> None:
        pass

    def publish_roster(self, run_id: str, roster: Roster) -> None:
        pass

    def roster(self, run_id: str) -> Roster | None:
        return None

    def find(self, run_id: str) -> tuple[dict[str, Any], VersionRecord | None]:
        return {}, None

    def epoch(self, run_id: str) -> int:
        return 0

    def publish_run(self, run_id: str, config: dict[str, Any], epoch: int) -> None:
        pass

    def publish_committed(self, run_id: str, record: VersionRecord) -> None:
        pass

    def keepalive(self, handles: Any, period_s: float) -> Any:
        raise NotImplementedError("a simulated run keeps no managers alive for a next driver (recovery.driver_grace_s is 0)")

    def forget(self, run_id: str) -> None:
        pass


class NoFaults:
    """A simulation's faults come from its trace and fault schedule, not from ``chaos``."""

    def fire(self, point: str, step: int, targets: FaultTargets) -> None:
        pass

    def observe_step(self, step: int, seconds: float, width: int) -> float | None:
        return None

    def wrap(self, executor: StepExecutor, targets: Callable[[], FaultTargets]) -> StepExecutor:
        return executor


@dataclass(frozen=True)
class SimPending:
    """A submitted simulated step (its outcome is decided when it is waited for)."""

    step: int
    loss: float
    stages: int
    lr: float
    snapshot: bool = False  # the step begins a snapshot version (it costs the step what the cost model says)

    def result(self) -> StepResult:
        return StepResult(loss=self.loss, grad_norms=[1.0] * self.stages, lr=self.lr)


class SimExecutor:
    """A step in simulated time; fails at the first death of a node or process it runs on. A step
    with a stage on a node cut off from the driver never ends: it fails at its deadline (the
    controller's, or :data:`STEP_DEADLINE_S`), as on Ray, unless that node is removed first."""

    def __init__(self, group: SimActors, cfg: RunConfig) -> None:
        self.group, self.cfg = group, cfg
        self.world = group.world
        self._pending: tuple[SimPending, float, tuple[float, str | None, ShardKey | None] | None] | None = None

    def start(self, step: int, x: Any, y: Any, snapshot: StreamPosition | None = None, faults: Any = None) -> SimPending:
        if snapshot is not None:
            self.world.positions[step] = snapshot
        return SimPending(step, float(10.0 / np.sqrt(step)), self.group.stages, self.cfg.train.lr, snapshot is not None)

    def _outcome(self, pending: Pending) -> tuple[float, tuple[float, str | None, ShardKey | None] | None]:
        """When the step ends, and the first death among its nodes and processes before then
        (decided once, when it is first waited for)."""
        if not isinstance(pending, SimPending):
            raise TypeError(f"a simulated step executor takes back its own SimPending, not {type(pending).__name__}")
        if self._pending is None or self._pending[0] is not pending:
            g, w, p = self.group, self.world, self.cfg.parallel
            with g.charged:
                end = w.step_end(w.clock.now, w.costs.step_s(g.stages, p.microbatches, self.cfg.train.batch_size, g.width, pending.snapshot, self.cfg.redundant), len(g.nodes))
                death = w.fleet.first_death(set(g.nodes.values()), set(g.nodes), end)
                cut = w.fleet.first_cut(set(g.nodes.values()), end)
                if cut is not None and (death is None or cut < death[0]):  # a silent stage: the step waits for ever
                    end = NEVER
                    death = w.fleet.first_death(set(g.nodes.values()), set(g.nodes), NEVER)
            self._pending = (pending, end, death)
        return self._pending[1], self._pending[2]

    def wait(self, pending: Pending, seconds: float) -> bool:
        end, death = self._outcome(pending)
        clock = self.world.clock
        if (death[0] if death is not None else end) <= clock.now + seconds:
            return True
        clock.advance(clock.now + seconds)
        return False

    def finish(self, pending: Pending, timeout: float = float("inf")) -> StepResult:
        g, w = self.group, self.world
        end, death = self._outcome(pending)
        self._pending = None
        limit = w.clock.now + (STEP_DEADLINE_S if timeout == float("inf") else timeout)
        if end == NEVER and (death is None or death[0] > limit):  # as on Ray: nothing comes back by the deadline
            w.clock.advance(limit)
            raise StepFailed(TimeoutError(f"step {pending.step} did not finish within its deadline"), None, None)
        if death is None:
            w.clock.advance(max(w.clock.now, end))
            for k in g.keys():
                g.at[k] = pending.step
            return pending.result()
        t, node, key = death
        if key is not None:
            g.ready.discard(key)
            detect = w.costs.detect_process_s
        else:
            key = min(k for k, n in g.nodes.items() if n == node)
            detect = w.costs.detect_node_s
        w.clock.advance(max(w.clock.now, t + detect))
        why = f"node {node} was removed" if node is not None else f"the process of {key} died"
        raise StepFailed(SimLost(f"simulated: {why}"), key.stage, key.replica, "forward")

    def settle(self) -> None:
        pass

    def snapshot(self, step: int, position: StreamPosition) -> None:
        self.world.positions[step] = position

    def eval_loss(self, x: Any, y: Any) -> float:
        return 0.0


class SimRuntime:
    """The ports of a simulated run (see the module's docstring). ``durable_every``: flush every
    N-th committed snapshot to a simulated durable tier (0: none)."""

    def __init__(self, world: World, seed: int = 0, durable_every: int = 0, standbys_per_node: int = 0, reclaims_known: bool = True) -> None:
        self.world = world
        self.clock = world.clock
        self.rng = random.Random(seed)
        self.errors: tuple[type[BaseException], ...] = (SimLost,)
        self.nodes = SimNodes(world, reclaims_known)
        self.fleet = SimManagers(world, SimCalls(world.clock, world.charged))
        self.registry = SimRegistry()
        self.faults = NoFaults()
        self.durable_every = durable_every
        self.standbys_per_node = standbys_per_node
        self.group_made: SimActors | None = None
        self.tier: SimFlusher | None = None

    def start(self, cfg: RunConfig, run_id: str, spans: Spans) -> list[tuple[str, str]]:
        """The node watch's rounds start (as on Ray). A trace that removes nodes is a spot fleet:
        without a simulated durable tier, the run says so."""
        rc = cfg.recovery
        self.nodes.start(rc.node_probe_s, rc.node_probe_failures, rc.node_probe_declare)
        fleet = self.world.fleet
        warning = spot_warning(cfg, len(fleet.nodes) if fleet.removals else 0, self.durable_every > 0)
        return [("spot_without_durable", warning)] if warning else []

    def standbys(self, cfg: RunConfig, run_id: str) -> Standbys | None:
        return SimStandbys(self.world, self.standbys_per_node)

    def group(self, cfg: RunConfig, run_id: str, standbys: Standbys | None) -> SimActors:
        self.group_made = SimActors(cfg, self.world, standbys)
        return self.group_made

    def monitor(self, status: RunStatus) -> ActorRef:
        return SimMonitor(self.world.charged)

    def durable(self, cfg: RunConfig, snapshots: SnapshotCoordinator, data_dir: str, metrics: MetricsWriter) -> DurableTier | None:
        self.tier = SimFlusher(self.world, self.durable_every) if self.durable_every > 0 else None
        return self.tier

    def executor(self, actors: list[list[Any]], cfg: RunConfig, node_of: Callable[[ShardKey], str | None] | None = None,
                 set_aside: Callable[[], frozenset[str]] = frozenset) -> StepExecutor:
        assert self.group_made is not None
        return SimExecutor(self.group_made, cfg)

    def cpu(self) -> float:
        return time.process_time() - self.world.charged.seconds

    def shutdown(self) -> None:
        pass
