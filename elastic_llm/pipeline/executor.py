"""The driver's side of a step: one :class:`StepPlan` to every stage actor, one report back.

Owns: the :class:`StepExecutor` protocol the controller runs steps through (and :class:`Pending`,
the submitted step it hands the controller and takes back); its Ray
implementation, :class:`RayStepExecutor` (cutting the global batch into the replicas' shares and
their microbatches at any width (:mod:`elastic_llm.pipeline.shares`), each replica's schedule for
its microbatch count, one call per replica per step to the replica's stage 0, which relays each
stage its plan and answers with the replica's reports (:mod:`elastic_llm.pipeline.relay`), the
links of the membership set up before its first step and again after any failed step, waiting
for the reports, aborting the others at the first failure, naming the root cause); and
:func:`link_peers`, which actors talk to which (pure). The driver makes DP calls per step whatever
the number of stages and microbatches, and never holds an activation or a gradient: they travel between the actors (:mod:`elastic_llm.pipeline.transport`).
Never decides what happens after a failure (the controller does) and never injects faults
(:class:`~elastic_llm.chaos.ChaosExecutor` wraps this one).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from elastic_llm.pipeline.plan import STEP_DEADLINE_S, FailureKind, Fault, StepPlan, StepReport, describe_failure, encode_ops
from elastic_llm.pipeline.relay import any_failed
from elastic_llm.pipeline.schedules import Route, build_schedule, routes, submission_order
from elastic_llm.pipeline.shares import cut, microbatch_sizes, replica_microbatches, weighted_mean
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.stream import StreamPosition

SETTLE_S = 120.0  # after a failure, how long the step's other calls get to finish or fail
LOOK_S = 0.05  # while a step runs, how often the driver looks at the nodes it judged dead (with a node watch)
LINK_S = 60.0  # deadline for setting up the links of a membership
GENERATIONS = itertools.count(1)  # link generations of executors built without a counter of their own (tests, benchmarks)


class StepFailed(RuntimeError):
    """A step failed: ``stage``/``replica``/``op`` of the root cause (None if not known, e.g. a
    timeout), and the exception that stands for it (``cause``)."""

    def __init__(self, cause: BaseException, stage: int | None, replica: int | None, op: str = "") -> None:
        self.cause, self.stage, self.replica, self.op = cause, stage, replica, op
        super().__init__(str(cause))


class NodeLost(RuntimeError):
    """An actor of the step whose node the run judged dead (its raylet refused the driver's
    probe): lost at once, before Ray's own view of the node follows."""


class StageError(RuntimeError):
    """A stage's own error during a step, as its report described it (``type_name``: the type of
    the exception the stage raised)."""

    def __init__(self, type_name: str, message: str) -> None:
        self.type_name = type_name
        super().__init__(message)


@dataclass
class StepResult:
    loss: float  # mean over the whole global batch
    grad_norms: list[float]  # per stage (the first replica that answered), before clipping
    lr: float
    reports: dict[ShardKey, StepReport] = field(default_factory=dict)


@dataclass
class PendingStep:
    """A submitted step: its calls (one per replica, to the replica's stage 0, which relays it to
    the replica's stages: :mod:`elastic_llm.pipeline.relay`), and what came back of them."""

    step: int
    generation: int
    n_stages: int
    dp: int
    relays: dict[Any, int]  # the relay calls not answered yet: ref -> replica
    micro_sizes: tuple[tuple[int, ...], ...]  # per replica, its microbatches' sizes (as planned)
    started: float = field(default_factory=time.perf_counter)
    reports: dict[ShardKey, StepReport] = field(default_factory=dict)
    lost: dict[ShardKey, BaseException] = field(default_factory=dict)  # calls that raised (the actor died)
    running: dict[int, tuple[int, ...]] = field(default_factory=dict)  # replica -> its stages still running after an early answer
    orphaned: set[ShardKey] = field(default_factory=set)  # stages whose relay died with their report (their replica's stage 0)

    @property
    def failed(self) -> bool:
        return any_failed(self.reports, self.lost)

    def unanswered(self) -> list[ShardKey]:
        """The actors whose report has not come back (and will not through a dead relay)."""
        return [ShardKey(s, r) for r in range(self.dp) for s in range(self.n_stages)
                if ShardKey(s, r) not in self.reports and ShardKey(s, r) not in self.lost and ShardKey(s, r) not in self.orphaned]

    def result(self) -> StepResult:
        """The step's result from the reports that came back: the loss (every microbatch's loss
        weighted by its sequences) needs the LM head's stage of every replica (NaN otherwise); per
        stage, the first replica that answered."""
        last = self.n_stages - 1
        root = self.reports.get(ShardKey(0, 0))
        losses: list[float] = []
        ok = True
        for r in range(self.dp):
            head = self.reports.get(ShardKey(last, r))
            if head is not None and head.ok:
                losses += head.losses
            elif root is not None and r in root.head_losses:  # the head died after the barrier
                losses += root.head_losses[r]
            else:
                ok = False
        norms, lr = [], float("nan")
        for s in range(self.n_stages):
            rep = next((self.reports[k] for k in (ShardKey(s, r) for r in range(self.dp)) if k in self.reports and self.reports[k].ok), None)
            if rep is not None:
                norms.append(rep.grad_norm)
                lr = rep.lr if math.isnan(lr) else lr
        loss = weighted_mean(losses, [n for m in self.micro_sizes for n in m]) if ok else float("nan")
        return StepResult(loss, norms or [float("nan")], lr, dict(self.reports))


class Pending(Protocol):
    """A submitted step as the controller holds it: its number and, once it ended, the step from
    what came back (``result``). Only the executor that started it takes it back."""

    @property
    def step(self) -> int: ...

    def result(self) -> StepResult: ...


def _own(pending: Pending) -> PendingStep:
    """The :class:`PendingStep` a :class:`RayStepExecutor` started (it takes back no other)."""
    if not isinstance(pending, PendingStep):
        raise TypeError(f"a Ray step executor takes back its own PendingStep, not {type(pending).__name__}")
    return pending


class StepExecutor(Protocol):
    """How the controller runs steps (Ray actors, or a fake in tests)."""

    def start(self, step: int, x: np.ndarray, y: np.ndarray, snapshot: StreamPosition | None = None,
              faults: Mapping[ShardKey, Fault] | None = None) -> Pending: ...

    def finish(self, pending: Pending, timeout: float = ...) -> StepResult: ...

    def wait(self, pending: Pending, seconds: float) -> bool: ...  # whether the step has ended (done, or failed: finish then says how), waiting at most ``seconds``

    def settle(self) -> None: ...

    def snapshot(self, step: int, position: StreamPosition) -> None: ...  # every stage copies its state now, between steps, as step ``step``'s snapshot (``position``: the data position after it)

    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float: ...


def link_peers(n_stages: int, dp: int, rts: Sequence[Route], redundant: bool = False) -> dict[ShardKey, set[ShardKey]]:
    """Who each actor exchanges messages with in a step: the neighbouring hops of every route (its
    replica), the redundant copy's predecessor and successor, the stage's other replicas (the
    all-reduce), and the barrier's two-level tree (every stage with its replica's stage 0, every
    replica's stage 0 with the run's root): at most stages + replicas links per actor, not
    stages x replicas. Symmetric."""
    peers: dict[ShardKey, set[ShardKey]] = {ShardKey(s, r): set() for r in range(dp) for s in range(n_stages)}

    def link(a: ShardKey, b: ShardKey) -> None:
        if a != b:
            peers[a].add(b)
            peers[b].add(a)

    for r in range(dp):
        for route in set(rts):
            for a, b in zip(route, route[1:]):
                link(ShardKey(a.stage, r), ShardKey(b.stage, r))
        if redundant:
            for s in range(n_stages):
                link(ShardKey(s, r), ShardKey((s + 1) % n_stages, r))
    for s in range(n_stages):
        for r in range(dp):
            for q in range(r + 1, dp):
                link(ShardKey(s, r), ShardKey(s, q))
    for r in range(dp):  # the barrier: stage s -> its replica's stage 0 -> the root
        for s in range(1, n_stages):
            link(ShardKey(0, r), ShardKey(s, r))
        link(ShardKey(0, 0), ShardKey(0, r))
    return peers


class RayStepExecutor:
    """Runs steps on ``actors[replica][stage]`` (Ray actor handles of StageWorker)."""

    def __init__(self, actors: Sequence[Sequence[Any]], schedule: str, n_micro: int, swapped: bool = False, redundant: bool = False,
                 generations: Iterator[int] | None = None, dead_nodes: Callable[[], set[str]] | None = None,
                 node_of: Callable[[ShardKey], str | None] | None = None) -> None:
        """``generations``: the counter link generations come from (the controller's, shared by its
        executors so that a later membership's links are always newer; default: this process's).
        ``dead_nodes``: the nodes the run judged dead (its node watch) or set aside (a cut link), looked at every
        :data:`LOOK_S` while a step runs; ``node_of``: where an actor runs. An actor of the step on
        a dead node is lost then, without waiting for Ray to fail its call."""
        self.dead_nodes, self.node_of = dead_nodes, node_of
        self.actors = [list(r) for r in actors]
        self.dp, self.n_stages = len(self.actors), len(self.actors[0])
        self.n_micro = n_micro  # the most microbatches a replica runs (fewer when its share has fewer sequences)
        self.schedule, self.swapped, self.redundant = schedule, swapped, redundant
        self.routes = routes(self.n_stages, n_micro, swapped)  # every route a microbatch may take: what the links cover
        self._ops: dict[int, list[np.ndarray]] = {}
        self.stage_ops(n_micro)  # refuses a schedule that would deadlock before any step
        self.generations = generations if generations is not None else GENERATIONS
        self.generation = 0
        self.linked = False
        self.last: PendingStep | None = None
        self.calls = 0  # actor calls made (steps, links, aborts): the driver's cost

    def stage_ops(self, n_micro: int) -> list[np.ndarray]:
        """Each stage's ops for a replica of ``n_micro`` microbatches, one compact array per stage
        (built once per count, reused by every plan). Raises ValueError for a schedule that would
        deadlock."""
        if n_micro not in self._ops:
            sched = build_schedule(self.schedule, self.n_stages, n_micro, self.swapped)
            submission_order(sched, routes(self.n_stages, n_micro, self.swapped))
            self._ops[n_micro] = [encode_ops(ops) for ops in sched]
        return self._ops[n_micro]

    def keys(self) -> list[ShardKey]:
        return [ShardKey(s, r) for r in range(self.dp) for s in range(self.n_stages)]

    def actor(self, key: ShardKey) -> Any:
        return self.actors[key.replica][key.stage]

    def connect(self) -> None:
        """Set up the links of this membership (a new generation); raises StepFailed naming an
        actor that could not take part."""
        self.generation = next(self.generations)
        keys = self.keys()
        addresses = self._gather({k: self.actor(k).link_address.remote() for k in keys}, LINK_S)
        peers = link_peers(self.n_stages, self.dp, self.routes, self.redundant)
        calls = {k: self.actor(k).connect_links.remote(self.generation, {p: addresses[p] for p in peers[k]}) for k in keys}
        self._gather(calls, LINK_S)
        heads = {ShardKey(0, r): self.actors[r][0].relay_to.remote(self.generation, self.actors[r]) for r in range(self.dp)}
        self._gather(heads, LINK_S)
        self.calls += 2 * len(keys) + self.dp
        self.linked = True

    def _gather(self, calls: dict[ShardKey, Any], timeout: float) -> dict[ShardKey, Any]:
        import ray

        ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout)
        out = {}
        for k, ref in calls.items():
            try:
                out[k] = ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, TimeoutError) as err:
                raise StepFailed(err, k.stage, k.replica, "links") from err
        return out

    def plans(self, step: int, x: np.ndarray, y: np.ndarray, snapshot: StreamPosition | None, faults: Mapping[ShardKey, Fault] | None = None) -> dict[ShardKey, StepPlan]:
        """Each actor's plan: replica r's share of the rows of ``x`` / ``y`` and its microbatch
        sizes (:func:`~elastic_llm.pipeline.shares.replica_microbatches`), the ops of its
        microbatch count; stage 0 gets the replica's tokens, the LM head's stage the targets (and
        with redundant copies the last stage the tokens, the one before it the targets)."""
        sizes = replica_microbatches(len(x), self.dp, self.n_micro)
        shares = [sum(m) for m in sizes]
        xs, ys = cut(x, shares), cut(y, shares)
        n, faults = self.n_stages, faults or {}
        out = {}
        for k in self.keys():
            tokens = xs[k.replica] if k.stage == 0 or (self.redundant and k.stage == n - 1) else None
            targets = ys[k.replica] if k.stage == n - 1 or (self.redundant and k.stage == n - 2) else None
            ops = self.stage_ops(len(sizes[k.replica]))[k.stage]
            out[k] = StepPlan(step, self.generation, ops, sizes[k.replica], len(x), tokens, targets, snapshot, faults.get(k))
        return out

    def start(self, step: int, x: np.ndarray, y: np.ndarray, snapshot: StreamPosition | None = None, faults: Mapping[ShardKey, Fault] | None = None) -> PendingStep:
        """Submit step ``step``: one call per replica, to its stage 0, carrying every stage's plan."""
        if not self.linked:
            self.connect()
        plans = self.plans(step, x, y, snapshot, faults)
        relays = {self.actors[r][0].relay_step.options(concurrency_group="relay").remote(
                      self.generation, [plans[ShardKey(s, r)] for s in range(self.n_stages)]): r
                  for r in range(self.dp)}
        self.calls += len(relays)
        sizes = tuple(plans[ShardKey(0, r)].micro_sizes for r in range(self.dp))
        self.last = PendingStep(step, self.generation, self.n_stages, self.dp, relays, sizes)
        return self.last

    def finish(self, pending: Pending, timeout: float = STEP_DEADLINE_S) -> StepResult:
        """Wait for every report; at the first failure abort the others (their blocked receives
        wake) and give them :data:`SETTLE_S` to report. Raises :class:`StepFailed` naming the
        root cause."""
        mine = _own(pending)
        failed = self._wait(mine, timeout)
        if failed:
            self.linked = False  # a failed step closed links: the next step sets up new ones
            raise self._root_cause(mine)
        return mine.result()

    def wait(self, pending: Pending, seconds: float) -> bool:
        """Whether the step has ended: every report came back, or one says it failed (or its
        actor died), waiting at most ``seconds`` (the controller looks at new drain notices
        meanwhile) and returning as soon as one replica's answer says it failed (not when the
        others answered too). What came back is kept for :meth:`finish`, which aborts the rest
        of a failed step."""
        import ray

        pending = _own(pending)
        deadline = time.monotonic() + seconds
        while pending.relays and not pending.failed:
            left = deadline - time.monotonic()
            look = self._look(left)
            ready, _ = ray.wait(list(pending.relays), num_returns=1, timeout=max(0.0, look))
            for ref in ready:
                self._collect(pending, ref)
            self._node_losses(pending)
            if (not ready and look >= left) or left <= 0:
                break
        return not pending.relays or pending.failed

    def _look(self, left: float) -> float:
        """How long one wait for reports may block: until the next look at the dead nodes."""
        return min(left, LOOK_S) if self.dead_nodes is not None and self.node_of is not None else left

    def _node_losses(self, pending: PendingStep) -> None:
        """The actors of ``pending`` still in the step whose node the run judged dead are lost
        now; a replica whose stage 0 (its relay) is among them loses the reports it relays."""
        if self.dead_nodes is None or self.node_of is None:
            return
        dead = self.dead_nodes()
        if not dead:
            return
        for key in pending.unanswered():
            node = self.node_of(key)
            if node is None or node not in dead:
                continue
            pending.lost[key] = NodeLost(f"{key}'s node {node[:12]} is lost to the run (its raylet refused the driver's probe, or a link of it was cut)")
            if key.stage == 0:  # its replica's reports are lost with it; its other stages are told to stop
                r = key.replica
                for ref in [ref for ref, rr in pending.relays.items() if rr == r]:
                    del pending.relays[ref]
                pending.running.pop(r, None)
                orphans = {ShardKey(s, r) for s in range(self.n_stages)} - set(pending.reports) - set(pending.lost) - pending.orphaned
                pending.orphaned |= orphans
                for k in orphans:
                    self.actor(k).abort_step.options(concurrency_group="control").remote(pending.generation)
                    self.calls += 1

    def nodes_died(self, nodes: set[str]) -> None:
        """The run's node watch judged ``nodes`` dead (called on its thread, at the verdict). When an
        actor of the step in flight runs there and has not answered, the step cannot succeed: every
        actor still in it is woken now (:meth:`_abort`: their blocked receives fail and their reports come back),
        not at the driver's next look, which then finds the step failed and names the lost actor
        (:meth:`_node_losses`). A step that ended, or with no unanswered actor there, is left alone.
        An abort is idempotent: the driver's own, at its look, changes nothing more."""
        p, node_of = self.last, self.node_of
        if p is None or node_of is None or not (p.relays or p.running):
            return
        if any(node_of(k) in nodes for k in p.unanswered()):
            self._abort(p)

    def _collect(self, pending: PendingStep, ref: Any) -> None:
        """Keep what the finished relay call ``ref`` answered: its replica's reports and lost
        stages, and which still run; a relay that raised lost its own actor (the replica's stage
        0), and with it the reports of the stages it had not answered for."""
        import ray

        r = pending.relays.pop(ref)
        try:
            got = ray.get(ref, timeout=0)
        except ray.exceptions.RayError as err:
            head = ShardKey(0, r)
            if head not in pending.reports:
                pending.lost[head] = err
            pending.orphaned |= {ShardKey(s, r) for s in pending.running.pop(r, range(self.n_stages))} - set(pending.reports) - set(pending.lost)
            return
        pending.reports.update({ShardKey(s, r): rep for s, rep in got.reports.items()})
        pending.lost.update({ShardKey(s, r): err for s, err in got.lost.items()})
        if got.running:
            pending.running[r] = got.running
        else:
            pending.running.pop(r, None)

    def _wait(self, pending: PendingStep, timeout: float, failed: bool = False) -> bool:
        """Wait for the step's reports; at the first failure abort the actors still in the step and
        collect what they answer within :data:`SETTLE_S`. Whether the step failed."""
        import ray

        deadline = time.monotonic() + timeout
        failed = failed or pending.failed  # seen by wait() already
        aborted = False
        while True:
            failed |= bool(pending.running)  # a relay answered before every stage did: one failed, or its wait ran out
            if failed and not aborted and pending.unanswered():  # wake the others' blocked receives, give them the settling time
                aborted = True
                self._abort(pending)
                deadline = time.monotonic() + SETTLE_S
            for r in list(pending.running):  # collect the rest of the replicas that answered early (not the stages known lost)
                skip = tuple(k.stage for k in pending.lost if k.replica == r)
                pending.relays[self.actors[r][0].relay_rest.options(concurrency_group="relay").remote(
                    pending.generation, max(1.0, deadline - time.monotonic()), skip)] = r
                del pending.running[r]
                self.calls += 1
            if not pending.relays:
                return failed
            left = deadline - time.monotonic()
            look = self._look(left)
            ready, _ = ray.wait(list(pending.relays), num_returns=1, timeout=max(0.0, look)) if left > 0 else ([], None)
            if not ready and look >= left:  # the deadline passed
                if aborted:
                    return True
                failed = True  # a hung step: abort it, then give it the settling time
            for ref in ready:
                self._collect(pending, ref)
            self._node_losses(pending)
            failed |= pending.failed

    def _abort(self, pending: PendingStep) -> None:
        """Wake every actor of ``pending`` still in the step (its blocked receives fail at once)."""
        import ray

        for key in pending.unanswered():
            try:
                self.actor(key).abort_step.options(concurrency_group="control").remote(pending.generation)
            except ray.exceptions.RayError:  # its actor is gone: nothing left to abort
                continue
            self.calls += 1

    def _root_cause(self, pending: PendingStep) -> StepFailed:
        """The first own error (by the time the stage reported it), else a call that raised (the
        actor died), else the peer the others lost, else a timeout."""
        errors = sorted(
            ((rep.failure.at, k, rep) for k, rep in pending.reports.items() if rep.failure is not None and rep.failure.kind is FailureKind.ERROR),
            key=lambda t: t[0],
        )
        if errors:
            _, k, rep = errors[0]
            f = rep.failure
            assert f is not None
            name, _, msg = f.cause.partition(": ")
            text = (msg or describe_failure(f, k)) + (f"\n{f.trace}" if f.trace else "")
            return StepFailed(StageError(name, text), k.stage, k.replica, f.op)
        if pending.lost:
            k = min(pending.lost, key=lambda k: (k.replica, k.stage))
            return StepFailed(pending.lost[k], k.stage, k.replica, self._op_when_lost(pending, k))
        lost_peers = [rep.failure.peer for rep in pending.reports.values() if rep.failure is not None and rep.failure.peer is not None and rep.failure.kind is FailureKind.PEER_LOST]
        if lost_peers:
            k = min(lost_peers, key=lambda k: (k.replica, k.stage))
            return StepFailed(RuntimeError(f"the links to {k} were lost"), k.stage, k.replica)
        return StepFailed(TimeoutError(f"step {pending.step} did not finish within its deadline"), None, None)

    @staticmethod
    def _op_when_lost(pending: PendingStep, key: ShardKey) -> str:
        """The op a dead actor was in, as its peers saw it: the op of a peer that lost it."""
        for rep in pending.reports.values():
            f = rep.failure
            if f is not None and f.peer == key and f.kind is FailureKind.PEER_LOST:
                return f"{f.op} of {rep.key}"
        return ""

    def settle(self, timeout: float = SETTLE_S) -> None:
        """Make sure no call of the last step still runs (abort it and wait for its reports)."""
        p = self.last
        if p is None or not (p.relays or p.running):
            return
        self.linked = False
        self._wait(p, timeout, failed=True)

    def snapshot(self, step: int, position: StreamPosition) -> None:
        """Every stage copies its state now, between steps, as the snapshot of ``step`` (a
        re-protection after a recovery): returns once each has started its copy (its manager
        collects it). Raises StepFailed naming an actor that did not answer, ValueError if a stage
        is at another step (the caller's mistake: its snapshot would never come)."""
        at = self._gather({k: self.actor(k).snapshot_now.remote(position) for k in self.keys()}, LINK_S)
        self.calls += len(at)
        elsewhere = {str(k): s for k, s in at.items() if s != step}
        if elsewhere:
            raise ValueError(f"a snapshot of step {step} between steps, but stages are at other steps: {elsewhere}")

    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
        """Forward-only loss of a batch (any number of sequences) through replica 0's stages, in
        at most ``n_micro`` microbatches (evaluation, not a step): the mean over its sequences."""
        import ray

        sizes = microbatch_sizes(len(x), self.n_micro)
        refs = []
        for xm, ym in zip(cut(x, sizes), cut(y, sizes)):
            act: Any = xm
            for s, actor in enumerate(self.actors[0]):
                act = actor.eval_forward.remote(act, ym if s == self.n_stages - 1 else None)
            refs.append(act)
        return weighted_mean(ray.get(refs, timeout=STEP_DEADLINE_S), sizes)
