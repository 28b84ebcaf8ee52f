"""Run the convergence experiment's grid of cells and write its files.

Owns: the output directory of an experiment — ``results.json`` (the experiment's parameters, the
target and one row per cell, rewritten atomically after every cell so that a rerun skips the
finished ones), ``results.md``, ``loss_vs_time.png`` and ``cells/<cell>/`` (each cell's
``metrics.jsonl`` and checkpoints) — and running one cell: a :class:`~elastic_llm.controller.Trainer`
over the cell's config in its own embedded Ray, which the trainer starts and stops.
Never trains anything itself (a strategy is only config overrides, see :mod:`.convergence`) and
never starts Ray before every cell's config is valid and the directory's parameters match.
"""

from __future__ import annotations

import logging
import datetime
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_llm import events
from elastic_llm.config import RunConfig, load_config
from elastic_llm.experiment.convergence import (
    Cell,
    ExperimentError,
    Rate,
    ReportContext,
    Settings,
    Target,
    baseline_row,
    cell_overrides,
    cell_row,
    check_overrides,
    check_settings,
    choose_target,
    command_line,
    grid,
    render_markdown,
    time_breakdown,
    with_target,
)
from elastic_llm.files import write_atomic

RESULTS, REPORT, PLOT = "results.json", "results.md", "loss_vs_time.png"


@dataclass(frozen=True)
class CellResult:
    """What one cell's run left: its per-step records (time order), the trainer's recovery
    records, the failed steps, seconds from start to shutdown, and the error if it stopped."""

    history: list[dict[str, Any]]
    recoveries: list[Mapping[str, Any]]  # the trainer's events.Recovery (or their lines)
    failures: int
    total_s: float
    failure_times_s: list[float] = field(default_factory=list)  # training seconds before each recovery
    error: str | None = None
    exit_code: int = 0


CellRunner = Callable[[RunConfig, Path, bool], CellResult]


def run_trainer_cell(cfg: RunConfig, cell_dir: Path, progress: bool) -> CellResult:
    """One cell: ``ray_trainer(cfg).fit()`` in a fresh embedded Ray; a run that stops
    (:class:`RunFailed`) is a result, not an error."""
    from elastic_llm.controller import CapacityUnavailable, RunFailed
    from elastic_llm.runtime.ray_runtime import ray_trainer

    t0 = time.perf_counter()
    marks: list[float] = []  # training seconds at each step before which a new recovery happened
    seen = [0, 0.0]  # recovery records, elapsed seconds of the last step

    def on_step(record: dict[str, Any]) -> None:
        if len(trainer.recoveries) > seen[0]:
            marks.append(seen[1])
        seen[:] = [len(trainer.recoveries), record["elapsed_s"]]

    trainer = ray_trainer(cfg, metrics_out=cell_dir / "metrics.jsonl", progress=progress)
    error, code = None, 0
    try:
        try:  # Ray start and the first placement before fit(): its clock (elapsed_s) starts after them
            trainer.setup()
        except CapacityUnavailable:
            pass  # fit() waits for capacity as any run does
        trainer.fit(on_step=on_step)
    except RunFailed as e:
        error, code = str(e).splitlines()[0], e.exit_code
    finally:
        trainer.shutdown()
    return CellResult(
        list(trainer.history), list(trainer.recoveries), int(getattr(trainer, "failures", 0)),
        time.perf_counter() - t0, marks, error, code,
    )


@dataclass(frozen=True)
class ConvergenceSpec:
    """The experiment as asked for on the command line (values already parsed and checked)."""

    config: str
    overrides: tuple[str, ...]
    strategies: tuple[str, ...]
    rates: tuple[Rate, ...]
    steps: int
    eval_every: int
    checkpoint_every: int = 100
    seed: int = 0
    target_loss: float | None = None
    progress: bool = True


log = logging.getLogger("elastic_llm.experiment")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Convergence:
    """``Convergence(spec, out).run() -> summary``; the constructor checks everything (configs of
    all cells, the directory's parameters) before anything starts. ``run_cell`` is for tests."""

    def __init__(self, spec: ConvergenceSpec, out: str | Path, run_cell: CellRunner = run_trainer_cell) -> None:
        from elastic_llm.runtime.session import check_placement, local_resources

        if spec.steps < 2:
            raise ExperimentError(f"--steps={spec.steps} must be >= 2")
        if spec.eval_every < 1 or spec.checkpoint_every < 1:
            raise ExperimentError(f"--eval-every={spec.eval_every} and --checkpoint-every={spec.checkpoint_every} must be >= 1")
        if spec.target_loss is not None and not math.isfinite(spec.target_loss):
            raise ExperimentError(f"--target-loss={spec.target_loss} is not a finite number: write e.g. --target-loss 2.5")
        self.spec, self.out, self.run_cell = spec, Path(out), run_cell
        base = load_config(spec.config, check_overrides(spec.overrides))
        sha = hashlib.sha256(json.dumps(base.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
        self.settings = Settings(spec.config, sha, spec.overrides, spec.steps, spec.eval_every, spec.checkpoint_every, spec.seed)
        self.cells = grid(spec.strategies, spec.rates)
        self.configs: dict[str, RunConfig] = {}
        for cell in self.cells:  # every cell's config is valid (and placeable) before any cell runs
            ckpt = str((self.out / "cells" / cell.key / "ckpt").resolve()) if cell.strategy == "checkpoint" else None
            cfg = load_config(spec.config, cell_overrides(cell, self.settings, ckpt))
            check_placement(cfg, local_resources(), [])
            self.configs[cell.key] = cfg
        self.rows: list[dict[str, Any]] = []
        if (self.out / RESULTS).is_file():
            self.rows = self._load()

    def _load(self) -> list[dict[str, Any]]:
        path = self.out / RESULTS
        try:
            doc = json.loads(path.read_text())
            stored, rows = doc["experiment"], doc["rows"]
        except (ValueError, KeyError, TypeError):
            raise ExperimentError(f"--out {self.out}: {path} is not a results file of this command: choose another --out") from None
        check_settings(stored, self.settings, str(self.out))
        return list(rows)

    # ------------------------------------------------------------------ the grid
    def run(self) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        done = {r["cell"] for r in self.rows}
        todo = [c for c in self.cells if c.key not in done]
        log.info(f"{len(self.cells)} cells, {len(self.cells) - len(todo)} already finished in {self.out / RESULTS}")
        for i, cell in enumerate(todo, 1):
            log.info(f"cell {i}/{len(todo)}: {cell.strategy}, {cell.label}, {self.spec.steps} steps")
            self.rows.append(self._run_cell(cell))
            self._write_results()
        self.rows = with_target(self.rows, self._target())
        self._write_results()
        self._write_report()
        return self.summary(len(todo))

    def _run_cell(self, cell: Cell) -> dict[str, Any]:
        cell_dir = self.out / "cells" / cell.key
        cell_dir.mkdir(parents=True, exist_ok=True)
        res = self.run_cell(self.configs[cell.key], cell_dir, self.spec.progress)
        row = cell_row(
            cell, res.history, res.recoveries, res.failures, total_s=res.total_s, finished_at=_now(),
            failure_times_s=res.failure_times_s, error=res.error, exit_code=res.exit_code,
        )
        log.info(f"  {cell.key}: {'stopped: ' + res.error if res.error else 'done'}; {row['steps']} steps, "
            f"final val_loss {row['final_val_loss']}, {row['failures']} failures, {row['recoveries']} recoveries")
        return row

    def _target(self) -> Target:
        return choose_target(self.spec.target_loss, baseline_row(self.rows), self.spec.steps)

    # ------------------------------------------------------------------ the files
    def _write_results(self) -> None:
        target = self._target()
        doc = {"experiment": self.settings.to_dict(), "target": {"loss": target.loss, "how": target.how}, "rows": self.rows}
        payload = json.dumps(doc, indent=2) + "\n"
        write_atomic(self.out / RESULTS, "w", lambda f: f.write(payload))

    def _write_report(self) -> None:
        from elastic_llm.experiment.plot import write_plot

        s = self.spec
        ctx = ReportContext(
            self.settings, s.strategies, s.rates, self._target(),
            machine=f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}",
            date=_now(), command=command_line(self.settings, s.strategies, s.rates, str(self.out), s.target_loss),
        )
        text = render_markdown(ctx, self.rows, self._times())
        write_atomic(self.out / REPORT, "w", lambda f: f.write(text))
        write_plot(self.out / PLOT, s.strategies, s.rates, self.rows, ctx.target.loss)

    def _times(self) -> dict[str, dict[str, float]]:
        """Each finished cell's time breakdown, from its ``metrics.jsonl``."""
        out = {}
        for r in self.rows:
            path = self.out / "cells" / r["cell"] / "metrics.jsonl"
            if path.is_file():
                lines = events.read_lines(path)
                t = time_breakdown(lines)
                if t is not None:
                    out[r["cell"]] = t
        return out

    def summary(self, ran: int) -> dict[str, Any]:
        target = self._target()
        keys = ("strategy", "failure_prob", "steps_to_target", "wall_to_target_s", "final_val_loss", "failures", "failed")
        wanted = {c.key for c in self.cells}
        return {
            "out": str(self.out),
            "cells": len(self.cells),
            "ran": ran,
            "failed": sum(1 for r in self.rows if r["cell"] in wanted and r["failed"]),
            "target_loss": target.loss,
            "rows": [{k: r[k] for k in keys} for r in self.rows if r["cell"] in wanted],
        }


def run_convergence(spec: ConvergenceSpec, out: str | Path, run_cell: CellRunner = run_trainer_cell) -> dict[str, Any]:
    """Check, then run the grid (finished cells skipped) and write the files; return the summary."""
    return Convergence(spec, out, run_cell).run()


def files(out: str | Path) -> Sequence[Path]:
    return tuple(Path(out) / n for n in (RESULTS, REPORT, PLOT))
