"""The memory plan of a run: what each stage holds on its device and on its host, before it starts.

Owns: :func:`plan` (one :class:`StagePlan` per pipeline stage, from the config alone), the
check of a plan against a device's memory (:func:`check`, :class:`DoesNotFit`, whose message
names the fields and values that would make the run fit), its text (:func:`render`), and the
object store a node's snapshots need (:func:`snapshot_store_bytes`, which the loopback clusters
size their nodes by and the run's start warns with). Pure: arithmetic on the config, no
tensor allocated, no Ray, no clock; ``elastic-llm plan`` prints it, ``train`` refuses a run that does not
fit before a step runs (up front when ``parallel.gpu_memory_gib`` is set, else each GPU stage
when it first sees its device).

Where the bytes come from (B x T tokens per microbatch, C = dim, F = ffn_hidden, H = heads, V =
vocabulary; read off the tensors autograd saves in :mod:`elastic_llm.model`, and checked against
them in ``tests/test_memory.py``):

* **state**: fp32 parameters, their fp32 gradients and AdamW's two fp32 moments: 4 + 4 + 8 bytes
  per parameter in either precision (bf16 keeps fp32 master weights);
* **activations per microbatch** (kept from a forward until its backward), per token and layer:
  fp32 ``4 (13C + 4F) + 4H``; bf16 autocast ``4rC + 20C + 8F + 4H`` with ``r`` the residual
  stream's bytes (4 on stage 0, whose embedding is fp32; 2 after it, whose input comes in bf16),
  plus in bf16 the autocast copies of the stage's linear weights (2 bytes per weight, each
  microbatch its own); with ``activation_checkpointing: layers`` a layer keeps only its input
  (``rC``) and the weight copies are made again in the backward. The last stage adds its final
  norm and head (``3rC`` or ``12C``) and the fp32 log-softmax of the logits (``4V``), or with
  checkpointing, when the head's loss runs in chunks (:meth:`~elastic_llm.model.StageModule.head_loss`),
  only the chunks' inputs (``rC``);
* **in flight**: how many microbatches' activations a stage holds at once, played out from the
  schedule (1F1B: ``min(stages - s, microbatches)``; GPipe: all of them);
* **working set**: the transient peak of one microbatch on top: the gradients of the logits on
  the last stage (of one chunk's, when the loss runs in chunks), the layer a backward recomputes
  with checkpointing (else none: a backward frees saved tensors as fast as it makes gradients);
* **runtime**: what the framework keeps besides tensors (:data:`RUNTIME_BYTES`);
* **transport** (host): a message queued to send and one received, each a microbatch's
  boundary activation at the wire's dtype; **collective**: the flat gradient and the summed one
  when ``dp`` > 1 (fp32); **redundant**: the successor's state and its activations for every
  microbatch of the step (``recovery.mode: redundant``); **snapshot buffers** (host): the two
  alternating copy buffers of the state (three on CUDA: pinned at the start, with the one for
  direct captures); **object store** (per node): the snapshot versions its manager holds with
  parity (:func:`snapshot_store_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from elastic_llm.config import ConfigError, RunConfig
from elastic_llm.shape import LOSS_CHUNK, ModelShape, count_parameters, stage_layer_range
from elastic_llm.pipeline.schedules import build_schedule
from elastic_llm.pipeline.shares import microbatch_sizes, replica_shares

GIB = 1 << 30
ADAM_BYTES = 8  # two fp32 moments per parameter
DEVICE_RESERVE = 0.05  # of a device's memory kept free for the allocator's rounding and fragmentation
# what the framework itself keeps in a stage process after its first step, beyond its tensors: on CUDA the context and
# cuBLAS's workspaces (about 0.5-1 GiB); on a CPU the math library's (oneDNN's) cached bf16 kernels and the heap glibc
# keeps (measured by `elastic-llm bench memory` on this project's 2-core machine: 2-6 MiB in fp32, 12-16 MiB in bf16)
RUNTIME_BYTES = {("cuda", "fp32"): 1 << 30, ("cuda", "bf16"): 1 << 30, ("cpu", "fp32"): 6 << 20, ("cpu", "bf16"): 16 << 20}


SNAPSHOT_BYTES_PER_PARAM = 12  # fp32 parameters + two AdamW moments
SNAPSHOT_VERSIONS_HELD = 4  # by one manager at most: 2 in flight (snapshot.coordinator.MAX_INFLIGHT), the committed one, one pinned by a durable flush


def snapshot_store_bytes(cfg: RunConfig, nodes: int) -> int:
    """The most one node's object store holds of the run's snapshots (pure estimate): one copy of
    the model's state (``SNAPSHOT_BYTES_PER_PARAM`` per parameter; with data parallelism each
    replica snapshots a 1/dp slice of its stage) spread over ``nodes`` nodes, no finer than one
    stage per node, plus the parity it holds for its erasure group (its peers' data chunks pass
    through a reused block as it encodes them: :mod:`elastic_llm.snapshot.exchange`; until
    2026-11-29 they were pulled into this object store, ``snapshot.parity`` more copies), for every
    version a manager may hold at once (:data:`SNAPSHOT_VERSIONS_HELD`). 0 without snapshots."""
    if not cfg.snapshots_on or nodes < 1:
        return 0
    sn = cfg.snapshot
    state = SNAPSHOT_BYTES_PER_PARAM * count_parameters(cfg.model.shape())
    per_node = state / min(nodes, cfg.parallel.stages * cfg.parallel.dp)
    group = min(sn.group_size, nodes)
    if group <= sn.parity:  # no erasure group forms
        return int(per_node * SNAPSHOT_VERSIONS_HELD)
    parity_share = sn.parity / (group - sn.parity)  # parity held per byte of data
    return int(per_node * (1 + parity_share) * SNAPSHOT_VERSIONS_HELD)


class DoesNotFit(RuntimeError):
    """A stage's plan needs more device memory than the device has."""


@dataclass(frozen=True)
class StagePlan:
    """Bytes one actor of a stage holds (every replica of a stage holds the same)."""

    stage: int
    layers: int
    params: int  # fp32 parameters
    grads: int
    optimizer: int
    activations: int  # one microbatch, with the configured checkpointing
    activations_none: int  # one microbatch, activation_checkpointing: none
    activations_layers: int  # one microbatch, activation_checkpointing: layers
    in_flight: int  # microbatches held at once
    working: int  # one microbatch's transient peak on top
    runtime: int  # the framework's own (RUNTIME_BYTES)
    collective: int
    redundant: int
    transport: int  # host
    snapshot_buffers: int  # host

    @property
    def device(self) -> int:
        """The stage's peak on its device."""
        return self.params + self.grads + self.optimizer + self.in_flight * self.activations + self.working + self.runtime + self.collective + self.redundant

    @property
    def host(self) -> int:
        return self.transport + self.snapshot_buffers


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    object_store_per_node: int
    nodes: int
    actors_per_node: float

    @property
    def peak(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.device)


def _linear_weights(shape: ModelShape, layers: int, last: bool) -> int:
    c, f = shape.dim, shape.ffn_hidden
    return layers * (4 * c * c + 3 * c * f) + (shape.vocab_size * c if last else 0)


def stage_parameters(shape: ModelShape, layers: int, first: bool, last: bool) -> int:
    """Parameters of a stage of ``layers`` layers (stage 0 adds the embedding, the last the final norm and head)."""
    c = shape.dim
    return _linear_weights(shape, layers, last) + layers * 2 * c + (shape.vocab_size * c if first else 0) + (c if last else 0)


def layer_bytes_per_token(shape: ModelShape, precision: str, residual: int) -> int:
    """Bytes one layer keeps for its backward per token (without checkpointing)."""
    c, f, h = shape.dim, shape.ffn_hidden, shape.n_heads
    if precision == "fp32":
        return 4 * (13 * c + 4 * f) + 4 * h + 8
    return 4 * residual * c + 20 * c + 8 * f + 4 * h + 2 * residual


def activation_bytes(shape: ModelShape, precision: str, checkpointing: str, layers: int, first: bool, last: bool, tokens: int) -> int:
    """Bytes one microbatch of ``tokens`` tokens keeps from its forward to its backward on a stage."""
    bf16 = precision == "bf16"
    residual = 4 if first or not bf16 else 2
    c, v = shape.dim, shape.vocab_size
    per_layer = residual * c if checkpointing == "layers" else layer_bytes_per_token(shape, precision, residual)
    per_token = layers * per_layer + (8 if first else 0)  # the token ids the embedding keeps
    chunked = last and checkpointing == "layers" and tokens > LOSS_CHUNK  # the head's loss in chunks, recomputed (model.head_loss)
    if chunked:
        per_token += residual * c + 8  # the chunks' inputs (the last layer's output) and targets
    elif last:
        per_token += (3 * residual * c if bf16 else 12 * c) + residual + 4 * v + 8  # final norm, head input, fp32 log-softmax, targets
    else:
        per_token += (2 if bf16 else 4) * c  # the output the stage holds for its backward, at the wire's dtype
    weight_copies = 2 * (_linear_weights(shape, 0 if checkpointing == "layers" else layers, last and not chunked)) if bf16 else 0
    return tokens * per_token + weight_copies


def working_bytes(shape: ModelShape, precision: str, checkpointing: str, layers: int, last: bool, tokens: int) -> int:
    """One microbatch's transient peak on top of what the stage keeps: on the last stage the
    gradients of the log-probabilities and of the logits (8 bytes per token and vocabulary entry,
    measured in either precision); with checkpointing the activations of the layer whose backward
    recomputes them; the larger of the two, since the head's backward ends before the layers'
    begin. Without either, none: a backward frees each saved tensor as it consumes it, at least
    as fast as it makes gradients (measured: the peak is the moment the last warm-up forward ends)."""
    ckpt = checkpointing == "layers"
    layer = tokens * layer_bytes_per_token(shape, precision, 4 if precision == "fp32" else 2) if ckpt and layers else 0
    if not last:
        return layer
    if ckpt and tokens > LOSS_CHUNK:  # one chunk recomputed: its log-probabilities, their and the logits' gradients, its norm and head
        return max(layer, LOSS_CHUNK * (12 * shape.vocab_size + 12 * shape.dim) + (2 * _linear_weights(shape, 0, True) if precision == "bf16" else 0))
    return max(layer, 8 * tokens * shape.vocab_size)


def in_flight(cfg: RunConfig, micro: int) -> list[int]:
    """Per stage, the most microbatch visits whose activations it holds at once under the schedule."""
    par = cfg.parallel
    out = []
    for ops in build_schedule(par.schedule, par.stages, micro, cfg.swapped):
        live = most = 0
        for op in ops:
            live += 1 if op.kind == "F" else -1
            most = max(most, live)
        out.append(most)
    return out


def plan(cfg: RunConfig, nodes: int | None = None) -> Plan:
    """The memory plan of ``cfg``; ``nodes``: worker nodes the actors spread over (None: one per actor)."""
    par, train, shape = cfg.parallel, cfg.train, cfg.model.shape()
    share = max(replica_shares(train.batch_size, par.dp))
    sizes = microbatch_sizes(share, par.microbatches)
    tokens = max(sizes) * shape.seq_len
    flights = in_flight(cfg, len(sizes))
    wire = 2 if train.precision == "bf16" else 4
    on_cuda = par.gpus_per_actor > 0
    stages: list[StagePlan] = []
    for s in range(par.stages):
        n = len(stage_layer_range(shape.n_layers, par.stages, s))
        first, last = s == 0, s == par.stages - 1
        p = stage_parameters(shape, n, first, last)
        acts = {ck: activation_bytes(shape, train.precision, ck, n, first, last, tokens) for ck in ("none", "layers")}
        stages.append(StagePlan(
            stage=s, layers=n, params=4 * p, grads=4 * p, optimizer=ADAM_BYTES * p,
            activations=acts[train.activation_checkpointing], activations_none=acts["none"], activations_layers=acts["layers"],
            in_flight=flights[s], working=working_bytes(shape, train.precision, train.activation_checkpointing, n, last, tokens),
            runtime=RUNTIME_BYTES[("cuda" if on_cuda else "cpu", train.precision)],
            collective=8 * p if par.dp > 1 else 0, redundant=0,
            transport=2 * tokens * shape.dim * wire, snapshot_buffers=(3 if on_cuda else 2) * SNAPSHOT_BYTES_PER_PARAM * p if cfg.snapshots_on else 0,
        ))
    if cfg.redundant:  # each stage also runs its successor's copy over every microbatch (its gradients in the replicas' sum too)
        stages = [replace(st, redundant=(nxt := stages[(st.stage + 1) % par.stages]).params * 4 + nxt.collective + len(sizes) * nxt.activations) for st in stages]
    actors = par.stages * par.dp
    n_nodes = nodes or actors
    return Plan(tuple(stages), snapshot_store_bytes(cfg, n_nodes), n_nodes, actors / n_nodes)


def fits(cfg: RunConfig, device_bytes: float) -> bool:
    return plan(cfg).peak.device <= device_bytes * (1 - DEVICE_RESERVE)


def _fixes(cfg: RunConfig, device_bytes: float) -> list[str]:
    """Single changes that would make ``cfg`` fit, each as ``field=value``."""
    from elastic_llm.config import config_from_dict

    base = cfg.to_dict()
    tries: list[tuple[str, str, object]] = []
    if cfg.train.activation_checkpointing == "none":
        tries.append(("train", "activation_checkpointing", "layers"))
    if cfg.train.precision == "fp32":
        tries.append(("train", "precision", "bf16"))
    share = max(replica_shares(cfg.train.batch_size, cfg.parallel.dp))
    tries += [("parallel", "microbatches", m) for m in range(cfg.parallel.microbatches + 1, share + 1) if share % m == 0]
    tries += [("parallel", "stages", s) for s in range(cfg.parallel.stages + 1, cfg.model.n_layers + 1) if cfg.model.n_layers % s == 0]
    found, seen = [], set()
    for section, key, value in tries:
        if key in seen:
            continue
        data = {**base, section: {**base[section], key: value}}
        try:
            ok = fits(config_from_dict(data), device_bytes)
        except ValueError:
            continue
        if ok:
            found.append(f"{section}.{key}={value}")
            seen.add(key)
    return found


def check(cfg: RunConfig, device_bytes: float, where: str) -> None:
    """Raise :class:`DoesNotFit` when a stage's plan exceeds ``device_bytes`` (less
    :data:`DEVICE_RESERVE`), naming the stage, the bytes and what would make it fit."""
    p = plan(cfg)
    worst = p.peak
    usable = device_bytes * (1 - DEVICE_RESERVE)
    if worst.device <= usable:
        return
    fixes = _fixes(cfg, device_bytes)
    hint = (f"any of {', '.join(fixes)}" if fixes else
            "a change of several of parallel.microbatches, parallel.stages, train.activation_checkpointing, train.precision (none alone is enough), or use a bigger device")
    raise DoesNotFit(
        f"stage {worst.stage} needs {worst.device / GIB:.1f} GiB of device memory ({worst.in_flight} microbatches of activations in flight at "
        f"{worst.activations / GIB:.2f} GiB each, state {(worst.params + worst.grads + worst.optimizer) / GIB:.1f} GiB), but {where} has "
        f"{device_bytes / GIB:.1f} GiB ({usable / GIB:.1f} usable): it would run out of memory; set {hint} (see `elastic-llm plan`)"
    )


def share(cfg: RunConfig, device_bytes: float) -> float:
    """A stage's part of a device of ``device_bytes``: all of it, or ``gpus_per_actor`` of it when
    that is a fraction (stages sharing a GPU)."""
    gpus = cfg.parallel.gpus_per_actor
    return device_bytes * (min(1.0, gpus) if gpus > 0 else 1.0)


def check_up_front(cfg: RunConfig) -> None:
    """``train``'s check before Ray starts: a GPU run whose ``parallel.gpu_memory_gib`` its plan
    does not fit is a :class:`ConfigError` (exit 2) naming what would make it fit."""
    par = cfg.parallel
    if par.gpus_per_actor > 0 and par.gpu_memory_gib:
        try:
            check(cfg, share(cfg, par.gpu_memory_gib * GIB), f"parallel.gpu_memory_gib={par.gpu_memory_gib:g} (x gpus_per_actor={par.gpus_per_actor:g})")
        except DoesNotFit as e:
            raise ConfigError(str(e)) from None


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def render(cfg: RunConfig, p: Plan, device_gib: float | None = None) -> str:
    """The plan as a table, GiB per stage actor, and whether it fits ``device_gib``."""
    t = cfg.train
    lines = [
        f"memory plan of {cfg.name}: {cfg.parallel.stages} stages x {cfg.parallel.dp} replicas, {cfg.parallel.schedule}, "
        f"{cfg.parallel.microbatches} microbatches, precision {t.precision}, activation_checkpointing {t.activation_checkpointing} (GiB per stage actor)",
        f"{'stage':>5} {'layers':>6} {'params':>7} {'grads':>7} {'adamw':>7} {'act/mb':>7} {'x flight':>8} {'ckpt/mb':>8} {'none/mb':>8} "
        f"{'work+rt':>8} {'other':>7} {'DEVICE':>8} {'host':>7}",
    ]
    for s in p.stages:
        lines.append(
            f"{s.stage:>5} {s.layers:>6} {_gib(s.params):>7} {_gib(s.grads):>7} {_gib(s.optimizer):>7} {_gib(s.activations):>7} {s.in_flight:>8} "
            f"{_gib(s.activations_layers):>8} {_gib(s.activations_none):>8} {_gib(s.working + s.runtime):>8} {_gib(s.collective + s.redundant):>7} "
            f"{_gib(s.device):>8} {_gib(s.host):>7}"
        )
    lines.append(f"host per node ({p.actors_per_node:g} actors on each of {p.nodes} nodes): snapshot buffers and transport "
                 f"{_gib(p.actors_per_node * max(s.host for s in p.stages))} GiB, object store {_gib(p.object_store_per_node)} GiB")
    if device_gib is not None:
        mine = share(cfg, device_gib * GIB)
        try:
            check(cfg, mine, f"a stage's share of a {device_gib:g} GiB device" if mine < device_gib * GIB else f"a {device_gib:g} GiB device")
            lines.append(f"fits a {device_gib:g} GiB device: the largest stage needs {_gib(p.peak.device)} GiB of {mine * (1 - DEVICE_RESERVE) / GIB:.2f} usable")
        except DoesNotFit as e:
            lines.append(f"does NOT fit: {e}")
    return "\n".join(lines)
