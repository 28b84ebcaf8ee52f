"""One training step as the controller runs it, and the jobs that follow a completed step.

Owns: submitting a step (the next batch of the data stream, the in-step faults, whether it takes
a snapshot, beginning that snapshot version once the plans are out), waiting for it with a
deadline (short when an actor sits on a node the probes suspect, from the moment it is
suspected, also mid-step; a step stalled past :data:`SUSPECT_STEPS` typical steps has its nodes'
links probed, and fails at once when two of its nodes cannot reach each other) and looking
meanwhile for drain notices (:attr:`StepRunner.between`, every :data:`NOTICE_LOOK_S`), rewinding
the stream when it fails, and what the driver holds of a submitted step (:class:`InterruptedStep`: if every survivor
finished it, a recovery counts it from their reports). Then, after every completed step, each job
in a method of its own (:class:`StepJobs`): the snapshot cadence's bookkeeping, the durable
tier's, the CheckFree+ mirrors, the checkpointing baseline, the chaos rate, validation, the
step's record, and, at every step boundary, the node deaths seen and the warm standbys. Never decides what happens after a failure (the controller's states do) and
never computes model math (the stage actors do).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from elastic_llm.chaos import FaultTargets
from elastic_llm import events
from elastic_llm.clock import Clock
from elastic_llm.config import RunConfig
from elastic_llm.controller.drains import Drain
from elastic_llm.controller.elastic import DRAIN_MARGIN_S
from elastic_llm.controller.links import LinkGuard
from elastic_llm.controller.metrics import MetricsWriter
from elastic_llm.controller.neighbours import refresh_mirrors
from elastic_llm.controller.ports import Faults
from elastic_llm.controller.setup import RunParts
from elastic_llm.controller.states import WaitingForCapacity
from elastic_llm.controller.ticks import Ticks
from elastic_llm.pipeline.executor import Pending, StepExecutor, StepFailed, StepResult
from elastic_llm.pipeline.shares import replica_shares
from elastic_llm.recovery.links import link_share
from elastic_llm.stream import StreamPosition, TokenStream

log = logging.getLogger("elastic_llm.controller")
SUSPECT_STEPS = 10.0  # a step with an actor on a suspect node may take this many typical steps ...
SUSPECT_MIN_S = 30.0  # ... and at least this long, before it counts as failed
STALL_MIN_S = 5.0  # a step past SUSPECT_STEPS typical steps, and at least this long, has its nodes' links probed (then once per such period)
STANDBY_LOOK_S = 1.0  # how often (at step boundaries) the warm standbys are topped up
NOTICE_LOOK_S = 1.0  # while a step runs, how often the controller looks for new drain notices
NOTICE_LOOK_MAX_S = 600.0  # ... for at most this long (then the step's own deadline decides)
REPROTECT_S = 10.0  # longest the run waits between steps for a re-protecting version to commit (later, it commits after a step)


def reprotect_wait_s(drains: Iterable[Drain], hosting: set[str], now: float) -> float:
    """How long the run waits between steps for a re-protecting version to commit:
    :data:`REPROTECT_S`, but never into the last ``DRAIN_MARGIN_S`` before the deadline of a drain
    of a node in ``hosting`` (the nodes of the run's stages: their moves come first); 0 once that
    is past. Pure."""
    lefts = [left - DRAIN_MARGIN_S for d in drains if d.node_id in hosting and (left := d.seconds_left(now)) is not None]
    return max(0.0, min([REPROTECT_S, *lefts]))


@dataclass(frozen=True)
class InterruptedStep:
    """What the driver holds of a step that was submitted: if a recovery finds that every
    survivor finished it, the step is counted from the reports that came back."""

    step: int
    pending: Pending
    position_after: StreamPosition  # the data position after the step's batch
    started: float


class StepRunner:
    """Submits steps and waits for them (see the module's docstring)."""

    def __init__(self, cfg: RunConfig, clock: Clock, stream: TokenStream, parts: RunParts, faults: Faults, nodes: LinkGuard,
                 targets: Callable[[], FaultTargets], errors: tuple[type[BaseException], ...]) -> None:
        self.cfg, self.clock, self.stream, self.parts = cfg, clock, stream, parts
        self.faults, self.nodes, self.targets, self.errors = faults, nodes, targets, errors
        self.interrupted: InterruptedStep | None = None
        self.typical_s: float | None = None  # a recent step's time (the suspect deadline's scale)
        self.between: Callable[[], object] | None = None  # looked at every NOTICE_LOOK_S while a step runs (new drain notices)

    def deadline_s(self) -> float | None:
        """The step's deadline when an actor sits on a node the probes suspect (None: the
        executor's own)."""
        suspects = self.nodes.suspects()
        if not suspects or not suspects & set(self.parts.group.nodes.values()):
            return None
        return max(SUSPECT_MIN_S, SUSPECT_STEPS * (self.typical_s or SUSPECT_MIN_S))

    def run(self, executor: StepExecutor, step: int, last: bool = False) -> tuple[StepResult, float]:
        """Step ``step`` on ``executor``: its result and when it started (``last``: the run's
        last step, which always takes a snapshot, so the run's end is committed). Raises
        :class:`StepFailed` with the data stream rewound (the step did not happen)."""
        position = self.stream.at()
        started = self.clock.perf_counter()
        sn = self.parts.snapshots
        self.interrupted = None
        try:
            x, y = self.stream.next_batch(self.cfg.train.batch_size)
            self.faults.fire("before_step", step, self.targets())
            snap = sn is not None and sn.due(step, last)
            pending = executor.start(step, x, y, snapshot=self.stream.at() if snap else None)
            self.interrupted = InterruptedStep(step, pending, self.stream.at(), started)
            if snap and sn is not None:
                sn.begin(step, self.parts.group.members())
            left = self._look_while_running(executor, pending, step)
            result = executor.finish(pending) if left is None else executor.finish(pending, left)
        except StepFailed:
            self.stream.seek(position)
            raise
        except self.errors as err:
            self.stream.seek(position)
            raise StepFailed(err, None, None) from err
        took = self.clock.perf_counter() - started
        self.typical_s = took if self.typical_s is None else min(took, 0.9 * self.typical_s + 0.1 * took)
        return result, started

    def _look_while_running(self, executor: StepExecutor, pending: Pending, step: int) -> float | None:
        """While the step runs, call :attr:`between` every :data:`NOTICE_LOOK_S` (a notice that
        arrives mid-step is acted on then, not at the next step boundary) and look at the
        suspects again (a node of the step suspected mid-step gives the step its suspect deadline
        from then: a hung node does not hold the run for the executor's whole deadline), until the
        step ends, its deadline passes or :data:`NOTICE_LOOK_MAX_S` did. Returns the seconds left
        of the step's deadline (None: the executor's own)."""
        t0 = self.clock.perf_counter()
        d = self.deadline_s()
        ends = None if d is None else t0 + d
        if self.between is None:
            return d
        stall = max(STALL_MIN_S, SUSPECT_STEPS * self.typical_s) if self.typical_s else 0.0
        look_links = t0 + stall if stall else None  # none before a step was timed
        while not executor.wait(pending, NOTICE_LOOK_S):
            self.between()
            now = self.clock.perf_counter()
            if ends is None and (d := self.deadline_s()) is not None:
                ends = now + d
            if look_links is not None and now >= look_links:  # a stalled step: are its own links cut?
                look_links = now + stall
                if self.nodes.check(step, Counter(self.parts.group.nodes.values())) is not None:
                    ends = now  # it fails now, the actors of the side set aside lost
            if now - t0 >= NOTICE_LOOK_MAX_S or (ends is not None and now >= ends):
                break
        return None if ends is None else max(0.0, ends - self.clock.perf_counter())


class StepJobs:
    """What follows a completed step, a method per job; :meth:`record` is the step's line."""

    def __init__(self, cfg: RunConfig, clock: Clock, metrics: MetricsWriter, parts: RunParts, faults: Faults, nodes: LinkGuard, val_tokens: np.ndarray) -> None:
        self.cfg, self.clock, self.metrics, self.parts, self.faults, self.nodes = cfg, clock, metrics, parts, faults, nodes
        self.val_tokens = val_tokens
        self._standby_look = float("-inf")
        self._adopted_seen = 0
        self._resumed_at: int | None = None  # the step the run resumed at after a standby was used (its top-up waits for a step after it)
        self._last_report = float("-inf")
        self.reclaimed = 0  # nodes the run has seen reclaimed so far
        self.waves = 0  # steps at which new reclaims were seen: preemption waves (``durable.every: auto`` counts them as failures)
        self._suspected: set[str] = set()  # the node watch's suspects at the last look (``node_suspect`` lines)
        self.fenced_total = 0  # calls, links and offers of older generations the stages and managers refused (``fenced`` lines)

    def suspects(self, step: int) -> None:
        """One ``node_suspect`` line per node the node watch began to suspect since the last look
        (again after it answered in between)."""
        now = self.nodes.suspects() - self.nodes.set_aside()  # the watch's own (a node set aside has its link_cut line)
        for node in sorted(now - self._suspected):
            self.metrics.emit(events.NodeSuspect(step=step, node=node))
        self._suspected = now

    def fenced(self, step: int, result: StepResult) -> None:
        """One ``fenced`` line per actor whose report names calls or links of an older
        generation it refused (a healed partition's zombies), and per snapshot manager whose
        latest part names offers, plans or driver calls it refused; :attr:`fenced_total` counts them."""
        for key, report in sorted(result.reports.items()):
            if report.fenced:
                self.fenced_total += len(report.fenced)
                self.metrics.emit(events.Fenced(step=step, stage=key.stage, replica=key.replica, count=len(report.fenced), what=list(report.fenced)))
        sn = self.parts.snapshots
        if sn is not None and sn.fenced:
            by_node: dict[str, list[str]] = {}
            for node, what in sn.fenced:
                by_node.setdefault(node, []).append(what)
            sn.fenced.clear()
            for node, whats in sorted(by_node.items()):
                self.fenced_total += len(whats)
                self.metrics.emit(events.Fenced(step=step, node=node, count=len(whats), what=whats))

    def deaths(self, step: int) -> None:
        """One ``node_dead`` line per node the runtime found dead since the last look."""
        self.suspects(step)
        for d in self.nodes.deaths():
            self.metrics.emit(events.NodeDead(step=step, node=d.node, address=d.address, outcome=d.outcome.value, failures=d.failures, suspect_s=round(d.suspect_s, 3)))

    def standbys(self, step: int, failures: int, elapsed_s: float) -> None:
        """Top the warm standbys up to ``recovery.standby`` per live node with slots that is not
        draining or suspect (they start in the background; at most every ``STANDBY_LOOK_S``,
        sooner when one was lost or used). One used by a recovery (or a grow, a drain) is
        replaced once the run has completed a step after it: a new process's start (Python,
        torch, the warm-up: seconds of CPU) does not compete with the first step of the resumed
        run, measured 1-4 s slower on this project's 2-core loopback cluster when it did. Where
        the steps do not run on the CPU a start takes (stages on GPUs; a simulated fleet with a
        device per actor: ``starts_take_step_cpu``) it is replaced at once, so a burst's next
        recovery finds it ready (fleet seed 1 at 30 s notices: 0.945 of the oracle with the wait)."""
        pool = self.parts.standbys
        if pool is None or not pool.enabled:
            return
        lost = pool.check()
        if lost:
            self.metrics.emit(events.Standby(step=step, lost=lost, ready=pool.count()[0]))
        if pool.adopted != self._adopted_seen and not lost and pool.starts_take_step_cpu:
            if self._resumed_at is None:
                self._resumed_at = step
            if step <= self._resumed_at:
                return
        now = self.clock.monotonic()
        if now - self._standby_look < STANDBY_LOOK_S and not lost and pool.adopted == self._adopted_seen:
            return
        self._standby_look, self._adopted_seen, self._resumed_at = now, pool.adopted, None
        if self.cfg.recovery.standby == "auto":
            pool.resize(failures, elapsed_s)
        avoid = set(self.nodes.draining()) | self.nodes.suspects()
        started = pool.ensure([n for n in self.nodes.with_slots() if n not in avoid])
        if started:
            ready, starting = pool.count()
            self.metrics.emit(events.Standby(step=step, started=started, ready=ready, starting=starting, per_node=pool.per_node))

    def snapshots(self, step: int, seconds: float) -> None:
        """The snapshot cadence: the step's time (``auto`` measures what versions cost), commit
        what finished, and a line per change of ``snapshot.every``."""
        sn = self.parts.snapshots
        if sn is None:
            return
        sn.observe_step(seconds, began=sn.last_begin == step)
        sn.poll()
        self.snapshot_lines(step)

    def reprotect(self, step: int, executor: StepExecutor, position: StreamPosition) -> None:
        """Between steps (after a step, a recovery, a drain), when the committed version has lost
        members of its erasure groups, or draining ones beyond their parity
        (:meth:`~elastic_llm.snapshot.coordinator.SnapshotCoordinator.reprotect_due`): every stage
        copies its state now and a version of ``step`` is taken on the nodes there are (unless one
        more loss is within parity and the next step takes a version anyway: ``snapshot.every``
        1). While one more loss could be beyond a group's parity
        (:meth:`~elastic_llm.snapshot.exposure.Exposure.critical`) and the version's work shares
        the steps' processors (stages on CPUs: a step would slow its copies and encode, and so
        lengthen the exposure), it is waited for, up to :data:`REPROTECT_S`, and never into the
        last ``DRAIN_MARGIN_S`` before a drain of a node hosting the run's stages (the drain's
        moves come first; the version then commits at a later look); otherwise the next step runs
        while it is taken. Its work ends when it would have after a wait, so the exposure lasts as
        long either way; its commit is read at the next look, or first thing in a recovery (fleet
        seed 1 with no notice lost 0.008 of the oracle to these waits at parity 2, with stages on
        devices). A stage that does not answer is left to the next step, which finds it failed."""
        sn = self.parts.snapshots
        if sn is None or not sn.reprotect_due(step):
            return
        critical = sn.exposure.critical(sn.committed)
        if not critical and sn.every <= 1:  # one more loss is within parity and the next step takes a version anyway
            return
        try:
            executor.snapshot(step, position)
        except (StepFailed, ValueError) as e:  # an actor gone (the next step finds it), or stages at other steps: the next step's own snapshot
            log.warning("no re-protecting snapshot of step %d: %s", step, e)
            return
        t0 = self.clock.perf_counter()
        wait_s = reprotect_wait_s(self.nodes.draining().values(), set(self.parts.group.nodes.values()), self.clock.time())
        pool = self.parts.standbys
        if not critical or (pool is not None and not pool.starts_take_step_cpu):  # one more loss is within parity, or the version's work takes no
            wait_s = 0.0  # step's processors (stages on devices): it is taken while training goes on, done when it would have been after a wait
        sn.begin(step, self.parts.group.members(), with_step=False)
        sn.poll(block=True, timeout=wait_s, drop=False)
        log.info("step %d's snapshot taken again between steps to re-protect it: %s after %.2f s", step,
                 "committed" if sn.committed is not None and sn.committed.version == step and not sn.inflight else "still in flight", self.clock.perf_counter() - t0)
        self.snapshot_lines(step)

    def snapshot_lines(self, step: int) -> None:
        """The lines of what the commits decided: cadence changes, re-protections."""
        sn = self.parts.snapshots
        if sn is None:
            return
        for change in sn.changes:
            self.metrics.emit(events.SnapshotEvery(step=step, **change))
        sn.changes.clear()
        for done in sn.reprotections:
            self.metrics.emit(events.Reprotect(step=step, **done))
        sn.reprotections.clear()
        for moved in sn.rehomes:
            self.metrics.emit(events.Rehome(step=step, **moved))
        sn.rehomes.clear()

    def durable(self, seconds: float, elapsed_s: float, failures: int) -> None:
        """The durable tier: what the run measured (``auto``'s inputs), and the flush in flight."""
        if self.parts.durable is not None:
            gone = len(self.nodes.reclaimed())
            self.waves += gone > self.reclaimed  # new preemptions since the last step: one wave, however many nodes
            self.reclaimed = gone
            self.parts.durable.observe(seconds, elapsed_s, failures + self.waves)  # auto: the rate of failures and preemption waves
            self.parts.durable.poll()

    def mirrors(self, step: int, force: bool = False) -> None:
        """CheckFree+: copy the embedding / LM head onto the neighbouring stages (every
        ``checkfree.mirror_every`` steps; ``force`` after start and after every recovery)."""
        every = self.cfg.checkfree.mirror_every
        if self.cfg.mirrors and (force or (every and step % every == 0)):
            refresh_mirrors(self.parts.group, step)

    def checkpoint(self, step: int, position: StreamPosition, force: bool = False) -> None:
        """The checkpointing baseline: checkpoint ``step`` when due (training waits: the
        baseline's cost), one metrics line."""
        ck = self.parts.checkpoints
        if ck is not None and (force or ck.due(step)):
            seconds = ck.save(step, position)
            self.metrics.emit(events.Checkpoint(step=step, seconds=seconds, path=str(ck.root)))

    def chaos_rate(self, step: int, seconds: float) -> None:
        """``chaos.failure_rate_per_hour``: once the first steps were timed, the per-step probability."""
        prob = self.faults.observe_step(step, seconds, self.parts.group.width)
        if prob is not None:
            log.info("chaos.failure_rate_per_hour=%s at %.2f s per step: each stage fails with probability %.2e per step",
                     self.cfg.chaos.failure_rate_per_hour, seconds, prob)
            self.metrics.emit(events.ChaosRate(step=step, rate_per_hour=self.cfg.chaos.failure_rate_per_hour, prob_per_step=prob))

    def record(self, step: int, result: StepResult, seconds: float, elapsed_s: float, tokens: int, end: int, executor: StepExecutor) -> dict[str, Any]:
        """The step's line (and validation when due), after the ``fenced`` lines of its reports."""
        self.fenced(step, result)
        share = self.links(step, result, seconds)
        rec: dict[str, Any] = {
            "step": step,
            "loss": result.loss,
            "tokens": tokens,
            "tokens_per_s": self.cfg.tokens_per_step() / seconds,
            "elapsed_s": elapsed_s,
            "lr": result.lr,
            "grad_norm": max(result.grad_norms),
            "dp": self.parts.group.width,
            "link_share": round(share, 4),
        }
        sn, du = self.parts.snapshots, self.parts.durable
        if sn is not None and sn.auto:
            rec["snapshot_every"] = sn.every
        if du is not None:
            rec["durable_every"] = du.every
        ev = self.cfg.train.eval_every
        if ev and (step % ev == 0 or step == end):
            rec["val_loss"] = self.evaluate(executor)
        return rec

    def links(self, step: int, result: StepResult, seconds: float) -> float:
        """The share of the step its links cost its slowest actor; a straggler drained when the
        rule says (:meth:`LinkGuard.observe`)."""
        g = self.parts.group
        node_of = {(k.stage, k.replica): n for k, n in g.nodes.items()}
        share = link_share({(k.stage, k.replica): rep.received for k, rep in result.reports.items()}, node_of, seconds)
        self.nodes.observe(step, share, Counter(g.nodes.values()))
        return share

    def evaluate(self, executor: StepExecutor) -> float:
        """Validation loss over ``train.eval_batches`` batches of replica 0's share."""
        stream = TokenStream(self.val_tokens, self.cfg.model.seq_len, seed=0, shuffle=False)
        share = replica_shares(self.cfg.train.batch_size, self.parts.group.width)[0]
        return float(np.mean([executor.eval_loss(*stream.next_batch(share)) for _ in range(self.cfg.train.eval_batches)]))

    def capacity(self, step: int, state: WaitingForCapacity, force: bool = False) -> None:
        """While waiting for capacity: a log and a metrics line at most every ``recovery.capacity_report_s``."""
        now = self.clock.monotonic()
        if not force and now - self._last_report < self.cfg.recovery.capacity_report_s:
            return
        self._last_report = now
        left = state.deadline - now
        log.info("waiting for capacity: %s: waiting for nodes (%.0f s so far, %.0f s left)", state.capacity, now - state.since, left)
        self.metrics.emit(events.WaitingForCapacity(step=step, need=state.capacity.need, have=state.capacity.have, waited_s=now - state.since, deadline_s=left))

    def end_of_failed_run(self) -> None:
        """A run that failed: every live snapshot manager learns the commits and discards sent
        so far (a relay through a node that died may not have passed one on), so the committed
        version the survivors keep is marked committed on each of them for a ``--resume``."""
        if self.parts.snapshots is not None:
            self.parts.snapshots.settle_relays()

    def end_of_run(self, step: int, tokens: int, elapsed_s: float, ticks: Ticks) -> None:
        """A run that finished: the versions in flight commit, the durable tier's last flush, the end line."""
        if self.parts.snapshots is not None:
            self.parts.snapshots.poll(block=True, final=True)
            self.snapshot_lines(step)
        if self.parts.durable is not None:
            self.parts.durable.finish()
        self.metrics.emit(events.End(step=step, tokens=tokens, elapsed_s=elapsed_s, seconds_by_state=dict(ticks.seconds),
                                     cpu_by_state={k: round(v, 4) for k, v in ticks.cpu.items()}))
