"""One pipeline stage of one data-parallel replica: the body of a Ray actor.

Owns: the stage's layers, its AdamW optimizer, LR schedule (warm-up + cosine), per-microbatch
forward/backward with the activations kept between them, gradient averaging with its
data-parallel peers, clipping at ``grad_clip`` and the L2 norm of the last clipped gradient
(CheckFree weights rebuilt stages by it). Activations and gradients cross actors as numpy arrays
(zero-copy through Ray's object store; torch tensors would be pickled).

Never decides anything about the run: the controller tells it what to do, in which order.
The class is plain Python so tests can drive it in-process; the controller wraps it in
``ray.remote``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import warnings
from typing import Any

import numpy as np
import torch

from elastic_llm.config import RunConfig, config_from_dict
from elastic_llm.model import build_stage, lm_loss

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def lr_factor(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at ``step``: linear warm-up, then cosine down to ``min_ratio``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def stage_seed(seed: int, stage: int, replica: int) -> int:
    return (seed * 7919 + stage * 104_729 + replica * 15_485_863) % (2**31)


class StageWorker:
    """Layers + optimizer of (stage, replica). Methods are called in schedule order."""

    def __init__(self, config: dict[str, Any] | RunConfig, stage: int, replica: int) -> None:
        self.cfg = config if isinstance(config, RunConfig) else config_from_dict(config)
        par, train = self.cfg.parallel, self.cfg.train
        self.stage, self.replica = stage, replica
        self.n_stages = par.stages
        self.first, self.last = stage == 0, stage == par.stages - 1
        self.device = torch.device("cuda" if par.gpus_per_actor > 0 and torch.cuda.is_available() else "cpu")
        torch.set_num_threads(par.threads())
        torch.manual_seed(stage_seed(train.seed, stage, replica))
        self.module = build_stage(self.cfg.model.shape(), par.stages, stage, train.seed).to(self.device)
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=train.lr,
            betas=(train.beta1, train.beta2),
            foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, train.warmup_steps, train.max_steps, train.min_lr / train.lr),
        )
        self.micro_per_replica = par.microbatches
        self.backwards_done = 0  # microbatches backpropagated in the current step
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.last_grad_norm = 0.0
        self.step_count = 0
        # Lazy asynchronous snapshots: step() marks a copy as due, snapshot() (another thread)
        # performs it while the next forward/backward run, and the next step() waits for it.
        self._copy_idle = threading.Event()
        self._copy_idle.set()
        self._stepped = threading.Condition()
        self._copy_due: int | None = None
        self._generation = 0  # bumped by reset_step(): pending snapshot() calls give up
        self.snapshot_wait_s = 0.0  # total time step() was blocked by an unfinished copy

    # ------------------------------------------------------------------ one microbatch
    def forward(self, mb: int, x: np.ndarray, targets: np.ndarray | None = None) -> np.ndarray | float:
        """Run the stage on microbatch ``mb``; keep what backward needs.

        Returns the output activations (numpy), or on the last stage the microbatch loss.
        """
        if self.first:
            inp = torch.from_numpy(np.asarray(x)).to(self.device)
        else:
            inp = torch.from_numpy(np.asarray(x)).to(self.device).requires_grad_(True)
        out = self.module(inp)
        self.inputs[mb] = inp
        if self.last:
            if targets is None:
                raise ValueError("the last stage needs targets to compute the loss")
            loss = lm_loss(out, torch.from_numpy(np.asarray(targets)).to(self.device))
            self.outputs[mb] = loss / self.micro_per_replica
            return float(loss.detach())
        self.outputs[mb] = out
        return out.detach().cpu().numpy()

    def backward(self, mb: int, grad: np.ndarray | None = None) -> np.ndarray | None:
        """Backpropagate microbatch ``mb``; return the gradient of its input (None on stage 0)."""
        out = self.outputs.pop(mb)
        inp = self.inputs.pop(mb)
        if self.last:
            out.backward()
        else:
            out.backward(torch.from_numpy(np.asarray(grad)).to(self.device))
        self.backwards_done += 1
        if self.first:
            return None
        return inp.grad.cpu().numpy()

    # ------------------------------------------------------------------ optimizer step
    def _check_complete(self) -> None:
        """Refuse to share or apply gradients of a step whose backward did not fully run (a call
        queued behind failed ones still executes: this keeps it from using partial gradients)."""
        if self.backwards_done != self.micro_per_replica or self.inputs or self.outputs:
            raise RuntimeError(
                f"stage {self.stage} replica {self.replica}: only {self.backwards_done} of {self.micro_per_replica} "
                "microbatches were backpropagated this step"
            )

    def flat_grad(self) -> np.ndarray:
        """All parameter gradients of this stage, flattened (for data-parallel averaging)."""
        self._check_complete()
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device) for p in self.module.parameters()]
        return torch.cat(grads).cpu().numpy()

    def average_grads(self, *peer_grads: np.ndarray) -> None:
        """Replace local gradients by the mean of ``peer_grads`` (every replica's flat_grad, in replica order)."""
        total = torch.from_numpy(np.asarray(peer_grads[0])).clone()
        for g in peer_grads[1:]:  # fixed replica order: every replica gets identical bits
            total += torch.from_numpy(np.asarray(g))
        total /= len(peer_grads)
        offset = 0
        for p in self.module.parameters():
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p).to(self.device)
            offset += n

    def step(self, *peer_grads: np.ndarray, snapshot: bool = False) -> dict[str, float]:
        """Average gradients over ``peer_grads`` (all replicas, in replica order; none for DP=1),
        clip, remember the clipped norm, update, advance the LR schedule.

        Blocks first if the snapshot copy of the previous step is unfinished (the update would
        overwrite tensors being copied). ``snapshot=True`` marks this step's state for copying by
        :meth:`snapshot`.
        """
        if not self._copy_idle.is_set():
            t = time.perf_counter()
            if not self._copy_idle.wait(timeout=600):
                raise TimeoutError(f"stage {self.stage}: the snapshot copy of step {self._copy_due} never ran")
            self.snapshot_wait_s += time.perf_counter() - t
        self._check_complete()
        if peer_grads:
            self.average_grads(*peer_grads)
        clip = self.cfg.train.grad_clip
        norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip))
        self.last_grad_norm = min(norm, clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backwards_done = 0
        self.scheduler.step()
        with self._stepped:
            self.step_count += 1
            if snapshot:
                self._copy_idle.clear()
                self._copy_due = self.step_count
            self._stepped.notify_all()
        return {"grad_norm": norm, "lr": lr, "snapshot_wait_s": self.snapshot_wait_s}

    def snapshot(self, version: int, smp: Any, key: str, data_position: dict[str, int] | None = None) -> dict[str, Any]:
        """Copy the state after step ``version`` into the reused buffer and hand it to ``smp``.

        Runs in the actor's "snapshot" concurrency group, overlapping the next forward/backward.
        The bytes travel as an argument of ``smp.put_shard``: they land once in the node's object
        store, owned by the call, and the manager's view survives this process dying.
        """
        import ray

        with self._stepped:
            generation = self._generation
            self._stepped.wait_for(lambda: self.step_count >= version or self._generation != generation, timeout=600)
            if self._generation != generation or self.step_count < version:
                self._release_copy()
                raise RuntimeError(f"stage {self.stage}: step {version} was aborted before its snapshot")
        if smp is None:
            self._release_copy()
            raise RuntimeError(f"stage {self.stage}: no snapshot manager on this node")
        if self._copy_due != version:
            raise RuntimeError(f"stage {self.stage}: step {version} was not marked for a snapshot (step(..., snapshot=True))")
        try:
            t = time.perf_counter()
            buf, manifest = self.capture_state(data_position, replica_slice=self.cfg.parallel.dp > 1)
            lo, hi = json.loads(manifest)["slice"]
            copy_s = time.perf_counter() - t
            ref = smp.put_shard.remote(version, key, buf[lo:hi], manifest)
            handoff_s = time.perf_counter() - t - copy_s
        finally:
            self._release_copy()
        result = ray.get(ref)
        return {**result, "copy_s": copy_s, "handoff_s": handoff_s, "state_bytes": int(buf.nbytes)}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def eval_forward(self, x: np.ndarray, targets: np.ndarray | None = None) -> np.ndarray | float:
        out = self.module(torch.from_numpy(np.asarray(x)).to(self.device))
        if self.last:
            return float(lm_loss(out, torch.from_numpy(np.asarray(targets)).to(self.device)))
        return out.cpu().numpy()

    # ------------------------------------------------------------------ state capture / restore
    def capture_state(self, data_position: dict[str, int] | None = None, replica_slice: bool = False) -> tuple[np.ndarray, str]:
        """Copy the whole state (or this replica's 1/DP slice) into the stage's reused buffer.

        Returns (buffer, manifest JSON). The buffer is preallocated once and overwritten by the
        next capture: callers hand it on (e.g. to a snapshot manager) before capturing again.
        """
        from elastic_llm.snapshot import state as st

        tensors = st.state_tensors(self.module, self.optimizer)
        if getattr(self, "_layout", None) is None or len(self._layout.entries) != len(tensors):
            self._layout = st.StateLayout(tensors)
            self._buffer = np.zeros(self._layout.nbytes, dtype=np.uint8)  # touched once, reused after
        lo, hi = (self._layout.slice_bounds(self.replica, self.cfg.parallel.dp) if replica_slice else (0, self._layout.nbytes))
        st.copy_into(self._buffer, self._layout, tensors, lo, hi)
        extra = st.json_state(self.optimizer, self.scheduler, self.step_count, data_position, self.cfg.config_hash())
        extra["slice"] = [lo, hi]
        return self._buffer, st.make_manifest(self._layout, extra, self.stage)

    def load_state(self, buffer: np.ndarray, manifest: str) -> int:
        """Restore parameters, optimizer, scheduler and RNG state; return the restored step."""
        from elastic_llm.snapshot import state as st

        m = st.restore(np.asarray(buffer), st.parse_manifest(manifest), self.module, self.optimizer, self.scheduler, self.cfg.config_hash(), self.stage)
        self.step_count = int(m["step"])
        self.reset_step()
        return self.step_count

    def _release_copy(self) -> None:
        self._copy_due = None
        self._copy_idle.set()

    def reset_step(self) -> int:
        """Drop the partial work of an aborted step (activations, accumulated gradients) and any
        snapshot copy still due for it."""
        self.inputs.clear()
        self.outputs.clear()
        self.optimizer.zero_grad(set_to_none=True)
        self.backwards_done = 0
        with self._stepped:
            self._generation += 1
            self._release_copy()
            self._stepped.notify_all()
        return self.step_count

    # ------------------------------------------------------------------ inspection
    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context() if ray.is_initialized() else None
        return {
            "stage": self.stage,
            "replica": self.replica,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id() if ctx else None,
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "step": self.step_count,
            "layers": self.module.layer_ids,
            "parameters": sum(p.numel() for p in self.module.parameters()),
        }

    def grads(self) -> dict[str, np.ndarray]:
        return {n: p.grad.detach().cpu().numpy().copy() for n, p in self.module.named_parameters() if p.grad is not None}

    def parameters(self) -> dict[str, np.ndarray]:
        return {n: p.detach().cpu().numpy().copy() for n, p in self.module.named_parameters()}

    def grad_norm(self) -> float:
        return self.last_grad_norm
