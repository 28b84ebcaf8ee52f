"""One pipeline stage of one data-parallel replica: the body of a Ray actor.

Owns: the stage's layers, its AdamW optimizer and LR schedule (built by :mod:`.optim`), per-microbatch
forward/backward with the activations kept between them, its flat gradient (what the replicas'
all-reduce sums), clipping at ``grad_clip`` and the L2 norm of the last clipped gradient
(CheckFree weights rebuilt stages by it), and the actor's links to its step peers. A whole step
is one call, :meth:`StageWorker.run_step`: :mod:`elastic_llm.pipeline.step` runs the plan's ops
on this object, activations and gradients travel over :mod:`elastic_llm.pipeline.transport`.

With ``recovery.mode: checkfree_plus`` a microbatch may visit a stage twice (the swapped order of
:mod:`elastic_llm.pipeline.schedules`), so activations are kept per (microbatch, visit). What the
other recovery modes need of a stage (CheckFree's rebuild and mirrors, the redundant copy,
checkpoint files, durable checkpoints) is :mod:`elastic_llm.pipeline.sources`', mixed in.

Never decides anything about the run: the controller tells it what to do, in which order.
Every method is a remote call the controller, the managers or the peers make on a stage actor
(Ray exposes methods of the actor class only); the work behind them is kept elsewhere (the step's
order in :mod:`~elastic_llm.pipeline.step`, the copies in :mod:`~elastic_llm.pipeline.copies`,
state packing in :mod:`elastic_llm.snapshot.state`). The class is plain Python so tests can drive
it in-process; the runtime starts it as a Ray actor through the light front of
:mod:`~elastic_llm.pipeline.stage_actor` (a process given a stage actor's handle then loads that
front, not torch).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from elastic_llm.clock import SYSTEM
from elastic_llm.config import RunConfig, config_from_dict
from elastic_llm.lease import Lease, remove_run_groups
from elastic_llm.model import StageModule, build_stage, lm_loss
from elastic_llm.pipeline import device
from elastic_llm.pipeline.copies import BackgroundCopies
from elastic_llm.pipeline.optim import build_optimizer
from elastic_llm.pipeline.plan import InjectedFault, StepPlan, StepReport, StepStats
from elastic_llm.pipeline.redundant import Shadow
from elastic_llm.pipeline.relay import Relay, ReplicaReports
from elastic_llm.pipeline.sources import OtherSources
from elastic_llm.pipeline.schedules import Hop, hop_index, hops_of, routes
from elastic_llm.pipeline.shares import microbatch_sizes
from elastic_llm.snapshot.records import Piece, ShardInfo, ShardKey
from elastic_llm.stream import StreamPosition
from elastic_llm.monitor import StageState
from elastic_llm.telemetry import Metrics
from elastic_llm.tensors import host

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


@dataclass(frozen=True)
class StageInfo:
    """Where a stage actor runs and what it holds."""

    stage: int
    replica: int
    pid: int
    node_id: str | None
    device: str
    threads: int
    step: int
    layers: tuple[int, ...]
    parameters: int
    gpu_ids: tuple[str, ...] = ()  # the devices Ray gave this process, indices or UUIDs (a standby adopted in its place takes them)
    links: int = -1  # the generation of its links to its step peers (-1: none yet): a new driver aborts a step of it left running


def warm_up(cfg: RunConfig) -> None:
    """A warm standby's start: one small forward, backward and AdamW step through the model's own
    code (a one-layer, 2-stage-shaped module of the run's architecture at width 32), so the lazy
    parts of torch (the autograd engine's threads, kernel selection, the fused optimizer path, the
    symbolic-shape module torch imports at the first backward given a gradient) are paid before a
    recovery needs the process: an adopted standby that had not paid the last (0.4 s of CPU) ran
    its first step 0.4-0.7 s slower than a steady one. Touches no GPU. Seeded, and the RNG is
    restored: the adopted stage starts from the same RNG state as a fresh actor."""
    rng = torch.get_rng_state()
    shape = cfg.model.shape()
    small = type(shape)(vocab_size=min(shape.vocab_size, 256), dim=32, n_heads=2, n_layers=2, seq_len=min(shape.seq_len, 16), ffn_hidden=64, norm_eps=shape.norm_eps, rope_theta=shape.rope_theta)
    for stage in (0, 1):
        module = build_stage(small, 2, stage, 0)
        optimizer, _ = build_optimizer(module, cfg.train)
        x = torch.randint(0, small.vocab_size, (1, small.seq_len)) if stage == 0 else torch.randn(1, small.seq_len, small.dim)
        out = module(x)
        if stage == 1:
            lm_loss(out, torch.zeros(1, small.seq_len, dtype=torch.long)).backward()
        else:  # with a gradient, as a stage gets its successor's: torch's first such backward imports sympy (0.4 s of CPU)
            out.backward(torch.ones_like(out))
        optimizer.step()
    torch.set_rng_state(rng)


def stage_seed(seed: int, stage: int, replica: int) -> int:
    return (seed * 7919 + stage * 104_729 + replica * 15_485_863) % (2**31)




class StageWorker(OtherSources):
    """Layers + optimizer of (stage, replica). Methods are called in schedule order."""

    def __init__(self, config: dict[str, Any] | RunConfig, stage: int | None, replica: int = 0, dp: int | None = None, run_id: str = "",
                 grace_s: float = 0.0) -> None:
        """``stage`` None starts a warm standby: the process has torch and the model code imported
        and warmed up, holds no stage and next to no memory, and becomes a stage on :meth:`adopt`.
        ``grace_s`` > 0: a detached actor that outlives its driver, ending itself (and the run's
        placement groups) once no driver's :meth:`keepalive` came for that long."""
        self.cfg = config if isinstance(config, RunConfig) else config_from_dict(config)
        self.run_id = run_id
        self.lease = Lease(grace_s, f"stage actor of run {run_id} (pid {os.getpid()})", SYSTEM, lambda: remove_run_groups(run_id)) if grace_s > 0 else None
        self.standby = stage is None
        self.adopted_gpus: tuple[str, ...] = ()  # devices taken over from a dead actor (a GPU run's standby)
        self.metrics = Metrics()
        self.relay: Any = None  # as stage 0 of a replica: its relay of the steps (relay_to)
        if stage is None:
            self.stage, self.replica, self.dp, self.n_stages = -1, -1, 0, self.cfg.parallel.stages
            self.step_count = 0
            torch.set_num_threads(1)  # idle: next to no CPU until adopted
            warm_up(self.cfg)
            return
        self._build(stage, replica, dp)

    def adopt(self, stage: int, replica: int, dp: int, gpu_ids: tuple[str, ...] | None = None) -> "StageInfo":
        """A warm standby becomes ``(stage, replica)`` of a width of ``dp``: it builds the stage
        (fresh weights, as a new actor would; the caller loads the state next). ``gpu_ids``: the
        devices this process may use from now on (the dead actor's, on the same node), set before
        CUDA is first touched. Returns the new stage's :meth:`info`."""
        if not self.standby:
            raise RuntimeError(f"stage {self.stage} replica {self.replica} is not a standby: it cannot be adopted")
        if gpu_ids:
            self.adopted_gpus = device.gpu_ids(gpu_ids)
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.adopted_gpus)
        self._build(stage, replica, dp)
        self.standby = False
        return self.info()

    def _build(self, stage: int, replica: int, dp: int | None) -> None:
        par, train = self.cfg.parallel, self.cfg.train
        self.stage, self.replica = stage, replica
        self.dp = dp or par.dp  # data-parallel width now (it changes as the run resizes): which 1/dp slice of the state this replica snapshots
        self.n_stages = par.stages
        self.first, self.last = stage == 0, stage == par.stages - 1
        device.make_deterministic(train.deterministic)  # before the process's first CUDA call
        self.device = device.stage_device(par.gpus_per_actor, torch.cuda.is_available(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        device.check_fits(self.cfg, self.device)  # a plan that does not fit this GPU stops here, naming what would make it fit
        torch.set_num_threads(par.threads())
        torch.manual_seed(stage_seed(train.seed, stage, replica))
        self.module = build_stage(self.cfg.model.shape(), par.stages, stage, train.seed).to(self.device)
        self.module.checkpoint_layers = train.activation_checkpointing == "layers"
        self._check_aborts(self.module)
        self.optimizer, self.scheduler = build_optimizer(self.module, train)
        from elastic_llm.snapshot.state import StateArena
        self.arena = StateArena(self.module, self.optimizer)  # state in one block: copies are single memcpys
        self.set_microbatches(microbatch_sizes(train.batch_size, par.microbatches), train.batch_size)  # the whole batch, until a plan sets this replica's
        self.backwards_done = 0  # visits backpropagated in the current step
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # (microbatch, visit) -> input
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.mirror: np.ndarray | None = None  # CheckFree+: the neighbour's embedding / head, flat
        self.mirror_step = -1
        self.shadow: Shadow | None = Shadow(self.cfg, (stage + 1) % par.stages, self.device) if self.cfg.redundant else None
        self.last_grad_norm = 0.0
        self.step_count = 0
        # Lazy asynchronous snapshots: step(snapshot=...) starts copying the updated state into the
        # reused buffer on a background thread while the next forward/backward run; the next
        # step() waits for it only if it is unfinished. A snapshot manager collects the copy.
        self.copies = BackgroundCopies(self.arena, self.device, f"{stage}-{replica}", self.cfg.chaos.snapshot_delay_s)
        if self.device.type == "cuda":
            self.copies.preallocate()  # pinned now, not in the first snapshot's step
        self.injected_error: str | None = None  # chaos: every forward raises this from now on
        self.links: Any = None  # SocketTransport: this actor's links to its step peers

    def _check_aborts(self, module: StageModule) -> None:
        """An aborted step (another actor of it failed) stops at this stage's next matrix
        product (every linear map and the embedding, the LM head included), in a forward or a
        backward, instead of finishing the op it is in."""

        def check(*_: Any) -> None:
            if self.links is not None:
                self.links.raise_if_aborted()

        def on_output(_m: Any, _i: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(check)  # runs when the backward reaches this layer

        for part in module.modules():
            if isinstance(part, (torch.nn.Linear, torch.nn.Embedding)):
                part.register_forward_pre_hook(check)
                part.register_forward_hook(on_output)

    def __repr__(self) -> str:
        # Ray shows this as the actor's display name (``ray list actors``, the dashboard) and in
        # its log prefix; it is taken once, when the actor starts (state() has the live role, so an
        # adopted standby keeps the name "Stage(standby, ...)" and reports its stage there)
        if self.standby:
            return f"Stage(standby, run {self.run_id})"
        return f"Stage({self.stage}/{self.n_stages}, replica {self.replica}, run {self.run_id})"

    # ------------------------------------------------------------------ one step, run by the actor
    def link_address(self) -> tuple[str, int]:
        """Where peers connect to this actor's links (started on first use, on the node's address)."""
        if self.links is None:
            from elastic_llm.pipeline.transport import SocketTransport

            import ray

            # peers on other nodes connect to this node's address (Ray's, as its raylet
            # registered it: a failure to read it is Ray's and propagates); without Ray (a stage
            # driven in process by a test) the peers are in this machine: loopback
            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            self.links = SocketTransport(ShardKey(self.stage, self.replica), host)
        return self.links.address

    def connect_links(self, generation: int, peers: dict[ShardKey, tuple[str, int]]) -> int:
        """Set up the links of membership ``generation`` (this actor is now ``(stage, replica)``
        of the run). Returns the completed steps."""
        self.link_address()
        assert self.links is not None
        self.links.me = ShardKey(self.stage, self.replica)
        self.links.connect(generation, peers)
        return self.step_count

    def run_step(self, plan: StepPlan) -> StepReport:
        """Run one whole optimizer step from ``plan`` (:mod:`elastic_llm.pipeline.step`); its report names what was fenced since the last."""
        from elastic_llm.pipeline.step import execute
        from elastic_llm.pipeline.transport import StaleGeneration

        if self.links is None:
            raise RuntimeError(f"stage {self.stage} replica {self.replica}: run_step before connect_links")
        if self.links.stale(plan.generation, f"a plan of step {plan.step}"):  # a zombie relay's (a healed partition): the links stay
            raise StaleGeneration(f"stage {self.stage} replica {self.replica} refused a plan of step {plan.step} of a stale generation")
        return replace(execute(self, plan, self.links), fenced=self.links.take_refused())

    def relay_to(self, generation: int, members: list[Any]) -> None:
        """As stage 0 of its replica, relay the steps of link generation ``generation`` to
        ``members`` (the replica's stage actors, in stage order, itself first)
        (:mod:`elastic_llm.pipeline.relay`)."""
        self.relay = Relay(generation, members)

    def relay_step(self, generation: int, plans: list[StepPlan]) -> ReplicaReports:
        """Called in the ``relay`` group: run a step on the replica's stages (``plans[s]`` for
        stage ``s``); their reports, as soon as all answered or one failed."""
        if self.relay is None:
            raise RuntimeError(f"stage {self.stage} replica {self.replica}: relay_step before relay_to")
        return self.relay.step(generation, plans)

    def relay_rest(self, generation: int, timeout: float, skip: tuple[int, ...] = ()) -> ReplicaReports:
        """Called in the ``relay`` group after an early answer: the reports of the stages that were still running (but ``skip``)."""
        return self.relay.rest(generation, timeout, skip) if self.relay is not None else ReplicaReports()

    def abort_step(self, generation: int) -> None:
        """Wake this actor's step if it is blocked on a peer (called in the ``control`` group
        while ``run_step`` runs)."""
        if self.links is not None:
            self.links.abort(generation)

    # ------------------------------------------------------------------ one microbatch
    def set_microbatches(self, sizes: tuple[int, ...], batch: int) -> None:
        """This replica's microbatches from now on (every :class:`StepPlan` sets them): ``sizes[mb]``
        sequences each, of a global batch of ``batch`` (:mod:`elastic_llm.pipeline.shares`). Their
        count fixes the routes and the visits a step must backpropagate; microbatch ``mb``'s loss
        counts with weight ``sizes[mb] / batch``, so the replicas' summed gradients are those of the
        mean loss over the global batch."""
        self.micro_sizes = tuple(sizes)
        self.micro_per_replica = len(self.micro_sizes)
        self.loss_weights = tuple(n / batch for n in self.micro_sizes)
        self.routes = routes(self.n_stages, self.micro_per_replica, self.cfg.swapped)
        self.backwards_per_step = sum(len(hops_of(r, self.stage)) for r in self.routes)

    def _hop(self, mb: int, visit: int) -> Hop:
        route = self.routes[mb]
        return route[hop_index(route, self.stage, visit)]

    def forward(
        self,
        mb: int,
        x: np.ndarray | torch.Tensor,
        targets: np.ndarray | None = None,
        visit: int = 0,
        shadow_x: np.ndarray | None = None,
        shadow_targets: np.ndarray | None = None,
    ) -> torch.Tensor | float:
        """Run the stage's parts of visit ``visit`` of microbatch ``mb``; keep what backward needs.

        ``x`` may be a tensor on this stage's device (a device transport hands those over) or
        host memory. Returns the output activations (a detached tensor on this stage's device: the
        transport decides whether they leave it), or after the LM head the microbatch loss. With a
        redundant copy of the successor, the copy runs too, on this stage's output (or on
        ``shadow_x``, the tokens, when the successor is stage 0; ``shadow_targets`` when it is the
        last stage)."""
        if self.injected_error is not None:
            raise InjectedFault(f"stage {self.stage} replica {self.replica}: {self.injected_error}")
        hop = self._hop(mb, visit)
        inp = torch.as_tensor(x, device=self.device)
        if not hop.embed:
            inp.requires_grad_(True)
        if hop.head and targets is None:
            raise ValueError("the stage applying the LM head needs targets to compute the loss")
        tgt = torch.from_numpy(np.asarray(targets)).to(self.device) if hop.head else None
        out = device.forward(self.cfg.train.precision, self.device, lambda: self.module.run(inp, hop.embed, hop.layers, hop.head, tgt), not hop.head)  # the loss after the head
        self.inputs[(mb, visit)] = inp
        if self.shadow is not None:
            copy_in = out.detach().requires_grad_(True) if shadow_x is None else torch.from_numpy(np.asarray(shadow_x))  # as the successor gets it
            self.shadow.forward(mb, copy_in, shadow_targets, self.loss_weights[mb])
        if hop.head:
            loss = out
            self.outputs[(mb, visit)] = loss * self.loss_weights[mb]
            return float(loss.detach())
        self.outputs[(mb, visit)] = out
        return out.detach()

    def backward(self, mb: int, grad: np.ndarray | torch.Tensor | None = None, visit: int = 0) -> torch.Tensor | None:
        """Backpropagate visit ``visit`` of microbatch ``mb``; return the gradient of its input, on
        this stage's device (None when the visit started from tokens)."""
        out = self.outputs.pop((mb, visit))
        inp = self.inputs.pop((mb, visit))
        if grad is None:
            out.backward()
        else:
            out.backward(torch.as_tensor(grad, device=self.device, dtype=out.dtype))
        self.backwards_done += 1
        if self._hop(mb, visit).embed:
            return None
        return inp.grad

    def shadow_backward(self, *grads: np.ndarray | torch.Tensor) -> None:
        """Backpropagate the redundant copy of the successor over every microbatch of the step
        (``grads[mb]``: the gradient the successor received for its output; none when the
        successor is the last stage), in microbatch order as the successor does."""
        assert self.shadow is not None, "shadow_backward needs recovery.mode=redundant"
        self.shadow.backward(grads, self.micro_per_replica)

    # ------------------------------------------------------------------ optimizer step
    def _check_complete(self) -> None:
        """Refuse to share or apply gradients of a step whose backward did not fully run (a call
        queued behind failed ones still executes: this keeps it from using partial gradients)."""
        if self.backwards_done != self.backwards_per_step or self.inputs or self.outputs:
            raise RuntimeError(f"stage {self.stage} replica {self.replica}: only {self.backwards_done} of {self.backwards_per_step} microbatch visits were backpropagated this step")

    def flat_grad(self) -> np.ndarray:
        """All parameter gradients of this stage, flattened (for the replicas' sum); with a redundant copy, the copy's
        after them (their sum is its successor's, added in the same order: the copy stays bit-identical to it)."""
        self._check_complete()
        return host(torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device) for p in self._summed()]))

    def set_flat_grad(self, flat: np.ndarray) -> None:
        """Replace the local gradients by ``flat`` (the replicas' sum, :meth:`flat_grad` layout)."""
        total = torch.from_numpy(np.asarray(flat))
        offset = 0
        for p in self._summed():
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p).to(p.device)
            offset += n

    def _summed(self) -> list[torch.nn.Parameter]:  # the parameters whose gradients the replicas sum: the stage's, then its redundant copy's
        return [*self.module.parameters(), *(self.shadow.module.parameters() if self.shadow is not None else ())]

    def step(self, snapshot: StreamPosition | Mapping[str, Any] | None = None) -> StepStats:
        """Clip the (already summed over replicas) gradients, remember the clipped norm, update, advance the
        LR schedule.

        Waits first if the snapshot copy of an earlier step is unfinished (the update would
        overwrite tensors being copied). ``snapshot`` (the data position after this step's batch)
        starts a background copy of the updated state for :meth:`snapshot_pieces` to collect.
        """
        self.copies.wait()
        self._check_complete()
        clip = self.cfg.train.grad_clip
        norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip))
        self.last_grad_norm = min(norm, clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.backwards_done = 0
        self.scheduler.step()
        self.step_count += 1
        if self.shadow is not None:
            self.shadow.step(clip)
        if snapshot is not None:
            self._start_copy(StreamPosition.of(snapshot))
        tags = {"run": self.run_id, "stage": self.stage, "replica": self.replica}
        self.metrics.set("stage_step", self.step_count, **tags)
        if snapshot is not None:
            self.metrics.set("stage_snapshot_version", self.step_count, **tags)
        return StepStats(norm, lr, self.copies.wait_s)

    @property
    def snapshot_wait_s(self) -> float:
        """Total seconds this actor's optimizer steps waited for an unfinished snapshot copy."""
        return self.copies.wait_s

    def _start_copy(self, data_position: StreamPosition | None) -> None:
        """Take the small JSON part now (RNG states move on with the next forward) and copy the
        bytes (this replica's 1/DP slice) in the background."""
        from elastic_llm.snapshot import state as st

        lo, hi = self.arena.layout.slice_bounds(self.replica, self.dp)
        extra = st.json_state(self.optimizer, self.scheduler, self.step_count, data_position.to_dict() if data_position else {}, self.cfg.config_hash())
        extra["slice"], extra["precision"] = [lo, hi], self.cfg.train.precision
        self.copies.start(self.step_count, lo, hi, st.make_manifest(self.arena.layout, extra, self.stage))

    def snapshot_now(self, data_position: StreamPosition | Mapping[str, Any] | None = None) -> int:
        """Start a background copy of the current state outside a step (a final snapshot, or
        before a planned stop); returns its version (the current step) for :meth:`snapshot_pieces`."""
        self.copies.wait()
        self._start_copy(StreamPosition.of(data_position) if data_position else None)
        return self.step_count

    def snapshot_pieces(self, version: int, k: int) -> list[Any]:
        """The copy of step ``version``, cut into ``k`` pieces for erasure coding.

        Called by this node's snapshot manager (num_returns = k + 1) in the "snapshot"
        concurrency group, so it overlaps training. Returns [info, piece 0, ..., piece k-1]: the
        pieces become objects in this node's object store owned by the caller (the manager), so
        they outlive this process; ``info`` has the manifest, byte ranges and CRC-32 of each piece.
        """
        job, copy_s = self.copies.take(version, f"stage {self.stage} replica {self.replica}", newest=self.step_count + 1)
        meta, pieces = self.copies.pieces(job, k)
        info = ShardInfo(ShardKey(self.stage, self.replica), version, job.lo, job.hi - job.lo, tuple(meta), job.manifest, copy_s)
        return [info, *pieces]

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def eval_forward(self, x: np.ndarray | torch.Tensor, targets: np.ndarray | None = None) -> np.ndarray | float:
        out = device.forward(self.cfg.train.precision, self.device, lambda: self.module(torch.as_tensor(x, device=self.device)), not self.last)
        if self.last:
            return float(lm_loss(out, torch.from_numpy(np.asarray(targets)).to(self.device)))
        return host(out.float())  # the training wire's rounding; numpy carries it as float32

    # ------------------------------------------------------------------ state capture / restore
    def capture_state(self, data_position: StreamPosition | Mapping[str, Any] | None = None, replica_slice: bool = False) -> tuple[np.ndarray, str]:
        """Copy the whole state (or this replica's 1/DP slice) into the stage's reused buffer now.

        Returns (buffer, manifest JSON). The buffer is overwritten by the next capture: callers
        hand it on (e.g. to a peer) before capturing again.
        """
        self.copies.wait()
        lo, hi = self.arena.layout.slice_bounds(self.replica, self.dp) if replica_slice else (0, self.arena.layout.nbytes)
        buf = self.copies.buffer(2)  # its own buffer: never one a snapshot in flight uses
        self.arena.capture(buf, lo, hi)
        return buf, self.state_manifest(lo, hi, data_position)

    def state_manifest(self, lo: int, hi: int, data_position: StreamPosition | Mapping[str, Any] | None = None) -> str:
        """The manifest of bytes [lo, hi) of the state as it is now (layout, optimizer, schedule, RNG, step)."""
        from elastic_llm.snapshot import state as st

        position = StreamPosition.of(data_position).to_dict() if data_position is not None else None
        extra = st.json_state(self.optimizer, self.scheduler, self.step_count, position, self.cfg.config_hash())
        extra["slice"], extra["precision"] = [lo, hi], self.cfg.train.precision  # the state is fp32 either way: a resume at the other precision loads it
        return st.make_manifest(self.arena.layout, extra, self.stage)

    def load_state(self, buffer: np.ndarray, manifest: str) -> int:
        """Restore parameters, optimizer, scheduler and RNG state from one whole-state buffer."""
        return self.load_parts(manifest, [0], buffer)

    def load_parts(self, manifest: str, offsets: list[int], *parts: np.ndarray) -> int:
        """Restore from pieces of the state (``parts[i]`` holds the bytes at ``offsets[i]``; all of
        them together cover the state: snapshot pieces, data-parallel slices). Returns the step."""
        from elastic_llm.snapshot import state as st

        if len(offsets) != len(parts):
            raise st.SnapshotFormatError(f"{len(parts)} snapshot parts but {len(offsets)} offsets")
        self.copies.wait()
        m = st.restore(
            [(int(o), np.asarray(p)) for o, p in zip(offsets, parts)],
            st.parse_manifest(manifest),
            self.arena,
            self.optimizer,
            self.scheduler,
            self.cfg.config_hash(),
            self.stage,
        )
        self.step_count = int(m["step"])
        self.reset_step()  # also forgets copies of steps after the restored one
        return self.step_count

    def reset_step(self) -> int:
        """Drop the partial work of an aborted step (activations, accumulated gradients); snapshot
        calls waiting for a step give up. Finished copies stay (a rollback may restore from them)."""
        self.inputs.clear()
        self.outputs.clear()
        self.optimizer.zero_grad()
        self.backwards_done = 0
        if self.shadow is not None:
            self.shadow.reset()
        self.copies.forget_after(self.step_count)
        return self.step_count

    def holds_own_copy(self, version: int) -> bool:
        """Whether one of this stage's background copy buffers holds all of step ``version``
        (what a recovery observes before its plan names the copies a rollback restores from)."""
        return self.copies.holds(version, self.arena.layout.nbytes)

    def corrupt_own_copies(self) -> list[int]:
        """Fault injection (``chaos: kill: stage, corrupt: true``): flip a byte of each of this
        stage's background copies. Returns the versions hit."""
        return self.copies.corrupt()

    def restore_own_copy(self, version: int, pieces: tuple[Piece, ...]) -> bool:
        """Roll back to step ``version`` from this stage's own background copy, if one of its
        buffers still holds it and every byte range in ``pieces`` (the committed snapshot's
        record) has the recorded checksum. Returns False (nothing changed)
        otherwise: the plan that named this copy cannot be followed."""
        job = self.copies.whole(version, self.arena.layout.nbytes, pieces)
        if job is None:
            return False
        self.load_parts(job.manifest, [0], job.buffer)
        return True

    def set_width(self, replica: int, dp: int) -> int:
        """The run resized: this actor is now replica ``replica`` of ``dp``. Changes no state, only
        which slice of it the next snapshot copies. Returns the completed steps."""
        if not 0 <= replica < dp:
            raise ValueError(f"replica {replica} is not in a width of {dp}")
        self.replica, self.dp = replica, dp
        return self.step_count

    def keepalive(self) -> None:
        """A driver of the run lives (``recovery.driver_grace_s``): the lease is renewed."""
        if self.lease is not None:
            self.lease.renew()

    def inject_error(self, message: str) -> None:
        """Fault injection: from now on every forward raises :class:`InjectedFault` (``message``)."""
        self.injected_error = message

    # ------------------------------------------------------------------ inspection
    def info(self) -> StageInfo:
        import ray

        ctx = ray.get_runtime_context() if ray.is_initialized() else None
        if self.standby:
            node = ctx.get_node_id() if ctx else None
            return StageInfo(stage=-1, replica=-1, pid=os.getpid(), node_id=node, device="none", threads=torch.get_num_threads(), step=0, layers=(), parameters=0)
        return StageInfo(
            stage=self.stage,
            replica=self.replica,
            pid=os.getpid(),
            node_id=ctx.get_node_id() if ctx else None,
            device=str(self.device),
            threads=torch.get_num_threads(),
            step=self.step_count,
            layers=tuple(self.module.layer_ids),
            parameters=sum(p.numel() for p in self.module.parameters()),
            gpu_ids=self.adopted_gpus or (device.gpu_ids(ray.get_gpu_ids()) if ctx else ()),
            links=self.links.generation if self.links is not None else -1,
        )

    def role(self) -> str:
        if self.standby:
            return "standby"
        ids = self.module.layer_ids
        parts = ["embed"] if self.first else []
        if ids:
            parts.append(f"L{ids[0]}-{ids[-1]}" if len(ids) > 1 else f"L{ids[0]}")
        if self.last:
            parts.append("head")
        return "+".join(parts)

    def state(self) -> StageState:
        """What this actor is doing now. Called by ``elastic-llm status`` in the ``status``
        concurrency group, so it answers while a forward or backward runs (it only reads)."""
        import ray

        if self.standby:
            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
            return StageState(self.run_id, -1, self.n_stages, -1, 0, "standby", node, os.getpid(), 0, None, False, 0)
        copies = self.copies
        held = self.arena.layout.nbytes + sum(b.nbytes for b in copies.buffers.values())
        self.metrics.set("stage_bytes_held", held, run=self.run_id, stage=self.stage, replica=self.replica)
        latest = copies.latest
        return StageState(
            run=self.run_id,
            stage=self.stage,
            stages=self.n_stages,
            replica=self.replica,
            width=self.dp,
            role=self.role(),
            node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
            pid=os.getpid(),
            step=self.step_count,
            snapshot_version=max(copies.held, default=None),
            copy_in_flight=latest is not None and not latest.done(),
            bytes_held=held,
        )

    def grads(self) -> dict[str, np.ndarray]:
        return {n: host(p.grad).copy() for n, p in self.module.named_parameters() if p.grad is not None}

    def parameters(self) -> dict[str, np.ndarray]:
        return {n: host(p).copy() for n, p in self.module.named_parameters()}

    def grad_norm(self) -> float:
        return self.last_grad_norm
