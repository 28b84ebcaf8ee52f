"""The training controller: a state machine over the run.

Owns: the run's state (:mod:`elastic_llm.controller.states`), the step counter, the data
stream on the driver, validation, metrics lines (which also feed the run's monitor actor, see
:mod:`elastic_llm.monitor`) and the progress bar, and the failure budget.
Each state has one handler that returns the next state; the decisions are pure (the transition
functions, :class:`FailurePolicy`, :class:`RecoveryPolicy`) and the side effects are done by
small executors: :class:`ActorGroup` (placement, actors), :class:`RecoveryExecutor` (observe,
carry out a plan), :class:`ElasticExecutor` (grow, evacuate draining nodes, shrink),
:class:`SnapshotCoordinator` (snapshot timing and versions), :class:`DurableTier` (flushes to
durable storage, in the background), the step executor (:mod:`elastic_llm.pipeline.executor`, one
plan per stage actor per step) and :class:`Chaos` (fault injection; in-step faults through
:class:`~elastic_llm.chaos.ChaosExecutor`, which wraps the step executor). A run
started with ``resume`` loads a durable checkpoint into its fresh actors before the first step.
After every step the controller looks (cheaply) at Ray's draining nodes
and, every ``elastic.grow_check_s``, for room for another replica.
Never computes model math (stage actors do, each running its part of a step from its plan),
never decides a recovery inline, and never waits without a deadline.

Why ~840 lines: one small handler per state (eight of them) plus the step, the setup (on Ray or
on injected :class:`~elastic_llm.controller.parts.Parts`, and a resume), counting a step that every
survivor finished after a failure, and the per-step hooks of the recovery modes and tiers (mirror
refresh, checkpoint writes, snapshot and flush cadence, calibrating failure rates); each handler
calls one executor and one pure transition, and keeping them side by side is what lets
``fit`` and the handlers read as the whole story of a run.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from elastic_llm.chaos import Chaos, ChaosExecutor, ChaosTargets
from elastic_llm.clock import SYSTEM, Clock
from elastic_llm.config import ConfigError, RunConfig
from elastic_llm import events
from elastic_llm.controller.actor_group import ActorGroup, CapacityUnavailable, PlanNotFollowed
from elastic_llm.controller.checkpoints import CheckpointExecutor
from elastic_llm.controller.elastic import ElasticExecutor
from elastic_llm.controller.metrics import MetricsWriter
from elastic_llm.monitor import Publisher, RunFacts, RunStatus
from elastic_llm.controller.neighbours import refresh_mirrors
from elastic_llm.controller.parts import Elastic, Group, Parts, Recovery
from elastic_llm.controller.progress import ProgressBar
from elastic_llm.controller.recovery import ModeOptions, RecoveryExecutor, RecoveryOutcome, recovery_records
from elastic_llm.controller.session import NAMESPACE, log, start_ray, store_warnings
from elastic_llm.controller.failover import (
    Keepalive,
    ResumeError,
    check_same_model,
    find_managers,
    forget,
    is_run_id,
    publish,
    publish_committed,
    publish_driver,
    published_committed,
    retire_old_driver,
)
from elastic_llm.controller.liveness import NodeWatch, RayNodeTable
from elastic_llm.controller.standby import StandbyPool
from elastic_llm.controller.states import (
    Draining,
    Failed,
    Finished,
    Progress,
    Recovering,
    Resizing,
    Running,
    Starting,
    State,
    WaitingForCapacity,
    after_failure,
    after_source_lost,
    after_step,
    after_unrecoverable,
    check_transition,
    is_terminal,
    start_waiting,
    while_waiting,
)
from elastic_llm.data import open_run_data
from elastic_llm.stream import StreamPosition, TokenStream
from elastic_llm.durable.format import Checkpoint, DurableError, open_checkpoint
from elastic_llm.durable.restore import check_fits
from elastic_llm.durable.tier import DurableTier, run_storage
from elastic_llm.model import count_parameters
from elastic_llm.pipeline.executor import PendingStep, RayStepExecutor, StepExecutor, StepFailed, StepResult
from elastic_llm.pipeline.shares import replica_shares
from elastic_llm.recovery.failure import During, FailureBudget, FailurePolicy, StepFailure
from elastic_llm.recovery.policy import RecoveryPolicy, SourceLost, UnrecoverableError
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.sources import Mode
from elastic_llm.spans import Spans

WAIT_POLL_S = 1.0  # how often the cluster is looked at while waiting for capacity
STANDBY_LOOK_S = 1.0  # how often (at step boundaries) the warm standbys are topped up
RESUME_S = 600.0  # longest the stages may take to load a durable checkpoint
UNTIL_STOPPED = 10**9  # fit(UNTIL_STOPPED): train until request_stop() (a replay); the progress shows no total


@dataclass(frozen=True)
class InterruptedStep:
    """What the driver holds of a step that was submitted: if a recovery finds that every
    survivor finished it, the step is counted from the reports that came back."""

    step: int
    pending: PendingStep
    position_after: StreamPosition  # the data position after the step's batch
    started: float


def ray_executor(actors: list[list[Any]], cfg: RunConfig) -> StepExecutor:
    """The real step executor: one plan per stage actor per step."""
    return RayStepExecutor(actors, cfg.parallel.schedule, cfg.parallel.microbatches, cfg.swapped, cfg.recovery.mode == Mode.REDUNDANT)


def checkpoint_refusal(error: Exception) -> DurableError | None:
    """The :class:`DurableError` a stage actor raised loading a durable checkpoint (the checkpoint
    is at fault: a corrupted, truncated or foreign file), with its message only, without Ray's
    wrapping and the actor's traceback; None for any other error."""
    cause = getattr(error, "cause", None)
    return DurableError(str(cause)) if isinstance(cause, DurableError) else None


class RunFailed(RuntimeError):
    """The run stopped in the ``failed`` state; ``state`` has the reason and the exit code.
    Committed snapshots are left as they were."""

    def __init__(self, state: Failed) -> None:
        self.state = state
        self.exit_code = state.exit_code
        trace = f"\n{state.failure.trace}" if state.failure is not None and state.failure.trace else ""
        super().__init__(state.reason + trace)


class RunUnrecoverable(RunFailed, UnrecoverableError):
    """The run failed because no lossless source survived (exit code 3)."""


class Trainer:
    """Runs one training run through its states.

    >>> trainer = Trainer(cfg); history = trainer.fit(); trainer.shutdown()

    ``cluster`` (a ``ray.cluster_utils.Cluster``) is only for tests and demos: chaos events that
    remove nodes need it.
    """

    def __init__(
        self,
        cfg: RunConfig,
        address: str | None = None,
        metrics_out: str | Path | None = None,
        progress: bool = False,
        dashboard: bool = False,
        cluster: Any = None,
        resume: str | None = None,
        parts: Parts | None = None,
    ) -> None:
        self.cfg = cfg
        if parts is not None and parts.snapshots is None and cfg.snapshots_on:
            raise ConfigError("a Trainer on injected parts (no Ray) and no injected snapshot coordinator runs without snapshots: set snapshot.enabled=false")
        self.parts = parts
        self.wait_poll_s = WAIT_POLL_S  # how often capacity is looked at while waiting
        self.make_executor = parts.make_executor if parts is not None else ray_executor
        self.clock: Clock = parts.clock if parts is not None and parts.clock is not None else SYSTEM  # a simulation passes its own
        self.address = address
        self.dashboard = dashboard
        self.run_id = uuid.uuid4().hex[:6]
        self.chaos = Chaos(cfg, cluster)
        self.failure_policy = FailurePolicy(cfg.recovery.max_failures, cfg.recovery.max_retries_per_step)
        self.recovery_policy = RecoveryPolicy()
        self.progress = Progress()  # step, failures, budget, ...: replaced, never changed in place
        self.state: State = Starting()
        self.seconds_by_state: dict[str, float] = {}
        self.cpu_by_state: dict[str, float] = {}  # the driver process's CPU seconds (time.process_time) in each state's handler
        self.owns_ray = False
        self.group: Group | None = parts.group if parts is not None else None
        self.snapshots: Any = parts.snapshots if parts is not None else None
        self.recovery: Recovery | None = None
        self.elastic: Elastic | None = None
        self.checkpoints: CheckpointExecutor | None = None  # recovery.mode: checkpoint
        self.durable: DurableTier | None = None  # durable.storage_path
        self.publisher: Publisher | None = None  # feeds the run's monitor actor (elastic-llm status, Ray metrics)
        self.stop_requested = False
        self.executor: StepExecutor | None = None  # runs steps on the current membership (chaos-wrapped)
        self.interrupted: InterruptedStep | None = None  # the step in progress once its updates were submitted
        self.end = cfg.train.max_steps  # fit(max_steps) may change it
        self.history: list[dict[str, Any]] = []
        self.recoveries: list[events.Recovery] = []
        self.plan_cpu_s: list[float] = []  # per recovery plan made: the driver's CPU seconds to observe and decide
        self.committed_steps_lost = 0  # committed steps that rollbacks undid (beyond the newest committed snapshot)
        self.resizes: list[events.Resize] = []
        self.drains: list[events.Drain] = []
        self._t0: float | None = None
        self._standby_look = float("-inf")
        self._own_spans = Spans(self.clock.perf_counter)
        self.watch: NodeWatch | None = None  # the driver's node probes (recovery.node_probe_s)
        self._adopted_seen = 0  # standbys adopted when the pool was last topped up
        self.bar = ProgressBar(progress, cfg.name)
        self._last_report = 0.0
        self._load_data()
        self.resume_from: Checkpoint | None = None
        self.reattach: str | None = None  # --resume RUN_ID: a run whose driver died
        self.keepalive: Keepalive | None = None
        if resume and is_run_id(resume):
            self.reattach = self.run_id = resume
        elif resume:  # checked now (JSON only), before any actor starts: a wrong checkpoint is refused at once
            self.resume_from = open_checkpoint(resume)
            for warning in check_fits(self.resume_from, cfg):
                log(f"warning: {warning}")
        if cfg.durable.storage_path:
            run_storage(cfg)  # refused now if it cannot be written, not at the first flush
        self.metrics = MetricsWriter(metrics_out, self.clock if parts is not None else None)  # opened (truncated) once the checks above passed

    @property
    def actors(self) -> list[list[Any]]:
        """``actors[replica][stage]``: the stage actor handles."""
        return self.group.actors if self.group is not None else []

    def run_facts(self) -> RunFacts:
        """What the run's monitor publishes about it now."""
        snaps = self.snapshots
        where = RunStatus(self.run_id, self.cfg.name, self.state.name, self.step, self.end, self.cfg.parallel.stages,
                          self.group.width if self.group is not None else self.cfg.parallel.dp)
        return RunFacts(where, snaps.committed if snaps is not None else None, frozenset(snaps.managers) if snaps is not None else frozenset())

    # ------------------------------------------------------------------ setup
    def _load_data(self) -> None:
        c = self.cfg
        data = open_run_data(c.data.dir, c.model.seq_len, c.train.seed, c.model.vocab_size, c.data.val_fraction, c.data.tokenizer, c.data.tokenizer_file)
        self.data_dir, self.stream, self.val_tokens = data.dir, data.train, data.val

    def setup(self) -> None:
        """Start (or join) Ray, the snapshot managers and the stage actors. Idempotent; raises
        :class:`CapacityUnavailable` when the actors cannot be placed now."""
        if self.executor is not None:
            return
        t0 = self.clock.perf_counter()
        spans = self._own_spans
        if self.parts is None:
            self._start_ray_parts()
        assert self.group is not None
        with spans.span("stages"):
            self.group.place()
            missing = [k for k in self.group.keys() if k not in self.group.ready]
            if missing:
                if not self.group.actors:
                    self.group.spawn_all()
                else:
                    self.group.replace(missing)
        c = self.cfg
        min_width = c.elastic.bounds(c.parallel.dp)[0]
        if c.recovery.mode == Mode.CHECKPOINT and self.checkpoints is None:
            self.checkpoints = CheckpointExecutor(self.ray_group, c.recovery.checkpoint_every, c.recovery.checkpoint_dir)
            self._checkpoint(0)  # a failure before the first periodic checkpoint rolls back to the start
        if self.reattach is not None:
            with spans.span("reattach"):
                self._reattach()
        if self.resume_from is not None:
            with spans.span("resume"):
                self._resume(self.resume_from)
        if self.parts is not None:
            self.recovery, self.elastic = self.parts.recovery, self.parts.elastic
        else:
            options = ModeOptions(Mode(c.recovery.mode), c.mirrors, c.checkfree.lr_scale, self.checkpoints, self.durable)
            self.recovery = RecoveryExecutor(self.ray_group, self.snapshots, c.snapshot.parity, min_width, options, self.watch)
            self.elastic = ElasticExecutor(self.ray_group, self.snapshots, min_width, c)
        self._new_executor()
        self._refresh_mirrors(force=True)
        self.metrics.emit(events.Start(
            run_id=self.run_id,
            config=self.cfg.to_dict(),
            parameters=count_parameters(self.cfg.model.shape()),
            actors=[
                {"stage": k.stage, "replica": k.replica, "node_id": self.group.nodes[k], "pid": self.group.pids[k]}
                for k in self.group.keys()
            ],
            data_dir=str(self.data_dir),
            setup_s={k.removesuffix("_s"): round(v, 3) for k, v in spans.totals(t0).items()},  # where the start went: ray, retire, managers, stages, ...
        ))

    def _start_ray_parts(self) -> None:
        """Ray (started or joined), the run's monitor actor, the snapshot managers (and the
        durable tier), and the stage actors' group."""
        import ray

        spans = self._own_spans
        with spans.span("ray"):
            self.owns_ray = start_ray(self.cfg, self.address, self.dashboard) or self.owns_ray
        rc = self.cfg.recovery
        if rc.node_probe_s > 0 and self.watch is None:  # before any actor: a node that dies from now on is noticed
            self.watch = NodeWatch(RayNodeTable(), rc.node_probe_s, rc.node_probe_failures)
            self.watch.start()
        if self.reattach is not None and self.publisher is None:  # before this driver's actors take the run's names
            check_same_model(self.run_id, self.cfg.to_dict())
            with spans.span("retire"):
                retire_old_driver(NAMESPACE, self.run_id)
        if self.publisher is None:  # the run-<id> actor: status and Ray metrics of the run
            self.publisher = Publisher(self.run_facts, NAMESPACE)
            self.metrics.observers.append(self.publisher.on_record)
        if self.cfg.snapshots_on and self.snapshots is None:  # managers first: they outlive any stage
            from elastic_llm.snapshot.coordinator import SnapshotCoordinator, check_parity_fits

            self.snapshots = SnapshotCoordinator(self.cfg, NAMESPACE, self.run_id)
            with spans.span("managers"):
                if self.reattach is not None:
                    self._find_old_run()
                self.snapshots.ensure_managers()  # one per node with CPUs
            check_parity_fits(len(self.snapshots.managers), self.cfg.snapshot.parity, self.cfg.snapshot.group_size)
            for warning in store_warnings(self.cfg, ray.nodes()):
                log(f"warning: {warning}")
                self.metrics.emit(events.RunWarning(step=self.step, what="object_store", message=warning))
            self._publish_run()
            if self.cfg.durable.storage_path:
                self.durable = DurableTier(self.cfg, self.snapshots, str(self.data_dir), self.metrics)
                self.snapshots.durable = self.durable
        if self.group is None:
            pool = StandbyPool(self.cfg, self.run_id, NAMESPACE) if self.cfg.recovery.standby != 0 else None
            self.group = ActorGroup(self.cfg, self.run_id, pool)

    def _find_old_run(self) -> None:
        """``--resume RUN_ID``: the dead driver's managers and its committed record."""
        sn = self.snapshots
        sn.managers = find_managers(NAMESPACE, self.run_id)
        sn.name_tag = f"-r{uuid.uuid4().hex[:4]}"
        record = published_committed(self.run_id)
        if sn.managers and record is not None:
            sn.committed = record

    def _publish_run(self) -> None:
        """Driver failover (``recovery.driver_grace_s`` > 0): publish the run's config, this
        driver's job and each committed record, and keep the managers alive."""
        sn = self.snapshots
        if sn.grace_s <= 0:
            return
        publish(self.run_id, "config", json.dumps(self.cfg.to_dict()))
        publish_driver(self.run_id)
        sn.on_commit = lambda record: publish_committed(self.run_id, record)
        self.keepalive = Keepalive(lambda: list(sn.managers.values()), min(5.0, sn.grace_s / 4))
        self.keepalive.start()
        log(f"run {self.run_id}: if this driver dies, `elastic-llm train --resume {self.run_id}` with the same config goes on from "
            f"its snapshots in memory within recovery.driver_grace_s={sn.grace_s:g} s")

    def _reattach(self) -> None:
        """``--resume RUN_ID``: the fresh stages restore the dead driver's newest committed
        snapshot from its managers (shards on lost nodes rebuilt from parity), and training goes
        on from its step and data position; without one, from the run's newest durable checkpoint."""
        import ray

        assert self.group is not None and self.reattach is not None
        t = self.clock.perf_counter()
        sn = self.snapshots
        rec = sn.committed if sn is not None else None
        try:
            if rec is None:
                raise UnrecoverableError("its snapshot managers or its committed record are gone")
            for _ in range(len(sn.managers) + 1):  # a shard that fails to load counts its node lost: look again
                alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
                dead = sn.dead_managers(alive)
                try:
                    srcs = {k: sn.fetch_stage_state(k.stage, k.replica, dead) for k in self.group.keys()}
                    break
                except SourceLost as e:
                    log(f"--resume {self.run_id}: {e}; looking again")
            else:
                raise UnrecoverableError("every snapshot part failed to load")
            calls = [self.ray_group.actor(k).load_parts.remote(src.manifest, list(src.offsets), *src.refs) for k, src in srcs.items()]
            ray.get(calls, timeout=RESUME_S)
        except (UnrecoverableError, ray.exceptions.RayError) as e:
            self.reattach = None
            if not self.cfg.durable.storage_path:
                raise ResumeError(
                    f"--resume {self.run_id}: nothing to resume from in memory ({str(e).splitlines()[0]}; its driver died more than "
                    f"recovery.driver_grace_s={self.cfg.recovery.driver_grace_s:g} s ago, or too many of its nodes went) and "
                    "durable.storage_path is not set: start a new run"
                ) from None
            log(f"--resume {self.run_id}: no in-memory snapshot ({str(e).splitlines()[0]}): the newest durable checkpoint instead")
            self.resume_from = open_checkpoint(run_storage(self.cfg).uri)
            return
        self.reattach = None
        self.progress = self.progress.resumed(rec.version)
        position = rec.shard(ShardKey(0, 0)).data_position()
        if position:
            self.stream.seek(position)
        seconds = self.clock.perf_counter() - t
        log(f"resumed run {self.run_id} from its committed in-memory snapshot of step {rec.version} in {seconds:.1f} s")
        self.metrics.emit(events.Reattach(step=rec.version, run_id=self.run_id, seconds=seconds, managers=len(sn.managers)))

    def _resume(self, ck: Checkpoint) -> None:
        """Every stage loads its layers from the durable checkpoint ``ck`` (whatever width or stage
        count wrote it); the step counter and the data stream continue from it."""
        import ray

        assert self.group is not None
        t = self.clock.perf_counter()
        calls = [self.ray_group.actor(k).load_durable.remote(ck.storage.uri, ck.name) for k in self.ray_group.keys()]
        try:
            ray.get(calls, timeout=RESUME_S)
        except ray.exceptions.RayTaskError as e:
            refusal = checkpoint_refusal(e)
            if refusal is None:
                raise
            raise refusal from None
        self.resume_from = None
        self.progress = self.progress.resumed(ck.step)
        if ck.manifest.get("data_position"):
            self.stream.seek(ck.manifest["data_position"])
        seconds = self.clock.perf_counter() - t
        log(f"resumed from {ck.uri} at step {ck.step} ({ck.manifest.get('width')} replica(s) x {ck.manifest.get('stages')} stages then) in {seconds:.1f} s")
        self.metrics.emit(events.Resume(step=ck.step, path=ck.uri, seconds=seconds, width_then=ck.manifest.get("width"), stages_then=ck.manifest.get("stages")))

    @property
    def ray_group(self) -> ActorGroup:
        """The group as the Ray-backed executors, restores and mirrors need it: they are used only
        when no parts were injected, and then the group is an :class:`ActorGroup`."""
        assert isinstance(self.group, ActorGroup), "a Ray-backed path ran on injected parts"
        return self.group

    def _new_executor(self) -> None:
        """A step executor over the current membership (its links are set up before its first step)."""
        assert self.group is not None
        self.executor = ChaosExecutor(self.make_executor(self.group.actors, self.cfg), self.chaos, self._targets)

    def _refresh_mirrors(self, force: bool = False) -> None:
        """CheckFree+: copy the embedding / LM head onto the neighbouring stages (every
        ``checkfree.mirror_every`` steps; ``force`` after start and after every recovery)."""
        every = self.cfg.checkfree.mirror_every
        if self.parts is not None:  # injected parts (a simulation) hold no layers to mirror
            return
        if self.cfg.mirrors and self.group is not None and (force or self.step % every == 0):
            refresh_mirrors(self.ray_group, self.step)

    def _checkpoint(self, step: int) -> None:
        """Write checkpoint ``step`` (training waits: the baseline's cost), one metrics line."""
        assert self.checkpoints is not None
        seconds = self.checkpoints.save(step, self.stream.at())
        self.metrics.emit(events.Checkpoint(step=step, seconds=seconds, path=str(self.checkpoints.root)))

    def _targets(self) -> ChaosTargets:
        return ChaosTargets(self.group, self.snapshots, self.metrics)

    # ------------------------------------------------------------------ one step
    def run_step(self) -> dict[str, Any]:
        """One optimizer step (snapshot and chaos as configured). Advances :attr:`step` and
        returns the step's record. On failure raises :class:`StepFailed` with the data stream
        rewound: the step did not happen."""
        import ray

        self.setup()
        assert self.executor is not None and self.group is not None
        if self._t0 is None:
            self._t0 = self.clock.perf_counter()
        step = self.step + 1
        position = self.stream.at()
        ts = self.clock.perf_counter()
        self.interrupted = None
        try:
            x, y = self.stream.next_batch(self.cfg.train.batch_size)
            self.chaos.fire("before_step", step, self._targets())
            snap = self.snapshots is not None and self.snapshots.due(step)
            pending = self.executor.start(step, x, y, snapshot=self.stream.at() if snap else None)
            self.interrupted = InterruptedStep(step, pending, self.stream.at(), ts)
            if snap:
                self.snapshots.begin(step, self.group.members())
            result = self.executor.finish(pending)
        except StepFailed:
            self.stream.seek(position)
            raise
        except (ray.exceptions.RayError, TimeoutError) as err:
            self.stream.seek(position)
            raise StepFailed(err, None, None) from err
        return self._finish_step(step, result, ts)

    def _finish_step(self, step: int, result: StepResult, ts: float) -> dict[str, Any]:
        """Count ``step`` as done: step counter, validation, the step's record."""
        now = self.clock.perf_counter()
        if self.snapshots is not None:
            self.snapshots.observe_step(now - ts, began=self.snapshots.last_begin == step)
            self.snapshots.poll()
            for change in self.snapshots.changes:
                self.metrics.emit(events.SnapshotEvery(step=step, **change))
            self.snapshots.changes.clear()
        if self.durable is not None:
            self.durable.observe(now - ts, now - (self._t0 or now), self.failures)
            self.durable.poll()
        self.progress = self.progress.stepped(step)
        self._refresh_mirrors()
        if self.checkpoints is not None and self.checkpoints.due(step):
            self._checkpoint(step)
        self.progress = self.progress.committed(self.committed_step)
        now = self.clock.perf_counter()
        assert self.group is not None and self._t0 is not None  # set when the run started and its first step began
        prob = self.chaos.observe_step(step, now - ts, self.group.width)
        if prob is not None:
            log(f"chaos.failure_rate_per_hour={self.cfg.chaos.failure_rate_per_hour} at {now - ts:.2f} s per step: each stage fails with probability {prob:.2e} per step")
            self.metrics.emit(events.ChaosRate(step=step, rate_per_hour=self.cfg.chaos.failure_rate_per_hour, prob_per_step=prob))
        record: dict[str, Any] = {
            "step": step,
            "loss": result.loss,
            "tokens": self.tokens_seen,
            "tokens_per_s": self.cfg.tokens_per_step() / (now - ts),
            "elapsed_s": now - self._t0,
            "lr": result.lr,
            "grad_norm": max(result.grad_norms),
            "dp": self.group.width,
        }
        if self.snapshots is not None and self.snapshots.auto:
            record["snapshot_every"] = self.snapshots.every
        if self.durable is not None:
            record["durable_every"] = self.durable.every
        ev = self.cfg.train.eval_every
        if ev and (step % ev == 0 or step == self.end):
            record["val_loss"] = self.evaluate()
        self.history.append(record)
        self.metrics.write(record)
        return record

    # the run's progress, read-only: handlers replace self.progress through its pure methods
    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def failures(self) -> int:
        return self.progress.failures

    @property
    def budget(self) -> FailureBudget:
        return self.progress.budget

    @property
    def committed_high(self) -> int:
        return self.progress.committed_high

    @property
    def drains_seen(self) -> frozenset[str]:
        return self.progress.drains_seen

    @property
    def tokens_seen(self) -> int:
        return self.progress.step * self.cfg.tokens_per_step()

    @property
    def committed_step(self) -> int:
        """The newest step a committed snapshot (or checkpoint) holds (without either: the last
        completed step)."""
        if self.checkpoints is not None:
            latest = self.checkpoints.latest()
            return latest[0] if latest else 0
        if self.snapshots is None:
            return self.step
        rec = self.snapshots.committed
        return rec.version if rec is not None else 0

    def evaluate(self) -> float:
        assert self.executor is not None and self.group is not None
        stream = TokenStream(self.val_tokens, self.cfg.model.seq_len, seed=0, shuffle=False)
        share = replica_shares(self.cfg.train.batch_size, self.group.width)[0]  # replica 0's share of a step's batch
        losses = [self.executor.eval_loss(*stream.next_batch(share)) for _ in range(self.cfg.train.eval_batches)]
        return float(np.mean(losses))

    # ------------------------------------------------------------------ the run
    def fit(self, max_steps: int | None = None, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Train until ``max_steps`` (default ``train.max_steps``) through the controller's
        states; return the per-step records (after a rollback, replayed steps appear again).
        Raises :class:`RunFailed` (exit code 4, or 3 when nothing lossless survived)."""
        self.end = max_steps if max_steps is not None else self.cfg.train.max_steps
        self.on_step = on_step
        self.state = Starting() if self.executor is None else self._next()
        self.bar.open(self.end if self.end < UNTIL_STOPPED else None, self.step)  # the clock (elapsed_s) starts at the first step, not at setup
        handlers: dict[type, Callable[[Any], State]] = {
            Starting: self._start,
            Running: self._run,
            Recovering: self._recover,
            WaitingForCapacity: self._wait,
            Resizing: self._resize,
            Draining: self._drain,
        }
        try:
            while not is_terminal(self.state):
                t, cpu, name = self.clock.perf_counter(), time.process_time(), self.state.name
                try:
                    new = handlers[type(self.state)](self.state)
                finally:  # counted also when a handler is interrupted (a simulation's end, Ctrl-C)
                    self.seconds_by_state[name] = self.seconds_by_state.get(name, 0.0) + self.clock.perf_counter() - t
                    self.cpu_by_state[name] = self.cpu_by_state.get(name, 0.0) + time.process_time() - cpu
                self._enter(new)
        finally:
            self.bar.close()
        if isinstance(self.state, Failed):
            self.metrics.emit(events.Failed(step=self.step, reason=self.state.reason, exit_code=self.state.exit_code))
            raise (RunUnrecoverable if self.state.exit_code == 3 else RunFailed)(self.state)
        if self.snapshots is not None:
            self.snapshots.poll(block=True)
        if self.durable is not None:
            self.durable.finish()
        elapsed = self.clock.perf_counter() - self._t0 if self._t0 is not None else 0.0
        self.metrics.emit(events.End(step=self.step, tokens=self.tokens_seen, elapsed_s=elapsed, seconds_by_state=dict(self.seconds_by_state),
                                   cpu_by_state={k: round(v, 4) for k, v in self.cpu_by_state.items()}))
        return self.history

    def _enter(self, new: State) -> None:
        """Move to ``new`` (checked against the allowed transitions); a change of state is one
        log line and one metrics line with its inputs."""
        old = self.state
        check_transition(old, new)
        self.state = new
        if type(old) is type(new) and not (isinstance(new, Recovering) and new != old):
            return
        why = ""
        if isinstance(new, Recovering):
            why = f"{new.failure} (attempt {new.attempt}; {new.reason})"
        elif isinstance(new, WaitingForCapacity):
            why = f"{new.capacity}; giving up in {new.deadline - new.since:.0f} s"
        elif isinstance(new, Failed):
            why = new.reason.splitlines()[0]
        routine = (isinstance(old, Starting) and isinstance(new, Running)) or (isinstance(old, Running) and isinstance(new, Finished))
        if not routine:
            log(f"{old.name} -> {new.name}" + (f": {why}" if why else f" at step {self.step}"))
        self.metrics.emit(events.StateChange(step=self.step, old=old.name, new=new.name, reason=why))
        if isinstance(new, WaitingForCapacity):
            self._report_capacity(new, force=True)
        self.bar.state(self.state.name, self.step, self.group.width if self.group else 0)

    def _keep_standbys(self) -> None:
        """Top the warm standbys up to ``recovery.standby`` per live, non-draining node with CPUs
        (they start in the background; at most every ``STANDBY_LOOK_S``)."""
        import ray

        pool = getattr(self.group, "pool", None)
        now = self.clock.monotonic()
        if pool is None or not pool.enabled:
            return
        lost = pool.check()
        if lost:
            self.metrics.emit(events.Standby(step=self.step, lost=lost, ready=pool.count()[0]))
        if now - self._standby_look < STANDBY_LOOK_S and not lost and pool.adopted == self._adopted_seen:
            return  # nothing used or lost since the last look
        self._standby_look, self._adopted_seen = now, pool.adopted
        from elastic_llm.controller.drains import draining_nodes

        if self.cfg.recovery.standby == "auto":
            pool.resize(self.failures, self.clock.perf_counter() - (self._t0 or self.clock.perf_counter()))
        draining = draining_nodes()
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0 and n["NodeID"] not in draining]
        started = pool.ensure(nodes)
        if started:
            ready, starting = pool.count()
            self.metrics.emit(events.Standby(step=self.step, started=started, ready=ready, starting=starting, per_node=pool.per_node))

    def _report_deaths(self) -> None:
        """One ``node_dead`` line per node the watch declared dead since the last look."""
        for d in self.watch.take() if self.watch is not None else []:
            self.metrics.emit(events.NodeDead(step=self.step, node=d.node, address=d.address, outcome=d.outcome.value, failures=d.failures,
                                              suspect_s=round(d.suspect_s, 3)))

    def request_stop(self) -> None:
        """Finish the run at the next step boundary (from another thread: a replay, a signal)."""
        self.stop_requested = True

    def _next(self) -> State:
        """After a step: finish, or act on draining nodes, or grow into new room, or go on."""
        assert self.group is not None and self.elastic is not None
        self._report_deaths()
        self._keep_standbys()
        drains, grow_to = self.elastic.look(self.drains_seen)
        return after_step(self.step, self.end, self.stop_requested, drains, self.group.width, grow_to)

    def _start(self, state: Starting) -> State:
        try:
            self.setup()
        except CapacityUnavailable as e:
            return start_waiting(state, e.capacity, self.clock.monotonic(), self.cfg.recovery.capacity_timeout_s)
        return self._next()

    def _run(self, state: Running) -> State:
        try:
            record = self.run_step()
        except StepFailed as e:
            failure = StepFailure.from_exception(self.step + 1, e.cause, e.stage, e.replica, op=e.op)
            self.progress = self.progress.step_failed(failure.step)
            return after_failure(failure, self.budget, self.failure_policy)
        if self.on_step:
            self.on_step(record)
        self.bar.step(record, self.state.name)
        return self._next()

    def _recover(self, state: Recovering) -> State:
        import ray

        assert self.recovery is not None
        failure = state.failure
        t0 = self.clock.perf_counter()
        self._report_deaths()
        spans = self._spans()
        try:
            with spans.span("plan"):
                cpu = time.process_time()
                obs = self.recovery.observe(self.executor, failure.step)
                plan = self.recovery_policy.decide(obs)
                self.plan_cpu_s.append(time.process_time() - cpu)  # the driver's CPU to observe and decide (its Ray calls' waits excluded)
            log(f"recovery plan for {failure.where}: {plan}")
            self.chaos.fire("recovery", failure.step, self._targets())
            outcome = self.recovery.execute(plan, obs, self.step)
        except CapacityUnavailable as e:
            return start_waiting(state, e.capacity, self.clock.monotonic(), self.cfg.recovery.capacity_timeout_s)
        except UnrecoverableError as e:
            return after_unrecoverable(failure, str(e))
        except SourceLost as e:  # a source the plan named was found gone: not a new failure, the run knows more now
            log(f"recovery of {failure.where}: {e}; observing again")
            return after_source_lost(state)
        except (ray.exceptions.RayError, TimeoutError, StepFailed, PlanNotFollowed) as err:  # observed again and re-planned
            again = StepFailure.from_exception(failure.step, err.cause if isinstance(err, StepFailed) else err, during=During.RECOVERY)
            self.progress = self.progress.charged(again.step)
            return after_failure(again, self.budget, self.failure_policy, state.attempt + 1)
        self._apply(outcome, failure, self.clock.perf_counter() - t0, spans.totals(t0))
        return self._next()

    def _spans(self) -> Spans:
        """The executors' span tracer (their ``actor``/``state`` spans; ``plan`` is the controller's)."""
        return getattr(self.group, "spans", None) or self._own_spans

    def _apply(self, outcome: RecoveryOutcome, failure: StepFailure, seconds: float, spans: dict[str, float] | None = None) -> None:
        """Adopt a finished recovery: step counter, data position, an executor over the new actors,
        and one metrics line per restored actor (and one for a shrink)."""
        lost = max(0, self.committed_high - outcome.step)  # committed steps this recovery undid
        self.committed_steps_lost += lost
        done = self.interrupted
        self._new_executor()
        if outcome.step == failure.step and done is not None and done.step == failure.step:
            # every survivor had finished the failed step (a stage died after the gradient
            # exchange) and the replaced ones took a peer's state of that step: it counts as done
            self.stream.seek(done.position_after)
            self._finish_step(done.step, done.pending.result(), done.started)
        else:
            self.progress = self.progress.rolled_back(outcome.step)
            if outcome.data_position is not None:
                self.stream.seek(outcome.data_position)
        if outcome.plan.width is not None:
            self._resized(*outcome.plan.width, "lost stages could not be placed", seconds, spans)
        for rec in recovery_records(outcome, failure, seconds, lost, {"plan_s": 0.0, "actor_s": 0.0, "state_s": 0.0, **(spans or {})}):
            self.recoveries.append(self.metrics.emit(rec))
        self._refresh_mirrors(force=True)

    def _failed_between_steps(self, err: BaseException, during: During) -> State:
        """A resize or a drain failed (an actor died meanwhile): recover as for a failed step."""
        failure = StepFailure.from_exception(self.step + 1, err.cause if isinstance(err, StepFailed) else err, during=during)
        self.progress = self.progress.charged(failure.step)
        return after_failure(failure, self.budget, self.failure_policy)

    def _resize(self, state: Resizing) -> State:
        import ray

        assert self.elastic is not None
        t0 = self.clock.perf_counter()
        try:
            out = self.elastic.grow()
        except CapacityUnavailable as e:
            log(f"no room for replica {state.to_dp} after all ({e.capacity}); staying at {state.from_dp}")
            return after_step(self.step, self.end, self.stop_requested)
        except (ray.exceptions.RayError, TimeoutError, PlanNotFollowed) as err:
            return self._failed_between_steps(err, During.RESIZE)
        self._new_executor()
        self._resized(out.from_dp, out.to_dp, out.reason, out.seconds, self._spans().totals(t0))
        return self._next()

    def _drain(self, state: Draining) -> State:
        import ray

        assert self.elastic is not None
        nodes = frozenset(d.node_id for d in state.drains)
        now = self.clock.time()
        t0 = self.clock.perf_counter()
        try:
            deadlines = [d.deadline for d in state.drains if d.deadline is not None]
            ev = self.elastic.evacuate(nodes, min(deadlines) if deadlines else None)
        except (ray.exceptions.RayError, TimeoutError, PlanNotFollowed) as err:
            return self._failed_between_steps(err, During.DRAIN)
        spans = self._spans().totals(t0)
        self.progress = self.progress.drained(nodes)
        self._new_executor()
        for d in state.drains:
            left = d.seconds_left(now)
            log(f"node {d.node_id[:12]} is draining ({'no deadline' if left is None else f'{left:.0f} s left'}): "
                f"{ev.moved} stage actors moved, {ev.dropped} replicas dropped, {ev.stayed} left in place, {ev.seconds:.1f} s")
            self.drains.append(self.metrics.emit(events.Drain(
                step=self.step, node=d.node_id, deadline_s=left, moved=ev.moved, dropped=ev.dropped,
                stayed=ev.stayed, seconds=ev.seconds, rollback_steps=0, how=ev.how, spans=spans,
            )))
        if ev.to_dp != ev.from_dp:
            self._resized(ev.from_dp, ev.to_dp, "drain: no room to move", ev.seconds, spans)
        return self._next()

    def _resized(self, from_dp: int, to_dp: int, reason: str, seconds: float, spans: dict[str, float] | None = None) -> None:
        log(f"width {from_dp} -> {to_dp} replicas ({reason}, {seconds:.1f} s)")
        self.resizes.append(self.metrics.emit(events.Resize(step=self.step, from_dp=from_dp, to_dp=to_dp, reason=reason, seconds=seconds, spans=dict(spans or {}))))

    def _wait(self, state: WaitingForCapacity) -> State:
        assert self.group is not None
        self.clock.sleep(self.wait_poll_s)
        new = while_waiting(state, self.group.placed(), self.group.capacity(), self.clock.monotonic())
        if isinstance(new, WaitingForCapacity):
            self._report_capacity(new)
        return new

    def _report_capacity(self, state: WaitingForCapacity, force: bool = False) -> None:
        now = self.clock.monotonic()
        if not force and now - self._last_report < self.cfg.recovery.capacity_report_s:
            return
        self._last_report = now
        left = state.deadline - now
        log(f"waiting for capacity: {state.capacity}: waiting for nodes ({now - state.since:.0f} s so far, {left:.0f} s left)")
        self.metrics.emit(events.WaitingForCapacity(
            step=self.step, need=state.capacity.need, have=state.capacity.have, waited_s=now - state.since, deadline_s=left,
        ))

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        import ray

        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        if self.keepalive is not None:
            self.keepalive.stop()
            self.keepalive = None
            if ray.is_initialized():
                forget(self.run_id)  # its managers end with this driver: nothing is left to resume
        if ray.is_initialized():
            if self.group is not None:
                self.group.shutdown()
            if self.snapshots is not None:
                self.snapshots.shutdown()
            if self.publisher is not None:
                self.metrics.observers.remove(self.publisher.on_record)
                self.publisher.close()
                self.publisher = None
        if self.checkpoints is not None:
            self.checkpoints.close()
        self.executor = None
        self.metrics.close()
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False
