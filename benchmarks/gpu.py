"""One CUDA GPU, without Ray: the GPU tests, device-to-host copy bandwidth, the snapshot's stall per
step and bf16 against fp32 on one in-process stage, in one JSON file (DIR/gpu.json).

Owns ``python -m benchmarks.gpu --out DIR [--budget-s 420]``. Its parts run in order, each within its
share of the budget (what one leaves goes to those after it), a part's failure recorded in the JSON
(``parts.<name>.error``) rather than ending the run: (1) ``pytest -m gpu tests/gpu`` in a subprocess,
its counts, its output in DIR/pytest-gpu.txt; (2) device-to-host GB/s of 256 MiB and 1 GiB blocks into
a buffer page-locked in place by the product's :func:`~elastic_llm.pipeline.copies.pinned`
(``cudaHostRegister``), into torch's pinned allocator and into pageable memory, against a
device-to-device copy of the same size (the peer), medians timed by CUDA events; (3) the snapshot's
stall: one 1-stage :class:`~elastic_llm.pipeline.stage.StageWorker` (MODEL, bf16) driven as tests/gpu
drives one, with no snapshot and with one every step in alternating blocks: median step times, their
difference, ``snapshot_wait_s``, one copy's time; (4) tokens/s of that stage in fp32, bf16 and bf16
with layer checkpointing, alternating, and each one's peak CUDA memory above what is resident.

A step is timed by the wall clock up to the end of the compute stream's work, never a device-wide
synchronize (that would wait for the snapshot's copy stream too and hide the overlap measured). Exit
0 when every part ran and the tests passed, 1 otherwise, 2 without a CUDA device (one line on
stderr, nothing written); a watchdog ends the run 40 s past its budget, with the JSON it has.

Must never: import Ray (nor anything that does, at import or while it runs: the GPU machine has
none), write outside DIR, copy product code (the step is the stage's own calls, the pinned buffer
the product's function), or judge its figures (BENCHMARKS.md does).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import median, ratio

EXIT_NO_DEVICE = 2
REPO = Path(__file__).resolve().parent.parent
RESULT, PYTEST_LOG = "gpu.json", "pytest-gpu.txt"
MIB = 1 << 20
COPY_SIZES = (256 * MIB, 1024 * MIB)
HOSTS = ("registered", "torch_pinned", "pageable", "device")  # where a device-to-host copy goes; "device": device-to-device, the peer
# ~150M parameters (1.8 GB of fp32 state with AdamW's moments), 8k tokens a step
MODEL = ["model.vocab_size=8192", "model.dim=1024", "model.n_heads=16", "model.n_layers=8", "model.seq_len=1024", "train.batch_size=8",
         "parallel.microbatches=1", "parallel.stages=1", "parallel.gpus_per_actor=1", "train.warmup_steps=1", "train.max_steps=1000000"]
PRECISIONS = {"fp32": ["train.precision=fp32"], "bf16": ["train.precision=bf16"], "bf16_ckpt": ["train.precision=bf16", "train.activation_checkpointing=layers"]}
SHARES = {"pytest": 3, "copies": 1, "stall": 2, "precision": 3}  # relative shares of the budget
GRACE_S = 40.0  # past the budget the watchdog stops the run: the default budget's run stays under 8 minutes
Part = Callable[[Path, float], dict]  # (DIR, deadline on time.monotonic()) -> its figures


def ms(s: float | None) -> float | None:
    return round(s * 1e3, 3) if s is not None else None


def write_json(path: Path, result: dict) -> None:
    """``result`` as ``path``, replaced whole (a run stopped midway leaves the parts done so far)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------- 1. the GPU tests
def pytest_counts(text: str) -> dict[str, int]:
    """{outcome: count} from pytest's last summary line ("1 failed, 2 passed, 1 warning in 3.1s")."""
    lines = [ln for ln in text.splitlines() if re.search(r"\bin [\d.]+s\b", ln)]
    found = re.findall(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?)\b", lines[-1] if lines else "")
    return {("errors" if word.startswith("error") else word): int(n) for n, word in found}


def gpu_tests(out: Path, deadline: float) -> dict:
    """tests/gpu in a subprocess; ``-m gpu`` comes after pyproject's addopts (``-m 'not slow'``), so it wins."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"]
    # tests/conftest.py's loopback_env() runs `ray get-auth-token --generate` in token mode when no token file exists: these tests need no Ray
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}  # no bytecode caches written into the checkout
    timeout = max(1.0, deadline - time.monotonic())
    res: dict[str, Any] = {"command": shlex.join(cmd), "output": PYTEST_LOG, "timeout_s": round(timeout, 1)}
    with open(out / PYTEST_LOG, "w") as log:
        try:
            res["returncode"] = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            res["returncode"], res["error"] = None, f"pytest did not finish within {timeout:.0f} s (killed)"
    text = (out / PYTEST_LOG).read_text(errors="replace")
    counts = pytest_counts(text)
    res.update(counts=counts, passed=counts.get("passed", 0), failed=counts.get("failed", 0) + counts.get("errors", 0), tail=text.splitlines()[-15:])
    if "error" not in res and (res["returncode"] != 0 or not res["passed"]):
        res["error"] = f"pytest exited {res['returncode']}: {res['passed']} passed, {res['failed']} failed or errors (see {PYTEST_LOG})"
    return res


# ---------------------------------------------------------------------- 2. copy bandwidth
def time_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int, deadline: float) -> list[float]:
    """Seconds of each ``dst.copy_(src)`` on the current stream (CUDA events), after one untimed copy
    (first touch of ``dst``'s pages); at least one timed, fewer than ``repeats`` once ``deadline`` passes."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times: list[float] = []
    for _ in range(repeats):
        if times and time.monotonic() > deadline:
            break
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)  # into pageable memory the call returns once the copy is done
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return times


def unregister(address: int) -> None:
    """Undo ``pinned`` (cudaHostRegister) of the buffer at ``address``."""
    err = torch.cuda.cudart().cudaHostUnregister(address)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister failed ({err})")


def host(kind: str, n: int) -> torch.Tensor:
    """``n`` bytes to copy into, of a kind in HOSTS: ``registered`` is pinned in place as a stage's copy buffers are (every page
    touched, then the product's ``pinned``; :func:`unregister` it after), ``device`` is the peer's."""
    if kind == "registered":
        from elastic_llm.pipeline.copies import pinned  # here: if the product's imports fail (reedsolo missing, say), only this row does

        buf = np.empty(n, dtype=np.uint8)
        buf.fill(0)
        return torch.from_numpy(pinned(buf))
    return torch.zeros(n, dtype=torch.uint8, pin_memory=kind == "torch_pinned", device="cuda" if kind == "device" else "cpu")


def copy_bandwidth(deadline: float, sizes: Sequence[int] = COPY_SIZES, repeats: int = 7) -> dict:
    """Device-to-host GB/s into each kind of host memory, and device-to-device (the peer)."""
    res: dict[str, Any] = {"unit": "GB/s: 1e9 bytes copied per second, one way", "repeats": repeats, "sizes": {}}
    for n in sizes:
        row: dict[str, Any] = res["sizes"].setdefault(f"{n // MIB}MiB", {})
        if time.monotonic() > deadline:
            row["error"] = "budget spent"
            continue
        src = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
        for name in HOSTS:
            try:  # one kind of memory failing (pinning refused, say) leaves the others' figures
                dst = host(name, n)
                try:
                    t = median(time_copy(dst, src, repeats, deadline))
                finally:
                    if name == "registered":
                        unregister(dst.data_ptr())
                    del dst
                row[name] = {"gbps": round(n / t / 1e9, 2), "ms": ms(t)}
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {e}"}
        del src
        torch.cuda.empty_cache()
        bw = {k: v.get("gbps") for k, v in row.items()}
        row["ratios"] = {f"{a}/{b}": ratio(bw.get(a), bw.get(b)) for a, b in
                         (("registered", "torch_pinned"), ("registered", "pageable"), ("registered", "device"), ("torch_pinned", "device"), ("pageable", "device"))}
    return res


# ---------------------------------------------------------------------- 3 and 4. one stage's steps
def build(sets: Sequence[str]) -> Any:
    """A 1-stage StageWorker of the defaults with ``sets`` (``--set`` style), as tests/gpu builds one."""
    from elastic_llm.config import load_config
    from elastic_llm.pipeline.stage import StageWorker

    return StageWorker(load_config(None, list(sets)), 0, 0)


def release(worker: Any) -> None:
    """Drop a stage: its last copy done, its copy thread ended, its pinned buffers unregistered
    (``pinned`` keeps them for the process's life, and this process builds several stages)."""
    worker.copies.wait()
    worker.copies.thread.shutdown(wait=True)
    for buf in worker.copies.buffers.values() if worker.device.type == "cuda" else ():
        unregister(buf.ctypes.data)
    worker.copies.held.clear()
    worker.copies.buffers.clear()


def batches(worker: Any, n: int, seed: int = 0) -> list[tuple[torch.Tensor, np.ndarray]]:
    """``n`` random batches: inputs already on the stage's device, targets on the host (as ``forward`` takes them)."""
    m, b, g = worker.cfg.model, worker.cfg.train.batch_size, np.random.default_rng(seed)
    return [(torch.as_tensor(g.integers(0, m.vocab_size, (b, m.seq_len)), device=worker.device), g.integers(0, m.vocab_size, (b, m.seq_len))) for _ in range(n)]


def train_step(worker: Any, batch: tuple[torch.Tensor, np.ndarray], snapshot: dict | None = None) -> float:
    """One optimizer step of a 1-stage pipeline as tests/gpu drives it; its wall seconds until the compute stream is done."""
    x, y = batch
    t = time.perf_counter()
    worker.forward(0, x, y)
    worker.backward(0, None)
    worker.step(snapshot=snapshot)
    if worker.device.type == "cuda":  # the compute stream's work only (see the module's docstring)
        torch.cuda.current_stream(worker.device).synchronize()
    return time.perf_counter() - t


def alternate(variants: dict[str, Callable[[bool], float]], block: int, rounds: int, deadline: float) -> dict[str, list[float]]:
    """Step seconds of each variant (called with ``first``: the block's first step) in blocks of ``block``
    steps taking turns, the order reversed every other round; each block's first step is left out (it
    pays for what the block before left running). At most ``rounds`` rounds, at least one, fewer once ``deadline`` passes."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        if r and time.monotonic() > deadline:
            break
        for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
            for j in range(block):
                dt = variants[name](j == 0)
                if j:
                    times[name].append(dt)
    return times


def snapshot_stall(sets: Sequence[str], deadline: float, block: int = 5, rounds: int = 12, warmup: int = 3) -> dict:
    """Median step time without snapshots and with one every step (in bf16); the difference is the stall."""
    sets = [*sets, "train.precision=bf16"]
    worker = build(sets)
    try:
        data = batches(worker, 4)
        for i in range(warmup):  # the last one snapshots: the copy stream and the first copy are paid before timing
            train_step(worker, data[i % len(data)], {"epoch": 0, "index": i} if i == warmup - 1 else None)
        count, waits, copy_s = [warmup], {"none": [], "snapshot": []}, []

        def variant(name: str) -> Callable[[bool], float]:
            def one(first: bool) -> float:
                count[0] += 1
                wait, previous = worker.snapshot_wait_s, worker.copies.latest
                dt = train_step(worker, data[count[0] % len(data)], {"epoch": 0, "index": count[0]} if name == "snapshot" else None)
                if not first:
                    waits[name].append(worker.snapshot_wait_s - wait)
                    if name == "snapshot":
                        copy_s.append(previous.result())  # the previous step's copy, which this step's update waited for: done
                return dt
            return one

        wait0 = worker.snapshot_wait_s
        times = alternate({"none": variant("none"), "snapshot": variant("snapshot")}, block, rounds, deadline)
        worker.copies.wait()
        none, snap, nbytes = median(times["none"], or_none=True), median(times["snapshot"], or_none=True), worker.arena.layout.nbytes
        stall = snap - none if none is not None and snap is not None else None
        return {
            "config": sets, "device": str(worker.device), "state_bytes": nbytes, "block": block, "steps_timed": {k: len(v) for k, v in times.items()},
            "step_ms": {"none": ms(none), "snapshot": ms(snap)}, "step_ms_all": {k: [ms(t) for t in v] for k, v in times.items()},
            "stall_ms_per_step": ms(stall), "stall_pct": round(100 * stall / none, 2) if stall is not None and none else None,
            "snapshot_wait_s_growth": round(worker.snapshot_wait_s - wait0, 4), "wait_ms_per_step": {k: ms(median(v, or_none=True)) for k, v in waits.items()},
            "copy_ms": ms(median(copy_s, or_none=True)), "copy_gbps": round(nbytes / median(copy_s) / 1e9, 2) if copy_s else None,
        }
    finally:
        release(worker)


def precision_speed(sets: Sequence[str], deadline: float, block: int = 4, rounds: int = 8, warmup: int = 2) -> dict:
    """Tokens/s and peak memory of the same stage in fp32, bf16 and bf16 with activation checkpointing."""
    workers: dict[str, Any] = {}
    res: dict[str, Any] = {"config": list(sets), "variants": {}}
    try:
        for name, extra in PRECISIONS.items():
            try:  # one that cannot be built (out of memory, say) leaves the others
                workers[name] = build([*sets, *extra])
            except Exception as e:
                res["variants"][name] = {"error": f"{type(e).__name__}: {e}"}
        if not workers:
            raise RuntimeError("no variant could be built")
        first_worker = next(iter(workers.values()))
        tokens, cuda = first_worker.cfg.train.batch_size * first_worker.cfg.model.seq_len, first_worker.device.type == "cuda"
        data = batches(first_worker, 4)
        for w in workers.values():
            for i in range(warmup):
                train_step(w, data[i % len(data)])
        peak = {name: {"peak_memory_bytes": 0, "peak_above_resident_bytes": 0} for name in workers}
        base, count = [0], dict.fromkeys(workers, 0)

        def variant(name: str) -> Callable[[bool], float]:
            def one(first: bool) -> float:
                if cuda and first:
                    torch.cuda.reset_peak_memory_stats()
                    base[0] = torch.cuda.memory_allocated()  # every variant's weights and moments (a step frees its gradients)
                count[name] += 1
                dt = train_step(workers[name], data[count[name] % len(data)])
                if cuda:
                    top, p = torch.cuda.max_memory_allocated(), peak[name]
                    p.update(peak_memory_bytes=max(p["peak_memory_bytes"], top), peak_above_resident_bytes=max(p["peak_above_resident_bytes"], top - base[0]))
                return dt
            return one

        times = alternate({name: variant(name) for name in workers}, block, rounds, deadline)
        for name, ts in times.items():
            step = median(ts, or_none=True)
            res["variants"][name] = {"step_ms": ms(step), "tokens_per_s": round(tokens / step, 1) if step else None, "steps_timed": len(ts),
                                     **{k: v if cuda else None for k, v in peak[name].items()}}
        got = res["variants"]
        res.update(tokens_per_step=tokens, block=block, ratios={f"{a}/{b} {key}": ratio(got.get(a, {}).get(key), got.get(b, {}).get(key)) for a, b, key in (
            ("bf16", "fp32", "tokens_per_s"), ("bf16_ckpt", "bf16", "tokens_per_s"), ("bf16_ckpt", "fp32", "tokens_per_s"),
            ("bf16", "fp32", "peak_above_resident_bytes"), ("bf16_ckpt", "bf16", "peak_above_resident_bytes"))})
        return res
    finally:
        for w in workers.values():
            release(w)


# ---------------------------------------------------------------------- the run
PARTS: dict[str, Part] = {
    "pytest": gpu_tests,
    "copies": lambda out, deadline: copy_bandwidth(deadline),
    "stall": lambda out, deadline: snapshot_stall(MODEL, deadline),
    "precision": lambda out, deadline: precision_speed(MODEL, deadline),
}


def environment(argv: Sequence[str]) -> dict:
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "command": shlex.join([sys.executable, "-m", "benchmarks.gpu", *argv]),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),  # "highest": fp32 matrix products without TF32
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, total_memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                   cudnn=torch.backends.cudnn.version(), visible_devices=torch.cuda.device_count())
    return env


def overdue(path: Path, result: dict, after_s: float) -> None:
    """The watchdog: a part stuck (in CUDA, in the product) past the budget; what was measured so far, then out."""
    result["errors"]["watchdog"] = f"still running {after_s:.0f} s after the start: stopped"
    try:
        write_json(path, result)
    finally:
        print(f"benchmarks.gpu: {result['errors']['watchdog']}", file=sys.stderr, flush=True)
        os._exit(1)


def run(out: Path, budget_s: float, argv: Sequence[str], parts: dict[str, Part]) -> int:
    """Every part in order within ``budget_s``, the JSON rewritten after each. Returns the exit code."""
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULT
    result: dict[str, Any] = {"benchmark": "gpu", "budget_s": budget_s, **environment(argv), "parts": {}, "errors": {}}
    write_json(path, result)

    watchdog = threading.Timer(budget_s + GRACE_S, overdue, (path, result, budget_s + GRACE_S))
    watchdog.daemon = True
    watchdog.start()
    names = list(parts)
    try:
        for i, name in enumerate(names):
            start = time.monotonic()
            left = t0 + budget_s - start
            try:
                if left <= 0:
                    raise TimeoutError("the budget was spent before this part started")
                part = parts[name](out, start + left * SHARES.get(name, 1) / sum(SHARES.get(n, 1) for n in names[i:]))
            except Exception as e:
                part = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8).splitlines()}
            result["parts"][name] = {**part, "wall_s": round(time.monotonic() - start, 2)}
            if "error" in part:
                result["errors"][name] = part["error"]
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            write_json(path, result)
            print(f"benchmarks.gpu: {name} done in {result['parts'][name]['wall_s']} s" + (f" (error: {part['error']})" if "error" in part else ""), file=sys.stderr)
    finally:
        watchdog.cancel()
    result["wall_s"] = round(time.monotonic() - t0, 2)
    write_json(path, result)
    print(f"wrote {path}")
    return 1 if result["errors"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description="One CUDA GPU, no Ray: GPU tests, copy bandwidth, snapshot stall, bf16 vs fp32.")
    p.add_argument("--out", type=Path, required=True, help=f"directory for {RESULT} and {PYTEST_LOG} (created; nothing is written elsewhere)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for all parts together (default 420)")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error(f"--budget-s={args.budget_s:g} must be > 0")
    if not torch.cuda.is_available():
        print(f"error: no CUDA device is visible (torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}, "
              f"CUDA_VISIBLE_DEVICES {os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): benchmarks.gpu measures one GPU; nothing was written", file=sys.stderr)
        return EXIT_NO_DEVICE
    sys.dont_write_bytecode = True  # the product's modules, imported from here on, leave no caches in the checkout
    return run(args.out, args.budget_s, argv, PARTS)


if __name__ == "__main__":
    sys.exit(main())
