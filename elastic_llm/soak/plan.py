"""The fault schedule of a soak: which faults strike which trial, after which step, aimed where.

Owns: the fault kinds (:class:`FaultKind`), parsing ``--faults``, and :func:`plan_soak`, a pure
function of (kinds, trials, faults per trial, seed, stages): the same arguments give the same
schedule, and trial ``i``'s faults depend only on (seed, i), so any trial can be re-run alone.
Never touches Ray, a process or a clock: the runner carries the schedule out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

FIRST_STEP = 3  # the first fault strikes after this step: snapshots of the steps before it committed
GAP = 3  # steps from one fault to the next: the hit step, its re-run (or a drained node's removal), a clean step
TAIL = 3  # clean steps after the last fault
JITTER = 2  # a fault strikes up to this many steps later than the earliest allowed


class FaultKind(str, Enum):
    """What a fault breaks; the value is the name used by ``--faults`` and in the report."""

    STAGE = "stage"  # SIGKILL of a stage actor's process
    MANAGER = "manager"  # SIGKILL of the snapshot manager's process on a stage's node
    NODE = "node"  # removal of a stage's node (a fresh node takes its place in the cluster)
    DRAIN = "drain"  # a Ray preemption drain of a stage's node (removed once drained, then replaced)
    PAUSE = "pause"  # SIGSTOP of a stage's process, SIGCONT a few seconds later: a straggler, not a death
    CORRUPT = "corrupt"  # a flipped byte in a stage's snapshot shard, then that stage killed: the recovery must not load it


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: it strikes once step ``step`` finished (so it hits step ``step + 1``),
    aimed at stage ``stage`` (replica 0), its process, its node or its node's snapshot manager."""

    kind: FaultKind
    step: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind.value} of stage {self.stage} after step {self.step}"


@dataclass(frozen=True)
class TrialPlan:
    """The faults of one trial, in step order, and how many steps its runs train."""

    trial: int
    faults: tuple[Fault, ...]
    steps: int


def parse_kinds(text: str) -> tuple[FaultKind, ...]:
    """``stage,manager,...`` as fault kinds (order kept, repeats dropped); ValueError naming the
    unknown kind and the known ones."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    known = ", ".join(k.value for k in FaultKind)
    if not names:
        raise ValueError(f"--faults is empty: name one or more of {known}, comma-separated")
    out: list[FaultKind] = []
    for name in names:
        try:
            kind = FaultKind(name)
        except ValueError:
            raise ValueError(f"--faults: unknown fault kind {name!r}: use one or more of {known}, comma-separated") from None
        if kind not in out:
            out.append(kind)
    return tuple(out)


def plan_trial(kinds: tuple[FaultKind, ...], faults: int, seed: int, trial: int, stages: int) -> TrialPlan:
    """Trial ``trial``'s ``faults`` faults, seeded by (seed, trial): the kinds come round in a
    shuffled order (every kind once before any twice), each aimed at a random stage, each at
    least :data:`GAP` steps after the previous one. Pure."""
    if not kinds or faults < 1 or stages < 1:
        raise ValueError(f"a trial needs fault kinds, faults >= 1 and stages >= 1 (got {kinds}, {faults}, {stages})")
    rng = np.random.default_rng([seed, trial])
    order: list[FaultKind] = []
    while len(order) < faults:
        order += [kinds[i] for i in rng.permutation(len(kinds))]
    out = []
    step = FIRST_STEP - GAP
    for kind in order[:faults]:
        step += GAP + int(rng.integers(0, JITTER + 1))
        out.append(Fault(kind, step, int(rng.integers(0, stages))))
    return TrialPlan(trial, tuple(out), step + TAIL)


def plan_soak(kinds: tuple[FaultKind, ...], trials: int, faults: int, seed: int, stages: int) -> list[TrialPlan]:
    """Every trial's plan (see :func:`plan_trial`). Pure."""
    return [plan_trial(kinds, faults, seed, i, stages) for i in range(trials)]
