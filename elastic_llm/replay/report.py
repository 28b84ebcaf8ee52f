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
    return sum(seconds for seconds, alive in spans(replay_alive, duration_s) if alive >= nodes_needed)


def spans(replay_alive: Sequence[tuple[float, int]], duration_s: float) -> list[tuple[float, int]]:
    """(seconds, nodes alive) of each stretch of the step function ``replay_alive`` within
    [0, duration_s] (empty stretches left out). Pure."""
    out = []
    for i, (t, alive) in enumerate(replay_alive):
        until = replay_alive[i + 1][0] if i + 1 < len(replay_alive) else duration_s
        start, end = max(t, 0.0), min(until, duration_s)
        if end > start:
            out.append((end - start, alive))
    return out


def oracle_widths(replay_alive: Sequence[tuple[float, int]], slots_per_node: float, stages: int, max_width: int) -> list[tuple[float, int]]:
    """The oracle's width over time: min(max_width, floor(nodes x slots / stages)) at every
    point of the alive curve (a step function like it)."""
    return [(t, min(max_width, int(n * slots_per_node // stages))) for t, n in replay_alive]


def width_rates(history: Sequence[dict[str, Any]]) -> dict[int, float]:
    """The run's steady rate at each width it trained at, steps per second: the median time
    between consecutive steps at that width (the first after a resize or a recovery is not one:
    its gap holds the pause). Widths with fewer than two such gaps are left out. Pure."""
    gaps: dict[int, list[float]] = {}
    for a, b in zip(history, history[1:]):
        w = b.get("dp")
        if w is not None and a.get("dp") == w and b["step"] == a["step"] + 1 and b["elapsed_s"] > a["elapsed_s"]:
            gaps.setdefault(int(w), []).append(b["elapsed_s"] - a["elapsed_s"])
    return {w: 1.0 / sorted(g)[len(g) // 2] for w, g in sorted(gaps.items()) if len(g) >= 2}


def rate_at(rates: dict[int, float], width: int) -> float:
    """The oracle's rate at ``width``: the run's own steady rate there when it measured one, else
    the rate of the widest width it measured scaled by width (throughput grows with replicas when
    each has devices of its own; on shared cores a measured width says otherwise). Pure."""
    if width <= 0 or not rates:
        return 0.0
    if width in rates:
        return rates[width]
    top = max(rates)
    return rates[top] * width / top


def oracle_steps(replay_alive: Sequence[tuple[float, int]], duration_s: float, slots_per_node: float, stages: int, max_width: int,
                 rates: dict[int, float]) -> float:
    """Steps the oracle commits in [0, duration_s]: at each moment its width's rate
    (:func:`rate_at` of the run's measured ``rates``), never losing anything."""
    total = 0.0
    widths = oracle_widths(replay_alive, slots_per_node, stages, max_width)
    for i, (t, w) in enumerate(widths):
        until = widths[i + 1][0] if i + 1 < len(widths) else duration_s
        start, end = max(t, 0.0), min(until, duration_s)
        if end > start:
            total += rate_at(rates, w) * (end - start)
    return total


def full_width_rate(history: Sequence[dict[str, Any]], max_width: int) -> float | None:
    """The run's steady rate at ``max_width`` (:func:`rate_at`), steps per second; None without
    two consecutive steps at any one width."""
    rates = width_rates(history)
    return rate_at(rates, max_width) if rates else None


def liveput(committed_steps: int, oracle: float) -> float | None:
    """Committed steps over the oracle's (None when the oracle had no room to train)."""
    return committed_steps / oracle if oracle > 0 else None


def liveput_fields(history: Sequence[dict[str, Any]], replay_alive: Sequence[tuple[float, int]], duration_s: float, slots_per_node: float,
                   stages: int, max_width: int, committed_steps: int) -> dict[str, Any]:
    """A report's ``liveput``, ``oracle_steps`` and ``full_width_steps_per_s`` for a run that
    committed ``committed_steps`` with these per-step records (``history``). Pure."""
    oracle = oracle_steps(replay_alive, duration_s, slots_per_node, stages, max_width, width_rates(history))
    rate = full_width_rate(history, max_width)
    return {"liveput": liveput(committed_steps, oracle), "oracle_steps": round(oracle, 1), "full_width_steps_per_s": round(rate, 4) if rate else None}


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
