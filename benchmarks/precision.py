"""Convergence in bf16 against fp32: the same run (config, seed, data) trained in both precisions.

Owns ``elastic-llm bench precision [--config jobs/llama-25m.yaml] [--steps 300] --out DIR``: for
``fp32`` then ``bf16`` it trains the config with the product's own trainer (``elastic-llm train``
on an embedded Ray, in a child process, ``snapshot.enabled=false``: the training alone,
validation every ``--steps // 12`` steps on 4 batches), keeps each run's metrics in
``DIR/{precision}.jsonl``, and reports every validation loss of both, the final ones and their
relative difference, the tokens/s of each, and a plot of both curves (``DIR/precision.png``).
``--from DIR`` reads the metrics of earlier runs instead of training (the plot and numbers
again, in seconds).

Never judges its results (the 2% target lives in BENCHMARKS.md), never writes outside DIR,
never reaches anything but 127.0.0.1 (the embedded Ray of each run).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, ratio

PRECISIONS = ("fp32", "bf16")


def train_command(config: str, steps: int, precision: str, metrics: Path, overrides: list[str]) -> list[str]:
    sets = [f"train.precision={precision}", f"train.eval_every={max(1, steps // 12)}", "train.eval_batches=4", "snapshot.enabled=false",
            "durable.storage_path=null", *overrides]
    return [sys.executable, "-m", "elastic_llm.cli", "train", "--config", config, "--max-steps", str(steps), "--no-progress",
            "--metrics-out", str(metrics), *[a for s in sets for a in ("--set", s)]]


def read_metrics(path: Path) -> dict[str, Any]:
    """The validation losses (step, loss), the last step's tokens/s and elapsed seconds of one run's metrics."""
    vals, last = [], {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "step" in row and "loss" in row:
            last = row
            if "val_loss" in row:
                vals.append((row["step"], row["val_loss"]))
    if not vals:
        raise ValueError(f"{path} has no validation losses: was it written by `elastic-llm train --metrics-out` with train.eval_every > 0?")
    return {"val": vals, "steps": last.get("step"), "tokens_per_s": last.get("tokens_per_s"), "elapsed_s": last.get("elapsed_s")}


def plot(path: Path, runs: dict[str, dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for name, run in runs.items():
        steps, losses = zip(*run["val"])
        ax.plot(steps, losses, marker="o", markersize=3, label=f"{name} (final {losses[-1]:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)


def run_precision_bench(config: str | None = None, steps: int = 300, out: str | None = None, from_dir: str | None = None,
                        overrides: list[str] | None = None) -> dict[str, Any]:
    config = config or "jobs/llama-25m.yaml"
    where = Path(from_dir or out or "bench-precision")
    where.mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now(_dt.timezone.utc)
    commands = {}
    for p in PRECISIONS:
        metrics = where / f"{p}.jsonl"
        commands[p] = train_command(config, steps, p, metrics, overrides or [])
        if from_dir is None:
            metrics.unlink(missing_ok=True)
            done = subprocess.run(commands[p], env={**os.environ, "RAY_ADDRESS": ""}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"the {p} run failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    runs = {p: read_metrics(where / f"{p}.jsonl") for p in PRECISIONS}
    final = {p: runs[p]["val"][-1][1] for p in PRECISIONS}
    png = where / "precision.png"
    plot(png, runs, f"{Path(config).stem}: validation loss, fp32 vs bf16 (same seed and data)")
    return {
        "bench": "precision", "date": started.isoformat(timespec="seconds"), "machine": machine_info(), "config": config, "steps": steps,
        "commands": {p: " ".join(c[2:]) for p, c in commands.items()}, "from": from_dir,
        "val_loss": {p: runs[p]["val"] for p in PRECISIONS}, "final_val_loss": final,
        "bf16_over_fp32_final": ratio(final["bf16"], final["fp32"], 4),
        "tokens_per_s": {p: runs[p]["tokens_per_s"] for p in PRECISIONS},
        "bf16_over_fp32_tokens_per_s": ratio(runs["bf16"]["tokens_per_s"], runs["fp32"]["tokens_per_s"]),
        "plot": str(png),
    }


if __name__ == "__main__":
    from benchmarks.common import main

    sys.exit(main("precision"))
