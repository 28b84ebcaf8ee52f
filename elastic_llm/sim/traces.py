"""Synthetic spot availability traces at fleet scale, in the replay's ``time_ms,event,node`` format.

Owns: :func:`synthetic_trace`, a seeded generator of a bursty preemption trace (every few minutes
a reclaim takes a share of the fleet at once, capacity comes back in batches some minutes later),
shaped like the published spot traces the replay format comes from but made up, and marked so in
its header. Pure apart from :func:`write_trace`. Never used to claim a measured result: the
benchmarks say which trace each figure comes from.
"""

from __future__ import annotations

import random
from pathlib import Path

HEADER = "# SYNTHETIC spot availability trace (elastic_llm.sim.traces, seed {seed}): {nodes} nodes, {hours:g} h; made up, not measured\ntime_ms,event,node\n"


def synthetic_trace(nodes: int, hours: float, seed: int = 0, gap_s: tuple[float, float] = (300.0, 1200.0),
                    burst: tuple[float, float] = (0.02, 0.2), back_s: tuple[float, float] = (120.0, 900.0), floor: float = 0.5) -> str:
    """The text of a trace: ``nodes`` at 0; every ``gap_s`` (uniform) a burst removes a share
    ``burst`` (uniform) of the nodes alive, never below ``floor`` x ``nodes``; each burst's nodes
    come back (as new nodes) after ``back_s`` (uniform), in one batch; one more node joins at the
    end, so the trace spans ``hours``."""
    rng = random.Random(seed)
    alive = [f"n{i:04d}" for i in range(nodes)]
    fresh = nodes
    events: list[tuple[int, str, str]] = [(0, "add", n) for n in alive]
    returns: list[tuple[float, int]] = []
    t, end = 0.0, hours * 3600.0
    while True:
        t += rng.uniform(*gap_s)
        if t >= end:
            break
        for at, count in [r for r in returns if r[0] <= t]:
            returns.remove((at, count))
            for _ in range(count):
                name = f"n{fresh:04d}"
                fresh += 1
                alive.append(name)
                events.append((int(at * 1000), "add", name))
        share = rng.uniform(*burst)
        count = min(int(len(alive) * share) + 1, max(0, len(alive) - int(floor * nodes)))
        ms = int(t * 1000)
        for name in rng.sample(sorted(alive), count):
            alive.remove(name)
            events.append((ms, "remove", name))
        if count:
            returns.append((t + rng.uniform(*back_s), count))
    for at, count in returns:  # capacity still away comes back, and the trace lasts ``hours``
        for _ in range(count):
            events.append((int(at * 1000), "add", f"n{fresh:04d}"))
            fresh += 1
    events.append((int(end * 1000), "add", f"n{fresh:04d}"))
    events.sort(key=lambda e: (e[0], e[1] != "remove"))
    return HEADER.format(seed=seed, nodes=nodes, hours=hours) + "".join(f"{ms},{kind},{name}\n" for ms, kind, name in events)


def write_trace(path: str | Path, nodes: int, hours: float, seed: int = 0) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(synthetic_trace(nodes, hours, seed))
    return out
