"""How often to snapshot and how often to flush to durable storage. Pure: numbers in, numbers out.

Owns: ``snapshot.every: auto`` (:func:`snapshot_every`: the smallest interval whose measured cost
per snapshot keeps the training overhead under ``snapshot.max_overhead_pct``; :class:`SnapshotCost`:
which steps are the clean baseline and what each version cost the steps), ``durable.every:
auto`` (:func:`young_daly_s` and :func:`flush_every`: the optimal interval sqrt(2 x cost x MTBF) of
Young (1974) / Daly (2006), in committed snapshots), whose turn a committed snapshot is
(:class:`FlushTurns`, kept by the durable tier on Ray and the simulated one alike), and
:class:`Ema`, the smoothing both use.
Never measures anything itself and never talks to Ray: the coordinator and the durable tier feed
it what they measured, and say the choice and its inputs in the metrics and the progress bar.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

MAX_SNAPSHOT_EVERY = 1000


@dataclass
class Ema:
    """Exponential moving average (and moving variance); ``None`` until the first sample."""

    alpha: float = 0.2
    value: float | None = None
    samples: int = 0
    var: float = 0.0

    def add(self, x: float) -> float:
        if self.value is None:
            self.value = x
        else:
            d = x - self.value
            self.value += self.alpha * d
            self.var = (1 - self.alpha) * (self.var + self.alpha * d * d)
        self.samples += 1
        return self.value

    @property
    def high(self) -> float | None:
        """The average plus one standard deviation: a value the samples seldom exceed."""
        return None if self.value is None else self.value + math.sqrt(self.var)

    @property
    def bound(self) -> float | None:
        """The average plus its own standard error: a value the true average seldom exceeds. The
        moving average weighs about ``(2 - alpha) / alpha`` samples, so its error is the samples'
        deviation over the square root of that."""
        return None if self.value is None else self.value + math.sqrt(self.var * self.alpha / (2 - self.alpha))


@dataclass
class Median:
    """The median of the last ``window`` samples; ``None`` until the first. Where an average would
    carry one slow outlier (a cold first step, another process's burst) for many samples."""

    window: int = 9
    recent: deque[float] = field(default_factory=deque)

    def add(self, x: float) -> float:
        self.recent.append(x)
        while len(self.recent) > self.window:
            self.recent.popleft()
        return statistics.median(self.recent)

    @property
    def value(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None


def snapshot_every(cost_s: float, step_s: float, max_overhead_pct: float, cap: int = MAX_SNAPSHOT_EVERY) -> int:
    """Smallest N >= 1 with cost_s / (N x step_s) <= max_overhead_pct / 100: a snapshot every N
    steps then costs at most that share of the training time. ``cost_s``: training time one
    snapshot costs (stage copies on the step path, parity exchange and manager CPU competing for
    the cores); ``step_s``: a step's time without a snapshot (the coordinator measures both: what the
    snapshot's parts took and what the steps around it took beyond clean steps; it uses the larger)."""
    if step_s <= 0 or cost_s <= 0:
        return 1
    n = math.ceil(cost_s / (step_s * max_overhead_pct / 100.0) - 1e-9)
    return max(1, min(cap, n))


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's checkpoint interval sqrt(2 x C x MTBF), in seconds."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * max(mtbf_s, 0.0))


def flush_every(interval_s: float, snapshot_every: int, step_s: float, cap: int = 100_000) -> int:
    """The interval ``interval_s`` in committed snapshots (one every ``snapshot_every`` steps of
    ``step_s`` seconds), at least 1."""
    if step_s <= 0:
        return 1
    return max(1, min(cap, round(interval_s / (snapshot_every * step_s))))


def mtbf_s(elapsed_s: float, failures: int, prior_s: float) -> float:
    """The mean time between failures the run has seen (its prior until it has seen one)."""
    return elapsed_s / failures if failures > 0 and elapsed_s > 0 else prior_s


AUTO_START = 8  # snapshot.every: auto starts here: snapshot steps and clean steps (SETTLE after each version) both get measured
AUTO_PROBE = 16  # ... and when its interval leaves no step clean, it leaves one clean after this many steps without (a fresh baseline)
SETTLE = 2  # steps after a version ended before a step counts as clean (what it left behind lands on them)
COLD = 2  # a run's first steps (compiling, first touches of memory) are neither baseline nor cost


@dataclass
class _Open:
    """A version whose cost is still being charged."""

    felt: float = 0.0  # its steps' time beyond clean steps, so far
    measured: bool = True  # False: one of its steps came before any clean baseline
    in_flight: int = 0  # steps it was in flight
    parts_s: float | None = None  # what its parts reported, once it committed
    ended: bool = False


class SnapshotCost:
    """``snapshot.every: auto``: what snapshot versions cost the steps, measured by the steps.

    A step is *clean* when no version began in it or was in flight and at least :data:`SETTLE`
    steps passed since the last one ended: what a version leaves behind (its objects freed, the
    durable flush it started, the raylets' last moves) lands on the steps after it, and those are
    not the baseline. The median of the last clean steps is the baseline (the run's cold first
    steps are clean too, and rare at short intervals: an average kept them); every other step's time beyond it is charged
    to the versions in flight (shared), or, when none is, to the newest one begun, negative
    differences too (noise evens out over a version's steps instead of adding up). A version's
    cost is final when a newer one begins after it ended, or when a clean step ran after it;
    then the larger of it and what its parts reported (the managers' CPU time and the stages'
    copies) is a sample of the cost, and the interval is chosen again: the smallest that keeps
    the cost within ``max_overhead_pct`` of the clean steps' time (:func:`snapshot_every`), the
    cost taken as the samples' moving average plus its standard error (:attr:`Ema.bound`: the
    budget is a share of the run's time, so what must stay within it is the average cost, known
    up to that error; the average plus a whole deviation, as before, bounded every single
    interval instead and chose intervals 2-4x longer than the budget needs on a noisy 2-core
    machine, where a version's felt cost is a few steps' noise), and never shorter than :meth:`floor`, which
    leaves a clean step in every interval (the baseline stays current). The
    first version is not a sample (cold buffers), and the run's first :data:`COLD` steps count for
    nothing. Pure: the coordinator tells it what happened.
    """

    def __init__(self, max_overhead_pct: float, every: int = AUTO_START) -> None:
        self.pct = max_overhead_pct
        self.every = every
        self.why = "auto: measuring the cost"
        self.cost = Ema(alpha=0.3)  # seconds one version costs the run
        self.span = Ema(alpha=0.3)  # steps one version is in flight
        self.clean_s = Median()  # clean steps: the baseline
        self.since_clean = 0  # steps since the last clean one (auto keeps its baseline fresh: AUTO_PROBE)
        self.since_end = SETTLE  # steps since a version last ended
        self.open: dict[int, _Open] = {}
        self.newest: int | None = None
        self.finals = 0  # versions whose cost became final
        self.steps = 0
        self.changes: list[dict[str, float | int | str | None]] = []  # decisions that changed the interval

    def floor(self) -> int:
        """The shortest interval that leaves a clean step between versions: the steps a version is
        in flight (their moving average plus one deviation, rounded up), the :data:`SETTLE` steps
        after it, and one. Shorter, no step would be clean, the baseline would never move again
        (a run's slow first steps, standbys starting beside them, would stay the baseline, every
        version's felt cost would read as nothing, and the interval would shrink to its parts';
        measured: every 3 at 25% overhead on the 3-node loopback cluster, against a 2% budget)."""
        return math.ceil(self.span.high or 1) + SETTLE + 1

    def probing(self) -> bool:
        """No version should begin: too long without a clean step (its baseline would go stale)."""
        return self.since_clean >= AUTO_PROBE

    def began(self, version: int) -> None:
        for v, o in list(self.open.items()):
            if o.ended:
                self._final(v)
        self.open[version] = _Open()
        self.newest = version

    def ended(self, version: int, parts_s: float | None) -> None:
        """``version`` committed (``parts_s``: what its parts reported) or was dropped (None:
        its cost is forgotten). A version already begun after it makes its cost final at once."""
        self.since_end = 0
        o = self.open.get(version)
        if o is None:
            return
        if parts_s is None:
            del self.open[version]
            return
        o.parts_s, o.ended = parts_s, True
        if self.newest is not None and self.newest > version:
            self._final(version)

    def step(self, seconds: float, active: list[int], began: bool) -> None:
        """A training step's wall time; ``active``: the versions in flight during it; ``began``:
        it began one."""
        clean = not active and not began and self.since_end >= SETTLE
        self.since_end += 1
        self.steps += 1
        if self.steps <= COLD:
            return
        if clean:
            self.clean_s.add(seconds)
            self.since_clean = 0
            for v in list(self.open):
                self._final(v)
            return
        self.since_clean += 1
        flying = [v for v in active if v in self.open]
        for v in flying:
            self.open[v].in_flight += 1
        charged = flying or ([self.newest] if self.newest in self.open else [])
        for v in charged:
            o = self.open[v]
            if self.clean_s.value is None:
                o.measured = False
            else:
                o.felt += (seconds - self.clean_s.value) / len(charged)

    def _final(self, version: int) -> None:
        o = self.open.pop(version)
        if o.parts_s is None:  # still in flight: it stays open
            self.open[version] = o
            return
        self.finals += 1
        base = self.clean_s.value
        if self.finals <= 1 or base is None:
            return
        felt = max(0.0, o.felt) if o.measured else None
        self.cost.add(max(o.parts_s, felt or 0.0))
        self.span.add(max(1, o.in_flight))
        cost = self.cost.bound or 0.0
        budget = snapshot_every(cost, base, self.pct)
        floor = self.floor()
        every = max(budget, floor)
        felt_txt = f"{felt:.3f}" if felt is not None else "unmeasured"
        self.why = (
            f"auto: {cost:.3f} s per snapshot (average {self.cost.value:.3f} s + its standard error; this one's parts {o.parts_s:.3f} s, "
            f"felt {felt_txt} s over its steps and the {SETTLE} after it), {base:.3f} s per clean step, budget {self.pct:g}% -> every {budget}"
            + (f"; at least {floor} (a version's {floor - SETTLE - 1} step(s) in flight, the {SETTLE} after it and one clean step "
               f"to measure against) -> every {every}" if floor > budget else "")
        )
        if every != self.every:
            self.changes.append({
                "every": every, "previous": self.every, "cost_s": cost, "step_s": base, "parts_s": o.parts_s, "felt_s": felt,
                "max_overhead_pct": self.pct, "why": self.why, "version": version,
            })
            self.every = every


@dataclass
class FlushTurns:
    """Every ``every``-th committed snapshot is flushed, one flush at a time: a snapshot whose
    turn comes while a flush is still in flight is not flushed (``skipped`` counts those), and
    the count goes on until one is."""

    every: int
    since: int = 0  # committed snapshots since the last flush started
    skipped: int = 0

    def wants(self, busy: bool) -> bool:
        """A snapshot committed now: is it flushed? (``busy``: a flush is in flight)."""
        self.since += 1
        due = self.since >= self.every
        if due and busy:
            self.skipped += 1
        return due and not busy

    def started(self) -> None:
        self.since = 0
