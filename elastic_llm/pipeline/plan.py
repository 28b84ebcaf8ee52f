"""What the driver tells a stage actor about one optimizer step, and what the actor answers.

Owns: :class:`StepPlan` (one per actor per step: the step number, the actor's ops in schedule
order, its replica's microbatch sizes and the global batch size (which the microbatch count and
the loss weights follow), its token inputs, whether to snapshot, the link generation its peers
are on) and
:class:`StepReport` (one per actor per step: loss parts, clipped gradient norm, learning rate,
per-op timings, and on failure which op failed, against which peer, why), plus the small enums
both use. Pure data: no Ray, no torch, no sockets; both are frozen and cross the Ray boundary as
arguments and return values.

The learning rate is reported, not planned: after a CheckFree rebuild each stage's schedule runs
at its own ``lr_scale``, so the stage's own scheduler is the authority and the report says what
it used.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from elastic_llm.pipeline.schedules import Op
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.stream import StreamPosition

STEP_DEADLINE_S = 900.0  # the one deadline of a step: a stage whose peer stays silent this long fails it, and the driver waits as long for its reports


class Phase(enum.Enum):
    """The kinds of work in one actor's step, in the order they run."""

    FORWARD = "forward"
    BACKWARD = "backward"
    SHADOW = "shadow"  # the redundant copy's backward (recovery.mode: redundant)
    ALLREDUCE = "allreduce"  # gradient sum among the replicas of the stage (each weighted by its share)
    BARRIER = "barrier"  # every actor of the run finished its gradients: updates may start
    UPDATE = "update"  # clip, optimizer step, LR schedule, snapshot copy

    @staticmethod
    def of(op: Op) -> "Phase":
        return Phase.FORWARD if op.kind == "F" else Phase.BACKWARD


class FailureKind(enum.Enum):
    ERROR = "error"  # this actor's own work raised: a root cause
    PEER_LOST = "peer_lost"  # a peer's link closed or broke (the peer died or failed first)
    ABORTED = "aborted"  # the driver aborted the step (another actor failed)
    DEADLINE = "deadline"  # a peer did not answer within the step deadline


class FaultAction(enum.Enum):
    """How a planned fault strikes (chaos only)."""

    SIGKILL = "sigkill"  # the actor's process kills itself with SIGKILL
    RAY_KILL = "ray_kill"  # ray.kill of the actor's own handle
    RAISE = "raise"  # an application error
    HOLD = "hold"  # wait there (up to HOLD_S) for the actor's node to be removed


class InjectedFault(RuntimeError):
    """Raised by a stage that chaos told to fail (``kill: error``, or a planned fault): an
    application error."""


@dataclass(frozen=True)
class Fault:
    """Chaos: strike at the start of this actor's first op of ``phase`` in the step. Set only by
    :class:`~elastic_llm.chaos.ChaosExecutor`; real plans carry None."""

    phase: Phase
    action: FaultAction


def encode_ops(ops: Sequence[Op]) -> np.ndarray:
    """Ops as one int32 array of rows (kind: 0 forward / 1 backward, microbatch, visit): a plan
    with 2 x 64 microbatches' ops pickles as one buffer, not 128 Python objects."""
    return np.array([(0 if op.kind == "F" else 1, op.mb, op.visit) for op in ops], np.int32).reshape(-1, 3)


def decode_ops(rows: np.ndarray) -> list[Op]:
    return [Op("F" if k == 0 else "B", int(mb), int(v)) for k, mb, v in rows.tolist()]


@dataclass(frozen=True)
class StepPlan:
    step: int  # the step this call runs (the actor has completed step - 1)
    generation: int  # the link generation its peers were connected with
    ops: np.ndarray  # this stage's forward/backward ops in schedule order (encode_ops; .op_list() decodes)
    micro_sizes: tuple[int, ...]  # sequences in each of this replica's microbatches (its share of the batch, cut)
    batch: int  # sequences in the global batch: a microbatch's loss counts with weight size / batch
    tokens: np.ndarray | None = None  # this replica's token batch (stage 0; the last stage's redundant copy of stage 0)
    targets: np.ndarray | None = None  # this replica's targets (the LM head; the redundant copy of the last stage)
    snapshot: StreamPosition | None = None  # data position after the step: copy the updated state for a snapshot
    fault: Fault | None = None
    deadline_s: float = STEP_DEADLINE_S  # a peer silent this long fails the step (the driver waits as long for the reports)

    def op_list(self) -> list[Op]:
        return decode_ops(self.ops)


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step of a stage reports to the driver."""

    grad_norm: float  # L2 norm of the replicas' summed gradient before clipping
    lr: float  # the learning rate the step used
    snapshot_wait_s: float  # total seconds steps of this actor waited for an unfinished snapshot copy


@dataclass(frozen=True)
class StepFailureInfo:
    phase: Phase | None  # the phase the actor was in
    op: str  # the op it was running ("F3", "allreduce", ...)
    kind: FailureKind
    peer: ShardKey | None  # the peer it was waiting on or sending to
    cause: str  # "ExceptionType: message"
    at: float  # wall clock (time.time()) when it failed: orders root causes
    trace: str = ""  # the last lines of the actor's traceback (its own errors)


@dataclass(frozen=True)
class StepReport:
    key: ShardKey
    step: int
    losses: tuple[float, ...] = ()  # microbatch losses, in microbatch order (the LM head's stage only)
    grad_norm: float = float("nan")  # before clipping
    lr: float = float("nan")
    snapshot_wait_s: float = 0.0
    op_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))  # seconds of each forward/backward op, in plan order (those that ran)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # seconds per Phase value, all ops of a phase summed
    failure: StepFailureInfo | None = None
    sent_bytes: dict[str, int] = field(default_factory=dict)  # per message kind: bytes this actor sent to peers
    head_losses: dict[int, tuple[float, ...]] = field(default_factory=dict)  # the barrier's root: every replica's microbatch losses
    received: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)  # per peer (stage, replica): bytes of message bodies, seconds reading them
    fenced: tuple[str, ...] = ()  # what this actor refused as of an older generation since its last report (a zombie's plans and links)

    @property
    def ok(self) -> bool:
        return self.failure is None

    def seconds(self, phase: Phase) -> float:
        return self.phase_seconds.get(phase.value, 0.0)


def describe_failure(f: StepFailureInfo, key: Any) -> str:
    peer = f" (peer {f.peer})" if f.peer is not None else ""
    return f"{key} failed in {f.op}{peer}: {f.cause}"
