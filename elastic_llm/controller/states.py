"""The controller's states and the pure functions that move between them.

Owns: the state classes (each carries its payload: the failure being recovered, what capacity is
missing and until when, why the run failed), :class:`Progress` (how far the run is, replaced by
its pure methods), the table of allowed transitions, and the transition functions. Pure: no Ray, no clock (``now`` comes in as an argument), no I/O; the
trainer calls them with what its executors observed and carries out the state they return.

    starting -> running <-> recovering
    running -> resizing (room for another replica) | draining (nodes announced their end) -> running
    starting | recovering -> waiting_for_capacity -> starting | recovering | failed
    any -> failed;  running | resizing | draining -> finished
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

from elastic_llm.controller.drains import Drain
from elastic_llm.recovery.failure import During, FailureBudget, FailurePolicy, StepFailure
from elastic_llm.sources import UnrecoverableError

EXIT_FAILED = 4  # failure budget spent, or no capacity within recovery.capacity_timeout_s
EXIT_UNRECOVERABLE = 3  # nothing lossless survives


@dataclass(frozen=True)
class Capacity:
    """What placement needs and what the cluster has free, as said to the user."""

    need: str  # e.g. "2 x {CPU: 1}"
    have: str  # e.g. "0 CPUs free on 1 node"

    def __str__(self) -> str:
        return f"need {self.need}; the cluster has {self.have}"


@dataclass(frozen=True)
class Progress:
    """How far the run is: what every handler reads and replaces (never changes in place)."""

    step: int = 0  # optimizer steps completed
    committed_high: int = 0  # newest step a committed snapshot ever held (every step, without snapshots)
    failures: int = 0  # failed steps (each one recovered, or the run stopped)
    budget: FailureBudget = field(default_factory=FailureBudget)  # failures the failure policy counts
    drains_seen: frozenset[str] = frozenset()  # draining nodes already acted on
    reclaims: int = 0  # failures a reclaim explains (a node of the run announced its end, or the runtime knows it was reclaimed): not charged
    excused: frozenset[str] = frozenset()  # the reclaimed nodes behind them: each excuses one failure (one that keeps coming back is charged)

    def stepped(self, step: int) -> "Progress":
        """Step ``step`` completed."""
        return replace(self, step=step)

    def committed(self, step: int) -> "Progress":
        """A committed snapshot (or checkpoint) holds step ``step`` now."""
        return replace(self, committed_high=max(self.committed_high, step))

    def step_failed(self, step: int, reclaims: frozenset[str] = frozenset()) -> "Progress":
        """Step ``step`` failed: one more failed step, charged to the budget unless a reclaimed
        node of ``reclaims`` that excused no failure yet explains it (preemptions are the fleet's
        weather, not a fault that could loop)."""
        return self._excused(reclaims, failures=self.failures + 1) or replace(self, failures=self.failures + 1, budget=self.budget.record(step))

    def charged(self, step: int, reclaims: frozenset[str] = frozenset()) -> "Progress":
        """A recovery, drain or resize of step ``step`` failed: charged to the budget unless a
        reclaimed node of ``reclaims`` that excused no failure yet explains it."""
        return self._excused(reclaims, failures=self.failures) or replace(self, budget=self.budget.record(step))

    def _excused(self, reclaims: frozenset[str], failures: int) -> "Progress | None":
        new = reclaims - self.excused
        return replace(self, failures=failures, reclaims=self.reclaims + 1, excused=self.excused | new) if new else None

    def rolled_back(self, step: int) -> "Progress":
        """A recovery left every stage at step ``step``."""
        return replace(self, step=step)

    def resumed(self, step: int) -> "Progress":
        """The run went on from a snapshot or checkpoint of step ``step``."""
        return replace(self, step=step, committed_high=step)

    def drained(self, nodes: frozenset[str]) -> "Progress":
        return replace(self, drains_seen=self.drains_seen | nodes)


@dataclass(frozen=True)
class Starting:
    name = "starting"


@dataclass(frozen=True)
class Running:
    step: int  # optimizer steps completed
    name = "running"


@dataclass(frozen=True)
class Recovering:
    failure: StepFailure
    attempt: int = 1  # recoveries tried for this failure (a failure during recovery re-plans)
    reason: str = field(default="", compare=False)  # why the failure policy let the run recover (the budget left)
    name = "recovering"


@dataclass(frozen=True)
class WaitingForCapacity:
    capacity: Capacity
    since: float
    deadline: float
    resume: Union[Starting, Recovering]  # what to try again once the actors can be placed
    name = "waiting_for_capacity"


@dataclass(frozen=True)
class Resizing:
    step: int
    from_dp: int
    to_dp: int
    reason: str
    name = "resizing"


@dataclass(frozen=True)
class Draining:
    step: int
    drains: tuple[Drain, ...]  # nodes hosting the run's stages that Ray marks as draining
    name = "draining"


@dataclass(frozen=True)
class Failed:
    reason: str
    exit_code: int
    failure: StepFailure | None = None
    name = "failed"


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


@dataclass(frozen=True)
class Finished:
    step: int
    name = "finished"


State = Union[Starting, Running, Recovering, WaitingForCapacity, Resizing, Draining, Failed, Finished]
_AFTER_STEP = (Running, Resizing, Draining, Finished)

ALLOWED: dict[type, tuple[type, ...]] = {
    Starting: (*_AFTER_STEP, WaitingForCapacity, Failed),
    Running: (*_AFTER_STEP, Recovering, Failed),
    Resizing: (*_AFTER_STEP, Recovering, Failed),
    Draining: (*_AFTER_STEP, Recovering, Failed),
    Recovering: (*_AFTER_STEP, Recovering, WaitingForCapacity, Failed),
    WaitingForCapacity: (WaitingForCapacity, Starting, Recovering, Failed),
    Failed: (),
    Finished: (),
}


class TransitionError(RuntimeError):
    """A transition the state machine does not allow: a bug in the controller."""


def check_transition(old: State, new: State) -> None:
    if not isinstance(new, ALLOWED[type(old)]):
        raise TransitionError(f"{old.name} -> {new.name} is not a transition of the controller")


def is_terminal(state: State) -> bool:
    return isinstance(state, (Failed, Finished))


# ---------------------------------------------------------------------- transitions


def after_step(
    step: int,
    end: int,
    stop: bool = False,
    drains: tuple[Drain, ...] = (),
    width: int = 1,
    grow_to: int | None = None,
) -> Union[Running, Resizing, Draining, Finished]:
    """Where a run goes after a step (or a recovery, a resize, a drain): finished at ``end`` or
    when asked to stop; nodes announcing their end come first, then growing into new room."""
    if step >= end or stop:
        return Finished(step)
    if drains:
        return Draining(step, drains)
    if grow_to is not None and grow_to > width:
        return Resizing(step, width, grow_to, "capacity")
    return Running(step)


def after_failure(
    failure: StepFailure, budget: FailureBudget, policy: FailurePolicy, attempt: int = 1
) -> Union[Recovering, Failed]:
    """A step (or a recovery) failed; ``budget`` already counts it."""
    decision = policy.decide(failure, budget)
    if decision.recover:
        return Recovering(failure, attempt, decision.reason)
    return Failed(f"{decision.reason}\nlast failure: {failure}", EXIT_FAILED, failure)


def after_source_lost(state: Recovering) -> Recovering:
    """A source the recovery plan named was found gone while the plan was carried out: observe
    and plan again. Not a new failure (the failure budget is not charged); each time, the run has
    learnt of one more lost part, so it ends."""
    return Recovering(state.failure, state.attempt + 1, state.reason)


def restart_after_resize(step: int, from_dp: int, to_dp: int) -> Recovering:
    """A grow under a policy that restarts every process at a new width (ray-train-elastic):
    a recovery follows that restarts them all from the newest durable checkpoint. Not a failure:
    the failure budget is not charged."""
    failure = StepFailure(step, None, None, f"resize {from_dp} -> {to_dp}: recovery.policy restarts every process at a new width", during=During.RESIZE)
    return Recovering(failure, 1, "a resize under recovery.policy=ray-train-elastic: not charged")


def after_unrecoverable(failure: StepFailure, why: str) -> Failed:
    return Failed(f"{failure}; nothing lossless survives: {why}", EXIT_UNRECOVERABLE, failure)


def start_waiting(resume: Union[Starting, Recovering], capacity: Capacity, now: float, timeout_s: float) -> WaitingForCapacity:
    return WaitingForCapacity(capacity, now, now + timeout_s, resume)


def while_waiting(state: WaitingForCapacity, placed: bool, capacity: Capacity, now: float) -> State:
    """One look at the cluster while waiting: resume once everything can be placed, fail at the
    deadline, else keep waiting (with what is missing now)."""
    if placed:
        return state.resume
    if now >= state.deadline:
        failure = state.resume.failure if isinstance(state.resume, Recovering) else None
        waited = now - state.since
        during = f" while recovering from: {failure}" if failure is not None else " to start the run"
        return Failed(
            f"waited {waited:.0f} s for capacity{during} (recovery.capacity_timeout_s={state.deadline - state.since:g}): {capacity}. "
            "Add nodes (or let the autoscaler add them), lower parallel.cpus_per_actor, or raise recovery.capacity_timeout_s",
            EXIT_FAILED,
            failure,
        )
    return WaitingForCapacity(capacity, state.since, state.deadline, state.resume)


def why_entered(new: State) -> str:
    """What a change into ``new`` says about why (for the log and the state line). Pure."""
    if isinstance(new, Recovering):
        return f"{new.failure} (attempt {new.attempt}; {new.reason})"
    if isinstance(new, WaitingForCapacity):
        return f"{new.capacity}; giving up in {new.deadline - new.since:.0f} s"
    if isinstance(new, Failed):
        return new.reason.splitlines()[0]
    return ""


def routine(old: State, new: State) -> bool:
    """A change not worth a log line: the start, and the end of a run that trained. Pure."""
    return (isinstance(old, Starting) and isinstance(new, Running)) or (isinstance(old, Running) and isinstance(new, Finished))
