"""Carry a soak's fault schedule out on a loopback Ray cluster, against real runs.

Owns: the loopback ``ray.cluster_utils.Cluster`` of a soak (a head without CPUs plus
``workers`` nodes), the reference run (undisturbed, same config and seed; trained once and
shared by the trials, whose configs are the same), and each trial's soaked run (with a durable
tier of its own, flushing every :data:`DURABLE_EVERY` committed snapshots at :data:`FLUSH_MB_S`, unless its config has
one): it trains in a thread while this (main) thread strikes each fault from outside the run
once the fault's step finished: SIGKILL of a stage's or a snapshot manager's process (also while
it writes a durable flush), removal of a node (a fresh node takes its place), a Ray drain (the
drained node is removed and replaced once the run has left it; until its drain line the next
fault waits and the run is lengthened by up to :data:`DRAIN_EXTRA_STEPS`), SIGSTOP then SIGCONT
of a stage (a straggler). Corruption goes through the run's own chaos hook (``kill: smp,
corrupt: true`` plus a kill of that stage in the next step), which reaches the manager's object
store, and so does a stage kill aimed at an op (``kill: stage, op: forward | backward | update``
in the next step). The moment a fault is aimed at from outside: between steps (the snapshots in
flight waited for first), while a snapshot version is still being worked on by a manager or a
durable flush is in flight (waited for up to :data:`MOMENT_STEPS` steps, else between steps; a
manager fault whose manager an earlier fault killed first waits, as long, for the run to replace
it), or
during a recovery (another stage is killed first, the run released, and the fault struck once
the run is recovering), or while a drain is pending (another stage's node is drained first and
the fault struck before the run has seen the drain: it meets both at once), or during a resize
(a run whose width can change: a node of its last replica is removed with no fresh node, so the
run drops that replica; then a fresh node comes, and the fault strikes while the spare replica
that grows the run back starts or joins; each waited for up to :data:`RESIZE_STEPS` steps).
Driver faults run in trials of their own, whose driver is an
``elastic-llm train`` process, SIGKILLed and resumed with ``--resume RUN_ID``. After the run its
newest durable checkpoint is read back and verified. A trial that does not end by its
deadline fails with where the run's thread is; its actors are ended, and if even that does not
end the run the soak stops with the trials it ran.
It is this big because it carries out every fault kind and moment against a live run, plus the
driver trials' separate processes; the schedule (plan) and the verdict (report) live apart.
Never judges anything (report does) and never sends traffic off loopback. Nodes are added and
removed from the main thread, which ``Cluster`` requires; the run's on_step callback waits
while a fault strikes between steps.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from elastic_llm.config import RunConfig
from elastic_llm.controller.states import Recovering, Resizing, State
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.soak.checks import hook_events, losses, verify_durable
from elastic_llm.soak.cluster import SoakCluster
from elastic_llm.soak.driver import driver_trial
from elastic_llm.soak.plan import Fault, FaultKind, Moment, TrialPlan, hooked
from elastic_llm.soak.report import Injection, TrialRun, build_report, write_report
from elastic_llm.soak.strikes import manager_pid, resume_paused, stage_pid

POLL_S = 0.1
PID_S = 2.0  # how long a stage actor gets to tell its pid before the recorded one is checked instead
STRIKE_S = 60.0  # longest one fault may take to strike
STOP_S = 30.0  # after a trial's deadline, how long its run gets to stop
DRAIN_EXTRA_STEPS = 10  # most steps a run is lengthened while a drain's moves (or faults) are still under way
RESIZE_STEPS = 15  # steps a resize fault waits for the run to shrink, then for its grow to start, before it strikes between steps
DURABLE_EVERY = 2  # a trial flushes every 2nd committed snapshot (unless its config has a durable tier)
MOMENT_STEPS = 5  # steps a fault waits for a snapshot or flush in flight before it strikes between steps
# a trial's flush writes are throttled to this (MB/s per manager): a flush then spans several steps,
# so a fault aimed at one finds one (unthrottled, a small model's flush can start and end within a step)
FLUSH_MB_S = 1.0


@dataclass(frozen=True)
class SoakOptions:
    workers: int = 4
    cpus_per_node: float = 2.0
    trial_timeout_s: float = 600.0
    pause_s: float = 3.0
    drain_deadline_s: float = 60.0
    seed: int = 0


log = logging.getLogger("elastic_llm.soak")


def where(thread: threading.Thread, frames: int = 6) -> str:
    """The innermost ``frames`` frames of ``thread``'s stack, one line each: a hang's diagnosis."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "its thread has ended"
    stack = traceback.extract_stack(frame)[-frames:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack))


class _Trial:
    """One soaked run: the run's thread asks, the main thread strikes."""

    def __init__(self, soak: "Soak", plan: TrialPlan, trainer: Any) -> None:
        self.soak, self.plan, self.t = soak, plan, trainer
        self.asks: queue.Queue[tuple[int, threading.Event]] = queue.Queue()
        self.closed = threading.Event()
        self.injections: list[Injection] = []
        self.history: list[dict[str, Any]] = []
        self.error: str | None = None
        self.paused: dict[int, float] = {}  # pid -> when to SIGCONT it
        self.drained: str | None = None  # node drained, to be removed once the run has left it
        self.later: dict[int, Fault] = {}  # faults deferred while a drain is under way, by their new step
        self.extra = 0  # steps added to the run while a drain was under way
        self.managers: list[tuple[int, str, Any, int]] = []  # (injection index, node, old handle, step)
        self.pending: Fault | None = None  # a fault waiting for its moment (a snapshot or flush in flight)
        self.waited = 0  # steps it has waited
        self.in_recovery: Fault | None = None  # a fault to strike once the run is recovering
        self.growing: _Grow | None = None  # a fault to strike once the run, shrunk by its primer, grows again
        self.doing = "starting"
        self.end = plan.steps  # the run's last step as this harness asked for it (Trainer.extend lengthens it)
        self.late: set[int] = set()  # steps after which a strike did not finish before the run went on
        self.recovering = threading.Event()  # set by the run's thread when it enters recovering
        self.resizing = threading.Event()  # ... and resizing
        trainer.observers.append(self._on_state)

    def _on_state(self, old: State, new: State) -> None:  # the run's thread: a change of state
        if isinstance(new, Recovering):
            self.recovering.set()
        elif isinstance(new, Resizing):
            self.resizing.set()

    # --------------------------------------------------------------- the run's thread
    def fit(self) -> None:
        try:
            self.history = self.t.fit(self.plan.steps, on_step=self.on_step)
        except BaseException as e:  # judged as a failed invariant
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def on_step(self, record: dict[str, Any]) -> None:
        if self.closed.is_set():  # the harness stopped serving (it failed): the run goes on to its stop
            return
        done = threading.Event()
        self.asks.put((record["step"], done))
        if not done.wait(STRIKE_S):  # the run goes on; the strike is recorded as one that did not finish in time
            self.late.add(record["step"])

    def close(self) -> None:
        """Stop serving the run's asks: the one it may be waiting on is answered, later ones are not made."""
        self.closed.set()
        while True:
            try:
                _, done = self.asks.get_nowait()
            except queue.Empty:
                return
            done.set()

    # --------------------------------------------------------------- the main thread
    def drive(self, thread: threading.Thread, deadline: float) -> str | None:
        """Serve the run's asks until it ends; what it was doing if ``deadline`` passes first."""
        due = {f.step: f for f in self.plan.faults if not hooked(f)}
        inside = {f.step: f for f in self.plan.faults if hooked(f)}
        while thread.is_alive():
            self._resume(time.monotonic())
            if time.monotonic() > deadline:
                return f"state {self.t.state.name} at step {self.t.step} ({self.doing}); the run's thread is in {where(thread)}"
            try:
                step, done = self.asks.get(timeout=POLL_S)
            except queue.Empty:
                continue
            self.doing = f"training after step {step}"
            struck = len(self.injections)
            try:
                self._between_steps(step, due.pop(step, None), inside.pop(step, None))
                if self.pending is not None or self.later or any(s > step for s in due):
                    self._lengthen(step)
            finally:
                done.set()
                if step in self.late:  # the run did not wait for these: they struck a later moment than aimed at
                    self.injections[struck:] = [replace(inj, error=inj.error or f"struck after the run had gone on: it took over {STRIKE_S:.0f} s")
                                                for inj in self.injections[struck:]]
            if self.in_recovery is not None:  # the run is released: strike once it is recovering
                fault, self.in_recovery = self.in_recovery, None
                self._strike_in_recovery(fault, min(deadline, time.monotonic() + STRIKE_S))
        return None

    def _lengthen(self, step: int) -> None:
        """Faults still to strike at the run's last step: one more step (at most DRAIN_EXTRA_STEPS,
        or RESIZE_STEPS more while a resize fault waits)."""
        cap = DRAIN_EXTRA_STEPS + (2 * RESIZE_STEPS if self.growing is not None else 0)
        if step >= self.end - 1 and self.extra < cap:
            self.t.extend(1)  # applied by the run's thread at its next step boundary
            self.end += 1
            self.extra += 1

    def _between_steps(self, step: int, fault: Fault | None, inside: Fault | None) -> None:
        if self.drained is not None and any(d.get("node") == self.drained for d in self.t.drains):
            self.soak.live.replace_node(self.drained)  # the run left it: it goes, a fresh node comes
            self.drained = None
        if inside is not None:  # struck by the run's chaos hook in the next step, whatever else waits
            self._record_hooked(inside, step)
        if self.drained is not None:  # its stages still move (their new actors start): one fault at a time
            self.doing = f"waiting for the stage spares of the drain of node {self.drained[:8]}"
            self._wait_for_spares(time.monotonic() + self.soak.options.drain_deadline_s / 2)
            for f in [x for x in (self.later.pop(step, None), fault) if x is not None]:
                self._defer(f, step)  # the one deferred before goes first
            self._lengthen(step)  # the run ends after the drain, not during it
            return
        if self.growing is not None:  # one fault at a time: the others wait for the resize's
            for f in [x for x in (self.later.pop(step, None), fault) if x is not None]:
                self._defer(f, step)
            if self.pending is not None:
                self._defer(self.pending, step)
                self.pending = None
            self._lengthen(step)
            self._resize_step(step)
            fault = None
        if step in self.later:
            if fault is not None:  # two due at once: the deferred one waits one more step
                self._defer(self.later.pop(step), step)
            else:
                fault = self.later.pop(step)
        if self.pending is not None:  # a fault waiting for its moment goes first
            if fault is not None:
                self._defer(fault, step)
            fault, self.pending = self.pending, None
        if inside is not None and fault is not None:  # the next step is the hooked fault's: one fault per step,
            self._defer(fault, step)  # or the verdict could not tell whose recovery the step's is
            fault = None
        if fault is None:
            return
        moment = fault.moment
        if fault.kind in (FaultKind.MANAGER, FaultKind.FLUSH) and not self._manager_alive(fault) and self.waited < MOMENT_STEPS:
            self.waited += 1  # its manager died of an earlier fault and the run has not replaced it yet:
            self.pending = fault  # the run does so at its next snapshot; ask again after the next step
            return
        if moment in (Moment.SNAPSHOT, Moment.FLUSH) and not self._busy(moment):
            if self.waited < MOMENT_STEPS:  # not now: ask again after the next step
                self.waited += 1
                self.pending = fault
                return
            moment = Moment.STEP  # none came: it strikes between steps instead
        self.waited = 0
        if moment in (Moment.STEP, Moment.RECOVERY, Moment.DRAIN):  # a recovery's or drain's primer strikes between steps too
            self._settle(step)
        if moment is Moment.DRAIN:  # drain another stage's node first; strike before the run has left it
            nodes = self.t.group.nodes
            n = self.t.cfg.parallel.stages
            other = next((s for s in ((fault.stage + i) % n for i in range(1, n)) if nodes[ShardKey(s, 0)] != nodes[ShardKey(fault.stage, 0)]), None)
            if other is not None:
                self._inject(Fault(FaultKind.DRAIN, fault.step, other), Moment.STEP, primer=True)
            self._inject(fault, Moment.DRAIN if self.drained is not None else Moment.STEP)
            return
        if moment is Moment.RESIZE:
            self._shrink_first(fault, step)
            return
        if moment is Moment.RECOVERY:  # kill another stage first; strike the fault once the run recovers
            primer = Fault(FaultKind.STAGE, fault.step, (fault.stage + 1) % self.t.cfg.parallel.stages)
            self.recovering.clear()  # from now on: the recovery this primer starts
            self._inject(primer, Moment.STEP, primer=True)
            self.in_recovery = fault
            return
        self._inject(fault, moment)

    def _record_hooked(self, inside: Fault, step: int) -> None:
        """Note a fault the run's chaos hook strikes in step ``step + 1`` (its config carries it)."""
        self._settle(step)
        key = ShardKey(inside.stage, 0)
        node = self.t.group.nodes[key][:8]
        if inside.kind is FaultKind.CORRUPT:
            self.injections.append(Injection(inside, f"stage {inside.stage}'s shard on node {node} (chaos hook), then the stage killed"))
            return
        log.info("trial %d: %s (chaos hook)", self.plan.trial, inside)
        what = f"stage {inside.stage} (pid {self.t.group.pids[key]}, node {node}) SIGKILLed by the chaos hook at its first {inside.moment.value} op of step {step + 1}"
        self.injections.append(Injection(inside, what, moment=inside.moment))

    def _defer(self, fault: Fault, step: int) -> None:
        """Strike ``fault`` after a later step: the first one no other deferred fault waits for."""
        at = step + 1
        while at in self.later:
            at += 1
        self.later[at] = replace(fault, step=at)

    def _shrink_first(self, fault: Fault, step: int) -> None:
        """A resize fault's primer: remove (with no fresh node yet) the node of a stage of the
        last replica that shares no node with the fault's stage, so the run has no room to
        replace it and drops the replica; the fault then waits for the grow (:meth:`_resize_step`)."""
        g = self.t.group
        mine = g.nodes[ShardKey(fault.stage, 0)]
        last = g.width - 1
        victim = next((g.nodes[k] for k in g.keys() if k.replica == last and last > 0 and g.nodes[k] != mine), None)
        if victim is None:  # one replica left (an earlier shrink not grown back yet): no primer
            self.growing = _Grow(fault, step, len(self.t.resizes), shrunk=True, primed=False)
            return
        self._settle(step)
        log.info("trial %d: resize primer: node %s of replica %d removed, no fresh node yet", self.plan.trial, victim[:8], last)
        self.soak.live.remove(victim)
        self.injections.append(Injection(Fault(FaultKind.NODE, step, next(k.stage for k in g.keys() if g.nodes[k] == victim)),
                                         f"node {victim[:8]} (replica {last}) removed with no room left, so the run shrinks",
                                         victim, moment=Moment.STEP, primer=True))
        self.growing = _Grow(fault, step, len(self.t.resizes))

    def _resize_step(self, step: int) -> None:
        """After each step while a resize fault waits: once the run has shrunk, a fresh node
        comes; once the run starts the spare replica that grows it back (or is joining it), the
        fault strikes. Waited for RESIZE_STEPS steps each, then it strikes between steps."""
        w, g = self.growing, self.t.group
        assert w is not None
        if not w.shrunk:
            w.shrunk = any(r["to_dp"] < r["from_dp"] for r in self.t.resizes[w.resizes:])
            if not w.shrunk and step < w.step + RESIZE_STEPS:
                return
            self.doing = "adding a fresh node so the run can grow back"
            self.soak.live.top_up()
            w.step, w.shrunk = step, True
            return
        hi = self.t.cfg.elastic.bounds(self.t.cfg.parallel.dp)[1]
        if not w.primed and g.width >= hi and not g.spares.replicas() and step < w.step + RESIZE_STEPS:
            self.growing = None  # the earlier shrink grew back before this fault's turn: shrink the run again
            self._shrink_first(w.fault, step)
            return
        if g.spares.replicas() or self.resizing.is_set():
            moment = Moment.RESIZE
        elif g.width >= hi or step >= w.step + RESIZE_STEPS:
            moment = Moment.STEP
        else:
            return
        self.growing = None
        self._settle(step)
        self._inject(w.fault, moment)

    def _settle(self, step: int) -> None:
        if self.t.snapshots is not None:
            self.doing = f"waiting for the snapshots in flight after step {step}"
            self.t.snapshots.poll(block=True)  # the run is parked in on_step: nothing new starts

    def _busy(self, moment: Moment) -> bool:
        """Whether a snapshot version is still being worked on by a manager (or a durable flush
        is in flight: started, not yet committed). Asked while the run waits in its on_step."""
        if moment is Moment.SNAPSHOT:
            return self.t.snapshots is not None and self.t.snapshots.busy()
        return self.t.durable is not None and self.t.durable.flushing() is not None  # its parts may all be written

    def _inject(self, fault: Fault, moment: Moment, primer: bool = False) -> None:
        self.doing = f"striking {fault}"
        log.info("trial %d: %s%s", self.plan.trial, fault, f" (struck at a {moment.value})" if moment is not fault.moment else "")
        try:
            inj = self._strike(fault)
        except Exception as e:  # reported as a fault without an outcome
            inj = Injection(fault, f"stage {fault.stage}", error=f"{type(e).__name__}: {e}")
        self.injections.append(replace(inj, moment=moment, primer=primer))
        self.doing = f"training after {fault}"

    def _strike_in_recovery(self, fault: Fault, until: float) -> None:
        """Strike ``fault`` once the run recovers from the stage just killed (the run's thread
        says when it enters recovering); between steps if it did not within ``until``."""
        entered = self.recovering.wait(max(0.0, until - time.monotonic()))
        self._inject(fault, Moment.RECOVERY if entered else Moment.STEP)

    def _wait_for_spares(self, until: float) -> None:
        """Hold the run (parked in on_step) until the actors its drain moves stages to have
        started, as a step of real length would: tiny steps outrun an actor's start."""
        g = self.t.group
        while time.monotonic() < until:
            g.spares.tend()  # the run's looks would start what was placed: it is parked here
            spares = g.spares.of()
            if spares and all(g.spares.ready(sp) for sp in spares.values()):
                return
            time.sleep(POLL_S)

    def _manager_pid(self, node: str) -> int | None:
        return manager_pid(self.t.snapshots, node, STRIKE_S)

    def _manager_alive(self, f: Fault) -> bool:
        """Whether the run's manager on fault ``f``'s stage's node answers (there is nothing to strike otherwise)."""
        return self._manager_pid(self.t.group.nodes[ShardKey(f.stage, 0)]) is not None

    def _kill_manager(self, f: Fault, node: str) -> tuple[int, Any]:
        handle = self.t.snapshots.managers[node]
        pid = self._manager_pid(node)
        if pid is None:
            raise RuntimeError(f"the snapshot manager of node {node[:8]} is already dead: nothing to kill")
        os.kill(pid, signal.SIGKILL)
        self.managers.append((len(self.injections), node, handle, f.step))
        return pid, handle

    def _stage_pid(self, key: ShardKey) -> int:
        return stage_pid(self.t.group, key, PID_S)

    def _strike(self, f: Fault) -> Injection:
        from elastic_llm.runtime.drains import request_drain

        key = ShardKey(f.stage, 0)
        node = self.t.group.nodes[key]
        if f.kind is FaultKind.STAGE:
            pid = self._stage_pid(key)
            os.kill(pid, signal.SIGKILL)
            return Injection(f, f"stage {f.stage} (pid {pid}, node {node[:8]})", node)
        if f.kind is FaultKind.PAUSE:
            pid = self._stage_pid(key)
            os.kill(pid, signal.SIGSTOP)
            self.paused[pid] = time.monotonic() + self.soak.options.pause_s
            return Injection(f, f"stage {f.stage} (pid {pid}, node {node[:8]}) stopped for {self.soak.options.pause_s:g} s", node)
        if f.kind is FaultKind.MANAGER:
            pid, _ = self._kill_manager(f, node)
            return Injection(f, f"snapshot manager of node {node[:8]} (pid {pid}), stage {f.stage}'s node", node)
        if f.kind is FaultKind.FLUSH:
            flush = self.t.durable.flushing() if self.t.durable is not None else None
            writing = flush[1] if flush is not None else []
            node = node if node in writing or not writing else writing[0]
            if flush is None:
                what = "no durable flush in flight"
            else:
                what = f"durable flush of step {flush[0]} ({flush[2]} of {len(writing)} nodes' parts still being written)"
            pid, _ = self._kill_manager(f, node)
            return Injection(f, f"snapshot manager of node {node[:8]} (pid {pid}) during the {what}", node)
        if f.kind is FaultKind.NODE:
            self.soak.live.replace_node(node)
            return Injection(f, f"node {node[:8]} (stage {f.stage}), replaced by a fresh node", node)
        if f.kind is FaultKind.DRAIN:
            request_drain(node, self.soak.options.drain_deadline_s, f"chaos soak: drain of stage {f.stage}'s node")
            self.drained = node
            return Injection(f, f"node {node[:8]} (stage {f.stage}) drained, deadline {self.soak.options.drain_deadline_s:g} s", node)
        raise AssertionError(f"{f.kind} is struck by the chaos hook")

    def _resume(self, now: float, every: bool = False) -> None:
        self.paused = resume_paused(self.paused, now, every)

    def finish(self) -> None:
        """After the run: no process left stopped, a drained node replaced, killed managers
        checked for a successor holding a newer committed version."""
        self._resume(0.0, every=True)
        if self.drained is not None:
            self.soak.live.replace_node(self.drained)
            self.drained = None
        self.judge_managers()

    def judge_managers(self) -> None:
        """Each killed manager: did a successor on its node hold a newer committed version?"""
        snaps = self.t.snapshots
        committed = snaps.committed.version if snaps is not None and snaps.committed is not None else -1
        for i, node, old, step in self.managers:
            new = snaps.managers.get(node) if snaps is not None else None
            replaced = (new is not None and new is not old and committed > step) or (new is None and committed > step)
            self.injections[i] = replace(self.injections[i], manager_replaced=replaced)


@dataclass
class _Grow:
    """A resize fault waiting: first for the run to shrink (after ``step``; ``resizes`` resize
    lines were written before its primer), then for the grow that follows a fresh node."""

    fault: Fault
    step: int
    resizes: int
    shrunk: bool = False
    primed: bool = True  # its primer removed a node (else it came while an earlier shrink was growing back)


class SoakAborted(RuntimeError):
    """A hung run that could not be ended: the soak stops with the trials run so far."""

    def __init__(self, why: str, run: TrialRun) -> None:
        super().__init__(why)
        self.run = run


class Soak:
    """A soak: ``Soak(load, plans, options).run(out_dir) -> report``; ``load(extra)`` builds the
    run config with ``extra`` overrides (the trials' chaos events) appended."""

    def __init__(self, load: Callable[[list[str]], RunConfig], plans: list[TrialPlan], options: SoakOptions, cluster: Any = None,
                 driver_argv: list[str] | None = None) -> None:
        self.load, self.plans, self.options = load, plans, options
        self.driver_argv = driver_argv  # ``elastic-llm train`` arguments (--config, --set ...) of the same run: driver trials
        self.steps = 0  # the reference's steps (driver trials train as many)
        self.given = cluster  # a test's cluster, kept; else one is started and shut down here
        self.nodes: SoakCluster | None = None

    @property
    def live(self) -> SoakCluster:
        assert self.nodes is not None, "the soak's cluster starts with run()"
        return self.nodes

    @property
    def cluster(self) -> Any:
        return self.live.cluster

    # ------------------------------------------------------------------ the runs
    def run(self, out_dir: str | Path) -> dict[str, Any]:
        from elastic_llm.runtime.session import node_store_bytes

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.load([])
        self.nodes = SoakCluster(self.options.workers, self.options.cpus_per_node, node_store_bytes(cfg, self.options.workers), self.given)
        runs: list[TrialRun] = []
        aborted = None
        try:
            log.info("reference run: %d+ steps of %s", self.plans[0].steps if self.plans else 0, cfg.name)
            drains = any(f.kind is FaultKind.DRAIN for p in self.plans for f in p.faults)
            resizes = any(f.moment is Moment.RESIZE for p in self.plans for f in p.faults)
            self.steps = max(p.steps for p in self.plans) + (DRAIN_EXTRA_STEPS if drains else 0) + (2 * RESIZE_STEPS if resizes else 0)
            if any(f.kind is FaultKind.DRIVER for p in self.plans for f in p.faults):
                # driver trials train `--max-steps` steps, which sets train.max_steps (the LR schedule's length): so does the reference
                cfg = self.load([f"train.max_steps={self.steps}"])
            reference = self._reference(cfg, self.steps, out / "reference")
            for plan in self.plans:
                try:
                    self.nodes.top_up()
                except Exception as e:  # noqa: BLE001 - the cluster itself failed: the report keeps the trials run so far
                    aborted = f"before trial {plan.trial} the cluster could not be brought back to {self.options.workers} worker nodes: {type(e).__name__}: {e}"
                    log.error("soak stopped: %s", aborted)
                    break
                try:
                    driver = any(f.kind is FaultKind.DRIVER for f in plan.faults)
                    runs.append((self._driver_trial if driver else self._trial)(plan, out / f"trial-{plan.trial}"))
                except SoakAborted as e:
                    log.error("soak stopped: %s", e)
                    runs.append(e.run)
                    aborted = str(e)
                    break
        finally:
            self.nodes.stop()
        meta = {"config": cfg.name, "seed": self.options.seed, "faults_per_trial": len(self.plans[0].faults),
                "kinds": sorted({f.kind.value for p in self.plans for f in p.faults}), "reference_steps": len(reference),
                "trials_planned": len(self.plans), "aborted": aborted}
        report = build_report(meta, reference, runs)
        write_report(out, report)
        return report

    def _reference(self, cfg: RunConfig, steps: int, out: Path) -> dict[int, float]:
        from elastic_llm.runtime.ray_runtime import ray_trainer

        out.mkdir(parents=True, exist_ok=True)
        t = ray_trainer(cfg, cluster=self.cluster, metrics_out=out / "metrics.jsonl", progress=False)
        try:
            return losses(t.fit(steps))
        finally:
            t.shutdown()

    def _durable_overrides(self, out: Path) -> list[str]:
        if self.load([]).durable.storage_path:
            return []
        return [f"durable.storage_path={out / 'durable'}", f"durable.every={DURABLE_EVERY}", f"durable.max_write_mb_s={FLUSH_MB_S:g}"]

    def _driver_trial(self, plan: TrialPlan, out: Path) -> TrialRun:
        if self.driver_argv is None:
            raise ValueError("driver faults need the run's `elastic-llm train` arguments (Soak(driver_argv=...))")
        sets = self._durable_overrides(out)
        return driver_trial(plan, out, self.driver_argv, self.cluster.address, self.steps, self.options.trial_timeout_s, sets, self.load(sets))

    def _trial(self, plan: TrialPlan, out: Path) -> TrialRun:
        from elastic_llm.runtime.ray_runtime import ray_trainer

        out.mkdir(parents=True, exist_ok=True)
        events = hook_events(plan)
        extra = [f"chaos.events=[{', '.join(events)}]"] if events else []
        cfg = self.load(extra + self._durable_overrides(out))  # every trial flushes, so faults can strike a flush
        t0 = time.monotonic()
        t = ray_trainer(cfg, cluster=self.cluster, metrics_out=out / "metrics.jsonl", progress=False)
        trial = _Trial(self, plan, t)
        hung = None
        thread = None
        try:
            t.setup()
            thread = threading.Thread(target=trial.fit, daemon=True, name=f"soak-trial-{plan.trial}")
            thread.start()
            hung = trial.drive(thread, t0 + self.options.trial_timeout_s)
            if hung is not None:
                log.error("trial %d hung: %s", plan.trial, hung)
                trial.close()
                t.request_stop()
                thread.join(STOP_S)
                if thread.is_alive():  # stuck inside Ray: ending the run's actors fails what it waits on
                    t.shutdown()
                    thread.join(STOP_S)
            trial.finish()
        except Exception as e:  # noqa: BLE001 - the harness itself failed: judged as a run that did not finish
            trial.error = trial.error or f"harness: {type(e).__name__}: {e}"
            trial.judge_managers()
            trial.close()
            if thread is not None and thread.is_alive():  # its actors are not ended under a running run
                t.request_stop()
                thread.join(STOP_S)
        finally:
            trial._resume(0.0, every=True)
            if hung is None:
                t.shutdown()
        durable, durable_error = verify_durable(t) if hung is None and trial.error is None else (None, None)
        run = TrialRun(plan, trial.injections, losses(trial.history), list(t.recoveries), list(t.drains), list(t.resizes),
                       time.monotonic() - t0, trial.error, hung, durable, durable_error)
        if thread is not None and thread.is_alive():
            raise SoakAborted(f"trial {plan.trial} hung ({hung}) and its run did not end once its actors were ended; it is in {where(thread)}", run)
        return run
