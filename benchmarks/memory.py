"""The memory plan against measured peaks, and what activation checkpointing saves and costs.

Measures, for each config given (default ``jobs/tiny.yaml`` and ``jobs/llama-25m.yaml``), in
``fp32`` and ``bf16`` and with ``activation_checkpointing`` ``none`` and ``layers``, every stage
of the pipeline as the product runs it: a :class:`~elastic_llm.pipeline.stage.StageWorker` built
in a fresh process (one thread, as ``threads_per_actor: 1``) runs its own ops of the schedule
(the forwards and backwards of its microbatches in the schedule's order, on inputs and
gradients of the sizes its neighbours send) and its optimizer step. Per stage it reports

* the peak resident memory of a steady step (Linux ``VmHWM`` after ``/proc/self/clear_refs``,
  less the process's resident memory before the stage was built; glibc's mmap threshold is fixed
  at 64 KiB so freed tensors leave the resident set) against :func:`elastic_llm.pipeline.memory.plan`'s
  device total for the stage;
* the peak activation memory (the step's peak less what was resident before it, less the
  gradients, which the step allocates) against the plan's activations in flight plus working set;
* the stage's median step time, so ``layers`` is compared with ``none`` side by side.

The processes of one stage and precision run one after the other, so outside load hits both
checkpointing settings alike. Never judges its results (targets and conclusions live in
BENCHMARKS.md), never starts Ray (the stage processes import it, as actors have), never writes a file.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import machine_info, median, ratio

CONFIGS = ("jobs/tiny.yaml", "jobs/llama-25m.yaml")
PRECISIONS = ("fp32", "bf16")
CHECKPOINTING = ("none", "layers")
CHILD_TIMEOUT_S = 600.0
MIB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap memory leaves the resident set first: the peak counts live bytes
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def measure_stage(config: str, overrides: list[str], stage: int, steps: int) -> dict[str, Any]:
    """In this process: build ``stage`` and run ``steps`` of its ops; the last step's peak and the step times."""
    import numpy as np
    import torch

    from elastic_llm.config import load_config
    from elastic_llm.pipeline.schedules import build_schedule
    from elastic_llm.pipeline.shares import microbatch_sizes
    from elastic_llm.pipeline.stage import StageWorker

    torch.set_num_threads(1)
    cfg = load_config(config, [*overrides, "snapshot.enabled=false", "parallel.dp=1"])
    par, shape = cfg.parallel, cfg.model.shape()
    import ray  # noqa: F401  (what a stage actor has imported, and building a stage imports, before the baseline)

    import elastic_llm.snapshot.state  # noqa: F401

    worker = StageWorker(cfg, None)  # a warm standby: torch's lazy parts started, no stage held
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16"):
        warm = torch.nn.Linear(64, 64)
        warm(torch.randn(8, 64)).sum().backward()
    _reset_peak()
    base_kib = _status_kib("VmRSS")
    worker.adopt(stage, 0, 1)
    built_kib = _status_kib("VmRSS")
    sizes = microbatch_sizes(cfg.train.batch_size, par.microbatches)
    ops = build_schedule(par.schedule, par.stages, len(sizes), cfg.swapped)[stage]
    wire = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    first, last = stage == 0, stage == par.stages - 1
    gen = np.random.default_rng(stage)
    times, peak_kib, before_kib = [], 0, 0
    for i in range(steps):
        if i == steps - 1:
            _reset_peak()
            before_kib = _status_kib("VmRSS")
        t0 = time.perf_counter()
        for op in ops:
            n = sizes[op.mb]
            if op.kind == "F":
                x = gen.integers(0, shape.vocab_size, (n, shape.seq_len)) if first else torch.randn(n, shape.seq_len, shape.dim).to(wire)
                worker.forward(op.mb, x, gen.integers(0, shape.vocab_size, (n, shape.seq_len)) if last else None)
            else:
                worker.backward(op.mb, None if last else torch.randn(n, shape.seq_len, shape.dim).to(wire))
        worker.step()
        times.append(time.perf_counter() - t0)
        if i == steps - 1:
            peak_kib = _status_kib("VmHWM")
    grads = 4 * sum(p.numel() for p in worker.module.parameters())
    return {
        "peak_bytes": (peak_kib - base_kib) * 1024,
        "activation_peak_bytes": (peak_kib - before_kib) * 1024 - grads,
        "built_bytes": (built_kib - base_kib) * 1024,
        "before_step_bytes": (before_kib - base_kib) * 1024,
        "step_s": median(times[1:]) if len(times) > 1 else times[0],
    }


def _run_child(config: str, overrides: list[str], stage: int, steps: int) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    spec = json.dumps({"config": config, "overrides": overrides, "stage": stage, "steps": steps})
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--child", spec], env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1] if (out.stderr or out.stdout).strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_memory_bench(configs: list[str] | None = None, overrides: list[str] | None = None, steps: int = 3,
                     progress: Any = None, precisions: tuple[str, ...] = PRECISIONS) -> dict[str, Any]:
    from elastic_llm.config import load_config
    from elastic_llm.pipeline.memory import plan

    started = _dt.datetime.now(_dt.timezone.utc)
    rows: list[dict[str, Any]] = []
    for config in configs or CONFIGS:
        for precision in precisions:
            stages = load_config(config, overrides or []).parallel.stages
            for stage in range(stages):
                for ck in CHECKPOINTING:
                    sets = [*(overrides or []), f"train.precision={precision}", f"train.activation_checkpointing={ck}"]
                    p = plan(load_config(config, [*sets, "snapshot.enabled=false", "parallel.dp=1"])).stages[stage]
                    got = _run_child(config, sets, stage, steps)
                    row = {"config": config, "precision": precision, "checkpointing": ck, "stage": stage, **got,
                           "plan_bytes": p.device, "plan_activation_bytes": p.in_flight * p.activations + p.working}
                    if "peak_bytes" in got:
                        row["measured_over_plan"] = ratio(got["peak_bytes"], p.device)
                        row["activations_measured_over_plan"] = ratio(got["activation_peak_bytes"], row["plan_activation_bytes"])
                    rows.append(row)
                    if progress:
                        progress(json.dumps(row))
    return {"bench": "memory", "date": started.isoformat(timespec="seconds"), "machine": machine_info(), "steps": steps,
            "command": "elastic-llm bench memory " + " ".join(sys.argv[3:]) if sys.argv[1:2] == ["bench"] else "elastic-llm bench memory",
            "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config and precision: the plan's worst error, and layers against none (activation peak per stage, summed step time)."""
    out = []
    keys = sorted({(r["config"], r["precision"]) for r in rows})
    for config, precision in keys:
        mine = [r for r in rows if (r["config"], r["precision"]) == (config, precision) and "peak_bytes" in r]
        by = {(r["stage"], r["checkpointing"]): r for r in mine}
        stages = sorted({r["stage"] for r in mine})
        act = [ratio(by[(s, "layers")]["activation_peak_bytes"], by[(s, "none")]["activation_peak_bytes"]) for s in stages if (s, "layers") in by and (s, "none") in by]
        t = {ck: sum(by[(s, ck)]["step_s"] for s in stages if (s, ck) in by) for ck in CHECKPOINTING}
        out.append({
            "config": config, "precision": precision,
            "plan_error_max": max((abs(r["measured_over_plan"] - 1) for r in mine), default=None),
            "activation_layers_over_none_per_stage": act,
            "step_time_layers_over_none": ratio(t["layers"], t["none"]),
        })
    return out


def markdown_table(result: dict[str, Any]) -> str:
    lines = ["| config | precision | ckpt | stage | plan MiB | measured MiB | measured/plan | act. plan MiB | act. measured MiB | step s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "peak_bytes" not in r:
            lines.append(f"| {r['config']} | {r['precision']} | {r['checkpointing']} | {r['stage']} | failed: {r.get('error')} | | | | | |")
            continue
        lines.append(f"| {os.path.basename(r['config'])} | {r['precision']} | {r['checkpointing']} | {r['stage']} | {r['plan_bytes'] / MIB:.1f} | "
                     f"{r['peak_bytes'] / MIB:.1f} | {r['measured_over_plan']:.3f} | {r['plan_activation_bytes'] / MIB:.1f} | "
                     f"{r['activation_peak_bytes'] / MIB:.1f} | {r['step_s']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        spec = json.loads(sys.argv[2])
        print(json.dumps(measure_stage(spec["config"], spec["overrides"], spec["stage"], spec["steps"])))
        sys.exit(0)
    from benchmarks.common import main

    sys.exit(main("memory"))
