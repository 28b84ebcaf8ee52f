"""Synthetic spot availability traces at fleet scale, in the replay's ``time_ms,event,node`` format.

Owns: :func:`synthetic_trace`, a seeded generator of a bursty preemption trace (every few minutes
a reclaim takes a share of the fleet at once, capacity comes back in batches some minutes later;
with zones, a burst takes one zone's nodes: correlated, as real reclaims are), :func:`fleet_trace`
(the fleet benchmark's harsh setting),
shaped like the published spot traces the replay format comes from but made up, and marked so in
its header. Pure apart from :func:`write_trace`. Never used to claim a measured result: the
benchmarks say which trace each figure comes from.
"""

from __future__ import annotations

import random
from pathlib import Path

HEADER = "# SYNTHETIC spot availability trace (elastic_llm.sim.traces, seed {seed}): {nodes} nodes, {hours:g} h; made up, not measured\ntime_ms,event,node\n"


def synthetic_trace(nodes: int, hours: float, seed: int = 0, gap_s: tuple[float, float] = (300.0, 1200.0),
                    burst: tuple[float, float] = (0.02, 0.2), back_s: tuple[float, float] = (120.0, 900.0), floor: float = 0.5,
                    zones: int = 0) -> str:
    """The text of a trace: ``nodes`` at 0; every ``gap_s`` (uniform) a burst removes a share
    ``burst`` (uniform) of the nodes alive, never below ``floor`` x ``nodes``; each burst's nodes
    come back (as new nodes) after ``back_s`` (uniform), in one batch; one more node joins at the
    end, so the trace spans ``hours``. With ``zones``, every node is in one of that many zones (a
    fourth column) and a burst is correlated: its victims come from one zone (the next ones when
    it has too few), as a reclaim of one zone's capacity; the nodes coming back join that zone."""
    rng = random.Random(seed)
    alive = [f"n{i:04d}" for i in range(nodes)]
    zone = {n: (f"z{i % zones}" if zones else "") for i, n in enumerate(alive)}
    fresh = nodes
    events: list[tuple[int, str, str]] = [(0, "add", n) for n in alive]
    returns: list[tuple[float, int, str]] = []
    t, end = 0.0, hours * 3600.0

    def come_back(at: float, count: int, z: str) -> None:
        nonlocal fresh
        for _ in range(count):
            name = f"n{fresh:04d}"
            fresh += 1
            zone[name] = z
            alive.append(name)
            events.append((int(at * 1000), "add", name))

    while True:
        t += rng.uniform(*gap_s)
        if t >= end:
            break
        for at, count, z in [r for r in returns if r[0] <= t]:
            returns.remove((at, count, z))
            come_back(at, count, z)
        share = rng.uniform(*burst)
        count = min(int(len(alive) * share) + 1, max(0, len(alive) - int(floor * nodes)))
        ms = int(t * 1000)
        if zones:
            first = rng.choice(sorted({zone[n] for n in alive}))
            order = sorted({zone[n] for n in alive}, key=lambda z: (z != first, z))
            pool = [n for z in order for n in rng.sample(sorted(m for m in alive if zone[m] == z), sum(1 for m in alive if zone[m] == z))]
            victims = pool[:count]
        else:
            victims = rng.sample(sorted(alive), count)
        for name in victims:
            alive.remove(name)
            events.append((ms, "remove", name))
        if count:
            returns.append((t + rng.uniform(*back_s), count, zone[victims[0]]))
    for at, count, z in returns:  # capacity still away comes back, and the trace lasts ``hours``
        for _ in range(count):
            name = f"n{fresh:04d}"
            zone[name] = z
            events.append((int(at * 1000), "add", name))
            fresh += 1
    last = f"n{fresh:04d}"
    zone[last] = "z0" if zones else ""
    events.append((int(end * 1000), "add", last))
    events.sort(key=lambda e: (e[0], e[1] != "remove"))
    if zones:
        head = HEADER.format(seed=seed, nodes=nodes, hours=hours).replace("time_ms,event,node\n", "time_ms,event,node,zone\n")
        return head + "".join(f"{ms},{kind},{name},{zone[name]}\n" for ms, kind, name in events)
    return HEADER.format(seed=seed, nodes=nodes, hours=hours) + "".join(f"{ms},{kind},{name}\n" for ms, kind, name in events)


def fleet_trace(nodes: int, hours: float, seed: int = 0) -> str:
    """The fleet benchmark's harsh trace: bursts of 5-25% of the fleet at once, all from one of
    four zones, every 3-12 minutes, capacity back only after 15-40 minutes, so the fleet dips
    to 40%."""
    return synthetic_trace(nodes, hours, seed, gap_s=(180.0, 720.0), burst=(0.05, 0.25), back_s=(900.0, 2400.0), floor=0.4, zones=4)


def write_trace(path: str | Path, nodes: int, hours: float, seed: int = 0, harsh: bool = False) -> Path:
    """Write :func:`synthetic_trace` (``harsh``: :func:`fleet_trace`) to ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text((fleet_trace if harsh else synthetic_trace)(nodes, hours, seed))
    return out
