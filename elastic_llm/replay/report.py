"""The replay report: how much of the replay had room to train, what an oracle would have trained,
and the JSON + PNG written after.

Owns: the pure arithmetic on a replay's alive curve (:func:`seconds_with_room`,
:func:`useful_fraction`), liveput (Parcae's figure: the committed steps over what an oracle
commits; :func:`oracle_widths`, :func:`oracle_steps`, :func:`full_width_rate`, :func:`liveput`: the
oracle trains at every moment at the widest width the live nodes hold, at the run's measured
steady full-width rate scaled by width, and never loses anything) and :func:`write_report`, which
writes ``replay.json`` atomically and ``replay.png`` (matplotlib, Agg backend, imported only
there). Never imports Ray, never reads a clock and never decides anything about the run: it only
measures and draws what it is given.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_llm.files import write_atomic


def seconds_with_room(
    replay_alive: Sequence[tuple[float, int]], duration_s: float, nodes_needed: int
) -> float:
    """Replay seconds in [0, duration_s] during which at least ``nodes_needed`` nodes were alive.

    ``replay_alive`` is a step function of ``(replay second, nodes alive)`` points sorted by time
    (as :class:`~elastic_llm.replay.trace.ReplayPlan` has it); each count holds until the next
    point, the last one until ``duration_s``; before the first point nothing is alive.
    """
    total = 0.0
    for i, (t, alive) in enumerate(replay_alive):
        until = replay_alive[i + 1][0] if i + 1 < len(replay_alive) else duration_s
        start, end = max(t, 0.0), min(until, duration_s)
        if alive >= nodes_needed and end > start:
            total += end - start
    return total


def oracle_widths(replay_alive: Sequence[tuple[float, int]], slots_per_node: float, stages: int, max_width: int) -> list[tuple[float, int]]:
    """The oracle's width over time: min(max_width, floor(nodes x slots / stages)) at every
    point of the alive curve (a step function like it)."""
    return [(t, min(max_width, int(n * slots_per_node // stages))) for t, n in replay_alive]


def oracle_steps(replay_alive: Sequence[tuple[float, int]], duration_s: float, slots_per_node: float, stages: int, max_width: int,
                 full_rate: float) -> float:
    """Steps the oracle commits in [0, duration_s]: at each moment ``full_rate`` (steps per second
    at ``max_width``) x its width / ``max_width``."""
    total = 0.0
    widths = oracle_widths(replay_alive, slots_per_node, stages, max_width)
    for i, (t, w) in enumerate(widths):
        until = widths[i + 1][0] if i + 1 < len(widths) else duration_s
        start, end = max(t, 0.0), min(until, duration_s)
        if end > start:
            total += full_rate * w / max_width * (end - start)
    return total


def full_width_rate(history: Sequence[dict[str, Any]], max_width: int) -> float | None:
    """The run's steady full-width rate, steps per second: the median step time of the steps it
    took at its widest width (the first of each stretch, which follows a resize or a recovery,
    left out), scaled to ``max_width`` when it never got there. None without two such steps."""
    if not history:
        return None
    widest = max(h.get("dp", max_width) for h in history)
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(history, history[1:])
            if a.get("dp") == widest and b.get("dp") == widest and b["step"] == a["step"] + 1 and b["elapsed_s"] > a["elapsed_s"]]
    if not gaps:
        return None
    median = sorted(gaps)[len(gaps) // 2]
    return max_width / widest / median


def liveput(committed_steps: int, oracle: float) -> float | None:
    """Committed steps over the oracle's (None when the oracle had no room to train)."""
    return committed_steps / oracle if oracle > 0 else None


def useful_fraction(training_s: float, room_s: float) -> float | None:
    """``training_s / room_s`` clamped to [0, 1]; None when there was no room (``room_s`` 0)."""
    if room_s <= 0:
        return None
    return min(1.0, max(0.0, training_s / room_s))


def write_report(
    out_dir: str | Path, report: dict[str, Any], timeline: Sequence[tuple[float, ...]], oracle: Sequence[tuple[float, int]] = ()
) -> tuple[Path, Path]:
    """Write ``out_dir/replay.json`` and ``out_dir/replay.png``; return both paths.

    The JSON is ``report`` plus ``timeline`` as ``{"t_s", "nodes_alive", "steps_committed",
    "width"}`` objects and the oracle's width curve; the PNG plots nodes alive and steps
    committed against replay seconds and, below, the run's width beside the oracle's, titled
    ``report.get("title")``. ``out_dir`` is created if missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        {"t_s": float(row[0]), "nodes_alive": int(row[1]), "steps_committed": int(row[2]), **({"width": int(row[3])} if len(row) > 3 else {})}
        for row in timeline
    ]
    json_path, png_path = out / "replay.json", out / "replay.png"
    body = {**report, "timeline": rows, **({"oracle_width": [{"t_s": float(t), "width": int(w)} for t, w in oracle]} if oracle else {})}
    payload = json.dumps(body, indent=2, sort_keys=True) + "\n"
    write_atomic(json_path, "w", lambda f: f.write(payload))

    fig = Figure(figsize=(9, 6.5), layout="constrained")
    nodes_ax, width_ax = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    steps_ax = nodes_ax.twinx()
    times = [r["t_s"] for r in rows]
    nodes_ax.step(times, [r["nodes_alive"] for r in rows], where="post", color="tab:blue")
    steps_ax.plot(times, [r["steps_committed"] for r in rows], color="tab:orange")
    nodes_ax.set_ylabel("nodes alive", color="tab:blue")
    steps_ax.set_ylabel("steps committed", color="tab:orange")
    nodes_ax.set_ylim(bottom=0)
    steps_ax.set_ylim(bottom=0)
    if rows and "width" in rows[0]:
        width_ax.step(times, [r.get("width", 0) for r in rows], where="post", color="tab:green", label="the run's width")
    if oracle:
        end = times[-1] if times else 0.0
        width_ax.step([t for t, _ in oracle] + [end], [w for _, w in oracle] + [oracle[-1][1]], where="post", color="tab:gray",
                      linestyle="--", label="the oracle's width")
    width_ax.set_ylabel("replicas")
    width_ax.set_xlabel("replay time (s)")
    width_ax.set_ylim(bottom=0)
    if rows or oracle:
        width_ax.legend(loc="lower left", fontsize="small")
    if report.get("title"):
        fig.suptitle(str(report["title"]))
    write_atomic(png_path, "wb", lambda f: fig.savefig(f, format="png", dpi=100))
    return json_path, png_path
