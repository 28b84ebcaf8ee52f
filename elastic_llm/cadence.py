"""How often to snapshot and how often to flush to durable storage. Pure: numbers in, numbers out.

Owns: ``snapshot.every: auto`` (:func:`snapshot_every`: the smallest interval whose measured cost
per snapshot keeps the training overhead under ``snapshot.max_overhead_pct``), ``durable.every:
auto`` (:func:`young_daly_s` and :func:`flush_every`: the optimal interval sqrt(2 x cost x MTBF) of
Young (1974) / Daly (2006), in committed snapshots), and :class:`Ema`, the smoothing both use.
Never measures anything itself and never talks to Ray: the coordinator and the durable tier feed
it what they measured, and say the choice and its inputs in the metrics and the progress bar.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SNAPSHOT_EVERY = 1000


@dataclass
class Ema:
    """Exponential moving average; ``None`` until the first sample."""

    alpha: float = 0.2
    value: float | None = None
    samples: int = 0

    def add(self, x: float) -> float:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        self.samples += 1
        return self.value


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
