"""The run configuration's rules: every value a run cannot train with, and how to fix it.

Owns: :func:`validate` (every rule, one function per section, the problems in the order of the sections),
each problem one line naming the field, the value and the fix. Pure: a config in, messages out.
"""

from __future__ import annotations

from typing import Any

from elastic_llm.config.schema import (
    CHAOS_DURING, CHAOS_HOW, CHECKPOINTING, CHAOS_KINDS, CHAOS_OPS, MAX_STANDBY, PLACEMENT_STRATEGIES, PRECISIONS, RECOVERY_MODES, SCHEDULES, TOKENIZERS, ConfigError, RunConfig,
)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _one_of(p: list[str], field_name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        p.append(f"{field_name}={value!r} is unknown: use one of {', '.join(options)}")


def validate(c: RunConfig) -> RunConfig:
    """``c`` if a run can train with it; else :class:`ConfigError` with every problem found."""
    problems = problems_of(c)
    if problems:
        raise ConfigError(problems)
    return c


def problems_of(c: RunConfig) -> list[str]:
    """Every rule a config breaks, one message each (in section order); the sizes first, since
    the other rules divide by them."""
    p: list[str] = []

    def positive(section: str, obj: Any, *names: str) -> None:
        for n in names:
            if getattr(obj, n) <= 0:
                p.append(f"{section}.{n}={getattr(obj, n)} must be > 0")

    positive("model", c.model, "vocab_size", "dim", "n_heads", "n_layers", "norm_eps", "rope_theta")
    positive("parallel", c.parallel, "stages", "dp", "microbatches", "cpus_per_actor")
    positive("train", c.train, "batch_size", "max_steps", "lr", "grad_clip", "eval_batches")
    if p:
        return p
    d = c.data
    p += [*_validate_model(c), *_validate_parallel(c), *_validate_elastic(c), *_validate_train(c), *_validate_data(c),
          *_validate_snapshot_cadence(c), *_validate_durable(c), *_validate_snapshot_parity(c), *_validate_recovery(c),
          *_validate_recovery_mode(c), *_validate_chaos(c)]
    if not 0 < d.val_fraction < 1:
        p.append(f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    return p


def _validate_model(c: RunConfig) -> list[str]:
    """The model's shape."""
    p: list[str] = []
    m, par = c.model, c.parallel
    if m.seq_len < 2:
        p.append(f"model.seq_len={m.seq_len} must be >= 2")
    if m.dim % m.n_heads:
        p.append(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}: choose n_heads in {{{_divisors(m.dim)}}}")
    elif (m.dim // m.n_heads) % 2:
        p.append(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even for rotary embeddings: change dim or n_heads")
    if m.ffn_hidden is not None and m.ffn_hidden <= 0:
        p.append(f"model.ffn_hidden={m.ffn_hidden} must be > 0 (or null for 4 x dim)")
    if m.n_layers % par.stages:
        p.append(
            f"parallel.stages={par.stages} does not divide model.n_layers={m.n_layers}: "
            f"choose parallel.stages in {{{_divisors(m.n_layers)}}} or change model.n_layers"
        )
    return p


def _validate_parallel(c: RunConfig) -> list[str]:
    """Schedule, placement and devices."""
    p: list[str] = []
    par = c.parallel
    _one_of(p, "parallel.schedule", par.schedule, SCHEDULES)
    _one_of(p, "parallel.placement_strategy", par.placement_strategy, PLACEMENT_STRATEGIES)
    if par.gpu_memory_gib is not None and not par.gpu_memory_gib > 0:
        p.append(f"parallel.gpu_memory_gib={par.gpu_memory_gib} must be > 0 (the memory of one GPU in GiB, e.g. 80), or null to read it from the device")
    if par.gpus_per_actor < 0:
        p.append(f"parallel.gpus_per_actor={par.gpus_per_actor} must be >= 0 (fractions like 0.5 share a GPU)")
    elif par.gpus_per_actor > 1:
        p.append(f"parallel.gpus_per_actor={par.gpus_per_actor:g}: a stage trains on one device (no tensor parallelism within a stage), "
                 "so more would sit idle: use 1 (or a fraction like 0.5 to share a GPU), and more parallel.stages for a model one device cannot hold")
    if par.threads_per_actor is not None and par.threads_per_actor <= 0:
        p.append(f"parallel.threads_per_actor={par.threads_per_actor} must be > 0 (or null for cpus_per_actor)")
    return p


def _validate_train(c: RunConfig) -> list[str]:
    """The optimizer and its schedule."""
    p: list[str] = []
    t = c.train
    _one_of(p, "train.precision", t.precision, PRECISIONS)
    _one_of(p, "train.activation_checkpointing", t.activation_checkpointing, CHECKPOINTING)
    if t.min_lr < 0 or t.min_lr > t.lr:
        p.append(f"train.min_lr={t.min_lr} must be between 0 and train.lr={t.lr}")
    if t.warmup_steps < 0:
        p.append(f"train.warmup_steps={t.warmup_steps} must be >= 0")
    if t.eval_every < 0:
        p.append(f"train.eval_every={t.eval_every} must be >= 0 (0 disables validation)")
    if not 0 <= t.weight_decay < 1:
        p.append(f"train.weight_decay={t.weight_decay} must be in [0, 1)")
    for n in ("beta1", "beta2"):
        if not 0 <= getattr(t, n) < 1:
            p.append(f"train.{n}={getattr(t, n)} must be in [0, 1)")
    if not 0 <= t.seed < 2**32:
        p.append(f"train.seed={t.seed} must be in [0, 2**32)")
    return p


def _validate_data(c: RunConfig) -> list[str]:
    """The tokenizer and the model's vocabulary."""
    p: list[str] = []
    m, d = c.model, c.data
    _one_of(p, "data.tokenizer", d.tokenizer, TOKENIZERS)
    if d.tokenizer == "byte" and m.vocab_size < 256:
        p.append(f"model.vocab_size={m.vocab_size} is too small for data.tokenizer='byte': use 256 or more")
    if d.tokenizer == "bpe" and m.vocab_size < 257:
        p.append(f"model.vocab_size={m.vocab_size} is too small for data.tokenizer='bpe': use at least 257 (256 bytes + <|endoftext|>), e.g. 32000")
    if d.tokenizer_file is not None and d.tokenizer != "bpe":
        p.append(f"data.tokenizer_file={d.tokenizer_file!r} needs data.tokenizer='bpe' (it is {d.tokenizer!r}): set data.tokenizer=bpe or remove data.tokenizer_file")
    if d.tokenizer_file is not None and d.dir is not None:
        p.append(f"data.tokenizer_file={d.tokenizer_file!r} is for the built-in corpus, but data.dir={d.dir!r} carries its own tokenizer.json: remove one of them")
    return p


def _validate_snapshot_cadence(c: RunConfig) -> list[str]:
    """When snapshots are taken."""
    p: list[str] = []
    sn = c.snapshot
    if sn.every != "auto" and (isinstance(sn.every, str) or sn.every < 1):
        p.append(f"snapshot.every={sn.every!r} must be an integer >= 1 or auto (or set snapshot.enabled=false)")
    if sn.max_overhead_pct <= 0:
        p.append(f"snapshot.max_overhead_pct={sn.max_overhead_pct} must be > 0 (percent of training time; default 2)")
    return p


def _validate_snapshot_parity(c: RunConfig) -> list[str]:
    """Lag, parity and codec of the snapshots."""
    p: list[str] = []
    sn = c.snapshot
    if sn.max_lag < 1:
        p.append(f"snapshot.max_lag={sn.max_lag} must be >= 1")
    if sn.parity < 1:
        p.append(f"snapshot.parity={sn.parity} must be >= 1")
    elif sn.group_size < sn.parity + 1:
        p.append(f"snapshot.group_size={sn.group_size} must be at least snapshot.parity + 1 = {sn.parity + 1}")
    elif sn.group_size > 255:
        p.append(f"snapshot.group_size={sn.group_size} must be <= 255 (Reed-Solomon over GF(2^8))")
    _one_of(p, "snapshot.codec", sn.codec, ("auto", "isal", "numpy"))
    return p


def _validate_recovery(c: RunConfig) -> list[str]:
    """Failure budget, capacity wait and node probes."""
    p: list[str] = []
    rc = c.recovery
    if rc.max_failures < 0:
        p.append(f"recovery.max_failures={rc.max_failures} must be >= 0 (0: stop at the first failure)")
    if rc.max_retries_per_step < 0:
        p.append(f"recovery.max_retries_per_step={rc.max_retries_per_step} must be >= 0 (0: a step that fails is not retried)")
    if rc.capacity_timeout_s <= 0:
        p.append(f"recovery.capacity_timeout_s={rc.capacity_timeout_s} must be > 0 seconds (default 600)")
    if not rc.link_set_aside_s > 0:
        p.append(f"recovery.link_set_aside_s={rc.link_set_aside_s} must be > 0 seconds (how long a node cut from a peer gets nothing placed on it; default 300)")
    if not 0 < rc.straggler_share <= 1:
        p.append(f"recovery.straggler_share={rc.straggler_share} must be in (0, 1] (the share of a step its links may cost before their rates are measured; default 0.25)")
    if rc.straggler_steps < 0:
        p.append(f"recovery.straggler_steps={rc.straggler_steps} must be >= 0 (steps in a row over straggler_share before a straggler is looked for; 0: never)")
    if rc.node_probe_s < 0:
        p.append(f"recovery.node_probe_s={rc.node_probe_s} must be >= 0 seconds (0 leaves node deaths to Ray's health checks; default 0.25)")
    if rc.driver_grace_s < 0:
        p.append(f"recovery.driver_grace_s={rc.driver_grace_s} must be >= 0 seconds (0: the run's snapshot managers end with its driver; default 120)")
    if rc.node_probe_failures < 1:
        p.append(f"recovery.node_probe_failures={rc.node_probe_failures} must be >= 1 (timed-out probes in a row before a node is a suspect; default 3)")
    if rc.capacity_report_s <= 0:
        p.append(f"recovery.capacity_report_s={rc.capacity_report_s} must be > 0 seconds (default 10)")
    return p


def _validate_chaos(c: RunConfig) -> list[str]:
    """The chaos events."""
    p: list[str] = []
    par = c.parallel
    for i, ev in enumerate(c.chaos.events):
        where = f"chaos.events[{i}]"
        _one_of(p, f"{where}.kill", ev.kill, CHAOS_KINDS)
        _one_of(p, f"{where}.how", ev.how, CHAOS_HOW)
        _one_of(p, f"{where}.during", ev.during, CHAOS_DURING)
        _one_of(p, f"{where}.op", ev.op, CHAOS_OPS)
        if ev.op == "allreduce" and par.dp < 2:
            p.append(f"{where}.op=allreduce needs parallel.dp >= 2 (one replica has no gradient all-reduce): use forward, backward or update")
        if ev.during in ("recovery", "recovered") and ev.kill not in ("stage", "node", "standby"):
            p.append(f"{where}: during: {ev.during} goes with kill: stage, node or standby, not kill: {ev.kill}")
        if ev.during == "resize" and ev.kill != "node":
            p.append(f"{where}: during: resize goes with kill: node (the node of a joining replica's stage), not kill: {ev.kill}")
        if ev.kill == "standby" and c.recovery.standby == 0:
            p.append(f"{where}: kill: standby needs warm standbys: set recovery.standby >= 1 or auto")
        if ev.step < 1:
            p.append(f"{where}.step={ev.step} must be >= 1")
        if not (0 <= ev.stage < par.stages and 0 <= ev.replica < par.dp):
            p.append(f"{where} names stage {ev.stage} replica {ev.replica}, but the run has {par.stages} stages x {par.dp} replicas")
        if ev.kill == "slow" and not ev.mbit > 0:
            p.append(f"{where}.mbit={ev.mbit} must be > 0 Mbit/s (the rate kill: slow gives the node's link)")
        if ev.kill == "isolate" and par.stages < 2:
            p.append(f"{where}: kill: isolate cuts a stage's node from another stage's, and the run has one stage: use kill: partition")
        if ev.corrupt and ev.kill not in ("smp", "stage"):
            p.append(f"{where}: corrupt: true goes with kill: smp (its committed shard) or kill: stage (its own copies), not kill: {ev.kill}")
        if ev.corrupt and ev.kill == "stage" and ev.during != "recovery":
            p.append(f"{where}: corrupt: true with kill: stage goes with during: recovery (its copies are flipped once the recovery's "
                     "snapshot is committed; before a step the flip could reach a snapshot still being collected)")
        if ev.node is not None and (ev.kill not in ("node", "smp", "partition") or ev.node < 0):
            p.append(f"{where}.node={ev.node}: a node index (>= 0) only goes with kill: node, smp or partition")
    return p


def _validate_durable(c: RunConfig) -> list[str]:
    p: list[str] = []
    du = c.durable
    if du.every != "auto" and (isinstance(du.every, str) or du.every < 1):
        p.append(f"durable.every={du.every!r} must be an integer >= 1 (flush every N-th committed snapshot) or auto")
    if du.keep_last < 1:
        p.append(f"durable.keep_last={du.keep_last} must be >= 1 (the newest committed checkpoint is always kept)")
    if du.mtbf_h <= 0:
        p.append(f"durable.mtbf_h={du.mtbf_h} must be > 0 hours")
    if not 0 <= du.flush_nice <= 19:
        p.append(f"durable.flush_nice={du.flush_nice} must be in 0..19 (0: same priority as training)")
    if du.max_write_mb_s < 0:
        p.append(f"durable.max_write_mb_s={du.max_write_mb_s} must be >= 0 (0: no throttle)")
    if du.run_name is not None and (not du.run_name or "/" in du.run_name or du.run_name in (".", "..")):
        p.append(f"durable.run_name={du.run_name!r} must be one directory name (no '/'), or null for the run's name")
    if du.storage_path is not None and not du.storage_path.strip():
        p.append("durable.storage_path is empty: give a directory or URI, or null for no durable tier")
    if du.storage_path and not c.snapshots_on:
        p.append(
            f"durable.storage_path is set but the run takes no snapshots (recovery.mode={c.recovery.mode}, snapshot.enabled={c.snapshot.enabled}): "
            "the durable tier flushes committed snapshots; use recovery.mode lossless with snapshots on"
        )
    return p


def _validate_recovery_mode(c: RunConfig) -> list[str]:
    p: list[str] = []
    sb = c.recovery.standby
    if sb != "auto" and (isinstance(sb, str) or isinstance(sb, bool) or not 0 <= sb <= MAX_STANDBY):
        p.append(f"recovery.standby={sb!r} must be an integer from 0 (no warm standbys) to {MAX_STANDBY} per node, or auto")
    rc, cf, ch, n = c.recovery, c.checkfree, c.chaos, c.parallel.stages
    if rc.mode not in RECOVERY_MODES:
        return [f"recovery.mode={rc.mode!r} is unknown: use one of {', '.join(RECOVERY_MODES)}"]
    if rc.mode == "checkfree_plus" and n < 4:
        p.append(f"recovery.mode=checkfree_plus needs parallel.stages >= 4 (it swaps the first two and the last two stages), got {n}: use more stages or recovery.mode=lossless")
    if rc.mode in ("checkfree", "redundant") and n < 3:
        p.append(f"recovery.mode={rc.mode} needs parallel.stages >= 3, got {n}: use more stages or recovery.mode=lossless")
    if rc.checkpoint_every < 1:
        p.append(f"recovery.checkpoint_every={rc.checkpoint_every} must be >= 1")
    if cf.lr_scale <= 0:
        p.append(f"checkfree.lr_scale={cf.lr_scale} must be > 0 (the paper uses 1.1 or 1.2)")
    if cf.mirror_every < 0:
        p.append(f"checkfree.mirror_every={cf.mirror_every} must be >= 0 (0: no mirrors)")
    if not 0 <= ch.failure_prob_per_step < 1:
        p.append(f"chaos.failure_prob_per_step={ch.failure_prob_per_step} must be in [0, 1)")
    if not 0 <= ch.failure_rate_per_hour < 1:
        p.append(f"chaos.failure_rate_per_hour={ch.failure_rate_per_hour} must be in [0, 1): write 0.1 for 10% per stage per hour")
    if ch.failure_prob_per_step and ch.failure_rate_per_hour:
        p.append("chaos.failure_prob_per_step and chaos.failure_rate_per_hour are both set: set one of them")
    if ch.failure_how not in CHAOS_HOW:
        p.append(f"chaos.failure_how={ch.failure_how!r} is unknown: use one of {', '.join(CHAOS_HOW)}")
    return p


def _validate_elastic(c: RunConfig) -> list[str]:
    p: list[str] = []
    el, par, t = c.elastic, c.parallel, c.train
    lo, hi = el.bounds(par.dp)
    if lo < 1:
        p.append(f"elastic.min_replicas={lo} must be >= 1")
    if not lo <= par.dp <= hi:
        p.append(
            f"elastic.min_replicas={lo} <= parallel.dp={par.dp} <= elastic.max_replicas={hi} does not hold: "
            "the run starts at parallel.dp replicas, within the elastic bounds"
        )
    if el.grow_check_s <= 0:
        p.append(f"elastic.grow_check_s={el.grow_check_s} must be > 0 seconds")
    if hi > t.batch_size and not p:  # any width up to the batch size works (pipeline/shares.py)
        widest = "elastic.max_replicas" if el.max_replicas is not None else "parallel.dp"
        p.append(
            f"{widest}={hi} replicas is more than train.batch_size={t.batch_size} sequences: every replica needs "
            f"at least one sequence of the global batch; lower {widest} or raise train.batch_size to at least {hi}"
        )
    return p


# --------------------------------------------------------------------------- loading


SPOT_LABEL = "elastic-llm.io/market"  # a node label: "spot" on preemptible nodes (cluster.yaml sets it from EC2's metadata)


def spot_warning(cfg: RunConfig, spot_nodes: int, durable: bool | None = None) -> str | None:
    """The warning a run on ``spot_nodes`` preemptible nodes starts with when it has no durable
    tier (``durable``: whether it has one, ``durable.storage_path`` when None); None when it has
    one, or no spot node. Pure."""
    if spot_nodes <= 0 or (bool(cfg.durable.storage_path) if durable is None else durable) or not cfg.snapshots_on:
        return None
    return (f"{spot_nodes} node(s) of this cluster are spot nodes and durable.storage_path is not set: a burst of preemptions "
            "beyond what the snapshots' parity and the live nodes can hold loses every committed step; set durable.storage_path "
            "(cluster.yaml gives its runs an S3 bucket: durable.storage_path: cluster) with durable.every: auto")
