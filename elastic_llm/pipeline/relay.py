"""A replica's stage 0 relays the step to its replica's stages, so the driver makes one call per replica.

Owns: :class:`Relay` (the head's side: the handles of its replica's stages for one link
generation, one ``run_step`` call to each per step, their reports gathered and answered in one
value; the answer comes early, with the stages still running named, as soon as one of them
failed or died, so the driver aborts the rest of the step at once, and a second call collects
the rest) and :class:`ReplicaReports` (that answer). Why: an actor call costs the driver ~250 us
of CPU (``bench transport``), so a 64 x 16 step sent actor by actor costs it ~250 ms; sent replica
by replica, 16 calls, and the reports come back 64 to a value (``bench transport``'s
``relay_calls``: the driver's CPU per relayed report).

Never decides anything about a failure: it reports what each stage answered, or the error its
call raised (the actor died), and leaves the root cause to the driver
(:class:`~elastic_llm.pipeline.executor.RayStepExecutor`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from elastic_llm.pipeline.plan import STEP_DEADLINE_S, StepPlan, StepReport


def any_failed(reports: Mapping[Any, StepReport], lost: Mapping[Any, BaseException]) -> bool:
    """Whether a step's answers so far say it failed: an actor died, or one reported a failure."""
    return bool(lost) or any(not rep.ok for rep in reports.values())


@dataclass
class ReplicaReports:
    """What a replica's stages answered, by stage: a report, or the error their call raised (the
    actor died); ``running``: the stages that had not answered yet (the answer came early because
    another failed, or the wait ran out)."""

    reports: dict[int, StepReport] = field(default_factory=dict)
    lost: dict[int, BaseException] = field(default_factory=dict)
    running: tuple[int, ...] = ()

    @property
    def failed(self) -> bool:
        return any_failed(self.reports, self.lost)

    def __reduce__(self) -> tuple[Any, ...]:
        # every report's op timings cross as one array: Ray sends each array as a buffer of its
        # own, ~60 us of the driver's CPU per report instead of a few (bench transport)
        stages = tuple(self.reports)
        reps = [self.reports[s] for s in stages]
        ops = np.concatenate([r.op_seconds for r in reps]) if reps else np.zeros(0)
        bare = tuple(replace(r, op_seconds=_NO_OPS) for r in reps)  # one shared empty array: pickled once
        return (_rebuilt, (stages, bare, ops, tuple(len(r.op_seconds) for r in reps), self.lost, self.running))


_NO_OPS = np.zeros(0)


def _rebuilt(stages: tuple[int, ...], bare: tuple[StepReport, ...], ops: np.ndarray, lengths: tuple[int, ...],
             lost: dict[int, BaseException], running: tuple[int, ...]) -> ReplicaReports:
    parts = np.split(ops, np.cumsum(lengths)[:-1]) if lengths else []
    return ReplicaReports({s: replace(r, op_seconds=o) for s, r, o in zip(stages, bare, parts)}, lost, running)


class Relay:
    """The head's relay for link generation ``generation``: ``members[s]`` is the handle of its
    replica's stage ``s`` (itself included)."""

    def __init__(self, generation: int, members: Sequence[Any]) -> None:
        self.generation = generation
        self.members = list(members)
        self.calls: dict[Any, int] = {}  # the step's calls not answered yet: ref -> stage
        self.dropped: list[Any] = []  # calls the driver said to skip (their node died), read once they end

    def step(self, generation: int, plans: Sequence[StepPlan], timeout: float = STEP_DEADLINE_S) -> ReplicaReports:
        """Send each stage its plan (``plans[s]``) and answer when every stage has, or as soon as
        one failed."""
        if generation != self.generation:
            raise RuntimeError(f"a step of link generation {generation} reached a relay of generation {self.generation}: links not set up")
        if len(plans) != len(self.members):
            raise ValueError(f"{len(plans)} plans for a replica of {len(self.members)} stages")
        self._forget_dropped()
        self.calls = {m.run_step.remote(plan): s for s, (m, plan) in enumerate(zip(self.members, plans))}
        return self._gather(timeout, stop_at_failure=True)

    def rest(self, generation: int, timeout: float, skip: Sequence[int] = ()) -> ReplicaReports:
        """The answers of the last step's stages still running (all of them, however they end,
        waiting at most ``timeout`` seconds), but for those in ``skip`` (the driver knows them
        lost: their node died; their calls end once Ray's view follows, unread)."""
        if generation != self.generation:
            return ReplicaReports()
        for ref in [ref for ref, s in self.calls.items() if s in skip]:
            del self.calls[ref]
            self.dropped.append(ref)
        return self._gather(timeout, stop_at_failure=False)

    def _forget_dropped(self) -> None:
        """Read the skipped calls that have ended (their errors would be reported as unhandled)."""
        import ray

        done, self.dropped = ray.wait(self.dropped, num_returns=len(self.dropped), timeout=0) if self.dropped else ([], [])
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError:  # the skipped stage's death, as expected
                continue

    def _gather(self, timeout: float, stop_at_failure: bool) -> ReplicaReports:
        import ray

        out = ReplicaReports()
        deadline = time.monotonic() + timeout
        while self.calls:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=left)
            for ref in ready:
                stage = self.calls.pop(ref)
                try:
                    out.reports[stage] = ray.get(ref, timeout=0)
                except ray.exceptions.RayError as err:  # the stage's actor died: its error is the answer
                    out.lost[stage] = err
            if stop_at_failure and out.failed:
                break
        out.running = tuple(sorted(self.calls.values()))
        return out
