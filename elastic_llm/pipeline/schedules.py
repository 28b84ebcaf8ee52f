"""Pipeline schedules as pure functions.

Owns: the route of each microbatch through the stages (straight, or CheckFree+'s swapped order),
which forward/backward operation each stage runs, in which order, for one optimizer step; and a
valid global submission order for them. Never touches Ray or torch: the runner turns these lists
into actor calls, and the tests check them without either.

A route is a list of hops; a hop is one visit of a stage, running some of its parts (embedding,
transformer layers, final norm + LM head). The straight route visits every stage once. CheckFree+
runs every odd microbatch through the first two and the last two stages' layers in swapped order,
``embed@0, layers@1, layers@0, layers@2 .. layers@n-3, layers@n-1, layers@n-2, head@n-1``, so
stage 1 learns to stand in for stage 0 and stage n-2 for stage n-1; the gradients of both orders
accumulate in the same step. An op names (kind, microbatch, visit): the visit counts the earlier
hops of the same microbatch at the same stage (0, or 1 for the second visit of a swapped route).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal


@dataclass(frozen=True)
class Op:
    kind: Literal["F", "B"]
    mb: int
    visit: int = 0  # 0: the microbatch's first visit of this stage, 1: its second (swapped route)

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.visit}" if self.visit else "")


@dataclass(frozen=True)
class Hop:
    """One visit of a stage: which of its parts run."""

    stage: int
    embed: bool
    layers: bool
    head: bool


Route = tuple[Hop, ...]
Schedule = list[list[Op]]  # one ordered op list per stage


def straight_route(n_stages: int) -> Route:
    """Every stage once, in order: stage 0 embeds, the last one applies the head."""
    return tuple(Hop(s, s == 0, True, s == n_stages - 1) for s in range(n_stages))


def swapped_route(n_stages: int) -> Route:
    """CheckFree+'s odd-microbatch route: layers of stages 0/1 and of n-2/n-1 in swapped order,
    the embedding still first and the head still last (needs at least 4 stages)."""
    if n_stages < 4:
        raise ValueError(f"the swapped (CheckFree+) order needs at least 4 stages, got {n_stages}")
    n = n_stages
    middle = tuple(Hop(s, False, True, False) for s in range(2, n - 2))
    return (
        (Hop(0, True, False, False), Hop(1, False, True, False), Hop(0, False, True, False))
        + middle
        + (Hop(n - 1, False, True, False), Hop(n - 2, False, True, False), Hop(n - 1, False, False, True))
    )


def routes(n_stages: int, n_micro: int, swapped: bool = False) -> list[Route]:
    """The route of every microbatch of a step: with ``swapped``, odd microbatches take
    :func:`swapped_route`, even ones the straight route."""
    straight = straight_route(n_stages)
    if not swapped:
        return [straight] * n_micro
    odd = swapped_route(n_stages)
    return [odd if mb % 2 else straight for mb in range(n_micro)]


def hops_of(route: Route, stage: int) -> list[int]:
    """Indices of the hops of ``route`` that visit ``stage``, in route order."""
    return [h for h, hop in enumerate(route) if hop.stage == stage]


def hop_index(route: Route, stage: int, visit: int) -> int:
    """Index in ``route`` of the ``visit``-th hop that visits ``stage``."""
    return hops_of(route, stage)[visit]


def visit_of(route: Route, h: int) -> tuple[int, int]:
    """(stage, visit) of hop ``h`` of ``route``."""
    stage = route[h].stage
    return stage, sum(1 for hop in route[:h] if hop.stage == stage)


def _forwards(rts: list[Route], stage: int, mb: int) -> list[Op]:
    return [Op("F", mb, v) for v in range(len(hops_of(rts[mb], stage)))]


def _backwards(rts: list[Route], stage: int, mb: int) -> list[Op]:
    return [Op("B", mb, v) for v in reversed(range(len(hops_of(rts[mb], stage))))]


def gpipe(n_stages: int, n_micro: int, swapped: bool = False) -> Schedule:
    """All forwards, then all backwards, on every stage."""
    _check(n_stages, n_micro)
    rts = routes(n_stages, n_micro, swapped)
    schedule: Schedule = []
    for s in range(n_stages):
        ops = [op for i in range(n_micro) for op in _forwards(rts, s, i)]
        schedule.append(ops + [op for i in range(n_micro) for op in _backwards(rts, s, i)])
    return schedule


def one_f_one_b(n_stages: int, n_micro: int, swapped: bool = False) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, then alternate, then drain the backwards.

    Stage s keeps at most ``n_stages - s`` microbatches' activations alive, against ``n_micro``
    for GPipe. With ``swapped`` the stages that are visited twice by odd microbatches cannot keep
    the closed form (its fixed order deadlocks), so the same rule is played out tick by tick
    (:func:`_one_f_one_b_played`).
    """
    _check(n_stages, n_micro)
    if swapped:
        return _one_f_one_b_played(routes(n_stages, n_micro, True), n_stages)
    schedule: Schedule = []
    for s in range(n_stages):
        warmup = min(n_stages - s - 1, n_micro)
        ops = [Op("F", i) for i in range(warmup)]
        for i in range(n_micro - warmup):
            ops += [Op("F", warmup + i), Op("B", i)]
        ops += [Op("B", i) for i in range(n_micro - warmup, n_micro)]
        schedule.append(ops)
    return schedule


def _one_f_one_b_played(rts: list[Route], n_stages: int) -> Schedule:
    """1F1B's rule on arbitrary routes, simulated in ticks: each tick every stage runs one op
    whose inputs were produced in an earlier tick, a ready backward first once the stage holds
    ``n_stages - s`` microbatches, else the next forward (lowest microbatch); if no stage can
    move under that limit, a ready forward runs anyway (so the play always finishes)."""
    n_micro = len(rts)
    todo = {s: [op for mb in range(n_micro) for op in _forwards(rts, s, mb) + _backwards(rts, s, mb)] for s in range(n_stages)}
    done: set[tuple[int, Op]] = set()
    schedule: Schedule = [[] for _ in range(n_stages)]
    held: list[set[int]] = [set() for _ in range(n_stages)]  # microbatches with activations alive on each stage

    def ready(s: int, kind: str) -> list[Op]:
        ops = [op for op in todo[s] if op.kind == kind and _ready(s, op, done, rts[op.mb])]
        return sorted(ops, key=lambda o: (o.mb, -o.visit if kind == "B" else o.visit))

    while any(todo.values()):
        picks: dict[int, Op] = {}
        for s in range(n_stages):
            fwd, bwd = ready(s, "F"), ready(s, "B")
            full = len(held[s]) >= n_stages - s
            if bwd and (full or not fwd):
                picks[s] = bwd[0]
            elif fwd and (not full or fwd[0].mb in held[s]):
                picks[s] = fwd[0]
        if not picks:  # only forwards over the limit can move: let the lowest stage with one run
            s, op = next((s, ready(s, "F")[0]) for s in range(n_stages) if ready(s, "F"))
            picks[s] = op
        for s, op in picks.items():
            todo[s].remove(op)
            schedule[s].append(op)
            done.add((s, op))
            if op.kind == "F":
                held[s].add(op.mb)
            elif not any(o.mb == op.mb for o in todo[s]):
                held[s].discard(op.mb)
    return schedule


SCHEDULES: dict[str, Callable[..., Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name: str, n_stages: int, n_micro: int, swapped: bool = False) -> Schedule:
    try:
        make = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}") from None
    return make(n_stages, n_micro, swapped)


def _check(n_stages: int, n_micro: int) -> None:
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need at least one stage and one microbatch, got {n_stages} stages, {n_micro} microbatches")


def _ready(stage: int, op: Op, done: set[tuple[int, Op]], route: Route) -> bool:
    h = hop_index(route, stage, op.visit)
    if op.kind == "F":
        if h == 0:
            return True
        prev_stage, prev_visit = visit_of(route, h - 1)
        return (prev_stage, Op("F", op.mb, prev_visit)) in done
    if (stage, Op("F", op.mb, op.visit)) not in done:
        return False
    if h == len(route) - 1:
        return True
    next_stage, next_visit = visit_of(route, h + 1)
    return (next_stage, Op("B", op.mb, next_visit)) in done


def submission_order(schedule: Schedule, rts: list[Route] | None = None) -> list[tuple[int, Op]]:
    """A global order of (stage, op) in which every op comes after the ops it consumes.

    Each stage's ops keep their schedule order, and an op is emitted only once its inputs
    (the previous hop's forward, the next hop's backward, its own forward) have been emitted:
    this is exactly a simulation of running every stage sequentially, so it also proves the
    schedule cannot deadlock. ``rts``: the microbatches' routes (default straight). Raises
    ValueError for a schedule that would deadlock.
    """
    n_stages = len(schedule)
    n_micro = 1 + max((op.mb for ops in schedule for op in ops), default=0)
    rts = rts if rts is not None else routes(n_stages, n_micro)
    cursor = [0] * n_stages
    done: set[tuple[int, Op]] = set()
    order: list[tuple[int, Op]] = []
    total = sum(len(ops) for ops in schedule)
    while len(order) < total:
        progressed = False
        for s in range(n_stages):
            while cursor[s] < len(schedule[s]) and _ready(s, schedule[s][cursor[s]], done, rts[schedule[s][cursor[s]].mb]):
                op = schedule[s][cursor[s]]
                done.add((s, op))
                order.append((s, op))
                cursor[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedule[s][cursor[s]] for s in range(n_stages) if cursor[s] < len(schedule[s])}
            raise ValueError(f"schedule deadlocks: stages wait on {stuck}")
    return order
