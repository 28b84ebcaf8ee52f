"""The failure-rate convergence experiment, planned: strategies, rates, cells, target, rows, report.

Owns: what each strategy is (:data:`STRATEGY_OVERRIDES`: config overrides only, the training
loop is the product's), the mapping of the paper's failure rates to per-step probabilities
(:data:`PAPER_RATES`), checking the command's values (:class:`ExperimentError` names the option
and the fix), the grid of cells (the ``none`` baseline once, rate-independent), the target loss,
the numbers of a row and the Markdown of ``results.md``.
Pure: never imports Ray or matplotlib, never reads a clock and never does I/O.

Why ~500 lines: it is the whole experiment except running cells and drawing: parsing and
checking every option, the grid, target and rows, where each cell's time went, and the report;
kept together so that everything a results file says is computed in one pure, tested place.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from elastic_llm import events

BASELINE = "none"
STRATEGIES = ("none", "checkpoint", "redundant", "checkfree", "checkfree_plus", "snapshot")
# strategy -> the config overrides that make it (besides the failure schedule and run length)
STRATEGY_OVERRIDES: dict[str, tuple[str, ...]] = {
    "none": ("recovery.mode=checkfree",),  # plain training: no snapshots, no checkpoints, no copies
    "checkpoint": ("recovery.mode=checkpoint",),  # + recovery.checkpoint_every / checkpoint_dir
    "redundant": ("recovery.mode=redundant",),
    "checkfree": ("recovery.mode=checkfree",),
    "checkfree_plus": ("recovery.mode=checkfree_plus",),
    "snapshot": ("recovery.mode=lossless", "snapshot.enabled=true"),
}
# the paper's failure rates (% per stage per hour) -> the per-step probabilities its runs used
PAPER_RATES: dict[int, float] = {5: 0.0009, 10: 0.002, 16: 0.004}
TARGET_FRACTION = 0.8  # default target: the baseline's validation loss near this fraction of N
# keys a cell sets itself -> the option to use instead of --set
CONTROLLED_KEYS: dict[str, str] = {
    "train.max_steps": "--steps",
    "train.eval_every": "--eval-every",
    "recovery.mode": "--strategies",
    "snapshot.enabled": "--strategies",
    "recovery.checkpoint_every": "--checkpoint-every",
    "recovery.checkpoint_dir": "--out (each cell checkpoints under DIR/cells/<cell>/ckpt)",
    "chaos.failure_prob_per_step": "--failure-rates or --failure-probs",
    "chaos.failure_rate_per_hour": "--failure-rates or --failure-probs",
    "chaos.failure_seed": "--seed",
}
COLUMNS = (
    "strategy", "failure_prob", "wall_s", "steps_to_target", "wall_to_target_s", "final_val_loss",
    "failures", "recoveries", "recovery_s", "tokens_per_s", "vs none",
)


class ExperimentError(ValueError):
    """A value of the experiment is invalid; the message names the option and the fix."""


class ExperimentMismatch(ExperimentError):
    """The output directory holds results of an experiment with other parameters."""


@dataclass(frozen=True)
class Rate:
    """One failure rate of the grid: each stage fails in a step with probability ``prob``;
    ``percent`` is the paper's rate it stands for (None: given directly with --failure-probs)."""

    prob: float
    percent: int | None = None

    @property
    def label(self) -> str:
        return f"{self.percent}% (p={self.prob:g})" if self.percent is not None else f"p={self.prob:g}"


NO_FAILURES = Rate(0.0)


@dataclass(frozen=True)
class Cell:
    """One run of the grid: ``strategy`` under failure ``rate``."""

    strategy: str
    rate: Rate

    @property
    def label(self) -> str:
        return "no failures" if self.strategy == BASELINE else self.rate.label

    @property
    def key(self) -> str:
        """The cell's name in ``results.json`` and its directory ``DIR/cells/<key>``."""
        return self.strategy if self.strategy == BASELINE else f"{self.strategy}-p{self.rate.prob!r}"


@dataclass(frozen=True)
class Settings:
    """What makes two runs of the experiment comparable. Results are only resumed under equal
    :data:`IDENTITY` fields; ``config`` and ``overrides`` are kept for the report."""

    config: str
    config_sha: str  # of the loaded config with the --set overrides
    overrides: tuple[str, ...]
    steps: int
    eval_every: int
    checkpoint_every: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["overrides"] = list(self.overrides)
        return d


IDENTITY = ("config_sha", "steps", "eval_every", "checkpoint_every", "seed")


@dataclass(frozen=True)
class Target:
    """The validation loss the strategies race to (None: no target) and how it was chosen."""

    loss: float | None
    how: str


@dataclass(frozen=True)
class ReportContext:
    """What the header of ``results.md`` says besides the rows."""

    settings: Settings
    strategies: tuple[str, ...]
    rates: tuple[Rate, ...]
    target: Target
    machine: str
    date: str
    command: str


# --------------------------------------------------------------------------- the command's values


def _items(text: str, option: str, example: str) -> list[str]:
    items = [x.strip() for x in str(text).split(",")]
    if not any(items):
        raise ExperimentError(f"{option} is empty: give a comma-separated list, e.g. {option} {example}")
    if not all(items):
        raise ExperimentError(f"{option} {text!r} has an empty item: write e.g. {option} {example}")
    return items


def _once(values: Sequence[Any], option: str) -> None:
    for i, v in enumerate(values):
        if v in values[:i]:
            raise ExperimentError(f"{option} lists {v} twice: list each once")


def _numbers(text: str, option: str, example: str) -> list[float]:
    out = []
    for item in _items(text, option, example):
        try:
            v = float(item)
        except ValueError:
            raise ExperimentError(f"{option}: {item!r} is not a number: write e.g. {option} {example}") from None
        if not math.isfinite(v):
            raise ExperimentError(f"{option}: {item!r} is not a finite number: write e.g. {option} {example}")
        out.append(v)
    return out


def parse_strategies(text: str) -> tuple[str, ...]:
    """``none,snapshot`` -> ("none", "snapshot"); unknown or repeated names are refused."""
    names = _items(text, "--strategies", "none,checkfree,snapshot")
    for n in names:
        if n not in STRATEGIES:
            raise ExperimentError(f"--strategies: unknown strategy {n!r}: use a comma-separated list of {', '.join(STRATEGIES)}")
    _once(names, "--strategies")
    return tuple(names)


def parse_failure_rates(text: str) -> tuple[Rate, ...]:
    """``5,10,16`` (the paper's rates in % per hour) -> their per-step probabilities."""
    known = ",".join(str(k) for k in PAPER_RATES)
    rates = []
    for v in _numbers(text, "--failure-rates", known):
        if v not in PAPER_RATES:
            raise ExperimentError(
                f"--failure-rates: {v:g} is not in the paper's table ({', '.join(str(k) for k in PAPER_RATES)}): "
                "use those, or give per-step probabilities directly with --failure-probs, e.g. --failure-probs 0.002,0.02"
            )
        rates.append(Rate(PAPER_RATES[int(v)], int(v)))
    _once([r.percent for r in rates], "--failure-rates")
    return tuple(rates)


def parse_failure_probs(text: str) -> tuple[Rate, ...]:
    """``0.002,0.02`` -> per-step failure probabilities of each stage, each in [0, 1)."""
    probs = _numbers(text, "--failure-probs", "0.002,0.02")
    for p in probs:
        if not 0 <= p < 1:
            raise ExperimentError(f"--failure-probs: {p:g} is not a probability in [0, 1): write e.g. --failure-probs 0.002,0.02")
    _once(probs, "--failure-probs")
    return tuple(Rate(p) for p in probs)


def check_overrides(overrides: Iterable[str]) -> tuple[str, ...]:
    """The user's ``--set`` overrides, refused when they set what a cell sets itself."""
    out = tuple(overrides)
    for o in out:
        key = o.split("=", 1)[0].strip()
        if key in CONTROLLED_KEYS:
            raise ExperimentError(f"--set {key} is set by the experiment for every cell: use {CONTROLLED_KEYS[key]} instead")
    return out


def default_eval_every(steps: int) -> int:
    return max(1, steps // 25)


# --------------------------------------------------------------------------- the grid


def strategy_overrides(strategy: str, prob: float, *, checkpoint_every: int = 100, checkpoint_dir: str | None = None, seed: int = 0) -> tuple[str, ...]:
    """The config overrides that make ``strategy`` under per-step failure probability ``prob``.
    Every strategy but ``none`` gets the same seeded failure schedule; ``none`` never fails."""
    if strategy not in STRATEGY_OVERRIDES:
        raise ExperimentError(f"strategy {strategy!r} is unknown: use one of {', '.join(STRATEGIES)}")
    out = list(STRATEGY_OVERRIDES[strategy])
    if strategy == "checkpoint":
        out.append(f"recovery.checkpoint_every={checkpoint_every}")
        if checkpoint_dir is not None:
            out.append(f"recovery.checkpoint_dir={json.dumps(str(checkpoint_dir))}")  # a YAML string, whatever the path
    if strategy == BASELINE:
        out.append("chaos.failure_prob_per_step=0")
    else:
        out += [f"chaos.failure_prob_per_step={prob!r}", f"chaos.failure_seed={seed}"]
    return tuple(out)


def cell_overrides(cell: Cell, settings: Settings, checkpoint_dir: str | None = None) -> tuple[str, ...]:
    """All overrides of one cell, applied to the config: the user's, then the cell's."""
    own = strategy_overrides(
        cell.strategy, cell.rate.prob, checkpoint_every=settings.checkpoint_every, checkpoint_dir=checkpoint_dir, seed=settings.seed
    )
    return settings.overrides + own + (f"train.max_steps={settings.steps}", f"train.eval_every={settings.eval_every}")


def grid(strategies: Sequence[str], rates: Sequence[Rate]) -> tuple[Cell, ...]:
    """The cells to run: the ``none`` baseline once (it never fails, whatever the rate), then
    every other strategy at every rate, rate by rate."""
    cells = [Cell(BASELINE, NO_FAILURES)] if BASELINE in strategies else []
    cells += [Cell(s, r) for r in rates for s in strategies if s != BASELINE]
    return tuple(cells)


def check_settings(stored: dict[str, Any], settings: Settings, where: str) -> None:
    """Refuse to add cells to results of an experiment with other parameters."""
    now = settings.to_dict()
    diffs = [f"{k}: {stored.get(k)!r} there, {now[k]!r} now" for k in IDENTITY if stored.get(k) != now[k]]
    if diffs:
        if "config_sha" in diffs[0]:
            diffs[0] = "the config (YAML file with the --set overrides) differs"
        raise ExperimentMismatch(
            f"--out {where} holds results of an experiment with other parameters ({'; '.join(diffs)}): "
            "rerun with the same parameters to resume it, or choose another --out"
        )


# --------------------------------------------------------------------------- rows and the target


def val_curve(history: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The validation points of a run in time order (replayed steps after a rollback included)."""
    return [{"step": h["step"], "val_loss": h["val_loss"], "elapsed_s": h["elapsed_s"]} for h in history if "val_loss" in h]


def recovery_events(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One ``{"step", "seconds"}`` per recovery: the trainer writes one record per restored
    actor, all of a recovery sharing its step and seconds."""
    seen: list[tuple[Any, Any]] = []
    for r in records:
        key = (r.get("step"), r.get("seconds"))
        if key not in seen:
            seen.append(key)
    return [{"step": s, "seconds": sec} for s, sec in seen]


def cell_row(
    cell: Cell,
    history: Sequence[dict[str, Any]],
    recoveries: Sequence[Mapping[str, Any]],
    failures: int,
    *,
    total_s: float,
    finished_at: str,
    failure_times_s: Sequence[float] = (),
    error: str | None = None,
    exit_code: int = 0,
) -> dict[str, Any]:
    """The ``results.json`` row of a finished (or failed) cell. ``wall_s`` is training time
    (from the first step, start-up excluded; ``total_s`` includes it); ``tokens_per_s`` the
    median per-step throughput; the target columns are filled in by :func:`with_target`."""
    events = recovery_events(recoveries)
    curve = val_curve(history)
    last = history[-1] if history else {}
    wall = last.get("elapsed_s")
    rates = [h["tokens_per_s"] for h in history if "tokens_per_s" in h]
    return {
        "cell": cell.key,
        "strategy": cell.strategy,
        "failure_prob": cell.rate.prob,
        "failure_rate_pct": cell.rate.percent,
        "wall_s": wall,
        "total_s": total_s,
        "steps": last.get("step", 0),
        "steps_to_target": None,
        "wall_to_target_s": None,
        "final_val_loss": curve[-1]["val_loss"] if curve else None,
        "failures": int(failures),
        "recoveries": len(events),
        "recovery_s": sum((float(e["seconds"] or 0.0) for e in events), 0.0),
        "tokens_per_s": statistics.median(rates) if rates else None,
        "effective_tokens_per_s": last["tokens"] / wall if wall and "tokens" in last else None,
        "val_curve": curve,
        "failure_steps": [e["step"] for e in events],
        "failure_times_s": list(failure_times_s),
        "failed": error is not None,
        "error": error,
        "exit_code": exit_code,
        "finished_at": finished_at,
    }


def choose_target(given: float | None, baseline: dict[str, Any] | None, steps: int) -> Target:
    """``given`` (--target-loss), else the baseline's validation loss at its eval step nearest
    80% of ``steps`` (so runs slowed by failures have room to reach it)."""
    if given is not None:
        return Target(float(given), "given with --target-loss")
    if baseline is None:
        return Target(None, "no target: no `none` run to take it from; pass --target-loss or add none to --strategies")
    curve = baseline.get("val_curve") or []
    if not curve:
        return Target(None, "no target: the `none` run has no validation loss; pass --target-loss")
    at = TARGET_FRACTION * steps
    point = min(curve, key=lambda p: (abs(p["step"] - at), p["step"]))
    return Target(float(point["val_loss"]), f"the `none` run's validation loss at step {point['step']}, its eval step nearest 80% of N ({at:g})")


def reach(curve: Sequence[dict[str, Any]], target: float | None) -> tuple[int | None, float | None]:
    """(step, elapsed seconds) of the first validation point, in time order, at or below ``target``."""
    if target is not None:
        for p in curve:
            if p["val_loss"] <= target:
                return p["step"], p["elapsed_s"]
    return None, None


def with_target(rows: Iterable[dict[str, Any]], target: Target) -> list[dict[str, Any]]:
    """The rows with ``steps_to_target`` / ``wall_to_target_s`` computed against ``target``."""
    out = []
    for r in rows:
        step, wall = reach(r.get("val_curve") or [], target.loss)
        out.append({**r, "steps_to_target": step, "wall_to_target_s": wall})
    return out


def baseline_row(rows: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in rows if r["strategy"] == BASELINE), None)


def panel_rows(rows: Sequence[dict[str, Any]], strategies: Sequence[str], rate: Rate) -> list[dict[str, Any]]:
    """The rows of one rate's table or plot panel: the ``none`` reference (when there is one),
    then the requested strategies at that rate, in the requested order."""
    by_cell = {r["cell"]: r for r in rows}
    base = baseline_row(rows)
    out = [base] if base is not None else []
    out += [by_cell[Cell(s, rate).key] for s in strategies if s != BASELINE and Cell(s, rate).key in by_cell]
    return out


# --------------------------------------------------------------------------- the report


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _ratio(row: dict[str, Any], base: dict[str, Any] | None) -> str:
    if base is None or not row.get("wall_to_target_s") or not base.get("wall_to_target_s"):
        return "—"
    return f"{row['wall_to_target_s'] / base['wall_to_target_s']:.2f}x"


def _table_line(row: dict[str, Any], base: dict[str, Any] | None) -> str:
    name = row["strategy"] + (f" (failed, exit {row.get('exit_code')})" if row.get("failed") else "")
    if row["strategy"] == BASELINE:
        name += " (reference)"
    cells = [
        name, f"{row['failure_prob']:g}", _fmt(row["wall_s"], 1), _fmt(row["steps_to_target"]), _fmt(row["wall_to_target_s"], 1),
        _fmt(row["final_val_loss"], 4), _fmt(row["failures"]), _fmt(row["recoveries"]), _fmt(row["recovery_s"], 1),
        _fmt(row["tokens_per_s"], 0), _ratio(row, base),
    ]
    return "| " + " | ".join(cells) + " |"


def rate_mapping(rates: Sequence[Rate]) -> str:
    if rates and all(r.percent is not None for r in rates):
        table = ", ".join(f"{r.percent}% -> {r.prob:g}" for r in rates)
        return f"the paper's failure rates (% per stage per hour) as the per-step probabilities its runs used: {table}"
    return "per-step failure probabilities of each stage, given directly with --failure-probs"


def time_breakdown(lines: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Where a cell's training time went, from its metrics lines: ``steps_s`` (steps that
    counted), ``replayed_s`` (steps a rollback undid), ``recovery_s`` (the recovering state),
    ``checkpoint_s`` (checkpoint writes), ``other_s`` (validation, failed step attempts, the
    driver) and ``total_s`` (seconds from the first step to the end). None without an end line."""
    typed = [events.parse(x) for x in lines]
    end = next((ev for ev in typed if isinstance(ev, events.End)), None)
    if end is None:
        return None
    steps = [x for x in lines if "event" not in x and "tokens_per_s" in x]
    durations = [x["tokens"] / x["step"] / x["tokens_per_s"] if x["step"] else 0.0 for x in steps]
    undone = [any(later["step"] <= x["step"] for later in steps[i + 1 :]) for i, x in enumerate(steps)]
    by_state = end.seconds_by_state or {}
    checkpoint_s = sum(float(ev.seconds or 0.0) for ev in typed if isinstance(ev, events.Checkpoint) and ev.step)
    steps_s = sum(d for d, u in zip(durations, undone) if not u)
    replayed_s = sum(d for d, u in zip(durations, undone) if u)
    recovery_s = float(by_state.get("recovering", 0.0))
    total = float(end.elapsed_s or 0.0)
    return {
        "total_s": total, "steps_s": steps_s, "replayed_s": replayed_s, "recovery_s": recovery_s, "checkpoint_s": checkpoint_s,
        "other_s": max(0.0, total - steps_s - replayed_s - recovery_s - checkpoint_s),
    }


TIME_COLUMNS = ("total_s", "steps_s", "replayed_s", "recovery_s", "checkpoint_s", "other_s")


def render_markdown(ctx: ReportContext, rows: Sequence[dict[str, Any]], times: dict[str, dict[str, float]] | None = None) -> str:
    """``results.md``: the header (config, N, target and how it was chosen, rate mapping,
    machine, date, command), then one table per rate with the ``none`` reference on top, then
    where each cell's time went (``times``: cell -> :func:`time_breakdown`)."""
    s = ctx.settings
    overrides = ", ".join(f"`{o}`" for o in s.overrides) or "none"
    target = _fmt(ctx.target.loss, 4)
    lines = [
        "# Failure-rate convergence",
        "",
        f"- config: `{s.config}` (sha `{s.config_sha}`), --set overrides: {overrides}",
        f"- N = {s.steps} steps, validation every {s.eval_every} steps, failure seed {s.seed}, checkpoint every {s.checkpoint_every} steps",
        f"- target validation loss: {target} ({ctx.target.how})",
        f"- failure rates: {rate_mapping(ctx.rates)}",
        f"- machine: {ctx.machine}",
        f"- date: {ctx.date}",
        f"- command: `{ctx.command}`",
        (
            "- wall_s and wall_to_target_s count from the run's first step (actor start-up excluded); "
            "tokens_per_s is the median per-step throughput; vs none: wall_to_target_s / none's"
        ),
    ]
    base = baseline_row(rows)
    for rate in ctx.rates:
        lines += ["", f"## failure rate {rate.label}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += [_table_line(r, base) for r in panel_rows(rows, ctx.strategies, rate)]
    if times:
        lines += [
            "", "## where the time went (seconds from the first step)", "",
            "steps: steps that counted; replayed: steps a rollback undid; recovery: the recovering state "
            "(new actor processes, state restore); checkpoint: checkpoint writes; other: validation, failed "
            "step attempts, the driver.", "",
            "| cell | " + " | ".join(c.removesuffix("_s") for c in TIME_COLUMNS) + " |", "|" + "---|" * (len(TIME_COLUMNS) + 1),
        ]
        wanted = {r["cell"] for rate in ctx.rates for r in panel_rows(rows, ctx.strategies, rate)}
        for r in rows:
            t = times.get(r["cell"])
            if t is not None and r["cell"] in wanted:
                lines.append(f"| {r['cell']} | " + " | ".join(f"{t[c]:.1f}" for c in TIME_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def command_line(settings: Settings, strategies: Sequence[str], rates: Sequence[Rate], out: str, target_loss: float | None = None) -> str:
    """The command that reproduces (and resumes) this experiment, every option spelled out."""
    if rates and all(r.percent is not None for r in rates):
        rate_opt = ["--failure-rates", ",".join(str(r.percent) for r in rates)]
    else:
        rate_opt = ["--failure-probs", ",".join(repr(r.prob) for r in rates)]
    parts = [
        "elastic-llm", "experiment", "convergence", "--config", settings.config, *rate_opt,
        "--strategies", ",".join(strategies), "--steps", str(settings.steps), "--eval-every", str(settings.eval_every),
        "--checkpoint-every", str(settings.checkpoint_every), "--seed", str(settings.seed), "--out", out,
    ]
    if target_loss is not None:
        parts += ["--target-loss", repr(target_loss)]
    for o in settings.overrides:
        parts += ["--set", o]
    return shlex.join(parts)
