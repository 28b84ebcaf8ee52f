"""Snapshots: our in-memory erasure-coded snapshots against torch.save and DCP async_save.

Measures, on the whole model's training state (parameters + AdamW moments) of a config:

* in process, on one 1-stage :class:`~elastic_llm.pipeline.stage.StageWorker` holding every layer
  (``parallel.stages=1``) after two real optimizer steps, the peers taking turns round by round
  (medians over rounds): ``torch.save`` (+ flush + fsync) and ``torch.load`` + ``load_state_dict``
  of ``{"model", "optim"}``; how long ``torch.distributed.checkpoint.async_save`` blocks its
  caller (single-process gloo group on 127.0.0.1); numpy memcpy of the state's bytes; our
  ``capture_state`` copy; Reed-Solomon parity encoding and CRC-32 of the state; our in-memory
  restore (``load_state`` into a fresh worker);
* on a loopback ``ray.cluster_utils.Cluster`` of worker nodes (``snapshot.group_size`` = nodes,
  SPREAD placement, where parity really runs) and, time permitting, on an embedded single-node
  Ray: two live :class:`~elastic_llm.controller.Trainer` runs (``train.eval_every=0``, snapshots
  on / off, ``snapshot.every=1``) taking turns in blocks of ``Trainer.run_step`` calls (a snapshot
  version in flight carries on across blocks as in one uninterrupted run): the training stall
  (the stage actors' ``snapshot_wait_s`` plus the controller's ``snapshots.stats.wait_s``), the
  throughput and CPU overhead of snapshots, and versions committed;
* on the cluster, ``snapshot.every: auto`` against no snapshots (after 60 steps to settle, in
  blocks of 24 steps or two of the intervals it chose, if longer): the overhead ``auto`` achieves next to its budget
  (``snapshot.max_overhead_pct``), per block, and the interval it chose and why; with
  ``--auto-only`` (:func:`run_snapshot_auto`) that alone, after a per-step trace of where a
  version's cost lands (the step that began it, its steps in flight, the ones after);
* on the cluster: the product's restore on the live Trainer with snapshots, from its committed
  version (``snapshots.fetch_stage_state`` + ``load_parts`` into fresh replacement stage actors,
  every stage), and how long a SnapshotManager takes to collect a whole-model stage's snapshot
  (``snapshot_version`` of a one-stage ``ManagerPlan``).

Everything heavy is measured side by side in one run (medians of rounds), because the machine is
shared: compare ratios, not absolute numbers.

Why it is this long (~850 lines): it drives five peers and three settings (in process, a
loopback cluster, an embedded Ray) in one run so that their figures are comparable, and each
needs its own setup and teardown; the pieces are one function each, in the order above.

Must never: copy product code (the step loop, the restore path, the snapshot plans: it calls
them), use a Trainer's private attributes, judge its results (targets and conclusions live in
BENCHMARKS.md), leave Ray, clusters, process groups or temporary files behind (everything is torn
down in ``finally``), or reach anything but 127.0.0.1.
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from benchmarks.common import MID_RUN, free_port, fs_type, load_at_end, machine_busy_s, machine_info, median, outside_share, process_tree_cpu, ratio, reference_rates, torch_adamw
from benchmarks.exchange import exchange_alone
from elastic_llm.config import RunConfig, load_config
from elastic_llm.runtime.session import NAMESPACE, loopback_env
from elastic_llm.controller.trainer import Trainer
from elastic_llm.runtime.ray_runtime import ray_trainer
from elastic_llm.shape import count_parameters


# --------------------------------------------------------------------------- small helpers


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(float(x), nd)


def _gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


def _proc_kind(pid: int, root: int) -> str:
    """What a process of the run is: driver, a Ray actor class, raylet, gcs_server, other."""
    if pid == root:
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return "gone"
    if cmd.startswith("ray::"):
        name = cmd[5:].split(".")[0].split()[0] if cmd[5:].strip() else "worker"
        return "IDLE_worker" if name == "IDLE" else name
    base = os.path.basename(cmd.split()[0]) if cmd else "?"
    return base if base in ("raylet", "gcs_server") else "ray_other"


def _cpu_tree(root: int) -> dict[int, tuple[str, float]] | None:
    """{pid: (kind, CPU seconds user + system)} of ``root`` and all its live descendants. The
    driver starts Ray (GCS, raylets, workers) itself, so this covers every process of a run."""
    tree = process_tree_cpu(root)
    return None if tree is None else {pid: (_proc_kind(pid, root), c) for pid, c in tree.items()}


def _cpu_delta(before: dict[int, tuple[str, float]] | None, after: dict[int, tuple[str, float]] | None) -> dict[str, float] | None:
    """CPU seconds spent between two :func:`_cpu_tree` readings, per process kind (processes that
    appeared count from zero; the kind is the one seen last, e.g. a worker that became an actor)."""
    if before is None or after is None:
        return None
    out: dict[str, float] = {}
    for pid, (kind, c1) in after.items():
        c0 = before.get(pid, (kind, 0.0))[1]
        out[kind] = out.get(kind, 0.0) + max(0.0, c1 - c0)
    return out


# --------------------------------------------------------------------------- in-process part


def _one_stage_worker(cfg: RunConfig) -> Any:
    from elastic_llm.pipeline.stage import StageWorker

    return StageWorker(cfg, 0, 0)


def _train_steps(worker: Any, cfg: RunConfig, n: int) -> None:
    """``n`` real optimizer steps on random tokens (so AdamW moments and step counts exist):
    every microbatch of a step, one sequence each."""
    rng = np.random.default_rng(cfg.train.seed)
    n_micro = int(getattr(worker, "micro_per_replica", cfg.parallel.microbatches))
    for _ in range(n):
        for mb in range(n_micro):
            x = rng.integers(0, cfg.model.vocab_size, (1, cfg.model.seq_len), dtype=np.int64)
            y = rng.integers(0, cfg.model.vocab_size, (1, cfg.model.seq_len), dtype=np.int64)
            worker.forward(mb, x, y)
            worker.backward(mb)
        worker.step()


def _fsync_save(obj: Any, path: str) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _in_process(cfg1: RunConfig, repeats: int, workdir: str, group_size: int) -> tuple[dict[str, Any], Any]:
    """Every in-process measurement; returns (results, (the trained worker, its snapshot buffer,
    manifest)). Parity is timed for RS(k = group_size - parity, parity), the code of the cluster
    phase's erasure group, and for RS(4 + 1)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from elastic_llm.snapshot import state as st
    from elastic_llm.snapshot.erasure import ReedSolomon, checksum, isal_available

    worker = _one_stage_worker(cfg1)
    _train_steps(worker, cfg1, 2)
    module, optim = worker.module, torch_adamw(worker.optimizer)  # the peers save torch's optimizer over the same tensors
    tensors = st.state_tensors(module, optim)
    state_bytes = int(sum(t.numel() * t.element_size() for _, t in tensors))
    buf, manifest = worker.capture_state()  # allocates + touches the reused buffer
    buf_bytes = int(buf.nbytes)
    out: dict[str, Any] = {
        "state_bytes": state_bytes,
        "snapshot_buffer_bytes": buf_bytes,
        "state_tensors": len(tensors),
        "torch_threads": torch.get_num_threads(),
        "checkpoint_dir_fs": fs_type(workdir),
    }

    # ---- memcpy yardstick and our copy: preallocated, warmed
    src = np.array(buf, copy=True)
    dst = np.empty_like(src)
    np.copyto(dst, src)

    # ---- parity encode: the state bytes split into k equal chunks (zero-padded), parity preallocated
    sn = cfg1.snapshot
    codes = {"config": (max(1, group_size - sn.parity), sn.parity), "4+1": (4, 1)}
    enc: dict[str, tuple[Any, list[np.ndarray], list[np.ndarray]]] = {}
    for name, (k, m) in codes.items():
        rs = ReedSolomon(k, m)
        chunk = -(-buf_bytes // k)
        padded = np.zeros(chunk * k, dtype=np.uint8)
        padded[:buf_bytes] = src
        data = [padded[i * chunk : (i + 1) * chunk] for i in range(k)]
        par = [np.zeros(chunk, dtype=np.uint8) for _ in range(m)]
        rs.encode(data, out=par)
        enc[name] = (rs, data, par)

    # ---- DCP: single-process gloo group on loopback
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    own_pg = False
    reused_stager = None

    save_path = os.path.join(workdir, "ckpt.pt")
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "torch_save",
            "torch_load",
            "dcp_get_state_dict",
            "dcp_async_block",
            "dcp_async_total",
            "dcp_async_block_reused_stager",
            "memcpy",
            "snapshot_copy",
            "snapshot_copy_only",
            "checksum",
            "restore_inmemory",
            "restore_inmemory_warm",
            "parity_config",
            "parity_4+1",
        )
    }
    dcp_first_block_s = None
    file_bytes = None

    def t_torch_save() -> None:
        nonlocal file_bytes
        t0 = time.perf_counter()
        _fsync_save({"model": module.state_dict(), "optim": optim.state_dict()}, save_path)
        times["torch_save"].append(time.perf_counter() - t0)
        file_bytes = os.path.getsize(save_path)

    def t_torch_load() -> None:
        fresh = _one_stage_worker(cfg1)  # a replacement starts from a fresh stage, like ours below
        fresh_optim = torch_adamw(fresh.optimizer)
        gc.collect()
        t0 = time.perf_counter()
        ckpt = torch.load(save_path, weights_only=True)
        fresh.module.load_state_dict(ckpt["model"])
        fresh_optim.load_state_dict(ckpt["optim"])
        times["torch_load"].append(time.perf_counter() - t0)
        del ckpt, fresh

    def t_dcp(i: int) -> None:
        nonlocal dcp_first_block_s
        for variant in ("default", "reused"):
            ckpt_dir = os.path.join(workdir, f"dcp-{variant}-{i}")
            t0 = time.perf_counter()
            msd, osd = get_state_dict(module, optim)
            t1 = time.perf_counter()
            kwargs = {"async_stager": reused_stager} if variant == "reused" else {}
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir, **kwargs)
            t2 = time.perf_counter()
            fut.result()  # wait outside the blocking time
            t3 = time.perf_counter()
            if variant == "default":
                times["dcp_get_state_dict"].append(t1 - t0)
                times["dcp_async_block"].append(t2 - t1)
                times["dcp_async_total"].append(t3 - t1)
                if dcp_first_block_s is None:
                    dcp_first_block_s = t2 - t1
            else:
                times["dcp_async_block_reused_stager"].append(t2 - t1)
            shutil.rmtree(ckpt_dir, ignore_errors=True)

    inner = 5  # the short in-memory operations repeat within a round, interleaved (memcpy, ours, memcpy, ...)

    def t_copies() -> None:
        for _ in range(inner):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times["memcpy"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            copy_buf, _ = worker.capture_state()
            times["snapshot_copy"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            worker.arena.capture(copy_buf)  # the bare copy into the same buffer, without the manifest
            times["snapshot_copy_only"].append(time.perf_counter() - t0)

    def t_checksum() -> None:
        for _ in range(inner):
            t0 = time.perf_counter()
            checksum(src)
            times["checksum"].append(time.perf_counter() - t0)

    def t_parity() -> None:
        for _ in range(inner):
            for name, (rs, data, par) in enc.items():
                t0 = time.perf_counter()
                rs.encode(data, out=par)
                times[f"parity_{name}"].append(time.perf_counter() - t0)

    def t_restore() -> None:
        fresh = _one_stage_worker(cfg1)
        gc.collect()
        t0 = time.perf_counter()
        fresh.load_state(buf, manifest)
        times["restore_inmemory"].append(time.perf_counter() - t0)
        del fresh
        t0 = time.perf_counter()
        warm.load_state(buf, manifest)
        times["restore_inmemory_warm"].append(time.perf_counter() - t0)

    warm = _one_stage_worker(cfg1)  # a stage that already has optimizer state (a survivor rolling back)
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=_dt.timedelta(seconds=300))
            own_pg = True
        reused_stager = DefaultStager(StagingOptions(False, False, False, False))  # caches its CPU copies across saves
        warm.load_state(buf, manifest)
        # warm-up round (page faults, first-call set-up), not recorded
        _fsync_save({"model": module.state_dict(), "optim": optim.state_dict()}, save_path)
        worker.capture_state()
        steps: list[Callable[[], None]] = [t_torch_save, t_torch_load, t_copies, t_checksum, t_parity, t_restore]
        for i in range(repeats):
            k = i % len(steps)
            for fn in steps[k:] + steps[:k]:  # rotate who goes first
                fn()
            t_dcp(i)
            buf, manifest = worker.capture_state()  # t_copies re-captured: keep the latest pair
    finally:
        if reused_stager is not None:
            try:
                reused_stager.close()
            except Exception:
                pass
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()
        if os.path.exists(save_path):
            os.remove(save_path)

    med = {k: median(v) for k, v in times.items() if v}
    out.update(
        torch_save_s=_r(med["torch_save"]),
        torch_save_file_bytes=file_bytes,
        torch_load_s=_r(med["torch_load"]),
        dcp_async_block_s=_r(med["dcp_async_block"]),
        dcp_async_block_first_call_s=_r(dcp_first_block_s),
        dcp_async_block_reused_stager_s=_r(med["dcp_async_block_reused_stager"]),
        dcp_get_state_dict_s=_r(med["dcp_get_state_dict"]),
        dcp_async_total_s=_r(med["dcp_async_total"]),
        memcpy_GBps=_gbps(buf_bytes, med["memcpy"]),
        memcpy_best_GBps=_gbps(buf_bytes, min(times["memcpy"])),
        snapshot_copy_GBps=_gbps(state_bytes, med["snapshot_copy"]),
        snapshot_copy_best_GBps=_gbps(state_bytes, min(times["snapshot_copy"])),
        snapshot_copy_s=_r(med["snapshot_copy"]),
        snapshot_copy_only_GBps=_gbps(state_bytes, med["snapshot_copy_only"]),
        checksum_GBps=_gbps(buf_bytes, med["checksum"]),
        parity_encode_GBps=_gbps(buf_bytes, med["parity_config"]),
        parity_code=f"RS({codes['config'][0]}+{codes['config'][1]})",
        parity_encode_4p1_GBps=_gbps(buf_bytes, med["parity_4+1"]),
        parity_backend="isal" if isal_available() else "numpy",
        restore_inmemory_s=_r(med["restore_inmemory"]),
        restore_inmemory_warm_s=_r(med["restore_inmemory_warm"]),
        repeats=repeats,
        raw_s={k: [round(x, 6) for x in v] for k, v in times.items()},
    )
    return out, (worker, buf, manifest)


def _hand_off(cfg1: RunConfig, buf: np.ndarray, manifest: str) -> dict[str, Any]:
    """How long a SnapshotManager on the driver's node takes to collect the snapshot of a stage
    actor holding the whole model (``snapshot_version`` of a one-stage plan, no erasure group)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from elastic_llm.pipeline.stage import StageWorker
    from elastic_llm.snapshot.manager import SnapshotManager
    from elastic_llm.snapshot.records import ManagerPlan, ShardKey
    from elastic_llm.snapshot.introductions import Known

    node = ray.get_runtime_context().get_node_id()
    here = NodeAffinitySchedulingStrategy(node, soft=False)
    smp = ray.remote(SnapshotManager).options(num_cpus=0, max_concurrency=8, scheduling_strategy=here).remote(node, cfg1.snapshot.codec)
    stage = ray.remote(concurrency_groups={"snapshot": 1})(StageWorker).options(num_cpus=0, scheduling_strategy=here).remote(cfg1.to_dict(), 0, 0)
    try:
        version = ray.get(stage.load_state.remote(buf, manifest), timeout=300)
        ray.get([stage.snapshot_now.remote({}), smp.held.remote()], timeout=300)  # both actors started
        t0 = time.perf_counter()
        ray.get(smp.snapshot_version.remote(ManagerPlan(version, ((ShardKey(0, 0), Known.of(stage)),))), timeout=300)
        return {"smp_hand_off_s": _r(time.perf_counter() - t0)}
    finally:
        ray.kill(stage)
        ray.kill(smp)


def _restore_from_trainer(trainer: Trainer, cfg: RunConfig, repeats: int) -> dict[str, Any]:
    """The product's restore of a lost replica, end to end, from the live ``trainer``'s committed
    snapshot, called as the controller calls it: for every stage of replica 0 in turn,
    ``snapshots.fetch_stage_state`` (the managers check the pieces' CRCs and hand out their refs),
    its ``load_parts`` submitted at once to a freshly started replacement stage actor on the node
    holding that stage's shard; then the wait for every load. Together: the whole model's state
    restored, as ``torch.load`` of it in one process is."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from elastic_llm.pipeline.stage import StageWorker
    from elastic_llm.snapshot.records import ShardKey

    snapshots = trainer.snapshots
    record = snapshots.committed
    if record is None:
        raise RuntimeError("the trainer with snapshots has no committed version to restore from")
    par = cfg.parallel
    nodes = [record.shard(ShardKey(s, 0)).node_id for s in range(par.stages)]
    Stage = ray.remote(StageWorker)
    fetch_s, load_s, sources = [], [], set()
    for _ in range(repeats):
        fresh = [
            Stage.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(cfg.to_dict(), s, 0)
            for s, node in enumerate(nodes)
        ]
        try:
            ray.get([a.info.remote() for a in fresh], timeout=300)  # started replacements (their state allocated)
            loads, fetch = [], 0.0
            for s, actor in enumerate(fresh):
                t0 = time.perf_counter()
                src = snapshots.fetch_stage_state(s, 0, frozenset())
                fetch += time.perf_counter() - t0
                loads.append(actor.load_parts.remote(src.manifest, list(src.offsets), *src.refs))
                sources.update(src.sources)
            t0 = time.perf_counter()
            ray.get(loads, timeout=300)
            fetch_s.append(fetch)
            load_s.append(time.perf_counter() - t0)  # what is left of the loads after the last fetch
        finally:
            for a in fresh:
                ray.kill(a)
    return {
        "restore_from_smp_s": _r(median([a + b for a, b in zip(fetch_s, load_s)])),
        # fetch_stage_state calls (shard_parts with CRC checks), then the wait for the loads still running
        "restore_from_smp_components_s": {"shard_parts_with_crc": _r(median(fetch_s)), "load_parts": _r(median(load_s))},
        "restore_from_smp_bytes": int(sum(s.nbytes for s in record.shards)),
        "restore_from_smp_sources": sorted(sources),
        "restore_from_smp_stage_actors": par.stages,
    }


# --------------------------------------------------------------------------- trainer part


def _actor_waits(trainer: Trainer) -> list[float]:
    """Cumulative ``snapshot_wait_s`` of every stage actor (replica-major, stage order)."""
    import ray

    refs = [a.__ray_call__.remote(lambda front: float(front.worker.snapshot_wait_s)) for row in trainer.actors for a in row]
    return ray.get(refs, timeout=120)


def _block(trainer: Trainer, n: int) -> dict[str, Any]:
    """``n`` more steps of ``trainer``, each one ``run_step`` (what ``fit`` runs per step, minus
    fit's final wait for the version in flight: the snapshot pipeline carries on across blocks as
    in one uninterrupted run). Per-step times and CPU seconds per process kind."""
    c0 = _cpu_tree(os.getpid())
    step_s = []
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.run_step()
        step_s.append(time.perf_counter() - t0)
    cpu = _cpu_delta(c0, _cpu_tree(os.getpid()))
    return {"step_s": step_s, "cpu": cpu}


def _block_plan(steps: int, rounds: int) -> list[int]:
    """Lengths of the ``rounds`` blocks (>= 2 steps each) that ``steps`` timed steps are cut into."""
    rounds = max(1, min(rounds, steps // 2))
    return [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]


def _compare_trainers(
    cfg_on: RunConfig,
    cfg_off: RunConfig,
    blocks_plan: list[int] | Callable[[Trainer], list[int]],
    warmup: int,
    cluster: Any = None,
    then: Callable[[Trainer], dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two live Trainers on the running Ray (snapshots on / off) taking turns, one block of
    ``blocks_plan[r]`` steps each in round r (the order alternates every round; a function of
    the trainer with snapshots after the warm-up gives the plan then). Returns the
    comparison and what ``then`` measured on the trainer with snapshots afterwards (before either
    shuts down, its last version committed)."""
    on, off = ray_trainer(cfg_on, cluster=cluster), ray_trainer(cfg_off, cluster=cluster)
    try:
        t0 = time.perf_counter()
        on.setup()
        off.setup()
        setup_s = time.perf_counter() - t0
        for _ in range(warmup):  # run_step, as the blocks: fit(warmup) would make every later step the run's last (a snapshot each)
            on.run_step()
            off.run_step()
        if callable(blocks_plan):
            blocks_plan = blocks_plan(on)
        waits0, stats0 = _actor_waits(on), asdict(on.snapshots.stats)
        busy0, wall0 = machine_busy_s(), time.perf_counter()
        blocks: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for r, n in enumerate(blocks_plan):
            order = [("on", on), ("off", off)] if r % 2 == 0 else [("off", off), ("on", on)]
            for name, t in order:
                blocks[name].append(_block(t, n))
        busy1, wall1 = machine_busy_s(), time.perf_counter()
        waits1 = _actor_waits(on)
        on.snapshots.poll(block=True)  # let the version in flight commit (outside any timing)
        stats1 = asdict(on.snapshots.stats)
        committed = on.snapshots.committed
        n_nodes = len({s.node_id for s in committed.shards}) if committed is not None else None
        managers = len(on.snapshots.managers)
        after = then(on) if then is not None else {}
    finally:
        on.shutdown()
        off.shutdown()

    timed = sum(blocks_plan)
    per_stage_wait = [b - a for a, b in zip(waits0, waits1)]
    actor_stall = max(per_stage_wait) / timed
    ctrl_stall = (stats1["wait_s"] - stats0["wait_s"]) / timed
    tokens = cfg_on.tokens_per_step()

    def summary(name: str) -> dict[str, Any]:
        bl = blocks[name]
        steady = [s for b in bl for s in b["step_s"][1:]]  # a block's first step absorbs the switch of trainers
        every = [s for b in bl for s in b["step_s"]]
        per_kind: dict[str, float] = {}
        for b in bl:
            for kind, c in (b["cpu"] or {}).items():
                per_kind[kind] = per_kind.get(kind, 0.0) + c
        cpu_total = sum(per_kind.values()) if per_kind else None
        return {
            "tokens_per_s_steady": round(tokens * len(steady) / sum(steady), 1),
            "tokens_per_s_all_steps": round(tokens * len(every) / sum(every), 1),
            "median_step_s": round(median(every), 4),
            "cpu_s_per_step": round(cpu_total / len(every), 4) if cpu_total is not None else None,
            "cpu_s_per_step_by_process": {k: round(v / len(every), 4) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1]) if v / len(every) >= 0.0005},
            "block_tokens_per_s_steady": [round(tokens * (len(b["step_s"]) - 1) / sum(b["step_s"][1:]), 1) for b in bl],
            "step_s": [[round(x, 4) for x in b["step_s"]] for b in bl],
        }

    s_on, s_off = summary("on"), summary("off")

    def pct(key: str) -> float:
        return round((1 - s_on[key] / s_off[key]) * 100, 2)

    offb = s_off["block_tokens_per_s_steady"]
    paired = [1 - a / b for a, b in zip(s_on["block_tokens_per_s_steady"], offb)]  # adjacent blocks share the outside load
    ours = sum(c for name in blocks for b in blocks[name] for c in (b["cpu"] or {}).values())
    outside = outside_share(busy1 - busy0, ours, wall1 - wall0) if busy0 is not None and busy1 is not None else None
    comparison = {
        "overhead_pct": pct("tokens_per_s_steady"),
        "overhead_all_steps_pct": pct("tokens_per_s_all_steps"),
        # how much the snapshot-free system alone moved between its blocks: the resolution of the above
        "overhead_paired_median_pct": round(median(paired) * 100, 2),
        "noise_pct": round((max(offb) - min(offb)) / median(offb) * 100, 2) if len(offb) > 1 else None,
        "cpu_overhead_pct": round((s_on["cpu_s_per_step"] / s_off["cpu_s_per_step"] - 1) * 100, 2)
        if s_on["cpu_s_per_step"] and s_off["cpu_s_per_step"]
        else None,
        "stall_s": _r(actor_stall + ctrl_stall),
        "stall_components_s": {"stage_actor_wait_max_per_step": _r(actor_stall), "controller_wait_per_step": _r(ctrl_stall)},
        "stage_wait_total_s": [_r(w) for w in per_stage_wait],
        **_breakdown(stats0, stats1),
        "snapshots_committed": int(stats1["committed"] - stats0["committed"]),
        "snapshots_skipped": int(stats1["skipped"] - stats0["skipped"]),
        "snapshots_discarded": int(stats1["discarded"] - stats0["discarded"]),
        "snapshots_superseded": int(stats1["superseded"] - stats0["superseded"]),
        "timed_steps_per_system": timed,
        "block_steps": list(blocks_plan),
        "nodes_with_stages": n_nodes,
        "snapshot_managers": managers,
        "setup_s": round(setup_s, 1),
        # share of the machine's CPU that processes outside this benchmark took while the blocks ran
        "outside_cpu_share": round(outside, 3) if outside is not None else None,
        "with_snapshot": s_on,
        "without_snapshot": s_off,
    }
    return comparison, after


def _breakdown(stats0: dict[str, Any], stats1: dict[str, Any]) -> dict[str, Any]:
    """Where a committed version's time went in the timed blocks (the coordinator's sums, per
    version), and the parity exchange's rate: bytes the holders read over the piece servers'
    links per second of their reading (checking and encoding included)."""
    n = max(1, int(stats1["committed"] - stats0["committed"]))
    ex0, ex1 = stats0["exchanged"], stats1["exchanged"]
    received, wall = ex1["received"] - ex0["received"], ex1["wall_s"] - ex0["wall_s"]
    return {
        "breakdown_per_version_s": {
            "stage_copy_and_crc": _r((stats1["copy_s"] - stats0["copy_s"]) / n),
            "manager_waits_for_pieces": _r((stats1["collect_s"] - stats0["collect_s"]) / n),
            "exchange_wall": _r(wall / n),
            "exchange_crc_cpu": _r((ex1["crc_s"] - ex0["crc_s"]) / n),
            "exchange_encode_cpu": _r((ex1["encode_s"] - ex0["encode_s"]) / n),
            "commit": _r((stats1["commit_s"] - stats0["commit_s"]) / n),
        },
        "exchange_bytes_per_version": int(received / n),
        "exchange_gbps": _gbps(received, wall),
    }


def _trainer_config(config_path: str, overrides: Sequence[str], extra: Sequence[str], every: int | str | None) -> RunConfig:
    """A benchmark trainer's config: no evaluation, a run's middle, snapshots every ``every`` steps (None: off)."""
    snap = ["snapshot.enabled=false"] if every is None else ["snapshot.enabled=true", f"snapshot.every={every}"]
    return load_config(config_path, [*overrides, "train.eval_every=0", MID_RUN, *extra, *snap])


def _trainer_configs(config_path: str, overrides: Sequence[str], extra: Sequence[str]) -> tuple[RunConfig, RunConfig]:
    return _trainer_config(config_path, overrides, extra, 1), _trainer_config(config_path, overrides, extra, None)


def _cluster_extra(workers: int) -> list[str]:
    """The cluster trainers' settings: one erasure group of every worker node, stages spread over them."""
    return [f"snapshot.group_size={workers}", "parallel.placement_strategy=SPREAD"]


def _start_cluster(cfg: RunConfig, workers: int, state_bytes: int = 0) -> tuple[Any, float]:
    """The loopback cluster of the trainer comparisons: a head without CPUs and ``workers`` worker
    nodes with room for two trainers' bundles of ``cfg`` and stores sized for ``state_bytes``.
    Returns it and its logical CPUs per node."""
    from elastic_llm.runtime.session import loopback_cluster

    par = cfg.parallel
    per_node = max(1.0, float(np.ceil(2 * par.stages * par.dp * par.cpus_per_actor / workers)))  # both trainers' bundles
    store, head_store = int(max(1 << 30, 6 * state_bytes)), int(max(512 << 20, 3 * state_bytes))
    # Ray's own health checks ({}): nothing here removes a node, and the overheads measured stay those of a plain cluster
    return loopback_cluster(workers, per_node, store, head_store_bytes=head_store, system_config={}, log_to_driver=False), per_node


def _cluster_phase(
    config_path: str,
    overrides: Sequence[str],
    cfg1: RunConfig,
    buf: np.ndarray,
    manifest: str,
    blocks_plan: list[int],
    warmup: int,
    repeats: int,
    workers: int,
    state_bytes: int,
    auto_rounds: int = 5,
) -> dict[str, Any]:
    """A loopback ``ray.cluster_utils.Cluster`` (a head without CPUs, where the driver and the
    hand-off measurement live, + ``workers`` worker nodes, one erasure group): parity runs, and
    ``snapshot.every: auto`` against its budget (:func:`_auto_overhead`, ``auto_rounds`` blocks; 0: not run)."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("bench snapshot starts its own Ray: shut down the running one first")
    extra = _cluster_extra(workers)
    cfg_on, cfg_off = _trainer_configs(config_path, overrides, extra)
    cluster = None
    try:
        t0 = time.perf_counter()
        cluster, per_node = _start_cluster(cfg_on, workers, state_bytes)
        cluster_s = time.perf_counter() - t0
        out = _hand_off(cfg1, buf, manifest)
        trainers, restore = _compare_trainers(
            cfg_on, cfg_off, blocks_plan, warmup, cluster=cluster, then=lambda on: _restore_from_trainer(on, cfg_on, repeats)
        )
        out.update(restore)
        out["trainers"] = trainers
        if auto_rounds:
            out["auto"] = _auto_overhead(config_path, overrides, extra, cfg_off, auto_rounds, cluster)
        out["trainers"]["cluster"] = {
            "worker_nodes": workers,
            "logical_cpus_per_node": per_node,
            "group_size": workers,
            "parity": cfg_on.snapshot.parity,
            "start_s": round(cluster_s, 1),
        }
        return out
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


# steps a snapshot.every: auto run takes first, to measure and choose its interval: on the 3-node
# cluster its baseline leaves the first steps' (standbys starting beside them) by step ~45 and the
# interval grows from there (30 left the first block mid-way: 6.8%, then 4.4%, 1.2%)
AUTO_SETTLE = 60
AUTO_BLOCK = 24  # steps per block of the auto comparison at least ...
# ... and at least this many of the intervals auto chose (a block shorter than one says nothing;
# with 2 and 3 blocks the snapshot-free blocks alone moved 3.2%, more than the 2% budget measured)
AUTO_CYCLES = 4


def _auto_overhead(config_path: str, overrides: Sequence[str], extra: Sequence[str], cfg_off: RunConfig, rounds: int, cluster: Any) -> dict[str, Any]:
    """``snapshot.every: auto`` against no snapshots, on the same cluster, in ``rounds`` blocks
    of :data:`AUTO_BLOCK` steps each (or :data:`AUTO_CYCLES` of the interval it chose, if longer)
    after :data:`AUTO_SETTLE` steps: the overhead it achieves next to its budget
    (``snapshot.max_overhead_pct``), per block (the noise) and its choice."""
    cfg_auto = _trainer_config(config_path, overrides, extra, "auto")
    block: list[int] = []

    def plan(t: Trainer) -> list[int]:
        block.append(max(AUTO_BLOCK, AUTO_CYCLES * (t.snapshots.every if t.snapshots is not None else 1)))
        return [block[0]] * rounds

    cmp, chosen = _compare_trainers(cfg_auto, cfg_off, plan, AUTO_SETTLE, cluster=cluster,
                                    then=lambda t: {"every": t.snapshots.every, "why": t.snapshots.why})
    on, off = cmp["with_snapshot"]["block_tokens_per_s_steady"], cmp["without_snapshot"]["block_tokens_per_s_steady"]
    return {
        "budget_pct": cfg_auto.snapshot.max_overhead_pct,
        "overhead_pct": cmp["overhead_pct"],
        "overhead_paired_median_pct": cmp["overhead_paired_median_pct"],
        "overhead_blocks_pct": [round((1 - a / b) * 100, 2) for a, b in zip(on, off)],
        "noise_pct": cmp["noise_pct"],
        "snapshots_committed": cmp["snapshots_committed"],
        "blocks": rounds,
        "block_steps": block[0],
        **chosen,
    }


TRACE_EVERY = 6  # the fixed interval of the per-step trace: a version's step, its steps in flight, SETTLE and clean steps after it
TRACE_STEPS = 96  # traced steps (16 versions at every 6), after TRACE_WARMUP untraced ones
TRACE_WARMUP = 20


def _cost_trace(config_path: str, overrides: Sequence[str], extra: Sequence[str], cluster: Any) -> dict[str, Any]:
    """Where a version's cost lands: one trainer with ``snapshot.every`` = :data:`TRACE_EVERY`,
    every step's wall time by its place after the step that began a version (0: that step), the
    mean excess of each place over the last two places' mean (steps no version touches, if its
    effects end within the interval), and how many versions were in flight during each step."""
    t = ray_trainer(_trainer_config(config_path, overrides, extra, TRACE_EVERY), cluster=cluster)
    rows: list[tuple[float, bool, int]] = []
    try:
        t.setup()
        for _ in range(TRACE_WARMUP):
            t.run_step()
        for _ in range(TRACE_STEPS):
            t0 = time.perf_counter()
            t.run_step()
            assert t.snapshots is not None
            rows.append((time.perf_counter() - t0, t.snapshots.last_begin == t.step, len(t.snapshots.inflight)))
    finally:
        t.shutdown()
    begins = [i for i, r in enumerate(rows) if r[1]]
    by_place: list[list[float]] = [[] for _ in range(TRACE_EVERY)]
    for b in begins:
        for k in range(TRACE_EVERY):
            if b + k < len(rows) and (k == 0 or not rows[b + k][1]):
                by_place[k].append(rows[b + k][0])
    base = float(np.mean(by_place[-2] + by_place[-1])) if by_place[-1] else None
    return {
        "every": TRACE_EVERY,
        "versions": len(begins),
        "clean_step_s": _r(base),
        "mean_step_s_by_place": [_r(float(np.mean(x))) if x else None for x in by_place],
        "excess_s_by_place": [_r(float(np.mean(x)) - base) if x and base is not None else None for x in by_place],
        "cost_s_per_version": _r(sum(float(np.mean(x)) - base for x in by_place[:-2] if x)) if base is not None else None,
        "steps_by_versions_in_flight": {str(n): sum(1 for r in rows if r[2] == n) for n in sorted({r[2] for r in rows})},
        "step_s": [_r(r[0], 4) for r in rows],
    }


def run_snapshot_auto(config_path: str = "jobs/tiny.yaml", overrides: Sequence[str] = (), *, workers: int = 3, rounds: int = 5) -> dict[str, Any]:
    """``bench snapshot --auto-only``: on the loopback cluster of the full benchmark, the per-step
    trace of where a version's cost lands (:func:`_cost_trace`), then ``snapshot.every: auto``
    against no snapshots (:func:`_auto_overhead`, ``rounds`` blocks)."""
    import ray

    loopback_env()
    if ray.is_initialized():
        raise RuntimeError("bench snapshot starts its own Ray: shut down the running one first")
    started, machine = time.perf_counter(), machine_info()
    extra = _cluster_extra(workers)
    cfg_on, cfg_off = _trainer_configs(config_path, overrides, extra)
    cluster = None
    try:
        cluster, _ = _start_cluster(cfg_on, workers)
        trace = _cost_trace(config_path, overrides, extra, cluster)
        auto = _auto_overhead(config_path, overrides, extra, cfg_off, rounds, cluster)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    load_at_end(machine)
    return {
        "benchmark": "snapshot-auto", "config": cfg_on.name, "config_path": str(config_path), "overrides": list(overrides),
        "worker_nodes": workers, "trace": trace, "auto": auto, "machine": machine,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "wall_s": round(time.perf_counter() - started, 1),
    }


def _single_node_phase(config_path: str, overrides: Sequence[str], blocks_plan: list[int], warmup: int) -> dict[str, Any]:
    """Embedded single-node Ray (what ``elastic-llm train`` starts): copy + hand-off to the local
    manager only, no parity (a group needs >= 2 nodes)."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("bench snapshot starts its own Ray: shut down the running one first")
    cfg_on, cfg_off = _trainer_configs(config_path, overrides, [])
    par = cfg_on.parallel
    need = 2 * par.stages * par.dp * par.cpus_per_actor
    ray.init(
        address="local",  # never join a cluster another process started
        num_cpus=max(float(os.cpu_count() or 1), need),  # logical: the idle trainer's actors hold bundles too
        namespace=NAMESPACE,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        logging_level="WARNING",
    )
    try:
        return _compare_trainers(cfg_on, cfg_off, blocks_plan, warmup)[0]
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------- the benchmark


def run_snapshot_bench(
    config_path: str = "jobs/tiny.yaml",
    steps: int = 10,
    overrides: Sequence[str] = (),
    *,
    rounds: int = 3,
    warmup: int = 10,
    repeats: int = 5,
    workers: int = 3,
    single_node: bool | None = None,
    time_budget_s: float = 240.0,
    auto_rounds: int = 5,
) -> dict[str, Any]:
    """Measure our snapshots against torch.save / DCP async_save on the state of ``config_path``.

    ``steps``: timed steps per system (snapshots on / off) in the trainer comparison, split into
    ``rounds`` blocks (see :func:`_block_plan`), after ``warmup`` untimed steps;
    ``repeats``: rounds of the in-process measurements (medians reported); ``workers``: worker
    nodes of the loopback cluster (= the erasure group); ``auto_rounds``: blocks of the
    ``snapshot.every: auto`` comparison on that cluster (0: none). The single-node comparison runs when
    ``single_node`` is True, or (None) when its estimated duration still fits ``time_budget_s``.
    Returns one JSON-serializable dict (see the module doc); every process, Ray instance,
    process group and temporary file it started is gone when it returns.
    """
    if steps < 2:
        raise ValueError(f"steps={steps} must be >= 2 (blocks of >= 2 steps: the first of each is not counted as steady state)")
    if rounds < 1 or repeats < 1 or warmup < 0 or workers < 2:
        raise ValueError("rounds and repeats must be >= 1, warmup >= 0, workers >= 2 (parity needs two nodes)")
    loopback_env()
    started = time.perf_counter()
    machine = machine_info()
    notes: list[str] = []
    cfg = load_config(config_path, list(overrides))
    cfg1 = load_config(config_path, [*overrides, "parallel.stages=1", "parallel.dp=1"])
    blocks_plan = _block_plan(steps, rounds)

    with tempfile.TemporaryDirectory(prefix="elastic-llm-snapbench-") as workdir:
        inproc, (worker, buf, manifest) = _in_process(cfg1, repeats, workdir, workers)
    state_bytes = inproc["state_bytes"]
    multi = _cluster_phase(config_path, overrides, cfg1, buf, manifest, blocks_plan, warmup, repeats, workers, state_bytes, auto_rounds)
    del worker, buf
    tr_multi = multi.pop("trainers")
    tr_single: dict[str, Any] = {}
    if single_node is None:
        # steps there are faster than on the cluster: this over-estimates
        est = (tr_multi["with_snapshot"]["median_step_s"] + tr_multi["without_snapshot"]["median_step_s"]) * (tr_multi["timed_steps_per_system"] + warmup)
        est += tr_multi["setup_s"] + 15
        single_node = time.perf_counter() - started + est <= time_budget_s
        if not single_node:
            notes.append(
                f"the single-node trainer comparison was skipped: it would end past time_budget_s={time_budget_s:g} s "
                f"(estimated {est:.0f} s more); pass single_node=True to force it"
            )
    if single_node:
        tr_single = _single_node_phase(config_path, overrides, blocks_plan, warmup)

    stall, stall_single = tr_multi["stall_s"], tr_single.get("stall_s")

    result: dict[str, Any] = {
        "benchmark": "snapshot",
        "config": cfg.name,
        "config_path": str(config_path),
        "overrides": list(overrides),
        "parameters": count_parameters(cfg.model.shape()),
        "stages": cfg.parallel.stages,
        "dp": cfg.parallel.dp,
        "steps": steps,
        "tokens_per_step": cfg.tokens_per_step(),
        **{k: v for k, v in inproc.items() if k != "raw_s"},
        **multi,
        "snapshot_stall_s": stall,
        "snapshot_stall_components_s": tr_multi["stall_components_s"],
        "snapshot_stall_single_node_s": stall_single,
        "snapshot_stall_single_node_components_s": tr_single.get("stall_components_s"),
        "cluster_step_s_with_snapshot": tr_multi["with_snapshot"]["median_step_s"],  # the loopback cluster, snapshots every step
        "cluster_step_s_without_snapshot": tr_multi["without_snapshot"]["median_step_s"],
        "train_overhead_pct": tr_multi["overhead_pct"],
        "train_overhead_paired_median_pct": tr_multi["overhead_paired_median_pct"],
        "train_overhead_noise_pct": tr_multi["noise_pct"],
        "train_overhead_single_node_pct": tr_single.get("overhead_pct"),
        "train_overhead_single_node_paired_median_pct": tr_single.get("overhead_paired_median_pct"),
        "train_overhead_single_node_noise_pct": tr_single.get("noise_pct"),
        "cpu_overhead_pct": tr_multi["cpu_overhead_pct"],
        "cpu_overhead_single_node_pct": tr_single.get("cpu_overhead_pct"),
        "snapshots_committed": tr_multi["snapshots_committed"],
        "snapshots_skipped": tr_multi["snapshots_skipped"],
        "snapshot_breakdown_per_version_s": tr_multi["breakdown_per_version_s"],
        "parity_exchange_bytes_per_version": tr_multi["exchange_bytes_per_version"],
        "parity_exchange_GBps": tr_multi["exchange_gbps"],
        "loopback_socket_GBps": (sock := reference_rates(max(1 << 20, tr_multi["exchange_bytes_per_version"]))["loopback_tcp_gb_s"]),
        "parity_exchange_vs_loopback_socket": ratio(tr_multi["exchange_gbps"], sock, 3),
        # the transport alone (the exchange above runs at the lowest priority beside training): a holder's read of one
        # member's chunk, a rebuild's parallel reads of one stage, each against a socket moving as many bytes, taking turns
        "exchange_alone": exchange_alone(state_bytes // workers, state_bytes // max(1, cfg.parallel.stages), workers - cfg.snapshot.parity),
        "stall_vs_torch_save": ratio(stall, inproc["torch_save_s"], 5),
        "stall_vs_dcp_async": ratio(stall, inproc["dcp_async_block_s"], 5),
        "stall_vs_dcp_async_reused_stager": ratio(stall, inproc["dcp_async_block_reused_stager_s"], 5),
        "stall_single_node_vs_torch_save": ratio(stall_single, inproc["torch_save_s"], 5),
        "stall_single_node_vs_dcp_async": ratio(stall_single, inproc["dcp_async_block_s"], 5),
        "copy_vs_memcpy": ratio(inproc["snapshot_copy_GBps"], inproc["memcpy_GBps"], 3),
        "restore_speedup_vs_torch_load": ratio(inproc["torch_load_s"], inproc["restore_inmemory_s"], 2),
        "restore_warm_speedup_vs_torch_load": ratio(inproc["torch_load_s"], inproc["restore_inmemory_warm_s"], 2),
        "restore_from_smp_speedup_vs_torch_load": ratio(inproc["torch_load_s"], multi.get("restore_from_smp_s"), 2),
        # what a restore that copies the state's bytes once at memcpy speed could reach at best
        "restore_memcpy_bound_vs_torch_load": ratio(inproc["torch_load_s"], inproc["state_bytes"] / (inproc["memcpy_GBps"] * 1e9), 2),
    }

    result["details"] = {"multi_node": tr_multi, "single_node": tr_single or None, "in_process_raw_s": inproc["raw_s"]}

    notes.append(
        "state = parameters + AdamW state of the whole model (one 1-stage StageWorker, parallel.stages=1) after 2 real "
        f"optimizer steps; the in-process peers take turns for {repeats} rounds (medians), all at {inproc['torch_threads']} "
        "torch thread(s), with a warm buffer, file and page cache."
    )
    notes.append(
        "torch_load_s and restore_inmemory_s both load into a freshly built stage (its state allocated at start), as a "
        "replacement actor would; restore_inmemory_warm_s loads into a stage whose optimizer state exists (a survivor "
        "rolling back). torch.load reads a page-cached file."
    )
    notes.append(
        "dcp_async_block_s: the time async_save(state_dict, checkpoint_id=dir) blocks as called by default (a fresh "
        "DefaultStager per call: a copy into newly allocated CPU memory before it returns); "
        "dcp_async_block_reused_stager_s passes one persistent DefaultStager whose cached CPU copies are reused; "
        "get_state_dict (dcp_get_state_dict_s) is timed apart. The future is waited for outside the timing."
    )
    notes.append(
        f"trainer runs: snapshot.every=1, train.eval_every=0; two live Trainers (snapshots on / off) on one Ray take turns in "
        f"blocks of {blocks_plan} steps (order alternating) after {warmup} warm-up step(s), stepped with Trainer.run_step so "
        "the snapshot pipeline carries on across blocks. snapshot_stall_s and train_overhead_pct come "
        f"from a loopback Cluster of {workers} worker nodes (head without CPUs, SPREAD, snapshot.group_size={workers}: copy + "
        "hand-off + parity + commit); *_single_node_* from an embedded single-node Ray (copy + hand-off only). Stall per "
        "timed step = max over stages of the actors' snapshot_wait_s + the controller's snapshots.stats.wait_s. Overhead "
        "uses all steps of a block but its first (which absorbs the switch between the two trainers); "
        "overhead_all_steps_pct uses every step; noise_pct is how much the snapshot-free system alone varied between its "
        "blocks."
    )
    notes.append(
        "snapshot_breakdown_per_version_s: per committed version of the timed blocks, summed over its parts: the stages' "
        "copies (with their pieces' CRC-32s), the managers' waits for them, the parity holders' reading of their groups' "
        "data over the piece servers' links (wall, with the CRC-32 checks and the encoding within it, in CPU seconds) and "
        "the driver's commit. parity_exchange_GBps = bytes the holders read / their reading's wall time; "
        "loopback_socket_GBps: one TCP connection on 127.0.0.1 moving as many bytes between warm buffers in this run "
        "(benchmarks.common.reference_rates, as bench recovery's; median of 5), its peer."
    )
    notes.append(
        f"restore_from_smp_s: after the blocks, the cluster Trainer with snapshots restores every stage of replica 0 from "
        "its committed version into freshly started stage actors on the nodes holding the shards, as the controller "
        "does (snapshots.fetch_stage_state per stage, its load_parts submitted at once, then the wait for all loads), "
        f"median of {repeats} rounds; "
        "smp_hand_off_s: one SnapshotManager on the driver's node collecting a whole-model stage's snapshot "
        "(snapshot_version of a one-stage ManagerPlan, no erasure group)."
    )
    for phase, tr in (("cluster", tr_multi), ("single-node", tr_single)):
        if tr and tr.get("snapshots_skipped"):
            notes.append(
                f"{phase}: {tr['snapshots_skipped']} due snapshots were skipped (two versions still in flight) and "
                f"{tr['snapshots_committed']} committed in {tr['timed_steps_per_system']} timed steps."
            )
    if cfg.parallel.cpus_per_actor * cfg.parallel.stages * cfg.parallel.dp >= (os.cpu_count() or 1):
        notes.append(
            f"{cfg.parallel.stages * cfg.parallel.dp} stage actors share {os.cpu_count()} cores (and all 'nodes' share them) "
            "with the snapshot copies, CRCs, object transfers and parity."
        )
    shares = [tr["outside_cpu_share"] for tr in (tr_multi, tr_single) if tr and tr.get("outside_cpu_share") is not None]
    if shares and max(shares) > 0.15:
        notes.append(f"other processes took up to {max(shares):.0%} of the machine's CPU while the trainers ran.")
    load_at_end(machine)
    result["notes"] = notes
    result["machine"] = machine
    result["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


if __name__ == "__main__":
    from benchmarks.common import main

    raise SystemExit(main("snapshot"))
