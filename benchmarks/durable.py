"""Durable tier: our flush and restore against a plain fsynced write, torch.save and torch.load.

Measures, in one run (peers side by side, medians of rounds; compare ratios, the machine is shared):

* in process, on the config's whole training state (a one-stage :class:`StageWorker` holding every
  layer after two optimizer steps): the product's shard writer (``format.write_shard`` of every
  tensor, CRC-32 included, fsync) into a local directory -> ``write_GBps``; a plain sequential
  write of the same bytes with fsync into the same directory -> ``disk_write_GBps``; ``torch.save``
  of the same state + fsync -> ``torch_save_GBps``; the product's restore (``load_durable``: read,
  verify every CRC, load into the stage) -> ``restore_s``; ``torch.load`` + ``load_state_dict`` of
  the torch.save file -> ``torch_load_s``;
* on an embedded Ray, the flush through the snapshot managers (a Trainer with
  ``durable.every: 1``): ``flush_GBps`` of the final flush (training idle; 5 rounds alternating
  with a plain write + fsync of as many bytes, each writing new files: the previous round's are
  deleted first, untimed, for both) and ``flush_GBps_during_training``; ``train_overhead_pct``: tokens/s of that run vs the same run
  with no durable tier (both live, taking turns in blocks of steps);
* on a loopback cluster of 3 worker nodes (``snapshot.group_size=3``, parity 1, SPREAD): a run
  with ``snapshot.every: auto`` (after 30 steps to settle) against the same run with
  ``snapshot.enabled: false``, taking turns in 3 blocks of at least two of the intervals auto
  chose: ``auto_overhead_pct`` (the median block), every block's, ``auto_every`` and ``auto_why``.
  Every trainer runs as a run's middle (``train.max_steps`` far past the timed steps).
  ``--auto-only`` runs this comparison alone.

Must never: copy product code (it calls the writer, the restore and the Trainer), judge results
(targets live in BENCHMARKS.md), leave Ray, clusters or files behind, or reach beyond 127.0.0.1.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

from benchmarks.common import MID_RUN, fs_type, median, torch_adamw
from elastic_llm import events
from elastic_llm.config import RunConfig, load_config
from elastic_llm.durable.storage import fsync_path


def _in_process(config_path: str, overrides: Sequence[str], workdir: str, rounds: int) -> dict[str, Any]:
    from elastic_llm.durable import format as fmt
    from elastic_llm.durable.flush import stage_tensors
    from elastic_llm.durable.storage import Storage
    from elastic_llm.pipeline.stage import StageWorker

    one = load_config(config_path, [*overrides, "parallel.stages=1"])
    w = StageWorker(one, 0, 0)  # every layer, AdamW moments allocated up front: the whole training state
    buf, manifest = w.capture_state({"epoch": 0, "index": 0})
    tensors = stage_tensors(manifest, w.module.layer_ids)
    nbytes = int(sum(t.nbytes for t in tensors))
    run = Storage(os.path.join(workdir, "run"))
    res: dict[str, list[float]] = {"write": [], "disk": [], "torch_save": [], "restore": [], "torch_load": []}
    sd = {"model": w.module.state_dict(), "optim": torch_adamw(w.optimizer).state_dict()}  # torch's optimizer over the same tensors
    for r in range(rounds):
        name = fmt.checkpoint_dir(r)
        run.makedirs(name)
        t = time.perf_counter()
        n, records = fmt.write_shard(run, f"{name}/{fmt.shard_file(0, 0)}", tensors, lambda lo, hi: iter([buf[lo:hi]]), {"format": "pt"})
        res["write"].append(time.perf_counter() - t)
        fmt.commit(run, name, fmt.make_manifest(one, w.step_count, "run", [(0, 0, manifest)], [fmt.PartResult(0, 0, fmt.shard_file(0, 0), n, 0.0, records)], None))
        plain = os.path.join(workdir, f"plain-{r}.bin")
        t = time.perf_counter()
        with open(plain, "wb") as f:
            for spec in tensors:
                f.write(buf[spec.src : spec.src + spec.nbytes])
            f.flush()
            os.fsync(f.fileno())
        res["disk"].append(time.perf_counter() - t)
        pt = os.path.join(workdir, f"state-{r}.pt")
        t = time.perf_counter()
        torch.save(sd, pt)
        fsync_path(pt)
        res["torch_save"].append(time.perf_counter() - t)
        fresh = StageWorker(one, 0, 0)
        fresh_optim = torch_adamw(fresh.optimizer)

        def ours(fresh: Any = fresh, name: str = name) -> None:
            t = time.perf_counter()
            fresh.load_durable(run.uri, name)
            res["restore"].append(time.perf_counter() - t)

        def peer(fresh: Any = fresh, pt: str = pt, fresh_optim: Any = fresh_optim) -> None:
            t = time.perf_counter()
            loaded = torch.load(pt, weights_only=True)
            fresh.module.load_state_dict(loaded["model"])
            fresh_optim.load_state_dict(loaded["optim"])
            res["torch_load"].append(time.perf_counter() - t)

        for go in ((ours, peer) if r % 2 == 0 else (peer, ours)):  # taking turns: the first after the writes pays for fresh memory
            go()
        for p in (plain, pt):
            os.remove(p)
        run.delete_dir(name)
    med = {k: median(v) for k, v in res.items()}
    return {
        "bytes": nbytes,
        "write_GBps": nbytes / med["write"] / 1e9,
        "disk_write_GBps": nbytes / med["disk"] / 1e9,
        "torch_save_GBps": nbytes / med["torch_save"] / 1e9,
        "restore_s": med["restore"],
        "torch_load_s": med["torch_load"],
        "restore_vs_torch_load": med["torch_load"] / med["restore"],
    }


def _alternate(cfgs: Sequence[RunConfig], warmup: int, blocks: int, block_steps: int | Callable[[list[Any]], int], cluster: Any = None,
               metrics: Sequence[str | None] = (), after: Any = None) -> tuple[list[float], list[Any], list[list[float]]]:
    """Live Trainers of ``cfgs`` taking turns in blocks of ``block_steps`` steps (``warmup`` steps
    each first, so e.g. ``snapshot.every: auto`` has settled): the median over rounds of each
    one's tokens/s relative to the first's, the first's median tokens/s, the Trainers (shut
    down) and each one's per-block throughput relative to the first's in the same round (the
    noise). ``block_steps`` may be a function of the Trainers after their warm-up. ``after(trainers)``
    runs before they shut down. Taking turns puts the machine's noise into every run alike."""
    from elastic_llm.runtime.ray_runtime import ray_trainer

    ts = [ray_trainer(c, cluster=cluster, metrics_out=(list(metrics) + [None] * len(cfgs))[i]) for i, c in enumerate(cfgs)]
    try:
        for t in ts:
            t.setup()
            for _ in range(warmup):
                t.run_step()
        if callable(block_steps):
            block_steps = block_steps(ts)
        rates: list[list[float]] = [[] for _ in ts]
        for r in range(blocks):
            order = list(range(len(ts))) if r % 2 == 0 else list(reversed(range(len(ts))))
            for i in order:
                t0 = time.perf_counter()
                for _ in range(block_steps):
                    ts[i].run_step()
                rates[i].append(block_steps * cfgs[i].tokens_per_step() / (time.perf_counter() - t0))
        for t in ts:
            if t.snapshots is not None:
                t.snapshots.poll(block=True)
            if t.durable is not None:
                t.durable.finish()
        per_block = [[rates[i][r] / rates[0][r] for r in range(blocks)] for i in range(len(ts))]
        if after is not None:
            after(ts)
        return [median(rates[0])] + [median(x) for x in per_block[1:]], ts, per_block
    finally:
        for t in ts:
            t.shutdown()


def _embedded(config_path: str, overrides: Sequence[str], workdir: str, steps: int) -> dict[str, Any]:
    import ray

    base = [*overrides, "train.eval_every=0", MID_RUN]
    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        m = os.path.join(workdir, "durable.jsonl")
        cfgs = [load_config(config_path, base), load_config(config_path, [*base, f"durable.storage_path={workdir}/emb", "durable.every=1", "durable.keep_last=2"])]
        side: dict[str, Any] = {}
        (off, ratio), _, _ = _alternate(cfgs, warmup=3, blocks=6, block_steps=max(1, steps // 6), metrics=[None, m],
                                        after=lambda ts: side.update(_flush_rounds(ts[1], workdir, FLUSH_ROUNDS)))
        flushes = [ev for ev in events.read_events(m) if isinstance(ev, events.Durable)]
        during = [f for f in flushes[:-FLUSH_ROUNDS - 1] if f.gbps > 0]
        return {
            **side,
            "flush_GBps_during_training": median(f.gbps for f in during) if during else None,
            "flushes": len(flushes),
            "train_overhead_pct": 100.0 * (1 - ratio),
            "tokens_per_s_durable_off": off,
            "tokens_per_s_durable_every_1": off * ratio,
        }
    finally:
        ray.shutdown()


FLUSH_ROUNDS = 5


def rec_bytes(rec: Any) -> int:
    """The bytes of a committed version's state (its shards' pieces)."""
    return int(sum(p.length for sh in rec.shards for p in sh.pieces))


def _flush_rounds(t: Any, workdir: str, rounds: int) -> dict[str, Any]:
    """With training idle: the trainer's durable tier flushes its newest committed snapshot
    ``rounds`` times (through the snapshot managers; timed as the product times it, from the
    start to its commit marker made durable),
    alternating with a plain write + fsync of as many bytes (one file, from a warm buffer) into
    the same directory: the medians, and their ratio (the flush's speed against the disk's)."""
    import numpy as np

    tier = t.durable
    tier.finish()
    rec = t.snapshots.committed
    flush_s, plain_s, nbytes = [], [], 0
    data: Any = None
    for r in range(rounds):
        for what in (("flush", "plain") if r % 2 == 0 else ("plain", "flush")):
            if what == "flush":
                if tier.latest() is not None:  # the previous round's files go first, as the plain file does: both write new files
                    shutil.rmtree(os.path.join(tier.run.root, tier.latest()[1]), ignore_errors=True)
                before = tier.stats.seconds
                tier.start(rec)
                tier.poll(block=True)
                flush_s.append(tier.stats.seconds - before)  # the product's own: start to the marker made durable (pruning after it excluded)
                ckpt = os.path.join(tier.run.root, tier.latest()[1])
                nbytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))  # shard files, manifest and marker
            else:
                if data is None:
                    data = np.ones(rec_bytes(rec), dtype=np.uint8)  # written once here: warm memory, as the snapshot pieces are
                path = os.path.join(workdir, "plain.bin")
                t0 = time.perf_counter()
                with open(path, "wb") as f:
                    f.write(memoryview(data)[: nbytes or len(data)])
                    f.flush()
                    os.fsync(f.fileno())
                plain_s.append(time.perf_counter() - t0)
                os.remove(path)
    fl, pl = median(flush_s), median(plain_s)
    return {"flush_bytes": nbytes, "flush_GBps": nbytes / fl / 1e9, "flush_rounds_s": [round(x, 4) for x in flush_s],
            "plain_same_bytes_GBps": nbytes / pl / 1e9, "plain_rounds_s": [round(x, 4) for x in plain_s], "flush_vs_plain": pl / fl}


AUTO_BLOCKS = 3  # blocks of the auto comparison (its median is the figure) ...
AUTO_CYCLES = 2  # ... each at least this many of the intervals auto chose (a block shorter than one says nothing)


def _auto_on_cluster(config_path: str, overrides: Sequence[str], steps: int, settle: int = 30) -> dict[str, Any]:
    import ray

    from elastic_llm.runtime.session import loopback_cluster

    base = [*overrides, "train.eval_every=0", MID_RUN, "snapshot.group_size=3", "snapshot.parity=1", "parallel.placement_strategy=SPREAD",
            "parallel.cpus_per_actor=0.5"]
    c = loopback_cluster(3, 2)
    try:
        cfgs = [load_config(config_path, [*base, "snapshot.enabled=false"]), load_config(config_path, [*base, "snapshot.every=auto"])]
        chosen: list[int] = []

        def block_steps(ts: list[Any]) -> int:
            chosen.append(max(steps // AUTO_BLOCKS, AUTO_CYCLES * ts[1].snapshots.every))
            return chosen[0]

        (off, ratio), ts, per_block = _alternate(cfgs, warmup=settle, blocks=AUTO_BLOCKS, block_steps=block_steps, cluster=c)
        return {
            "auto_block_steps": chosen[0],
            "auto_overhead_pct": 100.0 * (1 - ratio),
            "auto_overhead_blocks_pct": [round(100.0 * (1 - x), 2) for x in per_block[1]],  # the noise: each block's
            "auto_budget_pct": cfgs[1].snapshot.max_overhead_pct,
            "auto_every": ts[1].snapshots.every,
            "auto_why": ts[1].snapshots.why,
            "tokens_per_s_snapshots_off": off,
            "tokens_per_s_snapshots_auto": off * ratio,
        }
    finally:
        ray.shutdown()
        c.shutdown()


def run_durable_bench(config_path: str = "jobs/tiny.yaml", overrides: Sequence[str] = (), rounds: int = 5, steps: int = 36, cluster_steps: int = 48,
                      auto_only: bool = False) -> dict[str, Any]:
    """The durable tier against its peers (see the module doc); ``auto_only``: just the
    ``snapshot.every: auto`` comparison on the 3-node loopback cluster (the flush and restore
    comparisons skipped: on llama-25m they take most of the half hour)."""
    from elastic_llm.runtime.session import loopback_env

    loopback_env()
    load_config(config_path, list(overrides))  # a bad config fails here, before anything starts
    with tempfile.TemporaryDirectory(prefix="elastic-llm-bench-durable-", dir=os.environ.get("ELASTIC_LLM_BENCH_DIR")) as workdir:
        out: dict[str, Any] = {"config": config_path, "overrides": list(overrides), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__, "fs": fs_type(workdir)}}
        if not auto_only:
            out.update(_in_process(config_path, overrides, workdir, rounds))
            out.update(_embedded(config_path, overrides, workdir, steps))
            out["flush_vs_disk"] = out["flush_GBps"] / out["disk_write_GBps"]
            out["write_vs_disk"] = out["write_GBps"] / out["disk_write_GBps"]
        out.update(_auto_on_cluster(config_path, overrides, cluster_steps))
    auto_note = ("auto_overhead_pct: snapshot.every=auto against snapshots off, two live Trainers on the 3-node loopback cluster taking "
                 "turns in 6 blocks (order alternating), median of the per-block throughput ratio; auto after 30 steps to settle")
    out["notes"] = auto_note if auto_only else (
        "write_GBps: the product's shard writer on the whole state in process; flush_GBps: the final flush through the snapshot "
        "managers (training idle; includes the manifest + marker commit); train_overhead_pct: durable.every=1 against no durable "
        "tier, two live Trainers taking turns in blocks of steps; " + auto_note
    )
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}
