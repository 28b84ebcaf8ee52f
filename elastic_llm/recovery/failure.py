"""FailurePolicy: may the run recover from one more failure? Pure: no Ray, no clock, no I/O.

Owns: what a failure is as the controller sees it (:class:`StepFailure`: the step, the stage that
failed first, the error and the first lines of its traceback), the failure budget
(:class:`FailureBudget`, an immutable count of failures in total and per step), and the decision
(:class:`FailureDecision`) from ``recovery.max_failures`` and ``recovery.max_retries_per_step``.

Never decides *how* to recover (that is :class:`~elastic_llm.recovery.policy.RecoveryPolicy`)
and never touches an actor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from elastic_llm.snapshot.records import ShardKey
from elastic_llm.sources import StrEnum

TRACE_LINES = 8
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class During(StrEnum):
    """What the run was doing when the failure struck."""

    STEP = "step"
    RECOVERY = "recovery"  # recovering from an earlier failure
    RESIZE = "resize"  # growing into new room
    DRAIN = "drain"  # moving stages off a draining node


@dataclass(frozen=True)
class StepFailure:
    """A failed step (or a failed recovery of it): where, what, and the traceback's first lines."""

    step: int
    stage: int | None  # the stage whose call failed first (None: not known, e.g. a timeout)
    replica: int | None
    error: str  # exception type and its first line
    trace: str = ""  # the first lines of the (remote) traceback
    during: During = During.STEP
    op: str = ""  # the op the failing actor was running ("F3", "B0.1", "allreduce", "update"), when known

    @staticmethod
    def from_exception(step: int, err: BaseException, stage: int | None = None, replica: int | None = None, during: During = During.STEP, op: str = "") -> "StepFailure":
        cause = getattr(err, "cause", None)  # a RayTaskError wraps the exception the actor raised
        what = cause if isinstance(cause, BaseException) else err
        first = next((ln.strip() for ln in _ANSI.sub("", str(what)).splitlines() if ln.strip()), "")
        lines = [ln.rstrip() for ln in _ANSI.sub("", str(err)).splitlines() if ln.strip()]
        name = getattr(what, "type_name", None) or type(what).__name__  # a stage's error carries its own type's name
        return StepFailure(step, stage, replica, f"{name}: {first}".rstrip(": "), "\n".join(lines[:TRACE_LINES]), during, op)

    @property
    def where(self) -> str:
        if self.stage is None:
            return f"step {self.step}"
        return f"step {self.step}, stage {self.stage} replica {self.replica}"

    def __str__(self) -> str:
        what = "recovery of " if self.during == During.RECOVERY else ""  # == : a plain "recovery" too
        return f"{what}{self.where} failed: {self.error}" + (f" (in {self.op})" if self.op else "")


@dataclass(frozen=True)
class FailureBudget:
    """Failures seen so far: in total and per step (a replayed step counts under its number)."""

    total: int = 0
    per_step: tuple[tuple[int, int], ...] = field(default=())  # (step, failures), sorted by step

    def record(self, step: int) -> "FailureBudget":
        counts = dict(self.per_step)
        counts[step] = counts.get(step, 0) + 1
        return FailureBudget(self.total + 1, tuple(sorted(counts.items())))

    def of_step(self, step: int) -> int:
        return dict(self.per_step).get(step, 0)


@dataclass(frozen=True)
class FailureDecision:
    recover: bool
    reason: str


@dataclass(frozen=True)
class FailurePolicy:
    """``max_failures``: failures the run recovers from in total; ``max_retries_per_step``: times
    one step is tried again after failing. The failure past either limit stops the run."""

    max_failures: int
    max_retries_per_step: int

    def decide(self, failure: StepFailure, budget: FailureBudget) -> FailureDecision:
        """``budget`` already counts ``failure``."""
        same = budget.of_step(failure.step)
        if same > self.max_retries_per_step:
            return FailureDecision(
                False,
                f"step {failure.step} failed {same} times and recovery.max_retries_per_step={self.max_retries_per_step}: "
                "the same failure keeps coming back, so retrying again would loop; fix its cause (last error below)",
            )
        if budget.total > self.max_failures:
            return FailureDecision(
                False,
                f"{budget.total} failures in this run and recovery.max_failures={self.max_failures}: "
                "raise it if this fleet fails this often",
            )
        retries_left = self.max_retries_per_step - same + 1
        return FailureDecision(
            True,
            f"failure {budget.total} of at most {self.max_failures}; step {failure.step} may be tried {retries_left} more time(s)",
        )


def reclaims_behind(failure: StepFailure, nodes: dict[ShardKey, str], reclaimed: set[str], alive: Callable[[], set[str]],
                    spares: set[str] | frozenset[str] = frozenset()) -> set[str]:
    """The reclaimed nodes that could explain ``failure``: the failing actor's node (any of the
    run's ``nodes`` and its ``spares``' nodes, when the failure names no actor: a resize or a
    move that failed) when it is gone and was ``reclaimed`` (it announced its end, or the runtime
    knows it as a reclaim). The caller lets each node explain one failure only (a failure that
    keeps coming back with no new reclaim behind it is a loop, charged as any). ``alive`` is
    asked only when it matters. Pure but for ``alive``."""
    if not reclaimed:
        return set()
    if failure.stage is not None and failure.replica is not None:
        node = nodes.get(ShardKey(failure.stage, failure.replica))
        mine = {node} if node is not None else set()
    else:
        mine = set(nodes.values()) | set(spares)
    gone = mine & reclaimed
    return gone - alive() if gone else set()
