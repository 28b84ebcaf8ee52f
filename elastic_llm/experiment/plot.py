"""The convergence experiment's figure: validation loss against wall-clock, one panel per rate.

Owns: ``loss_vs_time.png`` (matplotlib, Agg backend, imported only here): in each rate's panel
one line per strategy (the ``none`` reference, black, in every panel), a cross where a recovery happened
and the target loss as a dashed line. Never runs, measures or decides anything: it draws the
rows it is given, as :func:`~elastic_llm.experiment.convergence.panel_rows` selects them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_llm.experiment.convergence import BASELINE, STRATEGIES, Rate, panel_rows
from elastic_llm.files import write_atomic

COLORS = dict(zip(STRATEGIES, ("black", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red")))


def write_plot(path: str | Path, strategies: Sequence[str], rates: Sequence[Rate], rows: Sequence[dict[str, Any]], target: float | None) -> Path:
    """Write the figure to ``path`` (atomically) and return it; panels without rows say so."""
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from matplotlib.figure import Figure

    n = max(1, len(rates))
    fig = Figure(figsize=(5.5 * n, 4.5), layout="constrained")
    axes = fig.subplots(1, n, sharey=True, squeeze=False)[0]
    for ax, rate in zip(axes, rates):
        drawn = False
        for row in panel_rows(rows, strategies, rate):
            curve = row.get("val_curve") or []
            if not curve:
                continue
            t = [p["elapsed_s"] for p in curve]
            v = [p["val_loss"] for p in curve]
            label = row["strategy"] + (" (failed)" if row.get("failed") else "")
            color = COLORS.get(row["strategy"])
            ax.plot(t, v, color=color, marker=".", linewidth=2.0 if row["strategy"] == BASELINE else 1.3, label=label)
            drawn = True
            marks = [m for m in row.get("failure_times_s") or [] if t[0] <= m <= t[-1]]
            if marks:
                ax.plot(marks, np.interp(marks, t, v), "x", color=color, markersize=7)
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=1.2, label=f"target {target:.3f}")
            lows = [p["val_loss"] for row in panel_rows(rows, strategies, rate) for p in row.get("val_curve") or []]
            if lows:  # the first evaluations are far above the target: zoom on where strategies differ
                ax.set_ylim(min(lows) - 0.05, target + 1.0)
        ax.set_title(f"failure rate {rate.label}")
        ax.set_xlabel("wall-clock since the first step (s)")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no finished runs yet", ha="center", va="center", transform=ax.transAxes)
    axes[0].set_ylabel("validation loss")
    fig.suptitle("validation loss against wall-clock (x: a recovery)")
    out = Path(path)
    write_atomic(out, "wb", lambda f: fig.savefig(f, format="png", dpi=100))
    return out
