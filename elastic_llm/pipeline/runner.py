"""Executes one optimizer step of a schedule on the stage actors.

Owns: turning the pure schedule into actor calls in a valid order, splitting the global batch
into replicas and microbatches, and the data-parallel gradient exchange. Activations and
gradients are passed as object refs straight from actor to actor; the driver only holds refs.

Ray runs the calls of one caller on one (synchronous) actor in submission order, so submitting
each stage's ops in schedule order reproduces the schedule exactly. A failed step comes out as
:class:`StepFailed` naming the stage whose call failed first (submission order is a topological
order of the step's calls, so the first failed call in it is a root cause, not a victim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import ray

from elastic_llm.pipeline.schedules import Op, build_schedule, hop_index, routes, submission_order

STEP_TIMEOUT_S = 900.0  # a step that takes longer is treated as a failure (a hung stage)
SETTLE_S = 120.0  # after a failure, how long the step's other calls get to finish or fail


class StepFailed(RuntimeError):
    """A call of the step failed: ``stage``/``replica`` of the first failed call (None if none
    failed, e.g. a timeout), and the exception it raised (``cause``)."""

    def __init__(self, cause: BaseException, stage: int | None, replica: int | None) -> None:
        self.cause, self.stage, self.replica = cause, stage, replica
        super().__init__(str(cause))


@dataclass
class StepResult:
    loss: float  # mean over the whole global batch
    grad_norms: list[float]  # per stage (replica 0), before clipping
    lr: float


class PipelineRunner:
    """Drives ``actors[replica][stage]`` through the named schedule."""

    def __init__(self, actors: Sequence[Sequence[Any]], schedule: str, n_micro: int, swapped: bool = False, redundant: bool = False) -> None:
        self.actors = [list(r) for r in actors]
        self.dp = len(self.actors)
        self.n_stages = len(self.actors[0])
        self.n_micro = n_micro
        self.routes = routes(self.n_stages, n_micro, swapped)
        self.order = submission_order(build_schedule(schedule, self.n_stages, n_micro, swapped), self.routes)
        self.redundant = redundant  # every stage also trains a copy of its successor (recovery.mode=redundant)

    def split(self, x: np.ndarray) -> list[list[np.ndarray]]:
        """Global batch (B, T) -> [replica][microbatch] of (B / dp / n_micro, T)."""
        per_replica = np.split(x, self.dp)
        return [np.split(r, self.n_micro) for r in per_replica]

    def submit_microbatches(self, x: np.ndarray, y: np.ndarray) -> list[ray.ObjectRef]:
        """Submit every forward and backward of one global batch; return the loss refs."""
        xs, ys = self.split(x), self.split(y)
        last = self.n_stages - 1
        loss_refs: list[ray.ObjectRef] = []
        self.inflight: list[ray.ObjectRef] = []
        self.calls: list[tuple[ray.ObjectRef, int, int]] = []  # (ref, replica, stage) in submission order
        self.first_op: dict[tuple[int, int], ray.ObjectRef] = {}  # (replica, stage) -> its first call of the step
        self.tails: list[ray.ObjectRef] = []  # calls that finish only once the whole forward/backward did
        for r, stages in enumerate(self.actors):
            fwd: dict[tuple[int, int], ray.ObjectRef] = {}  # (hop index, microbatch) -> output
            bwd: dict[tuple[int, int], ray.ObjectRef] = {}  # (hop index, microbatch) -> input gradient
            for s, op in self.order:
                actor = stages[s]
                route = self.routes[op.mb]
                h, last = hop_index(route, s, op.visit), len(route) - 1
                if op.kind == "F":
                    inp = xs[r][op.mb] if h == 0 else fwd[(h - 1, op.mb)]
                    kwargs = {}
                    if self.redundant and s == last:  # its copy of stage 0 starts from the tokens
                        kwargs["shadow_x"] = xs[r][op.mb]
                    if self.redundant and s == last - 1:  # its copy of the last stage computes the loss
                        kwargs["shadow_targets"] = ys[r][op.mb]
                    ref = fwd[(h, op.mb)] = actor.forward.remote(op.mb, inp, ys[r][op.mb] if h == last else None, op.visit, **kwargs)
                    if h == last:
                        loss_refs.append(ref)
                else:
                    grad = None if h == last else bwd[(h + 1, op.mb)]
                    ref = bwd[(h, op.mb)] = actor.backward.remote(op.mb, grad, op.visit)
                    if h == 0:  # the microbatch's last call: it fails if any call of the microbatch did
                        self.tails.append(ref)
                self.calls.append((ref, r, s))
                if (r, s) not in self.first_op:
                    self.first_op[(r, s)] = ref
            self.inflight += list(fwd.values()) + list(bwd.values())
            if self.redundant:
                self._shadow_backwards(r, bwd)
        return loss_refs

    def _shadow_backwards(self, r: int, bwd: dict[tuple[int, int], ray.ObjectRef]) -> None:
        """Every stage backpropagates its copy of the successor with the gradients the successor
        received (from the stage after it; none when the successor is the last stage)."""
        n = self.n_stages
        for s in range(n):
            succ = (s + 1) % n
            grads = [] if succ == n - 1 else [bwd[((succ + 1) % n, mb)] for mb in range(self.n_micro)]
            ref = self.actors[r][s].shadow_backward.remote(*grads)
            self.inflight.append(ref)
            self.tails.append(ref)
            self.calls.append((ref, r, s))

    def settle(self, timeout: float = SETTLE_S) -> None:
        """Wait until every call of the last step has finished or failed (after a failure, so
        that no stale call runs after the survivors are reset)."""
        refs = getattr(self, "inflight", [])
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)
        self.inflight = []

    def first_failed(self) -> tuple[int | None, int | None, BaseException | None]:
        """(stage, replica, error) of the first call, in submission order, that finished with an
        error: its own error, not the "inputs could not be computed" of the calls behind it."""
        calls = getattr(self, "calls", [])
        done, _ = ray.wait([c[0] for c in calls], num_returns=len(calls), timeout=0) if calls else ([], [])
        finished = set(done)
        for ref, r, s in calls:
            if ref in finished:
                try:
                    ray.get(ref, timeout=0)
                except Exception as e:
                    return s, r, e
        return None, None, None

    def submit_optimizer_step(self, snapshot: dict[str, int] | None = None) -> list[list[ray.ObjectRef]]:
        """Submit the data-parallel gradient exchange and the optimizer step of every stage.

        With data parallelism the exchange is a phase of its own: every replica of every stage
        fetches its peers' gradients and averages them, and only once all of them have (the
        driver waits for that, with a deadline) does any stage update. A failure during the
        exchange (an actor or a node with its gradients gone) then leaves every survivor at the
        same step, which is what lets the run drop or replace a replica without rolling back.
        ``snapshot`` (the data position after this step's batch) makes every stage start a
        background copy of its updated state. Returns refs[stage][replica] of the step statistics.

        Without data parallelism the driver waits the same way for every backward to finish
        before any update: a stage lost during the step then leaves all survivors at the previous
        step (CheckFree rebuilds from neighbours at one step; the ladder's rollbacks stay minimal).
        """
        if self.dp == 1:
            self._barrier(self.tails)
        else:
            averaged = []
            for s in range(self.n_stages):
                replicas = [self.actors[r][s] for r in range(self.dp)]
                grads = [a.flat_grad.remote() for a in replicas]
                refs = [a.average_grads.remote(*grads) for a in replicas]
                averaged += refs
                self.calls += [(ref, r, s) for r, ref in enumerate(refs)]
            self.inflight += averaged
            self._barrier(averaged)
        step_refs: list[list[ray.ObjectRef]] = []
        for s in range(self.n_stages):
            step_refs.append([self.actors[r][s].step.remote(snapshot=snapshot) for r in range(self.dp)])
            self.inflight += step_refs[-1]
            self.calls += [(ref, r, s) for r, ref in enumerate(step_refs[-1])]
        return step_refs

    def _barrier(self, refs: list[ray.ObjectRef]) -> None:
        """Wait until ``refs`` are all done; raise :class:`StepFailed` if any failed."""
        try:
            ray.get(refs, timeout=STEP_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as err:
            self.settle()
            stage, replica, first = self.first_failed()
            raise StepFailed(first or err, stage, replica) from err

    def submit_step(self, x: np.ndarray, y: np.ndarray) -> tuple[list[ray.ObjectRef], list[list[ray.ObjectRef]]]:
        """Submit one whole optimizer step; return (loss refs, step refs[stage][replica])."""
        return self.submit_microbatches(x, y), self.submit_optimizer_step()

    def train_step(self, x: np.ndarray, y: np.ndarray) -> StepResult:
        loss_refs, step_refs = self.submit_step(x, y)
        return self.collect(loss_refs, step_refs)

    def collect(self, loss_refs: list[ray.ObjectRef], step_refs: list[list[ray.ObjectRef]]) -> StepResult:
        """The step's result; raises :class:`StepFailed` if any call failed or the step timed out."""
        try:
            losses = ray.get(loss_refs, timeout=STEP_TIMEOUT_S)
            stats = [ray.get(refs, timeout=STEP_TIMEOUT_S)[0] for refs in step_refs]  # every replica; report replica 0
        except (ray.exceptions.RayError, TimeoutError) as err:
            self.settle()
            stage, replica, first = self.first_failed()
            raise StepFailed(first or err, stage, replica) from err
        # Every microbatch has the same number of tokens, so the batch loss is their mean.
        return StepResult(
            loss=float(np.mean(losses)),
            grad_norms=[st.grad_norm for st in stats],
            lr=stats[0].lr,
        )

    def survivors_result(self, loss_refs: list[ray.ObjectRef], step_refs: list[list[ray.ObjectRef]]) -> StepResult:
        """The result of a step that failed after its gradient exchange but that every surviving
        replica finished: the loss from whatever microbatch losses survive (NaN if none) and, per
        stage, the statistics of the first replica that answered."""
        losses, stats = [], []
        for ref in loss_refs:
            try:
                losses.append(ray.get(ref, timeout=STEP_TIMEOUT_S))
            except (ray.exceptions.RayError, TimeoutError):
                pass
        for refs in step_refs:
            for ref in refs:
                try:
                    stats.append(ray.get(ref, timeout=STEP_TIMEOUT_S))
                    break
                except (ray.exceptions.RayError, TimeoutError):
                    continue
        return StepResult(
            loss=float(np.mean(losses)) if len(losses) == len(loss_refs) else float("nan"),
            grad_norms=[st.grad_norm for st in stats] or [float("nan")],
            lr=stats[0].lr if stats else float("nan"),
        )

    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
        """Forward-only loss of a batch through replica 0's stages."""
        refs = []
        for xm, ym in zip(np.split(x, self.n_micro), np.split(y, self.n_micro)):
            act: Any = xm
            for s, actor in enumerate(self.actors[0]):
                act = actor.eval_forward.remote(act, ym if s == self.n_stages - 1 else None)
            refs.append(act)
        return float(np.mean(ray.get(refs)))


__all__ = ["PipelineRunner", "StepResult", "StepFailed", "Op"]
