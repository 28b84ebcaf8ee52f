"""The replay report: how much of the replay had room to train, and the JSON + PNG written after.

Owns: the pure arithmetic on a replay's alive curve (:func:`seconds_with_room`,
:func:`useful_fraction`) and :func:`write_report`, which writes ``replay.json`` atomically and
``replay.png`` (matplotlib, Agg backend, imported only there). Never imports Ray, never reads a
clock and never decides anything about the run: it only measures and draws what it is given.
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


def useful_fraction(training_s: float, room_s: float) -> float | None:
    """``training_s / room_s`` clamped to [0, 1]; None when there was no room (``room_s`` 0)."""
    if room_s <= 0:
        return None
    return min(1.0, max(0.0, training_s / room_s))


def write_report(
    out_dir: str | Path, report: dict[str, Any], timeline: list[tuple[float, int, int]]
) -> tuple[Path, Path]:
    """Write ``out_dir/replay.json`` and ``out_dir/replay.png``; return both paths.

    The JSON is ``report`` plus ``timeline`` as ``{"t_s", "nodes_alive", "steps_committed"}``
    objects; the PNG plots nodes alive (steps, left axis) and steps committed (right axis)
    against replay seconds, titled ``report.get("title")``. ``out_dir`` is created if missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        {"t_s": float(t), "nodes_alive": int(n), "steps_committed": int(s)}
        for t, n, s in timeline
    ]
    json_path, png_path = out / "replay.json", out / "replay.png"
    payload = json.dumps({**report, "timeline": rows}, indent=2, sort_keys=True) + "\n"
    write_atomic(json_path, "w", lambda f: f.write(payload))

    fig = Figure(figsize=(9, 4.5), layout="constrained")
    nodes_ax = fig.add_subplot()
    steps_ax = nodes_ax.twinx()
    times = [r["t_s"] for r in rows]
    nodes_ax.step(times, [r["nodes_alive"] for r in rows], where="post", color="tab:blue")
    steps_ax.plot(times, [r["steps_committed"] for r in rows], color="tab:orange")
    nodes_ax.set_xlabel("replay time (s)")
    nodes_ax.set_ylabel("nodes alive", color="tab:blue")
    steps_ax.set_ylabel("steps committed", color="tab:orange")
    nodes_ax.set_ylim(bottom=0)
    steps_ax.set_ylim(bottom=0)
    if report.get("title"):
        fig.suptitle(str(report["title"]))
    write_atomic(png_path, "wb", lambda f: fig.savefig(f, format="png", dpi=100))
    return json_path, png_path
