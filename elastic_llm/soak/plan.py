"""The fault schedule of a soak: which faults strike which trial, after which step, aimed where.

Owns: the fault kinds (:class:`FaultKind`), the moments a fault is aimed at (:class:`Moment`:
between steps, during a snapshot's copy and parity exchange, during a recovery, during a durable
flush, while a drain is pending, at a stage's forward, backward or update op), parsing ``--faults``, and :func:`plan_soak`, a pure function of (kinds, trials, faults
per trial, seed, stages): the same arguments give the same schedule, and trial ``i``'s faults
depend only on (seed, i), so any trial can be re-run alone.
Never touches Ray, a process or a clock: the runner carries the schedule out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

FIRST_STEP = 3  # the first fault strikes after this step: snapshots of the steps before it committed
GAP = 3  # steps from one fault to the next: the hit step, its re-run (or a drained node's removal), a clean step
TAIL = 3  # clean steps after the last fault
SLOW_GAP = 6  # steps from a slow link to the next fault: 3 slow steps name its straggler, then the probe, a look and the move
JITTER = 2  # a fault strikes up to this many steps later than the earliest allowed


class FaultKind(str, Enum):
    """What a fault breaks; the value is the name used by ``--faults`` and in the report."""

    STAGE = "stage"  # SIGKILL of a stage actor's process
    MANAGER = "manager"  # SIGKILL of the snapshot manager's process on a stage's node
    NODE = "node"  # removal of a stage's node (a fresh node takes its place in the cluster)
    DRAIN = "drain"  # a Ray preemption drain of a stage's node (removed once drained, then replaced)
    PAUSE = "pause"  # SIGSTOP of a stage's process, SIGCONT a few seconds later: a straggler, not a death
    CORRUPT = "corrupt"  # a flipped byte in a stage's snapshot shard, then that stage killed: the recovery must not load it
    FLUSH = "flush"  # SIGKILL of a snapshot manager while it writes its part of a durable checkpoint
    DRIVER = "driver"  # SIGKILL of the driver process mid-step, then ``elastic-llm train --resume RUN_ID`` in its place
    # on the multi-host harness (elastic_llm.hosts; struck by the run's own chaos events, its driver on a host of the harness):
    PARTITION = "partition"  # the link of a stage's node cut both ways for the rest of the trial (Ray declares the node dead)
    PARTITION_HEAL = "partition-heal"  # ... healed two steps later: its processes come back as zombies, fenced
    ISOLATE_PAIR = "isolate-pair"  # the link between a stage's node and the next stage's on another node cut both ways
    SLOW_LINK = "slow-link"  # a stage's node at SLOW_MBIT Mbit/s each way for the rest of the trial: a straggler, moved off


class Moment(str, Enum):
    """When a fault strikes; the value is the name used in the report."""

    STEP = "step"  # between two steps, no snapshot in flight
    SNAPSHOT = "snapshot"  # while a snapshot version is in flight: stage copies, parity exchange, encode
    RECOVERY = "recovery"  # while the run recovers from another stage killed just before
    FLUSH = "flush"  # while a durable flush is being written
    DRAIN = "drain"  # while a drain is pending: another stage's node was drained just before, the run not yet off it
    FORWARD = "forward"  # inside a step: the run's chaos hook kills the stage as it starts its first forward op
    BACKWARD = "backward"  # ... its first backward op
    UPDATE = "update"  # ... its optimizer update
    RESIZE = "resize"  # while the run grows back: a replica was dropped just before (its node removed with no room left), a fresh node came, and the run's spare replica is starting or joining


OPS = (Moment.FORWARD, Moment.BACKWARD, Moment.UPDATE)  # moments struck through the run's chaos hook


MOMENTS: dict[FaultKind, tuple[Moment, ...]] = {  # the moments each kind is aimed at, drawn at random
    FaultKind.STAGE: (Moment.STEP, Moment.SNAPSHOT, Moment.RECOVERY, Moment.FLUSH, Moment.DRAIN, *OPS),
    FaultKind.MANAGER: (Moment.STEP, Moment.SNAPSHOT, Moment.RECOVERY, Moment.DRAIN),
    FaultKind.NODE: (Moment.STEP, Moment.SNAPSHOT, Moment.RECOVERY, Moment.FLUSH, Moment.DRAIN),
    FaultKind.DRAIN: (Moment.STEP, Moment.SNAPSHOT),
    FaultKind.PAUSE: (Moment.STEP, Moment.SNAPSHOT),
    FaultKind.CORRUPT: (Moment.STEP,),  # struck by the run's chaos hook at a step's start
    FaultKind.FLUSH: (Moment.FLUSH,),
    FaultKind.DRIVER: (Moment.STEP,),  # killed once its metrics show the step: it is then inside a later one
    FaultKind.PARTITION: (Moment.STEP,),  # the harness's kinds strike while the step after theirs runs
    FaultKind.PARTITION_HEAL: (Moment.STEP,),
    FaultKind.ISOLATE_PAIR: (Moment.STEP,),
    FaultKind.SLOW_LINK: (Moment.STEP,),
}
HARNESS = (FaultKind.PARTITION, FaultKind.PARTITION_HEAL, FaultKind.ISOLATE_PAIR, FaultKind.SLOW_LINK)  # need the multi-host harness
ON_HARNESS_TOO = (FaultKind.STAGE, FaultKind.MANAGER, FaultKind.NODE)  # run there too, struck by the run's chaos events between steps
RESIZES = (FaultKind.STAGE, FaultKind.MANAGER, FaultKind.NODE)  # also aimed at a resize when the run's width can change


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: it strikes once step ``step`` finished (so it hits step ``step + 1``),
    aimed at stage ``stage`` (replica 0), its process, its node or its node's snapshot manager,
    at ``moment`` (the runner waits up to a few steps for a snapshot or flush to be in flight)."""

    kind: FaultKind
    step: int
    stage: int
    moment: Moment = Moment.STEP

    def __str__(self) -> str:
        at = "" if self.moment is Moment.STEP else f" at its {self.moment.value} op" if self.moment in OPS else f" during a {self.moment.value}"
        return f"{self.kind.value} of stage {self.stage} after step {self.step}{at}"


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


def hooked(f: Fault) -> bool:
    """Whether ``f`` is struck by the run's own chaos hook (inside a step) rather than from outside."""
    return f.kind is FaultKind.CORRUPT or (f.kind is FaultKind.STAGE and f.moment in OPS)


def kinds_problem(kinds: tuple[FaultKind, ...]) -> str | None:
    """Why ``kinds`` cannot be soaked together, or None. Pure. Driver faults run in trials of
    their own: the run's driver is then a separate process, and the other kinds are struck
    through the driver's own view of its actors."""
    if on_harness(kinds):
        elsewhere = [k.value for k in kinds if k not in HARNESS and k not in ON_HARNESS_TOO]
        if elsewhere:
            return (f"--faults: {','.join(elsewhere)} cannot run on the multi-host harness that {','.join(k.value for k in kinds if k in HARNESS)} need: "
                    f"soak them apart, or use {','.join(k.value for k in ON_HARNESS_TOO)} with them")
    if FaultKind.DRIVER in kinds and len(kinds) > 1:
        others = ",".join(k.value for k in kinds if k is not FaultKind.DRIVER)
        return f"--faults: driver faults run in soaks of their own (the run's driver is then a separate process): run --faults driver and --faults {others} separately"
    return None


def on_harness(kinds: tuple[FaultKind, ...]) -> bool:
    """Whether a soak of ``kinds`` runs on the multi-host harness (one of them needs it). Pure."""
    return any(k in HARNESS for k in kinds)


def plan_trial(kinds: tuple[FaultKind, ...], faults: int, seed: int, trial: int, stages: int, resize: bool = False) -> TrialPlan:
    """Trial ``trial``'s ``faults`` faults, seeded by (seed, trial): the kinds come round in a
    shuffled order (every kind once before any twice), each aimed at a random stage and moment,
    each at least :data:`GAP` steps after the previous one (:data:`SLOW_GAP` after a slow link,
    so that a later fault does not take its node before it is named); with ``resize`` (a run whose
    data-parallel width can shrink and grow) the kinds of :data:`RESIZES` are aimed at a resize
    too. Pure."""
    if not kinds or faults < 1 or stages < 1:
        raise ValueError(f"a trial needs fault kinds, faults >= 1 and stages >= 1 (got {kinds}, {faults}, {stages})")
    rng = np.random.default_rng([seed, trial])
    order: list[FaultKind] = []
    while len(order) < faults:
        order += [kinds[i] for i in rng.permutation(len(kinds))]
    out: list[Fault] = []
    step = FIRST_STEP - GAP
    for kind in order[:faults]:
        step += GAP + int(rng.integers(0, JITTER + 1)) + (SLOW_GAP - GAP if out and out[-1].kind is FaultKind.SLOW_LINK else 0)
        stage = int(rng.integers(0, stages))
        moments = (Moment.STEP,) if on_harness(kinds) else MOMENTS[kind] + ((Moment.RESIZE,) if resize and kind in RESIZES else ())
        out.append(Fault(kind, step, stage, moments[int(rng.integers(0, len(moments)))]))
    return TrialPlan(trial, tuple(out), step + TAIL)


def plan_soak(kinds: tuple[FaultKind, ...], trials: int, faults: int, seed: int, stages: int, first: int = 0,
              resize: bool = False) -> list[TrialPlan]:
    """The plans of trials ``first`` .. ``first + trials - 1`` (see :func:`plan_trial`). Pure."""
    return [plan_trial(kinds, faults, seed, i, stages, resize) for i in range(first, first + trials)]
