"""What a run's nodes cost and what it trained for the money: tokens per dollar, beside an
on-demand fleet of the run's full width over the same time.

Owns :class:`Price` (spot and on-demand dollars per node-hour of one node type, and where the
figures come from), :func:`load_prices` (the YAML price table: the one this package ships,
``elastic_llm/sim/prices.yaml``, or a user's; :class:`PriceError` names a bad entry and its
fix), :func:`price_for` (a node type's entry, or the error naming the type and the table), and
:func:`cost_fields` (a report's ``cost`` section).

A spot fleet pays for every node it holds, used or not. A simulation and a replay hold every
node the trace has alive, so the cost is the alive curve's node-hours at the spot price: the
table's, or where the trace carries a price column, the trace's from its first price on. The
on-demand fleet is the run's full width (``ceil(stages x max replicas / actors per node)``
nodes), never preempted, training at the run's own steady full-width rate for the whole time.
Pure except :func:`load_prices`, which reads the table.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from elastic_llm.replay.report import spans

PRICES = Path(__file__).resolve().parent.parent / "sim" / "prices.yaml"  # the table this package ships


class PriceError(ValueError):
    """A price table is unreadable or wrong, or lacks a node type; the message names which and the fix."""


@dataclass(frozen=True)
class Price:
    node_type: str
    spot_per_h: float  # dollars per node-hour, spot
    on_demand_per_h: float  # dollars per node-hour, on demand
    source: str = ""


def load_prices(path: str | Path | None = None) -> dict[str, Price]:
    """The price table at ``path`` (None: the shipped one): a mapping of node type to
    ``{spot_per_h, on_demand_per_h, source}``. Raises :class:`PriceError` naming the file and entry."""
    p = Path(path) if path is not None else PRICES
    if not p.is_file():
        raise PriceError(f"price table {str(p)!r} does not exist: pass a YAML file like {PRICES}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise PriceError(f"price table {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict) or not raw:
        raise PriceError(f"price table {str(p)!r} must map node types to {{spot_per_h, on_demand_per_h}}: see {PRICES}")
    table = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            raise PriceError(f"{p}: node type {name!r} must be a mapping with spot_per_h and on_demand_per_h")
        unknown = sorted(set(entry) - {"spot_per_h", "on_demand_per_h", "source"})
        if unknown:
            raise PriceError(f"{p}: node type {name!r} has unknown field(s) {unknown}: use spot_per_h, on_demand_per_h and source")
        values = []
        for field in ("spot_per_h", "on_demand_per_h"):
            v = entry.get(field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise PriceError(f"{p}: {name}.{field}={v!r} must be a number of dollars per node-hour")
            if v < 0:
                raise PriceError(f"{p}: {name}.{field}={v} is negative: a price is dollars per node-hour, >= 0")
            values.append(float(v))
        table[str(name)] = Price(str(name), values[0], values[1], str(entry.get("source", "")))
    return table


def price_for(table: dict[str, Price], node_type: str, where: str = "the price table") -> Price:
    """``node_type``'s prices; :class:`PriceError` naming it and the types the table has."""
    if node_type not in table:
        raise PriceError(f"{where} has no prices for node type {node_type!r} (it has {', '.join(sorted(table))}): add {node_type}: {{spot_per_h: ..., on_demand_per_h: ...}}")
    return table[node_type]


def node_hours(replay_alive: Sequence[tuple[float, int]], duration_s: float) -> float:
    """The alive curve's node-hours over [0, duration_s] (a step function, as the report's)."""
    return sum(seconds * alive for seconds, alive in spans(replay_alive, duration_s)) / 3600.0


def spot_dollars(price: Price, replay_alive: Sequence[tuple[float, int]], duration_s: float, spot_prices: Sequence[tuple[float, float]] = ()) -> float:
    """What the spot fleet of the alive curve paid over [0, duration_s]: its node-hours at the
    table's spot price, or at ``spot_prices`` (a trace's (second, dollars per node-hour from
    then on)) from the first of them on."""
    if not spot_prices:
        return node_hours(replay_alive, duration_s) * price.spot_per_h
    cuts = sorted({0.0, duration_s} | {t for t, _ in (*replay_alive, *spot_prices) if 0.0 < t < duration_s})
    return sum((b - a) * _at(replay_alive, a, 0) * _at(spot_prices, a, price.spot_per_h) for a, b in zip(cuts, cuts[1:])) / 3600.0


def _at(steps: Sequence[tuple[float, float]], t: float, before: float) -> float:
    """A step function's value at ``t`` (``before`` ahead of its first point)."""
    i = bisect.bisect_right([s for s, _ in steps], t)
    return steps[i - 1][1] if i else before


def cost_fields(price: Price, replay_alive: Sequence[tuple[float, int]], duration_s: float, committed_steps: int, tokens_per_step: int,
                full_width_steps_per_s: float | None, full_width_nodes: int, spot_prices: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """A report's ``cost``: the spot fleet's dollars (every node the trace held, used or not, at
    the trace's prices where it has them, :func:`spot_dollars`), the committed tokens per dollar,
    and the same for an on-demand fleet of ``full_width_nodes`` training at
    ``full_width_steps_per_s`` for ``duration_s``, with the ratio of the two. Pure."""
    hours = node_hours(replay_alive, duration_s)
    spot_usd = spot_dollars(price, replay_alive, duration_s, spot_prices)
    tokens = committed_steps * tokens_per_step
    od_usd = full_width_nodes * duration_s / 3600.0 * price.on_demand_per_h
    od_tokens = (full_width_steps_per_s or 0.0) * duration_s * tokens_per_step
    per_usd = tokens / spot_usd if spot_usd > 0 else None
    od_per_usd = od_tokens / od_usd if od_usd > 0 and od_tokens > 0 else None
    return {
        "node_type": price.node_type,
        "node_hours": round(hours, 3),
        "spot_usd": round(spot_usd, 2),
        "tokens": tokens,
        "tokens_per_usd": round(per_usd, 1) if per_usd is not None else None,
        "on_demand": {"nodes": full_width_nodes, "usd": round(od_usd, 2), "tokens": round(od_tokens), "tokens_per_usd": round(od_per_usd, 1) if od_per_usd else None},
        "vs_on_demand": round(per_usd / od_per_usd, 3) if per_usd is not None and od_per_usd else None,
        "price_source": price.source,
        "spot_price": "the trace's price column" if spot_prices else "the price table",
    }
