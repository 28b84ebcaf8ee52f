"""Fault injection: the configured ``chaos.events``, fired at fixed points of a run.

Owns: when each event fires and how it strikes (``ray.kill`` or SIGKILL of a stage, killing or
corrupting a snapshot manager, corrupting a stage's own background copies, removing a node of a
test cluster, cutting a node's link on the multi-host harness (``kill: partition``), or only
between two nodes (``kill: isolate``), slowing it (``kill: slow``) and healing them all (``kill: heal``), making a stage raise an application error on every step). The controller calls
:meth:`Chaos.fire` at its points: ``before_step`` (errors), ``recovery`` (kills after a recovery plan was made, before it is
carried out), ``recovered`` (kills once a recovery is over, its re-protection included, before the next step) and
``resize``. Kills *during* a step come from :class:`ChaosExecutor`, which wraps the real step
executor and keeps chaos out of its hot path: a stage kill rides in the victim's plan as a
:class:`~elastic_llm.pipeline.plan.Fault` (the actor strikes itself when it starts its first op of
the event's ``op`` kind, so kills land at a chosen point reproducibly); a node removal holds the
victim at that op, then removes its node on a thread of its own (a node does not die on the
driver's thread: the driver goes on noticing the failure meanwhile), joined before the recovery
observes the cluster (:meth:`ChaosExecutor.settle`), when the step ends, and at shutdown. Each
event fires once.

Failures at a rate (``chaos.failure_prob_per_step``, or ``chaos.failure_rate_per_hour`` turned
into a per-step probability once the first steps were timed) come from :func:`failures_at`, a
pure function of (seed, step): every run with the same seed sees the same stages fail at the same
steps, whatever its strategy or speed, and a higher probability only adds failures.
Never recovers anything and never decides: it only breaks things, as configured.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from elastic_llm import events
from elastic_llm.config import ChaosEvent, ConfigError, RunConfig
from elastic_llm.hosts.lab import Lab
from elastic_llm.pipeline.executor import Pending, StepExecutor, StepResult
from elastic_llm.pipeline.plan import Fault, FaultAction, Phase
from elastic_llm.snapshot.coordinator import SnapshotCoordinator
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.stream import StreamPosition

POINTS = ("before_step", "recovery", "recovered", "resize")
NODE_GONE_S = 60.0  # how long a node removal waits for Ray to see the node dead
CALIBRATION_STEPS = 3  # steps timed (after the first) before failure_rate_per_hour becomes a per-step probability


def failures_at(seed: int, step: int, n_stages: int, dp: int, prob: float) -> tuple[tuple[int, int], ...]:
    """(stage, replica) that fail in ``step``: each actor with probability ``prob``, at most one
    per step (the lowest draw; two in one step would break CheckFree's neighbour rule, and the
    chance, about (n p)^2 / 2, is negligible at the rates used). Pure and seeded by (seed, step)."""
    if prob <= 0:
        return ()
    import numpy as np

    u = np.random.default_rng([seed, step]).random((n_stages, dp))
    stage, replica = np.unravel_index(int(np.argmin(u)), u.shape)
    return ((int(stage), int(replica)),) if u[stage, replica] < prob else ()


def prob_per_step(rate_per_hour: float, step_s: float) -> float:
    """Per-step failure probability of a stage that fails within an hour with ``rate_per_hour``."""
    return 1.0 - (1.0 - rate_per_hour) ** (step_s / 3600.0)


class StageHits(Protocol):
    """What fault injection does to a run's stage actors; the runtime does it (a simulated run
    models none of it: its faults come from its trace and fault schedule)."""

    def kill_process(self, key: ShardKey, how: str) -> None: ...  # "sigkill": the process from its node; else Ray's kill
    def inject_error(self, key: ShardKey, message: str) -> None: ...  # its next calls raise
    def corrupt_own_copies(self, key: ShardKey) -> None: ...  # its background copies of its state
    def kill_standbys(self, node: str) -> int: ...  # every warm standby of ``node`` (SIGKILL); how many


class Hittable(Protocol):
    """The run's stage actors as fault injection sees them."""

    @property
    def width(self) -> int: ...
    @property
    def nodes(self) -> Mapping[ShardKey, str]: ...
    @property
    def hits(self) -> StageHits: ...


class Emitter(Protocol):
    def emit(self, event: events.Event) -> object: ...


@dataclass(frozen=True)
class FaultTargets:
    """What fault injection may hit: the stage actors, the snapshot coordinator (its managers),
    and the metrics (a fault's line). The one type the controller's ``Faults`` port and chaos use."""

    group: Hittable
    snapshots: SnapshotCoordinator | None
    metrics: Emitter


class Chaos:
    def __init__(self, cfg: RunConfig, cluster: Any = None) -> None:
        on_lab = cluster is None and bool(os.environ.get("ELASTIC_LLM_LAB"))  # a driver on a host of the harness: its nodes are hosts
        if any(ev.kill == "node" for ev in cfg.chaos.events) and cluster is None and not on_lab:
            raise ConfigError("chaos.events with kill: node need a test cluster (ray.cluster_utils.Cluster) or the multi-host harness "
                              "(elastic_llm.hosts): use kill: stage or smp here")
        self.lab = lab_of_driver() if on_lab or any(ev.kill in ("partition", "isolate", "slow", "heal") for ev in cfg.chaos.events) else None
        self.events = list(cfg.chaos.events)
        self.cluster = cluster
        self.fired: set[int] = set()
        ch = cfg.chaos
        self.seed, self.how = ch.failure_seed, ch.failure_how
        self.rate_per_hour = ch.failure_rate_per_hour
        self.prob = ch.failure_prob_per_step  # set from the rate once steps were timed
        self.shape = (cfg.parallel.stages, cfg.parallel.dp)
        self.rate_fired: set[int] = set()  # steps whose rate failure fired (a retried step is not hit again)
        self.step_times: list[float] = []
        self.removals: list[tuple[threading.Thread, list[BaseException]]] = []  # node removals under way (remove_later)

    def remove_later(self, evs: list[ChaosEvent], step: int, t: FaultTargets) -> None:
        """Strike node removals on a thread: their chaos lines now, the removals (one after the
        other, each until Ray sees its node dead) meanwhile; :meth:`join_removals` waits for them."""
        nodes, errors = [], []
        for ev in evs:
            self.record(ev, step, t.metrics)
            nodes.append(self._node(ev, t))

        def remove() -> None:
            try:
                for node in nodes:
                    self._remove_node(node)
            except BaseException as e:  # noqa: BLE001 - handed to join_removals, which raises it on the driver's thread
                errors.append(e)

        thread = threading.Thread(target=remove, name="elastic-llm-chaos-node", daemon=True)
        thread.start()
        self.removals.append((thread, errors))

    def join_removals(self) -> None:
        """Wait until every node removal under way is over; raise the first one's error."""
        removals, self.removals = self.removals, []
        for thread, _ in removals:
            thread.join()
        for _, errors in removals:
            if errors:
                raise errors[0]

    def observe_step(self, step: int, seconds: float, width: int) -> float | None:
        """Time a finished step; with ``failure_rate_per_hour`` the probability is set after
        :data:`CALIBRATION_STEPS` steps (the first is not counted). Returns it once, when set."""
        self.shape = (self.shape[0], width)
        if not self.rate_per_hour or self.prob or step < 2:
            return None
        self.step_times.append(seconds)
        if len(self.step_times) < CALIBRATION_STEPS:
            return None
        self.prob = prob_per_step(self.rate_per_hour, sum(self.step_times) / len(self.step_times))
        return self.prob

    def _point(self, ev: ChaosEvent) -> str:
        if ev.during in ("recovery", "recovered", "resize"):
            return ev.during
        return "before_step" if ev.kill in ("error", "standby", "heal") else "in_step"

    def due(self, point: str, step: int) -> list[ChaosEvent]:
        """The events due at ``point`` of ``step`` (``in_step`` includes the rate's failures);
        each is returned once."""
        out = []
        if point == "in_step" and step not in self.rate_fired:
            for stage, replica in failures_at(self.seed, step, *self.shape, self.prob):
                self.rate_fired.add(step)
                out.append(ChaosEvent(step, "stage", stage, replica, how=self.how))
        for i, ev in enumerate(self.events):
            when = ev.step <= step if point == "resize" else ev.step == step  # resize: the first one after step ``ev.step``
            if when and i not in self.fired and self._point(ev) == point:
                self.fired.add(i)
                out.append(ev)
        return out

    def fire(self, point: str, step: int, t: FaultTargets) -> None:
        """Fire the events due at ``point`` of ``step`` (one of :data:`POINTS`)."""
        assert point in POINTS, point
        for ev in self.due(point, step):
            self.strike(ev, step, t)

    @staticmethod
    def record(ev: ChaosEvent, step: int, metrics: Emitter) -> None:
        metrics.emit(events.Chaos(step=step, kill=ev.kill, stage=ev.stage, replica=ev.replica, how=ev.how, corrupt=ev.corrupt, during=ev.during, op=ev.op))

    def strike(self, ev: ChaosEvent, step: int, t: FaultTargets) -> None:
        import ray

        key = ShardKey(ev.stage, ev.replica)
        self.record(ev, step, t.metrics)
        if ev.kill == "error":
            t.group.hits.inject_error(key, f"chaos: injected error from step {step} on")
        elif ev.kill == "stage" and ev.corrupt:
            t.group.hits.corrupt_own_copies(key)
        elif ev.kill == "stage":
            t.group.hits.kill_process(key, ev.how)
        elif ev.kill == "smp":
            if t.snapshots is None:
                raise ConfigError("chaos event kill: smp needs snapshots: set snapshot.enabled: true")
            smp: Any = t.snapshots.managers[self._node(ev, t)]  # a Ray actor: chaos kills it or has it corrupt a shard
            if ev.corrupt:  # every version a recovery could read is hit: one in flight commits (or is dropped) first
                t.snapshots.poll(block=True)
                ray.get(smp.corrupt_shard.remote(key), timeout=60)
            else:
                ray.kill(smp, no_restart=True)
        elif ev.kill == "node":
            self._remove_node(self._node(ev, t))
        elif ev.kill == "standby":  # every warm standby of the stage's node (idle, or named by a recovery plan)
            t.group.hits.kill_standbys(self._node(ev, t))
        elif ev.kill == "partition":
            assert self.lab is not None
            self.lab.cut(host_of(self.lab, self._node(ev, t)))
        elif ev.kill == "isolate":  # only between this stage's node and the next stage's on another node: both still reach every other host
            assert self.lab is not None
            here = self._node(ev, t)
            order = [*range(ev.stage + 1, self.shape[0]), *range(ev.stage - 1, -1, -1)]  # the next stages first, then the previous ones
            there = next((n for s in order if (n := t.group.nodes[ShardKey(s, ev.replica)]) != here), None)
            if there is None:
                raise ConfigError(f"chaos event kill: isolate of stage {ev.stage}: every stage of replica {ev.replica} runs on one node, "
                                  "no link between them to cut: give the run more than one node")
            self.lab.cut(host_of(self.lab, here), "both", [host_of(self.lab, there)])
        elif ev.kill == "slow":  # the node's link at ev.mbit each way (the heal undoes it)
            assert self.lab is not None
            self.lab.slow(host_of(self.lab, self._node(ev, t)), ev.mbit)
        elif ev.kill == "heal":  # every cut link of the harness: a partition that heals
            assert self.lab is not None
            for host in self.lab.hosts:
                self.lab.heal(host)

    @staticmethod
    def ray_lists_alive(node_id: str) -> bool:
        import ray

        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    def _remove_node(self, node_id: str) -> None:
        """The node dies: removed from the test cluster, or on the harness every process of its
        host SIGKILLed (a machine that stops); over once Ray sees it dead."""
        if self.cluster is None and self.lab is not None:
            self.lab.kill(host_of(self.lab, node_id))
        else:
            victim = next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)
            if victim is None:
                raise RuntimeError(f"chaos: node {node_id[:12]} is not a worker node of the test cluster: it cannot be removed")
            self.cluster.remove_node(victim, allow_graceful=False)
        deadline = time.monotonic() + NODE_GONE_S  # the event is over once Ray has seen the node die
        while self.ray_lists_alive(node_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: Ray still reports node {node_id[:12]} alive {NODE_GONE_S:.0f} s after its removal")
            time.sleep(0.1)

    @staticmethod
    def _node(ev: ChaosEvent, t: FaultTargets) -> str:
        """The node an event hits: ``node`` (index into the live nodes with CPUs, sorted by node
        id) or else the node hosting the event's stage/replica."""
        import ray

        if ev.node is None and ev.during == "resize":  # the node of the joining replica's stage
            return t.group.nodes[ShardKey(ev.stage, t.group.width - 1)]
        if ev.node is None:
            return t.group.nodes[ShardKey(ev.stage, ev.replica)]
        alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0)
        if ev.node >= len(alive):
            raise ConfigError(f"chaos event node={ev.node}: the cluster has {len(alive)} live nodes with CPUs (0..{len(alive) - 1})")
        return alive[ev.node]


def lab_of_driver() -> Lab:
    """The multi-host harness this driver runs in (``ELASTIC_LLM_LAB``, set on its hosts);
    ConfigError where there is none or it cannot run here."""
    from elastic_llm.hosts.lab import unavailable

    state = os.environ.get("ELASTIC_LLM_LAB")
    why = unavailable() or (None if state and os.path.exists(state) else "this driver does not run on a host of one")
    if why:
        raise ConfigError(f"chaos.events with kill: partition or heal need the multi-host harness (elastic_llm.hosts), and {why}: "
                          "run the driver on one of its hosts (RayHosts.driver), or use kill: node on a test cluster")
    return Lab.attach(str(state))


def host_of(lab: Lab, node_id: str) -> str:
    """The lab host whose address Ray's node ``node_id`` has."""
    import ray

    addr = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), None)
    host = next((h.name for h in lab.hosts.values() if h.addr == addr), None)
    if host is None:
        raise RuntimeError(f"chaos: node {node_id[:12]} ({addr}) is not a host of the lab {lab.run}: its link cannot be cut")
    return host


class ChaosExecutor:
    """A step executor that strikes the run's in-step chaos events through ``inner`` (the real
    one): stage kills ride in the victim's plan, node removals and snapshot-manager kills strike
    right after the step's plans went out. With no events due it only forwards."""

    def __init__(self, inner: StepExecutor, chaos: Chaos, targets: Callable[[], FaultTargets]) -> None:
        self.inner, self.chaos, self.targets = inner, chaos, targets

    def start(self, step: int, x: Any, y: Any, snapshot: StreamPosition | None = None, faults: Any = None) -> Pending:
        events = self.chaos.due("in_step", step)
        if not events:
            return self.inner.start(step, x, y, snapshot, faults)
        planned = dict(faults or {})
        later = []
        for ev in events:
            key = ShardKey(ev.stage, ev.replica)
            if ev.kill == "stage":
                planned[key] = Fault(Phase(ev.op), FaultAction(ev.how))
                self.chaos.record(ev, step, self.targets().metrics)
            else:
                if ev.kill == "node" and ev.node is None:  # the victim waits at its op until its node is gone
                    planned[key] = Fault(Phase(ev.op), FaultAction.HOLD)
                later.append(ev)
        pending = self.inner.start(step, x, y, snapshot, planned)
        for ev in later:
            if ev.kill != "node":
                self.chaos.strike(ev, step, self.targets())
        nodes = [ev for ev in later if ev.kill == "node"]
        if nodes:
            self.chaos.remove_later(nodes, step, self.targets())
        return pending

    def finish(self, pending: Pending, timeout: float | None = None) -> StepResult:
        """The step's result; a node removal of the step is over when it returns (not when it
        raises: the failure is the driver's to notice while the node goes, and the recovery's
        :meth:`settle` waits for it)."""
        result = self.inner.finish(pending) if timeout is None else self.inner.finish(pending, timeout)
        self.chaos.join_removals()
        return result

    def wait(self, pending: Pending, seconds: float) -> bool:
        return self.inner.wait(pending, seconds)

    def settle(self) -> None:
        self.chaos.join_removals()  # the recovery observes a cluster whose node is gone, as Ray sees it
        self.inner.settle()

    def snapshot(self, step: int, position: StreamPosition) -> None:
        self.inner.snapshot(step, position)

    def eval_loss(self, x: Any, y: Any) -> float:
        return self.inner.eval_loss(x, y)
