"""The run configuration's schema: one typed dataclass per section, with its defaults.

Owns: the sections and their fields (each with a comment saying what it is), the values a field
may take (:data:`SCHEDULES`, ...), :class:`ConfigError`, and what a whole config answers
(:class:`RunConfig`: its identity for restores, whether it snapshots, ...). Loading is
:mod:`.loading`'s, the rules :mod:`.rules`'. Never reads a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from elastic_llm.shape import ModelShape
from elastic_llm.sources import Mode

SCHEDULES = ("gpipe", "1f1b")
CHECKPOINTING = ("none", "layers")  # train.activation_checkpointing: keep every layer's activations, or only each layer's input (recomputed in the backward)
PRECISIONS = ("fp32", "bf16")  # train.precision: what the forward and backward compute in (master weights and moments stay fp32)
TOKENIZERS = ("byte", "bpe")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# lossless: in-memory snapshots + parity (CheckFree+ only as the last rung); checkfree /
# checkfree_plus: no snapshots, a lost stage is rebuilt from its neighbours; checkpoint: periodic
# checkpoints on disk and rollback; redundant: every stage also trains a copy of its successor.
RECOVERY_MODES = tuple(m.value for m in Mode)


MAX_STANDBY = 8  # recovery.standby: most warm standby processes per node
STATE_FORMAT = 1  # a stage's state: parameters + AdamW moments in one flat arena (elastic_llm.snapshot.state)


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
    gpu_memory_gib: float | None = None  # each stage's GPU memory: `train` checks the memory plan against it before Ray starts (None: each GPU stage checks against its device when it starts)

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
    precision: str = "fp32"  # fp32 | bf16: forward and backward under bf16 autocast, bf16 between stages; weights, moments, snapshots stay fp32
    activation_checkpointing: str = "none"  # none | layers: each layer keeps only its input and runs again in the backward (less memory, ~1/3 more compute)
    deterministic: bool = False  # torch's deterministic algorithms (and the cuBLAS workspace they need): bit-exact recovery on CUDA needs it


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
    policy: str = "elastic-llm"  # a named recovery policy (elastic_llm.policies): elastic-llm | restart | ray-train-elastic | replica-group | redundant; it sets the fields it models
    checkpoint_every: int = 100  # mode checkpoint: a checkpoint every this many steps
    checkpoint_dir: str | None = None  # mode checkpoint: where (None: a fresh temporary directory per run)
    standby: int | str = 1  # warm standby stage processes per node (0: none; auto: from the observed failure rate)
    standby_gpus: bool = False  # GPU runs: standbys hold a device each (adoptable on any node), else they take the dead actor's device
    node_probe_s: float = 0.25  # the driver probes every worker node's raylet this often (0: no probes; Ray's health checks alone)
    node_probe_failures: int = 3  # probes in a row that time out before a node is a suspect of this run (a refused connection is dead at once)
    link_set_aside_s: float = 300.0  # a node on one side of a cut link between two live nodes gets nothing placed on it this long (doubled at each repeat): no recovery at every step
    straggler_share: float = 0.25  # a step whose slowest actor spends more than this share of it reading from other nodes' links ...
    straggler_steps: int = 3  # ... this many steps in a row has its link rates measured; a node on a slow link is a straggler, moved off like a drain (0: never)
    node_probe_declare: bool = True  # a node whose raylet refuses connections is declared dead to Ray (false: this run alone treats it as dead)
    driver_grace_s: float = 120.0  # snapshot managers, stage actors and standbys outlive a dead driver this long for `train --resume RUN_ID` (0: they die with it)


@dataclass
class DurableConfig:
    # a local directory or pyarrow URI (s3://bucket/dir?endpoint_override=..., gs://, hdfs://); "cluster": $ELASTIC_LLM_DURABLE_PATH (cluster.yaml sets it)
    storage_path: str | None = None  # None: no durable tier
    every: int | str = 50  # flush every N-th committed snapshot, or "auto" (Young/Daly from the flush cost and the observed rate of failures and preemption waves)
    keep_last: int = 3  # committed checkpoints kept in {storage_path}/{run_name}; older ones are deleted (never the newest)
    run_name: str | None = None  # directory under storage_path (None: the run's name)
    mtbf_h: float = 24.0  # every: auto: mean time between failures assumed until the run has seen failures of its own
    max_write_mb_s: float = 0.0  # throttle each manager's flush writes to this many MB/s (0: as fast as storage takes them)
    flush_nice: int = 10  # how many steps nicer than its snapshot manager a flush's writing thread runs (0-19, capped at nice 19; 0: as urgent as training)


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


ChaosKill = Literal["stage", "node", "smp", "error", "standby", "partition", "isolate", "slow", "heal"]
ChaosHow = Literal["ray_kill", "sigkill"]
ChaosDuring = Literal["step", "recovery", "recovered", "resize"]
ChaosOp = Literal["forward", "backward", "allreduce", "update"]
CHAOS_KINDS: tuple[str, ...] = typing.get_args(ChaosKill)  # the words a config may use (checked by validate)
CHAOS_HOW: tuple[str, ...] = typing.get_args(ChaosHow)
CHAOS_DURING: tuple[str, ...] = typing.get_args(ChaosDuring)
CHAOS_OPS: tuple[str, ...] = typing.get_args(ChaosOp)


@dataclass
class ChaosEvent:
    step: int  # fire while this step runs (1-based), or (during: recovery) while the failure of this step is recovered
    kill: ChaosKill  # stage: the actor of (stage, replica); node / smp: the node / snapshot manager hosting it; error: the stage raises on every step from now on;
    # partition: the link of the node hosting it is cut both ways (the multi-host harness, elastic_llm.hosts: the driver runs on one of its hosts);
    # isolate: the link between the node hosting it and the node of the next stage (same replica) on another node (else the previous one's) is cut both ways; both still reach every other host
    # slow: the link of the node hosting it runs at `mbit` Mbit/s each way (a tc token bucket on the harness)
    # heal: before the step, every cut link of the harness heals (the cut nodes' processes come back as zombies)
    stage: int = 0
    replica: int = 0
    how: ChaosHow = "ray_kill"  # ray_kill | sigkill (stage)
    # with kill=smp: flip a byte of its committed shard instead of killing it; with kill=stage,
    # during=recovery: a byte of each of the stage's own background copies, after the plan that may name them
    corrupt: bool = False
    node: int | None = None  # kill=node / smp: the node-th live node with CPUs (by node id), not the one hosting stage/replica
    # step | recovery: after the recovery plan of step `step`'s failure is made, before it is carried out | resize: in the
    # first grow after step `step`, once its spares joined, before their state is copied (kill: node: the joining replica's stage `stage`'s node) |
    # recovered: once the recovery of step `step`'s failure is over (its re-protecting snapshot included), before the next step
    during: ChaosDuring = "step"
    mbit: float = 50.0  # kill: slow: the rate the node's link is slowed to, each way
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
        """The identity of the training state this config makes: what defines the model and the
        state's layout (the model section, the stage count that splits its layers, the state format),
        nothing a resumed run may change (widths, CPUs per actor, microbatches, learning rate, run
        length: a restore checks it, :func:`~elastic_llm.durable.restore.check_fits` says what else changed)."""
        ident = {"model": dataclasses.asdict(self.model), "stages": self.parallel.stages, "state_format": STATE_FORMAT}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def snapshots_on(self) -> bool:
        """Whether the run takes in-memory snapshots: only ``recovery.mode: lossless`` does."""
        return self.snapshot.enabled and self.recovery.mode == Mode.LOSSLESS

    @property
    def outlives_driver(self) -> bool:
        """Whether the run's actors outlive a dead driver for ``recovery.driver_grace_s`` (its
        managers, stage actors and standbys detached, kept alive by the driver's keepalive) so that
        ``train --resume RUN_ID`` can take them over: only a run with in-memory snapshots."""
        return self.snapshots_on and self.recovery.driver_grace_s > 0

    @property
    def swapped(self) -> bool:
        """Whether odd microbatches run the first two and last two stages in swapped order (CheckFree+)."""
        return self.recovery.mode == Mode.CHECKFREE_PLUS

    @property
    def redundant(self) -> bool:
        """Whether every stage also trains a copy of its successor (``recovery.mode: redundant``)."""
        return self.recovery.mode == Mode.REDUNDANT

    @property
    def mirrors(self) -> bool:
        """Whether the embedding / LM head are mirrored on the neighbouring stages."""
        return self.recovery.mode in (Mode.LOSSLESS, Mode.CHECKFREE_PLUS) and self.checkfree.mirror_every > 0 and self.parallel.stages >= 2

    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.model.seq_len


