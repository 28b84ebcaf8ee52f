"""The training controller: a state machine over the run, on the ports of a runtime.

Owns: the run's state (:mod:`elastic_llm.controller.states`), its progress (step, committed
high, failures, the failure budget), the data stream on the driver, the metrics lines (which
also feed the run's monitor) and the progress bar, and one handler per state that returns the
next state. The decisions are pure (the transition functions, :class:`FailurePolicy`,
:class:`RecoveryPolicy`, the elastic policy); the side effects are carried out by the
orchestration above the ports (:mod:`.setup`, :mod:`.stepping`, :mod:`.recovery`,
:mod:`.elastic`), on whatever :class:`~elastic_llm.controller.ports.Runtime` the run was given:
Ray (:func:`elastic_llm.runtime.ray_trainer`) or a simulated fleet (:mod:`elastic_llm.sim`).
Never imports Ray, never computes model math, never decides a recovery inline, and never waits
without a deadline.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from elastic_llm import events
from elastic_llm.config import RunConfig
from elastic_llm.controller.metrics import MetricsWriter
from elastic_llm.controller.ports import CapacityUnavailable, FaultTargets, PlanNotFollowed, Runtime
from elastic_llm.controller.elastic import drain_records, spare_nodes
from elastic_llm.controller.progress import ProgressBar
from elastic_llm.controller.recovery import RecoveryOutcome, gone_since, recovery_records
from elastic_llm.controller.setup import Resumed, RunParts, close_parts, committed_step, open_parts, prepare, publish_roster, start_from, take_over
from elastic_llm.controller.stepping import StepJobs, StepRunner
from elastic_llm.controller.ticks import Requests, Ticks
from elastic_llm.controller.states import (
    Draining, Failed, Progress, Recovering, Resizing, RunFailed, RunUnrecoverable, Running, Starting, State, WaitingForCapacity,
    after_failure, after_source_lost, after_step, after_unrecoverable, check_transition, is_terminal, restart_after_resize, routine, start_waiting, while_waiting, why_entered,
)
from elastic_llm.shape import count_parameters
from elastic_llm.monitor import RunFacts, RunStatus
from elastic_llm.pipeline.executor import StepExecutor, StepFailed, StepResult
from elastic_llm.recovery.failure import During, FailurePolicy, StepFailure, reclaims_behind
from elastic_llm.recovery.policy import RecoveryPolicy, SourceLost, UnrecoverableError
from elastic_llm.sources import NodeGone
from elastic_llm.spans import Spans

__all__ = ["RunFailed", "RunUnrecoverable", "Trainer", "UNTIL_STOPPED"]

log = logging.getLogger("elastic_llm.controller")
WAIT_POLL_S = 1.0  # how often capacity is looked at while waiting for it
UNTIL_STOPPED = 10**9  # fit(UNTIL_STOPPED): train until request_stop() (a replay); the progress shows no total


class Trainer:
    """Runs one training run through its states on ``runtime``: ``t = ray_trainer(cfg); t.fit(); t.shutdown()``."""

    def __init__(self, cfg: RunConfig, runtime: Runtime, metrics_out: str | Path | None = None, progress: bool = False, resume: str | None = None) -> None:
        self.cfg, self.runtime, self.clock = cfg, runtime, runtime.clock
        self.run_id = f"{runtime.rng.getrandbits(24):06x}"
        self.failure_policy = FailurePolicy(cfg.recovery.max_failures, cfg.recovery.max_retries_per_step)
        self.recovery_policy = RecoveryPolicy()
        self.progress = Progress()  # step, failures, budget, ...: replaced, never changed in place
        self.state: State = Starting()
        self.ticks = Ticks(self.clock, runtime.cpu)  # seconds and the controller's CPU per state
        self.wait_poll_s = WAIT_POLL_S
        self.parts: RunParts | None = None
        self.executor: StepExecutor | None = None  # runs steps on the current membership (fault-wrapped)
        self.runner: StepRunner | None = None
        self.jobs: StepJobs | None = None
        self.stop_requested = False
        self.requests = Requests()  # from other threads: stop, train longer (applied at step boundaries)
        self.end = cfg.train.max_steps
        self.history: list[dict[str, Any]] = []
        self.recoveries: list[events.Recovery] = []
        self.resizes: list[events.Resize] = []
        self.drains: list[events.Drain] = []
        self.plan_cpu_s: list[float] = []  # per recovery plan: the driver's CPU seconds to observe and decide
        self.committed_steps_lost = 0  # committed steps that rollbacks undid (beyond the newest committed snapshot)
        self.on_step: Callable[[dict[str, Any]], None] | None = None
        self.observers: list[Callable[[State, State], None]] = []  # told of every change of state (old, new), from the run's thread
        self._t0: float | None = None
        self._spans = Spans(self.clock.perf_counter)
        self.bar = ProgressBar(progress, cfg.name)
        start = prepare(cfg, runtime, resume)  # the data, and what a resume names: refused now, before anything starts
        self.data_dir, self.stream, self.val_tokens = start.data.dir, start.data.train, start.data.val
        self.reattach, self.resume_from = start.reattach, start.checkpoint  # --resume RUN_ID (a run whose driver died), --resume CHECKPOINT
        self.run_id = start.reattach or self.run_id
        self.metrics = MetricsWriter(metrics_out, self.clock)  # opened (truncated) once the checks above passed

    # the run's parts (None before setup and after shutdown)
    group = property(lambda self: self.parts.group if self.parts is not None else None)
    actors = property(lambda self: self.parts.group.actors if self.parts is not None else [])  # [replica][stage]: the stage actors
    snapshots = property(lambda self: self.parts.snapshots if self.parts is not None else None)
    durable = property(lambda self: self.parts.durable if self.parts is not None else None)
    checkpoints = property(lambda self: self.parts.checkpoints if self.parts is not None else None)
    publisher = property(lambda self: self.parts.publisher if self.parts is not None else None)

    def run_facts(self) -> RunFacts:
        """What the run's monitor publishes about it now."""
        sn, width = self.snapshots, self.group.width if self.group is not None else self.cfg.parallel.dp
        where = RunStatus(self.run_id, self.cfg.name, self.state.name, self.step, self.end, self.cfg.parallel.stages, width)
        return RunFacts(where, sn.committed if sn is not None else None, frozenset(sn.managers) if sn is not None else frozenset())

    def targets(self) -> FaultTargets:
        return FaultTargets(self.group, self.snapshots, self.metrics)

    def setup(self) -> None:
        """Start the runtime, the run's parts and its stage actors, and where it resumes from.
        Idempotent; raises :class:`CapacityUnavailable` when the actors cannot be placed now."""
        if self.executor is not None:
            return
        t0, spans, rt = self.clock.perf_counter(), self._spans, self.runtime
        if self.parts is None:
            for what, warning in rt.start(self.cfg, self.run_id, spans):
                log.warning(warning)
                self.metrics.emit(events.RunWarning(step=self.step, what=what, message=warning))
            self.parts = open_parts(self.cfg, rt, self.run_id, self.reattach is not None, self.metrics, str(self.data_dir), self.run_facts, spans)
            self.runner = StepRunner(self.cfg, self.clock, self.stream, self.parts, rt.faults, self.parts.nodes, self.targets, rt.errors)
            self.runner.between = lambda: (self.parts.elastic.notice(self.drains_seen), self.jobs.snapshot_lines(self.step), self.jobs.suspects(self.step))  # type: ignore[union-attr]  # while a step runs: new notices start their spares and re-home parts
            self.parts.elastic.joined = lambda: rt.faults.fire("resize", self.step, self.targets())
            self.jobs = StepJobs(self.cfg, self.clock, self.metrics, self.parts, rt.faults, self.parts.nodes, self.val_tokens)
        g = self.parts.group
        with spans.span("stages"):
            take_over(self.parts)  # --resume RUN_ID: the dead driver's stage actors that answer
            g.placement.place()
            missing = [k for k in g.keys() if k not in g.ready]
            if missing:
                g.spawn_all() if not g.actors else g.replace(missing)
        assert self.jobs is not None
        if self.checkpoints is not None and self.checkpoints.latest() is None:
            self.jobs.checkpoint(0, self.stream.at(), force=True)  # a failure before the first periodic one rolls back to the start
        self._resumed(start_from(self.runtime, self.cfg, self.parts, self.run_id, self.reattach is not None, self.resume_from, self.metrics, spans))
        self._new_executor()
        self.jobs.mirrors(self.step, force=True)
        self.metrics.emit(events.Start(
            run_id=self.run_id, config=self.cfg.to_dict(), parameters=count_parameters(self.cfg.model.shape()),
            actors=[{"stage": k.stage, "replica": k.replica, "node_id": g.nodes[k], "pid": g.pids[k]} for k in g.keys()],
            data_dir=str(self.data_dir), setup_s={k.removesuffix("_s"): round(v, 3) for k, v in spans.totals(t0).items()},
        ))

    def _resumed(self, at: Resumed | None) -> None:
        if at is not None:
            self.progress = self.progress.resumed(at.step)
            if at.position:
                self.stream.seek(at.position)
        elif self.step == 0 and self.parts is not None:  # a run that begins at step 0: a rollback to its initial state resumes the data here
            self.parts.recovery.initial_position = self.stream.at()
        self.reattach = self.resume_from = None

    def _new_executor(self) -> None:
        """A step executor over the current membership (its links are set up before its first step)."""
        assert self.parts is not None
        self.executor = self.runtime.faults.wrap(self.runtime.executor(self.parts.group.actors, self.cfg, self.parts.group.nodes.get, self.parts.nodes.set_aside), self.targets)
        publish_roster(self.runtime, self.run_id, self.parts)  # the membership a next driver takes over

    # ------------------------------------------------------------------ one step
    def run_step(self) -> dict[str, Any]:
        """One optimizer step (snapshot, faults as configured): advances :attr:`step`, returns its record; raises :class:`StepFailed`, the stream rewound."""
        self.setup()
        assert self.executor is not None and self.runner is not None
        if self._t0 is None:
            self._t0 = self.clock.perf_counter()
        result, started = self.runner.run(self.executor, self.step + 1, last=self.step + 1 >= self.end)
        return self._finish_step(self.step + 1, result, started)

    def _finish_step(self, step: int, result: StepResult, started: float) -> dict[str, Any]:
        """Count ``step`` as done: the jobs that follow a step (:class:`StepJobs`), then its record."""
        jobs, now = self.jobs, self.clock.perf_counter()
        assert jobs is not None and self._t0 is not None
        jobs.snapshots(step, now - started)
        jobs.durable(now - started, now - self._t0, self.failures)
        self.progress = self.progress.stepped(step)
        jobs.mirrors(step)
        jobs.checkpoint(step, self.stream.at())
        self.progress = self.progress.committed(self.committed_step)
        now = self.clock.perf_counter()
        jobs.chaos_rate(step, now - started)
        assert self.executor is not None
        record = jobs.record(step, result, now - started, now - self._t0, self.tokens_seen, self.end, self.executor)
        self.history.append(record)
        self.metrics.write(record)
        return record

    # ------------------------------------------------------------------ the run
    def fit(self, max_steps: int | None = None, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Train until ``max_steps`` (default ``train.max_steps``) through the controller's
        states; return the per-step records (after a rollback, replayed steps appear again).
        Raises :class:`RunFailed` (exit code 4, or 3 when nothing lossless survived)."""
        self.end, self.on_step = max_steps if max_steps is not None else self.cfg.train.max_steps, on_step
        self.state = Starting() if self.executor is None else self._next()
        self.bar.open(self.end if self.end < UNTIL_STOPPED else None, self.step)  # the clock (elapsed_s) starts at the first step, not at setup
        handlers: dict[type, Callable[[Any], State]] = {
            Starting: self._start, Running: self._run, Recovering: self._recover,
            WaitingForCapacity: self._wait, Resizing: self._resize, Draining: self._drain,
        }
        try:
            while not is_terminal(self.state):
                with self.ticks.count(self.state.name):  # also when a handler is interrupted (a simulation's end, Ctrl-C)
                    new = handlers[type(self.state)](self.state)
                self._enter(new)
        finally:
            self.bar.close()
        if isinstance(self.state, Failed):
            if self.jobs is not None:
                self.jobs.end_of_failed_run()
            self.metrics.emit(events.Failed(step=self.step, reason=self.state.reason, exit_code=self.state.exit_code))
            raise (RunUnrecoverable if self.state.exit_code == 3 else RunFailed)(self.state)
        assert self.jobs is not None
        self.jobs.end_of_run(self.step, self.tokens_seen, self.clock.perf_counter() - (self._t0 or self.clock.perf_counter()), self.ticks)
        return self.history

    def _enter(self, new: State) -> None:
        """Move to ``new`` (checked against the allowed transitions); a change of state is one
        log line and one metrics line with its inputs."""
        old = self.state
        check_transition(old, new)
        self.state = new
        if type(old) is type(new) and not (isinstance(new, Recovering) and new != old):
            return
        why = why_entered(new)
        if not routine(old, new):
            log.info("%s -> %s%s", old.name, new.name, f": {why}" if why else f" at step {self.step}")
        self.metrics.emit(events.StateChange(step=self.step, old=old.name, new=new.name, reason=why))
        if isinstance(new, WaitingForCapacity) and self.jobs is not None:
            self.jobs.capacity(self.step, new, force=True)
        self.bar.state(self.state.name, self.step, self.group.width if self.group else 0)
        for observe in self.observers:
            observe(old, new)

    def request_stop(self) -> None:
        """Finish the run at the next step boundary (safe from another thread: a replay, a signal)."""
        self.requests.stop()

    def extend(self, steps: int) -> None:
        """Train ``steps`` more steps than asked (safe from another thread: a harness lengthening a run)."""
        self.requests.extend(steps)

    def _next(self) -> State:
        """After a step: finish, or act on draining nodes, or grow into new room, or go on."""
        assert self.parts is not None and self.jobs is not None and self.executor is not None
        stop, extra = self.requests.take()
        self.stop_requested, self.end = self.stop_requested or stop, self.end + extra
        self.jobs.deaths(self.step)
        self.jobs.reprotect(self.step, self.executor, self.stream.at())  # a committed version that lost members: taken again now, not a step later
        self.jobs.standbys(self.step, self.failures, self.clock.perf_counter() - (self._t0 or self.clock.perf_counter()))
        drains, grow_to = self.parts.elastic.look(self.drains_seen, self.step)
        return after_step(self.step, self.end, self.stop_requested, drains, self.parts.group.width, grow_to)

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
            self.progress = self.progress.step_failed(failure.step, self._reclaims(failure))
            return after_failure(failure, self.budget, self.failure_policy)
        if self.on_step:
            self.on_step(record)
        self.bar.step(record, self.state.name)
        return self._next()

    def _recover(self, state: Recovering) -> State:
        assert self.parts is not None and self.jobs is not None
        failure, rec, t0 = state.failure, self.parts.recovery, self.clock.perf_counter()
        self.jobs.deaths(self.step)
        spans, alive = self.parts.group.spans, self.parts.nodes.alive()  # a node that goes from now on is the plan's news, not a failure of it
        try:
            with spans.span("plan"):
                cpu = self.runtime.cpu()
                obs = rec.observe(self.executor, failure.step, from_start=self.committed_high == 0)
                plan = self.recovery_policy.decide(obs)
                self.plan_cpu_s.append(self.runtime.cpu() - cpu)  # the controller's CPU to observe and decide (its calls' waits excluded)
            log.info("recovery plan for %s: %s", failure.where, plan)
            self.runtime.faults.fire("recovery", failure.step, self.targets())
            outcome = rec.execute(plan, obs, self.step)
        except CapacityUnavailable as e:
            return start_waiting(state, e.capacity, self.clock.monotonic(), self.cfg.recovery.capacity_timeout_s)
        except UnrecoverableError as e:
            return after_unrecoverable(failure, str(e))
        except SourceLost as e:  # a source the plan named was found gone: not a new failure, the run knows more now
            log.warning("recovery of %s: %s; observing again", failure.where, e)
            return after_source_lost(state)
        except (*self.runtime.errors, StepFailed, PlanNotFollowed, NodeGone) as err:  # type: ignore[misc]  # observed again and re-planned
            return self._failed_work(err, During.RECOVERY, alive, state)
        self._apply(outcome, failure, self.clock.perf_counter() - t0, spans.totals(t0))
        after = self._next()  # re-protects the committed version first, if it lost members
        self.runtime.faults.fire("recovered", failure.step, self.targets())
        return after

    def _apply(self, outcome: RecoveryOutcome, failure: StepFailure, seconds: float, spans: dict[str, float]) -> None:
        """Adopt a finished recovery: step counter, data position, an executor over the new actors, one metrics line per restored actor (and a shrink)."""
        assert self.runner is not None and self.jobs is not None
        lost = max(0, self.committed_high - outcome.step)  # committed steps this recovery undid
        self.committed_steps_lost += lost
        done = self.runner.interrupted
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
            self._resized(*outcome.plan.width, outcome.plan.why_width, seconds, spans)
        for rec in recovery_records(outcome, failure, seconds, lost, {"plan_s": 0.0, "actor_s": 0.0, "state_s": 0.0, **spans}):
            self.recoveries.append(self.metrics.emit(rec))
        self.jobs.mirrors(self.step, force=True)

    def _failed_work(self, err: BaseException, during: During, alive: set[str], recovering: Recovering | None = None) -> State:
        """A recovery (``recovering``), resize or drain failed (an actor died meanwhile): observed again and
        re-planned; charged to nothing when a node of ``alive`` (as they were when it started) went meanwhile."""
        failure = StepFailure.from_exception(recovering.failure.step if recovering else self.step + 1, err.cause if isinstance(err, StepFailed) else err, during=during)
        if gone_since(self.runtime.nodes, alive, err, f"the {during} of step {failure.step}"):
            return after_source_lost(recovering) if recovering is not None else Recovering(failure, 1, "a node it placed things on went: not charged")
        self.progress = self.progress.charged(failure.step, self._reclaims(failure))
        return after_failure(failure, self.budget, self.failure_policy, recovering.attempt + 1 if recovering is not None else 1)

    def _reclaims(self, failure: StepFailure) -> frozenset[str]:
        """The reclaimed nodes that could explain ``failure`` (:func:`reclaims_behind`)."""
        g, nodes = self.group, self.runtime.nodes
        return frozenset(reclaims_behind(failure, g.nodes, nodes.reclaimed(), nodes.alive, spare_nodes(g))) if g is not None else frozenset()

    def _resize(self, state: Resizing) -> State:
        assert self.parts is not None
        t0, alive = self.clock.perf_counter(), self.runtime.nodes.alive()
        try:
            out = self.parts.elastic.grow(state.to_dp)
        except CapacityUnavailable as e:
            log.info("no room for replica %d after all (%s); staying at %d", state.to_dp, e.capacity, state.from_dp)
            return after_step(self.step, self.end, self.stop_requested)
        except (*self.runtime.errors, PlanNotFollowed, NodeGone) as err:  # type: ignore[misc]  # the runtime's errors: a tuple of exception types
            return self._failed_work(err, During.RESIZE, alive)
        self._new_executor()
        self._resized(out.from_dp, out.to_dp, out.reason, out.seconds, self.parts.group.spans.totals(t0))
        return restart_after_resize(self.step + 1, out.from_dp, out.to_dp) if self.parts.restart_on_resize else self._next()

    def _drain(self, state: Draining) -> State:
        assert self.parts is not None
        nodes = frozenset(d.node_id for d in state.drains)
        now, t0, alive = self.clock.time(), self.clock.perf_counter(), self.runtime.nodes.alive()
        try:
            ev = self.parts.elastic.evacuate(state.drains)
        except (*self.runtime.errors, PlanNotFollowed, NodeGone) as err:  # type: ignore[misc]  # the runtime's errors: a tuple of exception types
            return self._failed_work(err, During.DRAIN, alive - nodes)
        spans, self.progress = self.parts.group.spans.totals(t0), self.progress.drained(nodes)
        self._new_executor()
        for line in drain_records(state.drains, ev, self.step, now, spans):
            self.drains.append(self.metrics.emit(line))
        if ev.to_dp != ev.from_dp:
            self._resized(ev.from_dp, ev.to_dp, "drain: no room to move", ev.seconds, spans)
        given_up = self.parts.elastic.give_up(state.drains, self.step + 1)  # what stayed and goes before the next step ends
        return Recovering(given_up, 1, "given up at a drain before its nodes go: not charged") if given_up else self._next()

    def _resized(self, from_dp: int, to_dp: int, reason: str, seconds: float, spans: dict[str, float] | None = None) -> None:
        log.info("width %d -> %d replicas (%s, %.1f s)", from_dp, to_dp, reason, seconds)
        self.resizes.append(self.metrics.emit(events.Resize(step=self.step, from_dp=from_dp, to_dp=to_dp, reason=reason, seconds=seconds, spans=dict(spans or {}))))

    def _wait(self, state: WaitingForCapacity) -> State:
        assert self.group is not None
        self.clock.sleep(self.wait_poll_s)
        new = while_waiting(state, self.group.placement.placed(), self.group.placement.capacity(), self.clock.monotonic())
        if isinstance(new, WaitingForCapacity) and self.jobs is not None:
            self.jobs.capacity(self.step, new)
        return new

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """End the run's parts, close the metrics file and the runtime: every one of them, even
        when an earlier one raises (the first error is raised after all were tried)."""
        errors = []
        for what, step in close_parts(self.parts, self.runtime, self.run_id, self.metrics) + [("metrics file", self.metrics.close), ("runtime", self.runtime.shutdown)]:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the others must still be ended; raised below
                log.warning("shutdown: %s: %s: %s", what, type(e).__name__, e)
                errors.append(e)
        self.executor = self.runner = self.jobs = None  # the parts stay readable (a test's or a report's look at the run afterwards)
        if errors:
            raise errors[0]

    # the run's progress, read-only: handlers replace self.progress through its pure methods
    step = property(lambda self: self.progress.step)
    failures = property(lambda self: self.progress.failures)
    budget = property(lambda self: self.progress.budget)
    committed_high = property(lambda self: self.progress.committed_high)
    drains_seen = property(lambda self: self.progress.drains_seen)
    tokens_seen = property(lambda self: self.progress.step * self.cfg.tokens_per_step())
    seconds_by_state = property(lambda self: self.ticks.seconds)
    cpu_by_state = property(lambda self: self.ticks.cpu)

    committed_step = property(lambda self: committed_step(self.parts, self.step))  # the newest step a committed snapshot (or checkpoint) holds

    def evaluate(self) -> float:
        assert self.jobs is not None and self.executor is not None
        return self.jobs.evaluate(self.executor)
