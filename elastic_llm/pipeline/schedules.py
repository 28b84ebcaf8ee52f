"""Pipeline schedules as pure functions.

Owns: which forward/backward operation each stage runs, in which order, for one optimizer step;
and a valid global submission order for them. Never touches Ray or torch: the runner turns these
lists into actor calls, and the tests check them without either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal


@dataclass(frozen=True)
class Op:
    kind: Literal["F", "B"]
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}"


Schedule = list[list[Op]]  # one ordered op list per stage


def gpipe(n_stages: int, n_micro: int) -> Schedule:
    """All forwards, then all backwards, on every stage."""
    _check(n_stages, n_micro)
    ops = [Op("F", i) for i in range(n_micro)] + [Op("B", i) for i in range(n_micro)]
    return [list(ops) for _ in range(n_stages)]


def one_f_one_b(n_stages: int, n_micro: int) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, then alternate, then drain the backwards.

    Stage s keeps at most ``n_stages - s`` microbatches' activations alive, against ``n_micro``
    for GPipe.
    """
    _check(n_stages, n_micro)
    schedule: Schedule = []
    for s in range(n_stages):
        warmup = min(n_stages - s - 1, n_micro)
        ops = [Op("F", i) for i in range(warmup)]
        for i in range(n_micro - warmup):
            ops += [Op("F", warmup + i), Op("B", i)]
        ops += [Op("B", i) for i in range(n_micro - warmup, n_micro)]
        schedule.append(ops)
    return schedule


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name: str, n_stages: int, n_micro: int) -> Schedule:
    try:
        return SCHEDULES[name](n_stages, n_micro)
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}") from None


def _check(n_stages: int, n_micro: int) -> None:
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need at least one stage and one microbatch, got {n_stages} stages, {n_micro} microbatches")


def _ready(stage: int, op: Op, done: set[tuple[int, Op]], n_stages: int) -> bool:
    if op.kind == "F":
        return stage == 0 or (stage - 1, op) in done
    own_forward = (stage, Op("F", op.mb)) in done
    return own_forward and (stage == n_stages - 1 or (stage + 1, op) in done)


def submission_order(schedule: Schedule) -> list[tuple[int, Op]]:
    """A global order of (stage, op) in which every op comes after the ops it consumes.

    Each stage's ops keep their schedule order, and an op is emitted only once its inputs
    (previous stage's forward, next stage's backward, own forward) have been emitted: this is
    exactly a simulation of running every stage sequentially, so it also proves the schedule
    cannot deadlock. Raises ValueError for a schedule that would.
    """
    n_stages = len(schedule)
    cursor = [0] * n_stages
    done: set[tuple[int, Op]] = set()
    order: list[tuple[int, Op]] = []
    total = sum(len(ops) for ops in schedule)
    while len(order) < total:
        progressed = False
        for s in range(n_stages):
            while cursor[s] < len(schedule[s]) and _ready(s, schedule[s][cursor[s]], done, n_stages):
                op = schedule[s][cursor[s]]
                done.add((s, op))
                order.append((s, op))
                cursor[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedule[s][cursor[s]] for s in range(n_stages) if cursor[s] < len(schedule[s])}
            raise ValueError(f"schedule deadlocks: stages wait on {stuck}")
    return order
