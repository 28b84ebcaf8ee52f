"""Pipeline throughput: our Ray pipeline against two real peers, side by side in one run.

Measures tokens / s and CPU seconds per step of the same training (same model, initial weights,
batches of the training stream, microbatches, per-stage clipping and AdamW) in three systems:

* ``ray_pipeline``: the product itself, a :class:`~elastic_llm.controller.Trainer` stepped with
  ``Trainer.run_step`` (``snapshot.enabled=false``, ``train.eval_every=0``: the pipeline alone);
* ``single_process``: the same stage modules (``build_stage``) chained in one spawned process with
  every core (``torch.set_num_threads(os.cpu_count())``), gradient accumulation over microbatches
  of the pipeline's size, per-stage clip + AdamW each step, in ``train.precision`` (bf16: the
  forward under bf16 autocast, as the stages run it; fp32 weights and moments);
* ``torch_pipelining``: ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` /
  ``Schedule1F1B`` as ``parallel.schedule``) over gloo on 127.0.0.1, one spawned process per stage
  (x ``dp`` replicas) with the actors' threads per stage, clip + AdamW each step;

and the ratios between them. The peers build their optimizer with the product's
``build_optimizer`` and read the batches the Trainer reads, so all three compute the same update:
their first timed step's loss agrees (a note says so when it does not).

Timing: every system gets ``warmup`` untimed steps, then ``steps`` timed steps; throughput is
tokens / s over all timed steps. The systems take turns step by step (the order rotates every
step) while the other two sit idle, so a burst of outside load hits all three alike. Each system
lives in its own processes; its CPU seconds per step count all of them (for Ray: driver, raylet,
GCS, actors). Ray is a private embedded instance; the peers are started with ``spawn``, so a
script calling :func:`run_pipeline_bench` needs the ``if __name__ == "__main__":`` guard.

Why it is this long (~500 lines): two of the three peers run in spawned child processes (one
per pipeline stage for torch.distributed.pipelining) that the benchmark starts, feeds step by
step and tears down itself; that harness is half the module.

Must never: copy product code (the optimizer, the split into stages, the step loop: it calls
them), judge its results (targets and conclusions live in BENCHMARKS.md), leave Ray, process
groups or child processes behind (everything is torn down in ``finally``), write outside a
temporary directory, or reach anything but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from benchmarks.common import free_port, load_at_end, machine_busy_s, machine_info, median, outside_share, ratio, tree_cpu_s
from elastic_llm.config import RunConfig, config_from_dict, load_config
from elastic_llm.shape import count_parameters

READY_TIMEOUT_S = 300.0  # building a peer (spawn, import torch, build the model, rendezvous)
STEP_TIMEOUT_S = 300.0  # one step of one system; past it the system is stopped and reported failed
SYSTEMS = ("ray_pipeline", "single_process", "torch_pipelining")

StepFn = Callable[[int], dict[str, Any]]  # batch index -> {"time": s, "cpu": s, "loss": float | None}


def _train_batches(cfg: RunConfig, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first ``n`` batches a fresh Trainer of ``cfg`` trains on: its data (``data.dir``, else
    the built-in corpus), its seed, its order."""
    from elastic_llm.data import open_run_data

    stream = open_run_data(cfg.data.dir, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size, cfg.data.val_fraction, cfg.data.tokenizer, cfg.data.tokenizer_file).train
    return [stream.next_batch(cfg.train.batch_size) for _ in range(n)]


def _load_batches(path: str) -> tuple[np.ndarray, np.ndarray]:
    data = np.load(path)
    return data["x"], data["y"]


# --------------------------------------------------------------------------- peer 1: single process


def _build_single_process(cfg_dict: dict[str, Any], batches_path: str) -> tuple[StepFn, Callable[[], None]]:
    """Every stage module chained in one process on every core; one call = one optimizer step
    over dp x microbatches, each stage's gradient clipped on its own (as the actors do)."""
    import torch

    from elastic_llm.model import build_stage, lm_loss
    from elastic_llm.pipeline.optim import build_optimizer

    cfg = config_from_dict(cfg_dict)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(cfg.train.seed)
    stages = [build_stage(cfg.model.shape(), cfg.parallel.stages, s, cfg.train.seed) for s in range(cfg.parallel.stages)]
    model = torch.nn.Sequential(*stages)
    opt, sched = build_optimizer(model, cfg.train)
    n_micro = cfg.parallel.microbatches * cfg.parallel.dp  # same microbatch size as the pipeline
    xs, ys = _load_batches(batches_path)

    def step(i: int) -> dict[str, Any]:
        c0, t0 = time.process_time(), time.perf_counter()
        total = 0.0
        for xm, ym in zip(np.split(xs[i], n_micro), np.split(ys[i], n_micro), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16"):  # the stages' precision
                logits = model(torch.from_numpy(xm))
            loss = lm_loss(logits, torch.from_numpy(ym))
            (loss / n_micro).backward()
            total += float(loss.detach())
        for stage in stages:
            torch.nn.utils.clip_grad_norm_(stage.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        t1, c1 = time.perf_counter(), time.process_time()
        return {"time": t1 - t0, "cpu": c1 - c0, "loss": total / n_micro, "threads": torch.get_num_threads()}

    return step, lambda: None


# --------------------------------------------------------------------------- peer 2: torch.distributed.pipelining


def _build_torch_pp(rank: int, world: int, port: int, cfg_dict: dict[str, Any], batches_path: str) -> tuple[StepFn, Callable[[], None]]:
    """One stage of one replica under torch.distributed.pipelining.

    Rank ``r * stages + s`` is stage ``s`` of replica ``r``; with dp > 1 the replicas of a stage
    average their flat gradient with one all-reduce (the peer's own way of what the actors do).
    A step starts and ends with a barrier, so every rank times the same span.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from elastic_llm.model import build_stage, lm_loss
    from elastic_llm.pipeline.optim import build_optimizer

    cfg = config_from_dict(cfg_dict)
    par = cfg.parallel
    n_stages, dp = par.stages, par.dp
    replica, stage = divmod(rank, n_stages)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(par.threads())
    torch.manual_seed(cfg.train.seed)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=_dt.timedelta(seconds=STEP_TIMEOUT_S)
    )
    try:
        # Every rank creates every group, in the same order.
        pp_group = None
        dp_group = None
        if dp > 1:
            pp_groups = [dist.new_group([r * n_stages + s for s in range(n_stages)]) for r in range(dp)]
            dp_groups = [dist.new_group([r * n_stages + s for r in range(dp)]) for s in range(n_stages)]
            pp_group, dp_group = pp_groups[replica], dp_groups[stage]
        module = build_stage(cfg.model.shape(), n_stages, stage, cfg.train.seed)
        opt, sched = build_optimizer(module, cfg.train)
        pstage = PipelineStage(module, stage, n_stages, torch.device("cpu"), group=pp_group)
        schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[par.schedule]
        schedule = schedule_cls(pstage, n_microbatches=par.microbatches, loss_fn=lm_loss, scale_grads=True)
        first, last = stage == 0, stage == n_stages - 1
        xs, ys = _load_batches(batches_path)
    except BaseException:
        dist.destroy_process_group()
        raise

    def step(i: int) -> dict[str, Any]:
        x = torch.from_numpy(np.split(xs[i], dp)[replica])
        y = torch.from_numpy(np.split(ys[i], dp)[replica])
        losses: list[torch.Tensor] = []
        dist.barrier()  # every rank has been told to go
        c0, t0 = time.process_time(), time.perf_counter()
        if first and last:
            schedule.step(x, target=y, losses=losses, return_outputs=False)
        elif first:
            schedule.step(x, return_outputs=False)
        elif last:
            schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        if dp > 1:
            params = list(module.parameters())
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params])
            dist.all_reduce(flat, group=dp_group)
            flat /= dp
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        dist.barrier()  # the step ends when the slowest stage is done
        t1, c1 = time.perf_counter(), time.process_time()
        loss = float(torch.stack([v.detach() for v in losses]).mean()) if losses else None
        return {"time": t1 - t0, "cpu": c1 - c0, "loss": loss, "threads": torch.get_num_threads()}

    return step, dist.destroy_process_group


# --------------------------------------------------------------------------- child processes


_BUILDERS: dict[str, Callable[..., tuple[StepFn, Callable[[], None]]]] = {
    "single_process": _build_single_process,
    "torch_pipelining": _build_torch_pp,
}


def _child_main(conn: Connection, kind: str, args: tuple[Any, ...]) -> None:
    """Child entry: build the system, say ready, then run one step per index received; None ends."""
    close: Callable[[], None] | None = None
    try:
        step, close = _BUILDERS[kind](*args)
        conn.send(("ready", None))
        while (msg := conn.recv()) is not None:
            conn.send(("ok", step(msg)))
    except BaseException:  # reported to the parent, which decides
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        try:
            if close is not None:
                close()
        finally:
            conn.close()


class _ChildSystem:
    """A baseline living in spawned processes that step together (one, or one per stage)."""

    def __init__(self, name: str, kind: str, args_per_process: list[tuple[Any, ...]]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # fresh interpreters: no thread settings or Ray state inherited
        self.name = name
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        try:
            for args in args_per_process:
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=_child_main, args=(child_end, kind, args), daemon=True, name=f"bench-{name}")
                self.conns.append(parent_end)
                self.procs.append(proc)
                proc.start()
                child_end.close()
        except BaseException:
            self.close()
            raise

    def pids(self) -> set[int]:
        return {p.pid for p in self.procs if p.pid is not None}

    def _gather(self, timeout_s: float) -> list[Any]:
        """One reply from every process, or RuntimeError (a child's traceback, death or timeout)."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self.conns):
            pending = [c for i, c in enumerate(self.conns) if i not in replies]
            ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"{self.name}: no answer within {timeout_s:.0f} s")
            for c in ready:
                i = self.conns.index(c)
                try:
                    status, payload = c.recv()
                except EOFError:
                    raise RuntimeError(f"{self.name}: process {i} died (exit code {self.procs[i].exitcode})") from None
                if status == "error":
                    raise RuntimeError(f"{self.name}: process {i} failed:\n{payload}")
                replies[i] = payload
        return [replies[i] for i in range(len(self.conns))]

    def wait_ready(self) -> None:
        self._gather(READY_TIMEOUT_S)

    def step(self, i: int) -> dict[str, Any]:
        for c in self.conns:
            c.send(i)
        replies = self._gather(STEP_TIMEOUT_S)
        losses = [r["loss"] for r in replies if r["loss"] is not None]
        return {
            "time": max(r["time"] for r in replies),  # all ranks time the same barrier-to-barrier span
            "cpu": sum(r["cpu"] for r in replies),
            "loss": float(np.mean(losses)) if losses else None,
            "threads": replies[0]["threads"],
        }

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, ValueError):
                c.send(None)
        deadline = time.monotonic() + 10
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:  # a peer stuck in a collective after a failure
            if p.pid is None:
                continue  # never started
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()


# --------------------------------------------------------------------------- the benchmark


def _summary(records: list[dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    """Throughput over all timed steps, plus per-step detail to judge noise."""
    times = [r["time"] for r in records]
    cpus = [r["cpu"] for r in records if r.get("cpu") is not None]
    losses = [r["loss"] for r in records]
    total = float(sum(times))
    return {
        "tokens_per_s": round(tokens_per_step * len(times) / total, 1) if total > 0 else None,
        "timed_s": round(total, 4),
        "median_step_s": round(median(times), 4),
        "step_s": [round(t, 4) for t in times],
        "cpu_s_per_step": round(float(np.mean(cpus)), 4) if len(cpus) == len(records) else None,
        "loss_first_step": losses[0],
        "loss_last_step": losses[-1],
    }


def run_pipeline_bench(
    config_path: str = "jobs/tiny.yaml",
    steps: int = 6,
    overrides: Sequence[str] = (),
    warmup: int = 2,
) -> dict[str, Any]:
    """Measure our Ray pipeline, a single process and torch.distributed.pipelining in one run.

    All three train the model of ``config_path`` (with ``overrides``) from the same initial weights
    on the same ``warmup + steps`` batches of the training stream, taking turns step by step.
    Returns one JSON-serializable dict: tokens / s of each system over its ``steps`` timed steps,
    ``ratio_vs_single`` and ``ratio_vs_torch_pipelining`` (Ray / peer; None where a peer could not
    run, with the reason in ``notes``), the workload, the machine and per-system details.
    Raises if the Ray pipeline itself fails; every process it started is gone when it returns.
    """
    import ray

    from elastic_llm.runtime.session import loopback_env
    from elastic_llm.runtime.ray_runtime import ray_trainer

    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    loopback_env()
    # the pipeline alone: no snapshots (bench snapshot measures those), no validation
    cfg = load_config(config_path, ["snapshot.enabled=false", "train.eval_every=0", *overrides])
    par, train = cfg.parallel, cfg.train
    if train.batch_size % (par.dp * par.microbatches):  # the peers cut it evenly (np.split, n_microbatches)
        raise ValueError(
            f"bench pipeline's peers need equal microbatches: train.batch_size={train.batch_size} must be a multiple of "
            f"parallel.dp x parallel.microbatches = {par.dp * par.microbatches} (the product itself takes any width)"
        )
    tokens_per_step = cfg.tokens_per_step()
    notes: list[str] = []
    machine = machine_info()
    started = time.perf_counter()

    batches = _train_batches(cfg, warmup + steps)  # what the Trainer's run_step reads, in order
    ray_is_ours = not ray.is_initialized()  # then the driver's process tree holds all of Ray
    trainer = ray_trainer(cfg)
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    failed: dict[str, str] = {}
    children: dict[str, _ChildSystem] = {}
    ray_setup_s: float | None = None
    outside: float | None = None

    with tempfile.TemporaryDirectory(prefix="elastic-llm-bench-") as workdir:
        batches_path = os.path.join(workdir, "batches.npz")
        np.savez(batches_path, x=np.stack([b[0] for b in batches]), y=np.stack([b[1] for b in batches]))
        cfg_dict = cfg.to_dict()
        world = par.stages * par.dp
        port = free_port()
        try:
            # Start the peers first: they build while Ray starts (nothing is timed yet).
            t0 = time.perf_counter()
            children["single_process"] = _ChildSystem("single_process", "single_process", [(cfg_dict, batches_path)])
            if train.precision == "fp32":
                children["torch_pipelining"] = _ChildSystem(
                    "torch_pipelining", "torch_pipelining", [(rank, world, port, cfg_dict, batches_path) for rank in range(world)]
                )
            else:  # its stages would need autocast inside torch.distributed.pipelining and bf16 buffers declared: not written
                failed["torch_pipelining"] = f"not run at train.precision={train.precision}: this peer runs fp32 only here"
            trainer.setup()
            ray_setup_s = time.perf_counter() - t0  # Ray start + actors (peers build meanwhile)
            for name, child in list(children.items()):
                try:
                    child.wait_ready()
                except RuntimeError as e:
                    failed[name] = str(e)
                    child.close()
                    del children[name]
            child_pids = set().union(*(c.pids() for c in children.values())) if children else set()

            def ray_step(i: int) -> dict[str, Any]:  # run_step reads batch i itself
                c0 = tree_cpu_s(os.getpid(), child_pids) if ray_is_ours else None
                t0 = time.perf_counter()
                record = trainer.run_step()
                dt = time.perf_counter() - t0
                c1 = tree_cpu_s(os.getpid(), child_pids) if c0 is not None else None
                return {"time": dt, "cpu": c1 - c0 if c0 is not None and c1 is not None else None, "loss": record["loss"]}

            step_fns: dict[str, Callable[[int], dict[str, Any]]] = {"ray_pipeline": ray_step}
            step_fns.update({name: child.step for name, child in children.items()})
            busy0, ours0, wall0 = machine_busy_s(), tree_cpu_s(os.getpid()), time.perf_counter()
            for i in range(warmup + steps):
                active = [name for name in SYSTEMS if name in step_fns and name not in failed]
                k = i % len(active)
                for name in active[k:] + active[:k]:  # rotate who goes first
                    try:
                        rec = step_fns[name](i)
                    except RuntimeError as e:
                        if name == "ray_pipeline":
                            raise
                        failed[name] = str(e)
                        children.pop(name).close()
                        continue
                    if i >= warmup:
                        records[name].append(rec)
            busy1, ours1 = machine_busy_s(), tree_cpu_s(os.getpid())
            if None not in (busy0, busy1, ours0, ours1):
                outside = outside_share(busy1 - busy0, ours1 - ours0, time.perf_counter() - wall0)  # type: ignore[operator]
        finally:
            for child in children.values():
                child.close()
            trainer.shutdown()

    details: dict[str, Any] = {}
    for name in SYSTEMS:
        if name in failed or not records[name]:
            details[name] = {"tokens_per_s": None, "error": failed.get(name, "did not run")[-3000:]}
            last_line = failed.get(name, "did not run").strip().splitlines()[-1]
            notes.append(f"{name} could not run here, reported as null: {last_line}")
        else:
            details[name] = _summary(records[name], tokens_per_step)
    if ray_setup_s is not None:
        details["ray_pipeline"]["setup_s"] = round(ray_setup_s, 1)
    if "error" not in details["single_process"]:
        details["single_process"]["threads"] = records["single_process"][0]["threads"]
    if "error" not in details["torch_pipelining"]:
        details["torch_pipelining"].update(
            processes=world,
            threads_per_process=records["torch_pipelining"][0]["threads"],
            schedule_class={"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[par.schedule],
        )

    ray_tps = details["ray_pipeline"]["tokens_per_s"]
    single_tps = details["single_process"].get("tokens_per_s")
    torch_tps = details["torch_pipelining"].get("tokens_per_s")

    first_losses = {k: v["loss_first_step"] for k, v in details.items() if v.get("loss_first_step") is not None}
    if len(first_losses) > 1:
        # Same weights, batches and update rule: the first timed step's loss must agree up to float
        # reordering, or the systems are not doing the same work.
        spread = max(first_losses.values()) - min(first_losses.values())
        if not math.isfinite(spread) or spread > 1e-4 * max(1.0, *(abs(v) for v in first_losses.values())):
            notes.append(f"first timed step losses differ by {spread:.2e}: {first_losses}")
    notes.append(
        f"{par.stages} stages x dp {par.dp} at {par.threads()} thread(s) and {par.cpus_per_actor} CPU per stage on "
        f"{os.cpu_count()} cores; the single process uses {os.cpu_count()} threads. The systems take turns step by step; "
        "other load on the machine moves absolute numbers between runs, so compare ratios (median_ratios resist bursts)."
    )
    load_at_end(machine)
    machine["outside_cpu_share"] = round(outside, 3) if outside is not None else None
    if outside is not None and outside > 0.15:
        notes.append(f"other processes used {outside:.0%} of the machine's CPU while the steps ran: every number is disturbed.")

    def median_of(name: str) -> float | None:
        return details[name].get("median_step_s")

    return {
        "benchmark": "pipeline",
        "config": cfg.name,
        "config_path": str(config_path),
        "overrides": list(overrides),
        "parameters": count_parameters(cfg.model.shape()),
        "stages": par.stages,
        "dp": par.dp,
        "microbatches": par.microbatches,
        "schedule": par.schedule,
        "threads_per_stage": par.threads(),
        "batch_size": train.batch_size,
        "seq_len": cfg.model.seq_len,
        "tokens_per_step": tokens_per_step,
        "steps": steps,
        "warmup": warmup,
        "ray_pipeline_tokens_per_s": ray_tps,
        "single_process_tokens_per_s": single_tps,
        "torch_pipelining_tokens_per_s": torch_tps,
        "ratio_vs_single": ratio(ray_tps, single_tps),
        "ratio_vs_torch_pipelining": ratio(ray_tps, torch_tps),
        # The same ratios from median step times: robust to one step hit by a burst of outside load.
        "median_ratios": {
            "vs_single": ratio(median_of("single_process"), median_of("ray_pipeline")),
            "vs_torch_pipelining": ratio(median_of("torch_pipelining"), median_of("ray_pipeline")),
        },
        # CPU seconds per step over all of a system's processes: barely moved by outside load, it
        # shows what a system spends on top of the same model math.
        "cpu_s_per_step": {name: details[name].get("cpu_s_per_step") for name in SYSTEMS},
        "details": details,
        "machine": machine,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 1),
        "notes": notes,
    }


if __name__ == "__main__":
    from benchmarks.common import main

    raise SystemExit(main("pipeline"))
