"""One optimizer step of one stage actor, run by the actor itself from its :class:`StepPlan`.

Owns: the order of work inside an actor's step: its forward and backward ops in schedule order
(receiving inputs from and sending outputs to the neighbouring hops of each microbatch's route),
the redundant copy's backward, the gradient all-reduce (sum) among the stage's replicas, the
run-wide barrier before any update (every actor's gradients are final before any actor changes
its weights: a failure before it leaves every survivor at the previous step), the update, and the
:class:`StepReport`. A failure is caught here, classified (own error, lost peer, abort, deadline),
and the actor's links are closed so that peers blocked on it wake at once; the report carries it.
Never decides anything about the run: what to run comes from the plan, the model math from
the actor (:class:`StageMath`, the part of :class:`~elastic_llm.pipeline.stage.StageWorker` a
step uses; the worker imports this module, not the other way round).
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from elastic_llm.pipeline.collective import allreduce_sum
from elastic_llm.pipeline.plan import FailureKind, Fault, FaultAction, InjectedFault, Phase, StepFailureInfo, StepPlan, StepReport, StepStats
from elastic_llm.pipeline.schedules import hop_index
from elastic_llm.pipeline.shares import cut
from elastic_llm.pipeline.transport import Aborted, DeadlineExceeded, Msg, PeerLost, Transport
from elastic_llm.snapshot.records import ShardKey

class StageMath(Protocol):
    """What a step needs of its stage actor: where it sits, and its model math."""

    stage: int
    replica: int
    dp: int
    n_stages: int
    micro_per_replica: int

    @property
    def routes(self) -> Sequence[Any]: ...  # per microbatch: its route of hops
    shadow: Any  # the redundant copy of the successor stage (None without recovery.mode=redundant)
    step_count: int

    def set_microbatches(self, sizes: tuple[int, ...], batch: int) -> None: ...
    def forward(self, mb: int, x: Any, targets: Any = None, visit: int = 0, shadow_x: Any = None, shadow_targets: Any = None) -> Any: ...
    def backward(self, mb: int, grad: Any = None, visit: int = 0) -> Any: ...
    def shadow_backward(self, *grads: np.ndarray | torch.Tensor) -> None: ...
    def flat_grad(self) -> np.ndarray: ...
    def set_flat_grad(self, flat: np.ndarray) -> None: ...
    def step(self, snapshot: Any = None) -> StepStats: ...


TRACE_LINES = 6  # traceback lines a report carries
HOLD_S = 120.0  # longest a planned fault keeps its actor waiting for its death
ROOT = ShardKey(0, 0)  # the barrier's root: stage 0 of replica 0 (replicas are renumbered from 0)


def replica_root(replica: int) -> ShardKey:
    """Where a replica's stages meet at the barrier: its stage 0."""
    return ShardKey(0, replica)


class _Run:
    def __init__(self, worker: StageMath, plan: StepPlan, links: Transport) -> None:
        self.w, self.plan, self.links = worker, plan, links
        self.me = ShardKey(worker.stage, worker.replica)
        self.op_seconds: list[float] = []  # forward/backward ops, in plan order
        self.phase_seconds: dict[str, float] = {}
        self.phase: Phase | None = None
        self.op = "start"
        self.peer: ShardKey | None = None
        self.fault: Fault | None = plan.fault

    def _enter(self, phase: Phase, op: str) -> float:
        self.phase, self.op, self.peer = phase, op, None
        if self.fault is not None and self.fault.phase is phase:
            fault, self.fault = self.fault, None
            _strike(fault, self.me, op)
        return time.perf_counter()

    def _done(self, t0: float) -> None:
        assert self.phase is not None
        dt = time.perf_counter() - t0
        if self.phase in (Phase.FORWARD, Phase.BACKWARD):
            self.op_seconds.append(dt)
        self.phase_seconds[self.phase.value] = self.phase_seconds.get(self.phase.value, 0.0) + dt

    def recv(self, peer: ShardKey, kind: Msg, mb: int, hop: int) -> np.ndarray | torch.Tensor:
        self.peer = peer
        out = self.links.recv(peer, kind, mb, hop)
        self.peer = None
        return out

    def send(self, peer: ShardKey, kind: Msg, mb: int, hop: int, array: Any) -> None:
        self.peer = peer
        self.links.send(peer, kind, mb, hop, array)
        self.peer = None

    def run(self) -> StepReport:
        w, plan = self.w, self.plan
        w.set_microbatches(plan.micro_sizes, plan.batch)
        n, m = w.n_stages, w.micro_per_replica
        xs = cut(plan.tokens, plan.micro_sizes) if plan.tokens is not None else None
        ys = cut(plan.targets, plan.micro_sizes) if plan.targets is not None else None
        losses: dict[int, float] = {}
        for op in plan.op_list():
            t0 = self._enter(Phase.of(op), repr(op))
            route = w.routes[op.mb]
            h, last = hop_index(route, w.stage, op.visit), len(route) - 1
            if op.kind == "F":
                inp = xs[op.mb] if h == 0 and xs is not None else self.recv(self._at(route[h - 1].stage), Msg.ACT, op.mb, h)
                kwargs = {}
                if w.shadow is not None and w.stage == n - 1:  # its copy of stage 0 starts from the tokens
                    kwargs["shadow_x"] = xs[op.mb] if xs is not None else None
                if w.shadow is not None and w.stage == n - 2:  # its copy of the last stage computes the loss
                    kwargs["shadow_targets"] = ys[op.mb] if ys is not None else None
                out = w.forward(op.mb, inp, ys[op.mb] if h == last and ys is not None else None, op.visit, **kwargs)
                if h == last:
                    losses[op.mb] = float(out)
                else:
                    self.send(self._at(route[h + 1].stage), Msg.ACT, op.mb, h + 1, out)
            else:
                grad = None if h == last else self.recv(self._at(route[h + 1].stage), Msg.GRAD, op.mb, h)
                if w.shadow is not None and grad is not None and w.stage != n - 1:  # the predecessor trains a copy of me
                    self.send(self._at((w.stage - 1) % n), Msg.SHADOW, op.mb, 0, grad)
                g = w.backward(op.mb, grad, op.visit)
                if h > 0:
                    self.send(self._at(route[h - 1].stage), Msg.GRAD, op.mb, h - 1, g)
            self._done(t0)
        if w.shadow is not None:
            t0 = self._enter(Phase.SHADOW, "shadow")
            succ = (w.stage + 1) % n
            grads = [] if succ == n - 1 else [self.recv(self._at(succ), Msg.SHADOW, mb, 0) for mb in range(m)]
            w.shadow_backward(*grads)
            self._done(t0)
        if w.dp > 1:
            t0 = self._enter(Phase.ALLREDUCE, "allreduce")
            replicas = [ShardKey(w.stage, r) for r in range(w.dp)]
            w.set_flat_grad(allreduce_sum(self, w.flat_grad(), replicas, w.replica))
            self._done(t0)
        t0 = self._enter(Phase.BARRIER, "barrier")
        mine = tuple(losses[mb] for mb in sorted(losses))
        heads = self._barrier(mine if w.stage == n - 1 else None)
        self._done(t0)
        t0 = self._enter(Phase.UPDATE, "update")
        stats = w.step(snapshot=plan.snapshot)
        self._done(t0)
        return StepReport(
            self.me, plan.step, mine, stats.grad_norm, stats.lr, stats.snapshot_wait_s, np.array(self.op_seconds), self.phase_seconds, None,
            self.links.sent_bytes(), heads, received=self.links.received(),
        )

    def _at(self, stage: int) -> ShardKey:
        return ShardKey(stage, self.w.replica)

    def _barrier(self, losses: tuple[float, ...] | None) -> dict[int, tuple[float, ...]]:
        """Every actor tells the root its gradients are final; the root answers once all did. A
        tree of two levels, so no actor holds links to every stage of every replica: each stage
        tells its replica's stage 0 (:func:`replica_root`), which tells the run's root (stage 0 of
        replica 0) for its whole replica; the answer goes back down the same way. The LM head's
        stages send their microbatch losses with it (float32, as computed), so the step's loss
        survives a head that dies during its update. Returns them (at the run's root)."""
        n, me, r = self.w.n_stages, self.me, self.w.replica
        mine = replica_root(r)
        heads: dict[int, tuple[float, ...]] = {}
        if me != mine:  # a stage of a replica: its replica's root collects it
            self.send(mine, Msg.READY, 0, 0, None if losses is None else np.asarray(losses, np.float32))
            self.recv(mine, Msg.GO, 0, 0)
            return heads
        head = losses  # stage 0 is the head of a one-stage pipeline
        for s in range(1, n):
            got = self.recv(ShardKey(s, r), Msg.READY, 0, 0)
            if s == n - 1:
                head = tuple(float(v) for v in got)
        if me != ROOT:  # a replica's root: its whole replica is ready
            self.send(ROOT, Msg.READY, 0, 0, None if head is None else np.asarray(head, np.float32))
            self.recv(ROOT, Msg.GO, 0, 0)
        else:
            if head is not None:
                heads[0] = head
            for q in range(1, self.w.dp):
                got = self.recv(replica_root(q), Msg.READY, 0, 0)
                heads[q] = tuple(float(v) for v in got)
            for q in range(1, self.w.dp):
                self.send(replica_root(q), Msg.GO, 0, 0, None)
        for s in range(1, n):
            self.send(ShardKey(s, r), Msg.GO, 0, 0, None)
        return heads

    def failed(self, err: BaseException) -> StepReport:
        if isinstance(err, PeerLost):
            kind, peer = FailureKind.PEER_LOST, err.peer
        elif isinstance(err, Aborted):
            kind, peer = FailureKind.ABORTED, None
        elif isinstance(err, DeadlineExceeded):
            kind, peer = FailureKind.DEADLINE, err.peer
        else:
            kind, peer = FailureKind.ERROR, self.peer
        first = (str(err).splitlines() or [""])[0]
        trace = "".join(traceback.format_exception(err)[-TRACE_LINES:]) if kind is FailureKind.ERROR else ""
        info = StepFailureInfo(self.phase, self.op, kind, peer, f"{type(err).__name__}: {first}".rstrip(": "), time.time(), trace)
        return StepReport(
            self.me, self.plan.step, op_seconds=np.array(self.op_seconds), phase_seconds=self.phase_seconds, failure=info, sent_bytes=self.links.sent_bytes()
        )


def execute(worker: StageMath, plan: StepPlan, links: Transport) -> StepReport:
    """Run ``plan`` on ``worker`` over ``links``; never raises for a failure of the step (the
    report carries it, and the links are closed so peers waiting on this actor wake)."""
    run = _Run(worker, plan, links)
    links.begin(plan.step, plan.deadline_s)
    try:
        if worker.step_count != plan.step - 1:
            raise RuntimeError(f"stage {worker.stage} replica {worker.replica} has completed step {worker.step_count}, the plan is for step {plan.step}")
        return run.run()
    except Exception as err:  # the step failed here: tell the driver, wake the peers
        links.poison()
        return run.failed(err)


def _strike(fault: Fault, me: ShardKey, op: str) -> None:
    if fault.action is FaultAction.SIGKILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action is FaultAction.RAY_KILL:
        import ray

        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        time.sleep(HOLD_S)  # killed meanwhile; never goes on with the step
    elif fault.action is FaultAction.HOLD:
        time.sleep(HOLD_S)  # chaos removes this actor's node meanwhile
    raise InjectedFault(f"chaos: {me} failed at {op}")
