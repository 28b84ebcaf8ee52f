"""Spot availability traces: parse ``time_ms,add|remove,node[,zone][,price]`` CSV and plan a replay of it.

A ``price`` column (named by the header line, which it needs) is the spot price in dollars per
node-hour from that event's time on, for every node the trace holds; an empty cell keeps the
price as it was. Before a trace's first price, the price table's applies.

Owns: the trace format and its validation (:class:`TraceError` names the file, the line, the bad
value and the fix), and :func:`plan_replay`, which turns trace events into timed replay actions on
replay nodes ``r0, r1, ...`` (windowed, time- and node-scaled, seeded victims, optional drain
notice; a trace's zones carried to the replay nodes, a burst's victims drawn from its zones).
Pure: never imports Ray, never reads a clock, never does I/O except :func:`load_trace`.
"""

from __future__ import annotations

import csv
import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

KINDS = ("add", "remove")
ACTION_ORDER = ("drain", "remove", "add")  # the order of actions at equal times
HEADER = ("time_ms", "event", "node")
HEADER_ZONE = (*HEADER, "zone")
HEADERS = (HEADER, HEADER_ZONE, (*HEADER, "price"), (*HEADER_ZONE, "price"))
Steps = tuple[tuple[float, int], ...]
Prices = tuple[tuple[float, float], ...]  # (replay second, spot dollars per node-hour from then on)


class TraceError(ValueError):
    """A trace is invalid; the message names the file, the line, the bad value and the fix."""


@dataclass(frozen=True)
class TraceEvent:
    """One trace line: at ``time_ms`` trace node ``node`` was added or removed (``kind``), in
    availability zone ``zone`` when the trace has a zone column; ``price``: the spot price
    from then on, when the trace has a price column and the line one."""

    time_ms: int
    kind: str
    node: str
    zone: str | None = None
    price: float | None = None


@dataclass(frozen=True)
class ReplayAction:
    """At replay second ``at_s``: "add", "drain" or "remove" replay node ``node`` ("r0", ...).

    For "drain", ``deadline_s`` is the seconds from ``at_s`` until the node's removal; else None.
    """

    at_s: float
    kind: str
    node: str
    deadline_s: float | None = None


@dataclass(frozen=True)
class ReplayPlan:
    """The fleet at replay second 0, the timed actions after it and both alive curves.

    ``trace_alive`` / ``replay_alive`` are step functions ``(replay second, nodes alive)``: a point
    at 0, one at every change and a closing point at ``duration_s``.
    """

    initial_nodes: tuple[str, ...]
    actions: tuple[ReplayAction, ...]
    duration_s: float
    trace_alive: Steps
    replay_alive: Steps
    zones: tuple[tuple[str, str], ...] = ()  # (replay node, its zone) when the trace has zones
    spot_prices: Prices = ()  # the trace's prices in the window (a point at 0 when one was set before it); none without a price column


def _apply(alive: set[str], event: TraceEvent) -> str | None:
    """Apply one event to ``alive``, or return what is wrong with it (``alive`` unchanged)."""
    if event.kind == "add" and event.node in alive:
        return f"node {event.node!r} is added but already alive: remove it first or rename it"
    if event.kind == "remove" and event.node not in alive:
        return f"node {event.node!r} is removed but not alive: add it earlier or fix the name"
    (alive.add if event.kind == "add" else alive.remove)(event.node)
    return None


def _parse_line(fields: list[str], where: str, columns: tuple[str, ...] = HEADER_ZONE) -> TraceEvent:
    """One line, its columns named by the trace's header (without one: time_ms,event,node[,zone])."""
    priced = columns[-1] == "price"
    allowed = (len(columns),) if priced else (3, 4)
    if len(fields) not in allowed:
        shape = ",".join(columns)
        raise TraceError(
            f"{where}: {','.join(fields)!r} has {len(fields)} fields, not {' or '.join(map(str, allowed))}: "
            + (f"write {shape} (an empty price keeps the last one)" if priced else "write time_ms,add|remove,node_name[,zone]")
        )
    time_text, kind, node, *rest = (f.strip() for f in fields)
    price_text = rest.pop() if priced else ""
    zone = rest[0] if rest else None
    try:
        time_ms = int(time_text)
    except ValueError:
        raise TraceError(
            f"{where}: time {time_text!r} is not an integer: write whole milliseconds"
        ) from None
    if time_ms < 0:
        raise TraceError(f"{where}: time {time_ms} is negative: write a time_ms >= 0")
    if kind not in KINDS:
        raise TraceError(f"{where}: {kind!r} is not add or remove: write add or remove")
    if not node:
        raise TraceError(f"{where}: the node name is empty: write a node name after the event")
    if rest and not zone:
        raise TraceError(f"{where}: the zone is empty: write a zone name or leave the fourth column out")
    return TraceEvent(time_ms, kind, node, zone, _price(price_text, where) if price_text else None)


def _price(text: str, where: str) -> float:
    try:
        price = float(text)
    except ValueError:
        price = math.nan
    if not math.isfinite(price) or price < 0:
        raise TraceError(f"{where}: price {text!r} is not a number of dollars per node-hour >= 0: write one, or leave the cell empty to keep the last price")
    return price


def parse_trace(text: str, name: str = "trace") -> tuple[TraceEvent, ...]:
    """Parse and validate trace CSV ``text``; ``name`` (e.g. the file name) heads every error.

    Blank lines, ``#`` comments and a first header line (``time_ms,event,node[,zone][,price]``;
    a price column needs it) are skipped. Times
    are whole milliseconds >= 0, never going backwards; a node is added only when not alive and
    removed only when alive; at least one event is required.
    """
    events: list[TraceEvent] = []
    alive: set[str] = set()
    columns: tuple[str, ...] = HEADER_ZONE
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = next(csv.reader([line]))
        if not events and (header := tuple(f.strip().lower() for f in fields)) in HEADERS:
            columns = header
            continue
        where = f"{name} line {lineno}"
        event = _parse_line(fields, where, columns)
        if events and event.time_ms < events[-1].time_ms:
            raise TraceError(
                f"{where}: time {event.time_ms} is before the previous event's "
                f"{events[-1].time_ms}: sort the trace by time_ms"
            )
        problem = _apply(alive, event)
        if problem:
            raise TraceError(f"{where}: {problem}")
        events.append(event)
    if not events:
        raise TraceError(f"{name}: the trace has no events: add lines time_ms,add|remove,node_name")
    return tuple(events)


def load_trace(path: str | Path) -> tuple[TraceEvent, ...]:
    """Read and parse the trace file at ``path`` (every error names the path)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise TraceError(
            f"{path}: cannot read the trace ({reason}): pass the path of a readable UTF-8 CSV file"
        ) from exc
    return parse_trace(text, name=str(path))


def parse_window(text: str) -> tuple[float, float]:
    """Parse the CLI form ``START_S:END_S`` (trace seconds, e.g. ``600:4200``)."""
    try:
        start_text, end_text = text.split(":")
        start, end = float(start_text), float(end_text)
    except ValueError:
        raise ValueError(
            f"--window {text!r} is not START_S:END_S: write two numbers of trace seconds, "
            "e.g. --window 600:4200"
        ) from None
    if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
        raise ValueError(f"--window {text!r}: need 0 <= START_S < END_S: e.g. --window 600:4200")
    return start, end


def _number(value: object, option: str, fix: str, *, zero_ok: bool = False) -> float:
    """``value`` as a float, or ValueError naming ``option`` and ``fix`` (must be > 0 or >= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{option}={value!r} is not a finite number: {fix}")
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{option}={value!r} must be {'>=' if zero_ok else '>'} 0: {fix}")
    return float(value)


def _check_window(window: object, trace_end_s: float) -> tuple[float, float]:
    if window is None:
        if trace_end_s <= 0:
            raise ValueError("window: every trace event is at time 0: add later events")
        return 0.0, trace_end_s
    fix = "pass window=(start_s, end_s) in trace seconds, e.g. (600.0, 4200.0) (--window 600:4200)"
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window={window!r} is not a (start_s, end_s) pair: {fix}")
    start = _number(window[0], "window start", fix, zero_ok=True)
    end = _number(window[1], "window end", fix)
    if not start < end <= trace_end_s:
        raise ValueError(
            f"window=({start}, {end}) needs start < end within the trace (0 to {trace_end_s} s): "
            f"{fix}"
        )
    return start, end


def _target(alive: int, node_scale: float) -> int:
    """Replay nodes for ``alive`` trace nodes: round(alive * node_scale), at least 1 if alive."""
    return max(round(alive * node_scale), 1 if alive else 0)


def _steps(start: int, changes: Iterable[tuple[float, int]], end_s: float) -> Steps:
    """A step function from (0, start) through ``changes`` (kept where the count changes)."""
    points = [(0.0, start)]
    for t, n in changes:
        if n != points[-1][1]:
            points.append((t, n))
    points.append((end_s, points[-1][1]))
    return tuple(points)


def plan_replay(
    events: Iterable[TraceEvent],
    *,
    window: tuple[float, float] | None = None,
    time_scale: float = 1.0,
    node_scale: float = 1.0,
    notice_s: float = 0.0,
    seed: int = 0,
) -> ReplayPlan:
    """Plan the replay of ``events`` (as :func:`parse_trace` returns them).

    ``window`` = (start_s, end_s) in trace seconds (None: 0 to the last event). The trace nodes
    alive at start_s — after every event at or before start_s, as an action at replay second 0 is
    the initial fleet — form the initial fleet; events after start_s and before end_s are
    replayed at replay second (trace_s - start_s) / time_scale.

    ``node_scale``: while the trace has N nodes alive the replay has round(N * node_scale) nodes
    (Python's round: halves go to even), but at least 1 whenever N >= 1. Events at the same
    time_ms are one burst: the difference of the replay target before and after the whole burst
    is added or removed at that moment. Removal victims are drawn with ``random.Random(seed)``
    from the replay nodes alive; added nodes get fresh labels ``r<k>``, never reused.

    ``notice_s`` (replay seconds; 0 = no notice and no drains): each removal at t is preceded by
    a drain of the same node at max(0, t - notice_s), deadline_s = t - drain time. Victims are
    drawn first from nodes alive at the drain time; a victim added after it (only when too few
    were) is drained at t with deadline 0. Actions are sorted by at_s; at equal times drains come
    first, then removes, then adds.
    """
    events = tuple(events)
    if not events:
        raise ValueError("events: the trace has no events: pass the events of a non-empty trace")
    if any(a.time_ms > b.time_ms for a, b in zip(events, events[1:])):
        raise ValueError("events: times go backwards: pass events sorted by time_ms")
    time_scale = _number(time_scale, "time_scale", "pass a speed-up factor > 0, e.g. 60")
    node_scale = _number(node_scale, "node_scale", "pass a factor > 0, e.g. 0.25")
    notice_s = _number(notice_s, "notice_s", "pass 0 (no notice) or seconds, e.g. 10", zero_ok=True)
    start_s, end_s = _check_window(window, events[-1].time_ms / 1000)

    trace: set[str] = set()
    zone_of: dict[str, str | None] = {}  # trace node -> its zone (None: the trace has none)
    replayed: list[TraceEvent] = []
    prices: list[tuple[float, float]] = []  # (replay second, spot price from then on)
    for event in events:
        if event.time_ms / 1000 >= end_s:
            break
        if event.time_ms / 1000 > start_s:
            replayed.append(event)
        elif problem := _apply(trace, event):
            raise ValueError(f"events: {problem}")
        else:
            zone_of.setdefault(event.node, event.zone)
            if event.price is not None:  # the price set last before the window holds at its start
                prices = [(0.0, event.price)]
    start_trace = len(trace)
    born: dict[str, float] = {}  # replay node alive -> replay time added
    rzone: dict[str, str | None] = {}  # every replay node (alive: those in ``born``) -> its zone
    next_label, rng = 0, random.Random(seed)
    for z, count in sorted(Counter(zone_of[n] for n in trace).items(), key=lambda kv: _zone_key(kv[0])):
        for _ in range(_target(count, node_scale)):
            born[f"r{next_label}"] = -1.0
            rzone[f"r{next_label}"] = z
            next_label += 1
    initial = tuple(born)
    actions: list[ReplayAction] = []
    trace_changes: list[tuple[float, int]] = []
    for time_ms, burst in groupby(replayed, key=lambda e: e.time_ms):
        burst_events = list(burst)
        for event in burst_events:
            if problem := _apply(trace, event):
                raise ValueError(f"events at time_ms {time_ms}: {problem}")
            zone_of.setdefault(event.node, event.zone)
        t = (time_ms / 1000 - start_s) / time_scale
        priced = [event.price for event in burst_events if event.price is not None]
        if priced:
            prices.append((t, priced[-1]))
        trace_changes.append((t, len(trace)))
        in_trace = Counter(zone_of[n] for n in trace)
        in_replay = Counter(rzone[n] for n in born)
        for z in sorted(set(in_trace) | set(in_replay), key=_zone_key):  # one zone (None) when the trace has none
            diff = _target(in_trace[z], node_scale) - in_replay[z]
            for _ in range(max(diff, 0)):
                label = f"r{next_label}"
                next_label += 1
                born[label] = t
                rzone[label] = z
                actions.append(ReplayAction(t, "add", label))
            if diff >= 0:
                continue
            drain_at = max(0.0, t - notice_s)
            mine = [n for n in born if rzone[n] == z]  # dict order: by label, reproducible
            ready = [n for n in mine if born[n] < drain_at]
            victims = rng.sample(ready, min(-diff, len(ready)))
            victims += rng.sample([n for n in mine if born[n] >= drain_at], -diff - len(victims))
            for node in victims:
                if notice_s > 0:
                    at = drain_at if born[node] < drain_at else t
                    actions.append(ReplayAction(at, "drain", node, deadline_s=t - at))
                actions.append(ReplayAction(t, "remove", node))
                del born[node]

    actions.sort(key=lambda a: (a.at_s, ACTION_ORDER.index(a.kind)))
    duration_s = (end_s - start_s) / time_scale
    alive, replay_changes = len(initial), []
    for at_s, group in groupby(actions, key=lambda a: a.at_s):
        alive += sum({"add": 1, "remove": -1}.get(a.kind, 0) for a in group)
        replay_changes.append((at_s, alive))
    labelled = {n: z for n, z in rzone.items() if z is not None}
    return ReplayPlan(
        initial_nodes=initial,
        actions=tuple(actions),
        duration_s=duration_s,
        trace_alive=_steps(start_trace, trace_changes, duration_s),
        replay_alive=_steps(len(initial), replay_changes, duration_s),
        zones=tuple(sorted(labelled.items())),
        spot_prices=tuple(prices),
    )


def _zone_key(zone: str | None) -> tuple[bool, str]:
    return zone is not None, zone or ""
