"""Pipeline sweep: what the driver pays per training step as stages, microbatches and replicas grow.

The step executor sends one ``run_step`` call per stage actor per step; activations, gradients and
the replicas' gradient all-reduce travel between the actors. This benchmark measures what that
leaves on the driver, for two models:

* ``micro``: ``jobs/tiny.yaml`` with ``model.dim=64, n_layers=8, n_heads=4, seq_len=32``, small
  enough that per-call overhead dominates each step;
* ``tiny``: ``jobs/tiny.yaml`` with ``model.n_layers=8`` (so 8 stages divide the layers);

over stages {2, 4, 8} x microbatches {4, 16, 64} x replicas {1, 2, 4}, keeping only
stages x replicas <= 16 actors (larger ones do not fit 2 cores / the machine's memory). A step's
batch is microbatches x replicas sequences: one sequence per microbatch per replica.

Per configuration it runs a fresh :class:`~elastic_llm.controller.Trainer` (snapshots off, no
validation, the built-in corpus) on one embedded Ray started once for the whole sweep, for
``warmup`` untimed steps then ``steps`` timed ones, each with ``Trainer.run_step``, and records:

* driver CPU seconds per step: ``time.process_time()`` of the driver process around
  ``run_step``. It includes the threads Ray runs inside the driver (core worker: gRPC, the
  reference counter, reply handling), not the raylet, GCS or actors. Those threads also work
  while the driver waits for a step, so the row also has the CPU of the driver's main thread
  alone (``time.thread_time()``): the Trainer's and the executor's own work (batches, plans,
  serialising and submitting the calls, reading the reports);
* wall seconds per step and tokens / s;
* driver calls per step: the step executor's ``calls`` counter, next to the Trainer's other
  calls per step (the CheckFree+ mirror copies of lossless mode, the default) and the calls the
  old driver-side runner made for the same configuration (2 S M DP + S DP, + 2 S DP with DP > 1);
* object store bytes per step: the change of the raylet's ``cumulative_created_bytes`` (the
  store stats behind ``ray memory --stats-only``, which prints them in MiB only), i.e. bytes of
  every object any process created in the object store, between two points where every actor
  has run every call submitted to it;
* with DP > 1, gradient bytes per stage per step: the all-reduce bytes (``chunk`` + ``gather``)
  a stage's replica sent, over that stage's gradient (4 bytes x its parameters), max over stages
  and replicas (the direct reduce-scatter + all-gather sends 2 (DP - 1) / DP of it);

and, per (model, stages, replicas), driver CPU per step at 64 microbatches over that at 4.
The 64-microbatch configurations run :data:`LARGE_STEPS` timed steps by default: spawning the
~400 actors of the full grid alone takes most of a 15-minute budget on 2 cores.

Owns: the sweep's grid, the measurements above, the JSON result, its markdown table and its plot
(matplotlib, Agg backend, imported only when plotting). Must never copy product code (it steps
the product's Trainer), change product behaviour, leave Ray or actors behind (every Trainer is
shut down before the next configuration, and Ray at the end if the sweep started it), or reach
anything but 127.0.0.1.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import load_at_end, machine_busy_s, machine_info, outside_share, ratio, tree_cpu_s

BASE_CONFIG = "jobs/tiny.yaml"
MODELS: dict[str, tuple[str, ...]] = {
    "micro": ("model.dim=64", "model.n_layers=8", "model.n_heads=4", "model.seq_len=32"),
    "tiny": ("model.n_layers=8",),
}
STAGES = (2, 4, 8)
MICROBATCHES = (4, 16, 64)
REPLICAS = (1, 2, 4)
MAX_ACTORS = 16  # stages x replicas beyond this do not fit 2 cores / the memory of a laptop-class machine
CPUS_PER_ACTOR = 0.5  # Ray's bookkeeping only: every actor runs one torch thread
RAY_CPUS = 16  # logical CPUs of the sweep's embedded Ray: room for MAX_ACTORS x CPUS_PER_ACTOR
LARGE_STEPS = 2  # timed steps of the 64-microbatch configurations: the full sweep then takes ~20 min on 2 cores, most of it spawning actors
TARGET_CPU_RATIO = 1.5  # driver CPU per step at 64 microbatches over at 4, per (model, stages, replicas)
BYTES_SOURCE = "the raylet's store_stats.cumulative_created_bytes (change over the timed steps, whole node)"


@dataclass(frozen=True)
class Point:
    """One configuration of the sweep."""

    model: str
    stages: int
    microbatches: int
    dp: int

    @property
    def actors(self) -> int:
        return self.stages * self.dp

    @property
    def batch_size(self) -> int:
        return self.microbatches * self.dp  # one sequence per microbatch per replica

    def label(self) -> str:
        return f"{self.model} S={self.stages} M={self.microbatches} DP={self.dp}"


def old_driver_calls(stages: int, microbatches: int, dp: int) -> int:
    """Actor calls per step of the old driver-side runner: a forward and a backward call per stage
    per microbatch per replica, an update per actor, and with DP > 1 a gradient fetch and a
    gradient load per actor."""
    return 2 * stages * microbatches * dp + stages * dp + (2 * stages * dp if dp > 1 else 0)


def parse_only(specs: Iterable[str]) -> list[tuple[int, int, int]]:
    """``"S,M,DP"`` strings (e.g. ``"2,4,1"``) -> tuples; raises ValueError naming a bad one."""
    out = []
    for spec in specs:
        parts = spec.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--only {spec!r}: expected STAGES,MICROBATCHES,REPLICAS, e.g. 2,4,1")
        s, m, d = (int(p) for p in parts)
        out.append((s, m, d))
    return out


def sweep_points(models: Sequence[str], only: Sequence[tuple[int, int, int]] = ()) -> tuple[list[Point], list[Point]]:
    """(the configurations to run, the ones skipped for having more than MAX_ACTORS actors), in
    run order: model, stages, replicas, microbatches. ``only`` keeps just those (S, M, DP)."""
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    run, skipped = [], []
    for model in models:
        for s in STAGES:
            for dp in REPLICAS:
                for m in MICROBATCHES:
                    p = Point(model, s, m, dp)
                    if only and (s, m, dp) not in only:
                        continue
                    (run if p.actors <= MAX_ACTORS else skipped).append(p)
    return run, skipped


class StoreStats:
    """Bytes ever created in the object store of the Ray this driver is connected to (every
    node), read from the raylet: ``None`` where this Ray does not expose them."""

    def __init__(self) -> None:
        import ray
        from ray._private.internal_api import get_state_from_address

        assert ray.is_initialized()
        self.state = get_state_from_address(ray.get_runtime_context().gcs_address)

    def check(self) -> bool:
        """Does the counter see an object the driver puts into the store (1 MiB)?"""
        import numpy as np
        import ray

        before = self.created_bytes()
        ref = ray.put(np.zeros(2**20, np.uint8))
        after = self.created_bytes()
        del ref
        return before is not None and after is not None and after - before >= 2**20

    def created_bytes(self) -> int | None:
        from ray._private.internal_api import get_memory_info_reply

        try:
            stats = get_memory_info_reply(self.state, timeout_seconds=30.0).store_stats
        except Exception:  # grpc errors, a stats layout this Ray does not have
            return None
        return int(stats.cumulative_created_bytes)


def _config(point: Point, data_dir: str) -> Any:
    from elastic_llm.config import load_config

    return load_config(
        BASE_CONFIG,
        [
            *MODELS[point.model],
            f"parallel.stages={point.stages}",
            f"parallel.dp={point.dp}",
            f"parallel.microbatches={point.microbatches}",
            f"parallel.cpus_per_actor={CPUS_PER_ACTOR}",
            "parallel.threads_per_actor=1",
            f"train.batch_size={point.batch_size}",
            "train.eval_every=0",
            "snapshot.enabled=false",
            f"data.dir={data_dir}",
        ],
    )


def _grad_ratio(reports: dict[Any, Any], params: dict[int, int], dp: int) -> float | None:
    """All-reduce bytes a stage's replica sent (chunk + gather) over the stage's gradient bytes,
    max over stages and replicas; None at DP = 1."""
    if dp == 1:
        return None
    worst = 0.0
    for key, rep in reports.items():
        sent = rep.sent_bytes.get("chunk", 0) + rep.sent_bytes.get("gather", 0)
        worst = max(worst, sent / (4 * params[key.stage]))
    return round(worst, 4)


def mirror_calls(cfg: Any) -> int:
    """Actor calls per step the Trainer makes besides the executor's: with CheckFree+ mirrors
    (``recovery.mode`` lossless or checkfree_plus, ``checkfree.mirror_every=1``) every replica's
    embedding and LM head are copied to their neighbouring stage, a ``mirror_source`` and a
    ``hold_mirror`` call each (:func:`elastic_llm.controller.neighbours.refresh_mirrors`)."""
    every = cfg.checkfree.mirror_every
    return 2 * 2 * cfg.parallel.dp if cfg.mirrors and every == 1 else 0


def _settle(trainer: Any) -> list[Any]:
    """Wait until every actor has run all the calls submitted to it so far (the Trainer does not
    wait for its mirror copies, whose objects would otherwise land in the next window): an
    ``info`` call, which runs after them, on every actor. Returns the infos."""
    import ray

    actors = [a for replica in trainer.group.actors for a in replica]
    return ray.get([a.info.remote() for a in actors], timeout=120)


def measure(point: Point, data_dir: str, steps: int, warmup: int, store: StoreStats) -> dict[str, Any]:
    """Run one configuration on a fresh Trainer; the row of the sweep. The Trainer is shut down
    before this returns, also when a step fails (the row then carries the traceback)."""
    from elastic_llm.runtime.ray_runtime import ray_trainer

    cfg = _config(point, data_dir)
    tokens_per_step = cfg.tokens_per_step()
    row: dict[str, Any] = {
        "model": point.model,
        "stages": point.stages,
        "microbatches": point.microbatches,
        "dp": point.dp,
        "actors": point.actors,
        "batch_size": point.batch_size,
        "tokens_per_step": tokens_per_step,
        "warmup": warmup,
        "steps": steps,
        "old_driver_calls_per_step": old_driver_calls(point.stages, point.microbatches, point.dp),
        "mirror_calls_per_step": mirror_calls(cfg),
    }
    trainer = ray_trainer(cfg)
    t0 = time.perf_counter()
    try:
        trainer.setup()
        row["setup_s"] = round(time.perf_counter() - t0, 2)
        for _ in range(warmup):
            trainer.run_step()
        executor = trainer.executor.inner  # type: ignore[union-attr]  # ChaosExecutor -> RayStepExecutor
        cpu, main, wall = [], [], []
        _settle(trainer)
        calls0, bytes0 = executor.calls, store.created_bytes()
        for _ in range(steps):
            c0, m0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            record = trainer.run_step()
            w1, m1, c1 = time.perf_counter(), time.thread_time(), time.process_time()
            cpu.append(c1 - c0)
            main.append(m1 - m0)
            wall.append(w1 - w0)
        calls1 = executor.calls
        infos = _settle(trainer)
        bytes1 = store.created_bytes()
        reports = dict(executor.last.reports)
        params = {i.stage: i.parameters for i in infos}
        sent: dict[str, int] = {}
        for rep in reports.values():
            for kind, n in rep.sent_bytes.items():
                sent[kind] = sent.get(kind, 0) + n
        row.update(
            driver_cpu_s_per_step=round(sum(cpu) / steps, 5),
            driver_cpu_s=[round(c, 5) for c in cpu],
            driver_main_thread_cpu_s_per_step=round(sum(main) / steps, 5),
            wall_s_per_step=round(sum(wall) / steps, 4),
            step_s=[round(w, 4) for w in wall],
            tokens_per_s=round(tokens_per_step * steps / sum(wall), 1),
            driver_calls_per_step=(calls1 - calls0) / steps,
            object_store_bytes_per_step=(bytes1 - bytes0) / steps if bytes0 is not None and bytes1 is not None else None,
            grad_allreduce_over_grad_bytes=_grad_ratio(reports, params, point.dp),
            sent_bytes_last_step=sent,
            stage_parameters=[params[s] for s in sorted(params)],
            loss_last_step=round(float(record["loss"]), 4),
        )
    except Exception as err:  # one configuration failing must not lose the others
        row["error"] = f"{type(err).__name__}: {err}"
        row["traceback"] = traceback.format_exc()
    finally:
        trainer.shutdown()
    return row


def cpu_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, stages, replicas): driver CPU per step at the most microbatches over at the
    fewest (64 over 4 on the full grid), against :data:`TARGET_CPU_RATIO`."""
    groups: dict[tuple[str, int, int], dict[int, dict[str, Any]]] = {}
    for r in rows:
        if r.get("driver_cpu_s_per_step") is not None:
            groups.setdefault((r["model"], r["stages"], r["dp"]), {})[r["microbatches"]] = r
    out = []
    lo, hi = min(MICROBATCHES), max(MICROBATCHES)
    for (model, s, dp), by_m in groups.items():
        if lo in by_m and hi in by_m:
            value = ratio(by_m[hi]["driver_cpu_s_per_step"], by_m[lo]["driver_cpu_s_per_step"])
            main = ratio(by_m[hi]["driver_main_thread_cpu_s_per_step"], by_m[lo]["driver_main_thread_cpu_s_per_step"])
            out.append(
                {
                    "model": model, "stages": s, "dp": dp, "microbatches": [lo, hi],
                    "cpu_ratio": value, "within_target": value is not None and value <= TARGET_CPU_RATIO,
                    "main_thread_cpu_ratio": main,
                }
            )
    return out


def run_pipeline_sweep(
    models: Sequence[str] = tuple(MODELS),
    steps: int = 4,
    warmup: int = 2,
    large_steps: int | None = LARGE_STEPS,
    only: Sequence[tuple[int, int, int]] = (),
    plot: str | None = "bench-pipeline-sweep.png",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the sweep (see the module docstring); one JSON-serializable dict. ``large_steps``: timed
    steps of the 64-microbatch configurations (at most ``steps``; None: ``steps``), to fit a time budget.
    ``plot``: where to write the PNG (None: no plot). ``progress``: called with one line per
    configuration. Starts an embedded Ray on 127.0.0.1 unless one is initialised, and shuts it
    down at the end if it started it."""
    import ray

    from elastic_llm.runtime.session import NAMESPACE, loopback_env
    from elastic_llm.data import ensure_builtin_corpus

    if steps < 1 or warmup < 0 or (large_steps is not None and large_steps < 1):
        raise ValueError(f"steps={steps} and large_steps={large_steps} must be >= 1, warmup={warmup} >= 0")
    large_steps = steps if large_steps is None else min(large_steps, steps)
    points, skipped = sweep_points(models, only)
    if not points:
        raise ValueError("no configuration left to run: check --models and --only")
    loopback_env()
    data_dir = str(ensure_builtin_corpus())
    machine = machine_info()
    started = time.perf_counter()
    ours = not ray.is_initialized()
    if ours:
        ray.init(
            address="local",  # a private Ray: never a cluster another process started
            num_cpus=RAY_CPUS,
            namespace=NAMESPACE,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level="WARNING",
        )
    rows = []
    try:
        store = StoreStats()
        store_ok = store.check()
        busy0, tree0, wall0 = machine_busy_s(), tree_cpu_s(os.getpid()), time.perf_counter()
        for i, p in enumerate(points):
            n = large_steps if p.microbatches == max(MICROBATCHES) else steps
            row = measure(p, data_dir, n, warmup, store)
            rows.append(row)
            if progress is not None:
                done = (
                    f"cpu {row['driver_cpu_s_per_step']:.4f} s/step (main thread {row['driver_main_thread_cpu_s_per_step']:.4f}), "
                    f"wall {row['wall_s_per_step']:.3f} s/step" if "error" not in row else f"FAILED: {row['error']}"
                )
                progress(f"[{i + 1}/{len(points)}] {p.label()}: {done} ({time.perf_counter() - started:.0f} s so far)")
        busy1, tree1 = machine_busy_s(), tree_cpu_s(os.getpid())
        outside = None
        if ours and None not in (busy0, busy1, tree0, tree1):  # our Ray is all in the driver's process tree
            outside = outside_share(busy1 - busy0, tree1 - tree0, time.perf_counter() - wall0)  # type: ignore[operator]
    finally:
        if ours:
            ray.shutdown()

    too_big = ", ".join(f"S={s} DP={dp}" for s, dp in sorted({(p.stages, p.dp) for p in skipped}))
    notes = [
        f"only stages x replicas <= {MAX_ACTORS} run; {len(skipped)} configurations skipped ({too_big or 'none'}): more actors do not fit 2 cores / memory",
        "driver_cpu_s_per_step is time.process_time() of the driver process around Trainer.run_step(): it includes Ray's core-worker threads in the driver, not the raylet, GCS or actors",
        "driver_main_thread_cpu_s_per_step is time.thread_time() of the driver's main thread around the same call: the Trainer's and executor's own "
        "Python work (batches, plans, serialising and submitting the calls, reading the reports), without Ray's background threads, which keep working while the driver waits",
        f"object_store_bytes_per_step is measured: {BYTES_SOURCE}, between two points where every actor has run every call "
        "submitted to it (an info call on each); everything any process created in the store counts; "
        + ("checked first: a 1 MiB ray.put moved it by >= 1 MiB" if store_ok else "WARNING: a 1 MiB ray.put did not move it, the column is not trustworthy"),
        f"every actor runs 1 torch thread; parallel.cpus_per_actor={CPUS_PER_ACTOR} on an embedded Ray of {RAY_CPUS} logical CPUs over {os.cpu_count()} cores",
        "driver_calls_per_step counts the step executor's calls (RayStepExecutor.calls); mirror_calls_per_step are the Trainer's other calls "
        "per step: recovery.mode lossless (the default) refreshes the CheckFree+ mirrors of the embedding and LM head every step "
        "(checkfree.mirror_every=1), 4 calls per replica whose results go through the object store once above the inline threshold",
        "old_driver_calls_per_step: 2*S*M*DP + S*DP (+ 2*S*DP when DP > 1), the calls the driver-side runner made before the one-call-per-actor executor",
    ]
    if large_steps != steps:
        notes.append(f"configurations with {max(MICROBATCHES)} microbatches ran {large_steps} timed steps instead of {steps}, to fit the time budget")
    failed = [r for r in rows if "error" in r]
    if failed:
        notes.append(f"{len(failed)} configuration(s) failed; their rows carry the error and traceback")
    load_at_end(machine)
    machine["outside_cpu_share"] = round(outside, 3) if outside is not None else None
    if outside is not None and outside > 0.15:
        notes.append(f"other processes used {outside:.0%} of the machine's CPU during the sweep: wall times and tokens/s are disturbed, driver CPU less so")
    result = {
        "benchmark": "pipeline_sweep",
        "base_config": BASE_CONFIG,
        "models": {m: list(MODELS[m]) for m in models},
        "grid": {"stages": list(STAGES), "microbatches": list(MICROBATCHES), "dp": list(REPLICAS), "max_actors": MAX_ACTORS},
        "skipped": [{"model": p.model, "stages": p.stages, "microbatches": p.microbatches, "dp": p.dp} for p in skipped],
        "warmup": warmup,
        "steps": steps,
        "large_steps": large_steps,
        "object_store_counter_checked": store_ok,
        "rows": rows,
        "cpu_ratio_target": TARGET_CPU_RATIO,
        "cpu_ratios": cpu_ratios(rows),
        "machine": machine,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 1),
        "notes": notes,
    }
    if plot:
        write_plot(result, plot)
        result["plot"] = os.path.abspath(plot)
    return result


def _bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    if n < 1024:
        return f"{n:.0f} B"
    return f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.2f} MiB"


def markdown_table(result: dict[str, Any]) -> str:
    """The rows as a markdown table, then the CPU ratios, for BENCHMARKS.md."""
    lines = [
        "| model | S | M | DP | batch | driver CPU s/step | main thread | wall s/step | tokens/s | executor calls/step "
        "| + mirror calls/step | old runner calls/step | object store / step | all-reduce / grad bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        head = f"| {r['model']} | {r['stages']} | {r['microbatches']} | {r['dp']} | {r['batch_size']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:80]} | | | | | {r['mirror_calls_per_step']} | {r['old_driver_calls_per_step']} | | |")
            continue
        g = r["grad_allreduce_over_grad_bytes"]
        lines.append(
            f"{head} {r['driver_cpu_s_per_step']:.4f} | {r['driver_main_thread_cpu_s_per_step']:.4f} | {r['wall_s_per_step']:.3f} | {r['tokens_per_s']:.0f} | {r['driver_calls_per_step']:g} | "
            f"{r['mirror_calls_per_step']} | {r['old_driver_calls_per_step']} | {_bytes(r['object_store_bytes_per_step'])} | {'-' if g is None else f'{g:.3f}'} |"
        )
    lo, hi = min(MICROBATCHES), max(MICROBATCHES)
    lines += [
        "",
        f"| model | S | DP | driver CPU/step M={hi} / M={lo} (target <= {result['cpu_ratio_target']}) | the same, main thread only |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in result["cpu_ratios"]:
        main = c["main_thread_cpu_ratio"]
        lines.append(
            f"| {c['model']} | {c['stages']} | {c['dp']} | {c['cpu_ratio']:.2f}{'' if c['within_target'] else ' (over)'} | {'n/a' if main is None else f'{main:.2f}'} |"
        )
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: str) -> None:
    """Driver CPU per step against microbatches (log2 x), one line per (model, stages, replicas):
    one panel per model, on the same y scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple[str, int, int], list[tuple[int, float]]] = {}
    for r in result["rows"]:
        if r.get("driver_cpu_s_per_step") is not None:
            lines.setdefault((r["model"], r["stages"], r["dp"]), []).append((r["microbatches"], r["driver_cpu_s_per_step"]))
    models = [m for m in result["models"] if any(k[0] == m for k in lines)] or list(result["models"])
    colours = {s: plt.get_cmap("tab10")(i) for i, s in enumerate(STAGES)}
    styles = {dp: ls for dp, ls in zip(REPLICAS, ("-", "--", ":"))}
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 5), sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        for (m, s, dp), pts in sorted(lines.items()):
            if m != model:
                continue
            pts.sort()
            ax.plot([x for x, _ in pts], [c for _, c in pts], color=colours.get(s), linestyle=styles.get(dp, "-"), marker="o", label=f"S={s} DP={dp}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(MICROBATCHES), [str(m) for m in MICROBATCHES])
        ax.set_xlabel("microbatches per step")
        ax.set_title(f"{model}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    top = max((c for pts in lines.values() for _, c in pts), default=1.0)
    axes[0][0].set_ylim(0, top * 1.08)  # shared by every panel; set once all lines are drawn
    axes[0][0].set_ylabel("driver CPU seconds per step")
    fig.suptitle("Driver CPU per training step (one run_step call per actor per step)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
