"""Typed run configuration: YAML in, validated dataclasses out.

Owns: the config schema, YAML loading, ``--set key=value`` overrides and validation. Every
rejected value raises :class:`ConfigError` naming the field and the fix; nothing here starts Ray
or touches the filesystem beyond reading the YAML file.

Why ~500 lines: one dataclass per config section and one message per rule that can be broken;
the rules are what keep a bad value from surfacing as a traceback deep inside a run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from elastic_llm.model import ModelShape
from elastic_llm.sources import Mode

SCHEDULES = ("gpipe", "1f1b")
TOKENIZERS = ("byte", "bpe")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# lossless: in-memory snapshots + parity (CheckFree+ only as the last rung); checkfree /
# checkfree_plus: no snapshots, a lost stage is rebuilt from its neighbours; checkpoint: periodic
# checkpoints on disk and rollback; redundant: every stage also trains a copy of its successor.
RECOVERY_MODES = tuple(m.value for m in Mode)


MAX_STANDBY = 8  # recovery.standby: most warm standby processes per node


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and how to fix it."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class ModelConfig:
    vocab_size: int = 256
    dim: int = 256
    n_heads: int = 4
    n_layers: int = 4
    seq_len: int = 128
    ffn_hidden: int | None = None  # None: 4 x dim (SwiGLU hidden as in the CheckFree configs)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def shape(self) -> ModelShape:
        return ModelShape(
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            seq_len=self.seq_len,
            ffn_hidden=self.ffn_hidden or 4 * self.dim,
            norm_eps=self.norm_eps,
            rope_theta=self.rope_theta,
        )


@dataclass
class ParallelConfig:
    stages: int = 4
    dp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4  # per replica and step; a replica whose share has fewer sequences runs one per sequence
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    threads_per_actor: int | None = None  # None: max(1, int(cpus_per_actor))
    placement_strategy: str = "PACK"

    def threads(self) -> int:
        return self.threads_per_actor or max(1, int(self.cpus_per_actor))


@dataclass
class TrainConfig:
    batch_size: int = 16  # sequences per optimizer step, summed over data-parallel replicas (replica r of w takes batch_size // w, one more if r < batch_size % w)
    max_steps: int = 100
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50  # 0 disables validation
    eval_batches: int = 2


@dataclass
class DataConfig:
    dir: str | None = None  # prepared shards (local path or URI); None: the built-in corpus
    tokenizer: str = "byte"  # byte | bpe (byte-level BPE from Hugging Face tokenizers)
    tokenizer_file: str | None = None  # bpe, built-in corpus: encode it with this tokenizer.json (None: train a BPE of model.vocab_size tokens on it)
    val_fraction: float = 0.02


@dataclass
class SnapshotConfig:
    enabled: bool = True
    every: int | str = 1  # snapshot every N steps, or "auto": the smallest N whose measured cost stays under max_overhead_pct
    max_overhead_pct: float = 2.0  # every: auto: training time the snapshots may cost, in percent
    group_size: int = 4  # nodes per erasure group (fewer nodes: one group of all of them)
    parity: int = 1  # parity chunks per codeword = nodes of a group that may be lost at once
    codec: str = "auto"  # auto | isal | numpy
    max_lag: int = 4  # steps the committed snapshot may trail training before a step waits for it


@dataclass
class RecoveryConfig:
    max_failures: int = 100  # failures the run recovers from in total; one more stops it (exit 4)
    max_retries_per_step: int = 3  # times one step is retried after failing; one more failure stops the run (exit 4)
    capacity_timeout_s: float = 600.0  # longest wait for actors that cannot be placed, then the run stops (exit 4)
    capacity_report_s: float = 10.0  # while waiting for capacity, say what is missing this often
    mode: str = "lossless"  # one of RECOVERY_MODES; only lossless takes snapshots
    checkpoint_every: int = 100  # mode checkpoint: a checkpoint every this many steps
    checkpoint_dir: str | None = None  # mode checkpoint: where (None: a fresh temporary directory per run)
    standby: int | str = 1  # warm standby stage processes per node (0: none; auto: from the observed failure rate)
    standby_gpus: bool = False  # GPU runs: standbys hold a device each (adoptable on any node), else they take the dead actor's device
    node_probe_s: float = 0.25  # the driver probes every worker node's raylet this often (0: no probes; Ray's health checks alone)
    node_probe_failures: int = 3  # probes in a row that time out before a node is a suspect of this run (a refused connection is dead at once)
    node_probe_declare: bool = True  # a node whose raylet refuses connections is declared dead to Ray (false: this run alone treats it as dead)
    driver_grace_s: float = 120.0  # snapshot managers outlive a dead driver this long for `train --resume RUN_ID` (0: they die with it)


@dataclass
class DurableConfig:
    storage_path: str | None = None  # local directory or pyarrow URI (s3://bucket/dir?endpoint_override=..., gs://, hdfs://); None: no durable tier
    every: int | str = 50  # flush every N-th committed snapshot, or "auto" (Young/Daly from the flush cost and the observed failure rate)
    keep_last: int = 3  # committed checkpoints kept in {storage_path}/{run_name}; older ones are deleted (never the newest)
    run_name: str | None = None  # directory under storage_path (None: the run's name)
    mtbf_h: float = 24.0  # every: auto: mean time between failures assumed until the run has seen failures of its own
    max_write_mb_s: float = 0.0  # throttle each manager's flush writes to this many MB/s (0: as fast as storage takes them)
    flush_nice: int = 10  # niceness of the flushing threads (0-19; 0: as urgent as training)


@dataclass
class CheckFreeConfig:
    lr_scale: float = 1.1  # a stage rebuilt from its neighbours trains with learning rate x this
    mirror_every: int = 1  # copy embedding / LM head onto the neighbouring stage every N steps (0: never)


@dataclass
class ElasticConfig:
    min_replicas: int | None = None  # fewest data-parallel replicas the run trains with; None: parallel.dp (no shrinking)
    max_replicas: int | None = None  # most replicas it grows to when capacity appears; None: parallel.dp (no growing)
    grow_check_s: float = 5.0  # how often (at step boundaries) the controller looks for room for another replica
    drains: bool = True  # move stages off nodes Ray marks as draining (preemption notices) before their deadline

    def bounds(self, dp: int) -> tuple[int, int]:
        """(min, max) replicas, the unset ones filled in from the starting width ``dp``."""
        lo = self.min_replicas if self.min_replicas is not None else dp
        hi = self.max_replicas if self.max_replicas is not None else dp
        return lo, hi


ChaosKill = Literal["stage", "node", "smp", "error", "standby"]
ChaosHow = Literal["ray_kill", "sigkill"]
ChaosDuring = Literal["step", "recovery"]
ChaosOp = Literal["forward", "backward", "allreduce", "update"]
CHAOS_KINDS: tuple[str, ...] = typing.get_args(ChaosKill)  # the words a config may use (checked by validate)
CHAOS_HOW: tuple[str, ...] = typing.get_args(ChaosHow)
CHAOS_DURING: tuple[str, ...] = typing.get_args(ChaosDuring)
CHAOS_OPS: tuple[str, ...] = typing.get_args(ChaosOp)


@dataclass
class ChaosEvent:
    step: int  # fire while this step runs (1-based), or (during: recovery) while the failure of this step is recovered
    kill: ChaosKill  # stage: the actor of (stage, replica); node / smp: the node / snapshot manager hosting it; error: the stage raises on every step from now on
    stage: int = 0
    replica: int = 0
    how: ChaosHow = "ray_kill"  # ray_kill | sigkill (stage)
    # with kill=smp: flip a byte of its committed shard instead of killing it; with kill=stage,
    # during=recovery: a byte of each of the stage's own background copies, after the plan that may name them
    corrupt: bool = False
    node: int | None = None  # kill=node / smp: the node-th live node with CPUs (by node id), not the one hosting stage/replica
    during: ChaosDuring = "step"  # step | recovery: after the recovery plan of step `step`'s failure is made, before it is carried out
    op: ChaosOp = "forward"  # kill: stage: strike when the actor starts its first op of this kind in the step (forward | backward | allreduce | update)


@dataclass
class ChaosConfig:
    events: list[ChaosEvent] = field(default_factory=list)
    failure_prob_per_step: float = 0.0  # each stage actor fails in a step with this probability (seeded)
    failure_rate_per_hour: float = 0.0  # or: probability that a stage fails within an hour (0.1 = 10%), per step from the measured step time
    failure_seed: int = 0  # the failure schedule's seed: same seed, same (step, stage) failures in every run
    failure_how: ChaosHow = "ray_kill"  # ray_kill | sigkill
    snapshot_delay_s: float = 0.0  # every stage's snapshot copy takes this much longer (a snapshot of known cost, for snapshot.every: auto)


@dataclass
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    checkfree: CheckFreeConfig = field(default_factory=CheckFreeConfig)
    durable: DurableConfig = field(default_factory=DurableConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Hash of everything that shapes the trained state (not of run length or naming)."""
        d = self.to_dict()
        for section in ("name", "snapshot", "recovery", "elastic", "checkfree", "durable", "chaos"):
            d.pop(section)
        d["parallel"].pop("dp")  # the width may change while training: the global batch fixes the math
        d["train"].pop("max_steps")
        d["train"].pop("eval_every")
        d["train"].pop("eval_batches")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def snapshots_on(self) -> bool:
        """Whether the run takes in-memory snapshots: only ``recovery.mode: lossless`` does."""
        return self.snapshot.enabled and self.recovery.mode == Mode.LOSSLESS

    @property
    def swapped(self) -> bool:
        """Whether odd microbatches run the first two and last two stages in swapped order (CheckFree+)."""
        return self.recovery.mode == Mode.CHECKFREE_PLUS

    @property
    def mirrors(self) -> bool:
        """Whether the embedding / LM head are mirrored on the neighbouring stages."""
        return self.recovery.mode in (Mode.LOSSLESS, Mode.CHECKFREE_PLUS) and self.checkfree.mirror_every > 0 and self.parallel.stages >= 2

    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.model.seq_len

    def validate(self) -> "RunConfig":
        problems = _validate(self)
        if problems:
            raise ConfigError(problems)
        return self


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _one_of(p: list[str], field_name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        p.append(f"{field_name}={value!r} is unknown: use one of {', '.join(options)}")


def _validate(c: RunConfig) -> list[str]:
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
    if par.gpus_per_actor < 0:
        p.append(f"parallel.gpus_per_actor={par.gpus_per_actor} must be >= 0 (fractions like 0.5 share a GPU)")
    if par.threads_per_actor is not None and par.threads_per_actor <= 0:
        p.append(f"parallel.threads_per_actor={par.threads_per_actor} must be > 0 (or null for cpus_per_actor)")
    return p


def _validate_train(c: RunConfig) -> list[str]:
    """The optimizer and its schedule."""
    p: list[str] = []
    t = c.train
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
        if ev.during == "recovery" and ev.kill not in ("stage", "node", "standby"):
            p.append(f"{where}: during: recovery goes with kill: stage, node or standby, not kill: {ev.kill}")
        if ev.kill == "standby" and c.recovery.standby == 0:
            p.append(f"{where}: kill: standby needs warm standbys: set recovery.standby >= 1 or auto")
        if ev.step < 1:
            p.append(f"{where}.step={ev.step} must be >= 1")
        if not (0 <= ev.stage < par.stages and 0 <= ev.replica < par.dp):
            p.append(f"{where} names stage {ev.stage} replica {ev.replica}, but the run has {par.stages} stages x {par.dp} replicas")
        if ev.corrupt and ev.kill not in ("smp", "stage"):
            p.append(f"{where}: corrupt: true goes with kill: smp (its committed shard) or kill: stage (its own copies), not kill: {ev.kill}")
        if ev.corrupt and ev.kill == "stage" and ev.during != "recovery":
            p.append(f"{where}: corrupt: true with kill: stage goes with during: recovery (its copies are flipped once the recovery's "
                     "snapshot is committed; before a step the flip could reach a snapshot still being collected)")
        if ev.node is not None and (ev.kill not in ("node", "smp") or ev.node < 0):
            p.append(f"{where}.node={ev.node}: a node index (>= 0) only goes with kill: node or kill: smp")
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
    if rc.mode == "redundant" and max(c.parallel.dp, c.elastic.bounds(c.parallel.dp)[1]) > 1:
        p.append("recovery.mode=redundant trains one pipeline (parallel.dp=1, elastic.max_replicas<=1): a lost stage is covered by its predecessor's copy, not by a replica")
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


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotated type ``tp``; int is accepted for float."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if isinstance(value, str) and str in inner:
            return value
        return _coerce(value, inner[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping of {_field_list(tp)}, got {value!r}")
        return _from_dict(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 3e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}={value!r} must be true or false")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}={value!r} must be an integer")
    if tp in (float, str) and not isinstance(value, tp):
        raise ConfigError(f"{where}={value!r} must be a {_type_name(tp)}")
    return value


def _field_list(cls: Any) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _from_dict(cls: Any, data: dict[str, Any], where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            [f"unknown key {prefix}{k}: valid keys{' of ' + where if where else ''} are {_field_list(cls)}" for k in unknown]
        )
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ConfigError([f"{where}.{n} is required" for n in missing])
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def _apply_override(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r} is not key=value: write e.g. --set train.lr=3e-4")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r} has an empty key part: write e.g. --set train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML ({e.problem})") from None
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML run config, apply ``key=value`` overrides, validate.

    Raises :class:`ConfigError` for a missing/unparseable file, unknown keys, wrong types and
    invalid values.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist: pass --config with a YAML file such as jobs/tiny.yaml")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping with sections {_field_list(RunConfig)}")
        data = loaded or {}
    for assignment in overrides:
        _apply_override(data, assignment)
    return _from_dict(RunConfig, data).validate()


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return _from_dict(RunConfig, data).validate()
