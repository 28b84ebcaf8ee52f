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

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from elastic_llm import events
from elastic_llm.config import RunConfig
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.controller.states import Recovering, Resizing
from elastic_llm.soak.plan import Fault, FaultKind, Moment, TrialPlan, hooked
from elastic_llm.soak.report import Injection, TrialRun, build_report, write_report

POLL_S = 0.1
PID_S = 2.0  # how long a stage actor gets to tell its pid before the recorded one is checked instead
STRIKE_S = 60.0  # longest one fault may take to strike
JOIN_S = 180.0  # a fresh node's raylet on a loaded 2-core machine can take over Ray's default 30 s to join
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


def say(line: str) -> None:
    print(f"[chaos] {line}", file=sys.stderr, flush=True)


def _pid(actor_self: Any) -> int:  # runs inside an actor (``__ray_call__``)
    return os.getpid()


def where(thread: threading.Thread, frames: int = 6) -> str:
    """The innermost ``frames`` frames of ``thread``'s stack, one line each: a hang's diagnosis."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "its thread has ended"
    stack = traceback.extract_stack(frame)[-frames:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack))


def verify_durable(t: Any) -> tuple[str | None, str | None]:
    """A finished run's newest durable checkpoint (see :func:`check_checkpoint`), which must also
    be of the run's newest committed step; (None, None) for a run without a durable tier."""
    if t.durable is None:
        return None, None
    latest = t.durable.latest()
    if latest is None:
        return None, "the run committed no durable checkpoint"
    step, name = latest
    committed = t.snapshots.committed.version if t.snapshots is not None and t.snapshots.committed is not None else None
    if committed is not None and step != committed:
        return None, f"the newest durable checkpoint is of step {step}, the newest committed snapshot of step {committed}"
    return check_checkpoint(t.durable.run, name)


def check_checkpoint(run: Any, name: str) -> tuple[str | None, str | None]:
    """Checkpoint ``name`` of run directory ``run`` read back (every tensor against its checksum),
    and a copy of it with one byte flipped refused: (what verified, None) or (None, why not)."""
    from elastic_llm.durable.format import Checkpoint

    try:
        summary = Checkpoint(run, name).verify()
    except Exception as e:
        return None, f"{name} does not verify: {type(e).__name__}: {e}"
    missed = flip_is_missed(run, name)
    if missed is not None:
        return None, missed
    return f"{name}: {summary['tensors']} tensors, {summary['bytes']} bytes; a byte flipped in a copy of it was detected", None


def flip_is_missed(run: Any, name: str) -> str | None:
    """Copy checkpoint ``name`` of a local run directory, flip one byte in the middle of its
    largest file, and verify the copy: None when the flip is refused with a DurableError, else
    what happened (object stores are not copied: None)."""
    import shutil
    import tempfile

    from elastic_llm.durable.format import Checkpoint, DurableError
    from elastic_llm.durable.storage import Storage

    src = Path(run.root) / name
    if "://" in run.uri and not run.uri.startswith("file://") or not src.is_dir():
        return None
    with tempfile.TemporaryDirectory(prefix="soak-flip-") as tmp:
        shutil.copytree(src, Path(tmp) / name)
        victim = max((f for f in (Path(tmp) / name).iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        try:
            Checkpoint(Storage(tmp), name).verify()
        except DurableError:
            return None
        except Exception as e:
            return f"a flipped byte in {victim.name} of a copy of {name} ended in {type(e).__name__}: {e} instead of a clear DurableError"
        return f"a flipped byte in {victim.name} of a copy of {name} was not detected"


def verify_durable_dir(cfg: RunConfig) -> tuple[str | None, str | None]:
    """The newest committed checkpoint in ``cfg``'s durable run directory (see :func:`check_checkpoint`)."""
    from elastic_llm.durable.format import newest_committed
    from elastic_llm.durable.tier import run_storage

    run = run_storage(cfg)
    newest = newest_committed(run)
    if newest is None:
        return None, "the run committed no durable checkpoint"
    return check_checkpoint(run, newest.name)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """A metrics file's complete lines (one being written is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def losses(history: list[dict[str, Any]]) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history}  # a re-run step keeps its last loss


def hook_events(plan: TrialPlan) -> list[str]:
    """The run's chaos events that carry out ``plan``'s faults struck from inside a step (pure):
    a corrupt fault flips a byte of the stage's shard in its node's manager and kills the stage in
    the same (next) step, so that its recovery needs that shard; a stage fault aimed at an op
    kills the stage as it starts its first op of that kind in the next step."""
    out = []
    for f in plan.faults:
        hit = f.step + 1
        if f.kind is FaultKind.CORRUPT:
            out += [f"{{step: {hit}, kill: smp, stage: {f.stage}, corrupt: true}}", f"{{step: {hit}, kill: stage, stage: {f.stage}, how: sigkill}}"]
        elif hooked(f):
            out.append(f"{{step: {hit}, kill: stage, stage: {f.stage}, how: sigkill, op: {f.moment.value}}}")
    return out


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
        done.wait(STRIKE_S)

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
            try:
                self._between_steps(step, due.pop(step, None), inside.pop(step, None))
                if self.pending is not None or self.later or any(s > step for s in due):
                    self._lengthen(step)
            finally:
                done.set()
            if self.in_recovery is not None:  # the run is released: strike once it is recovering
                fault, self.in_recovery = self.in_recovery, None
                self._strike_in_recovery(fault, min(deadline, time.monotonic() + STRIKE_S))
        return None

    def _lengthen(self, step: int) -> None:
        """Faults still to strike at the run's last step: one more step (at most DRAIN_EXTRA_STEPS,
        or RESIZE_STEPS more while a resize fault waits)."""
        cap = DRAIN_EXTRA_STEPS + (2 * RESIZE_STEPS if self.growing is not None else 0)
        if step >= self.t.end - 1 and self.extra < cap:
            self.t.end += 1
            self.extra += 1

    def _between_steps(self, step: int, fault: Fault | None, inside: Fault | None) -> None:
        if self.drained is not None and any(d.get("node") == self.drained for d in self.t.drains):
            self.soak.replace_node(self.drained)  # the run left it: it goes, a fresh node comes
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
        say(f"trial {self.plan.trial}: {inside} (chaos hook)")
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
        say(f"trial {self.plan.trial}: resize primer: node {victim[:8]} of replica {last} removed, no fresh node yet")
        self.soak.cluster.remove_node(next(n for n in self.soak.cluster.worker_nodes if n.node_id == victim), allow_graceful=False)
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
            self.soak.top_up()
            w.step, w.shrunk = step, True
            return
        hi = self.t.cfg.elastic.bounds(self.t.cfg.parallel.dp)[1]
        if not w.primed and g.width >= hi and not g.spares and step < w.step + RESIZE_STEPS:
            self.growing = None  # the earlier shrink grew back before this fault's turn: shrink the run again
            self._shrink_first(w.fault, step)
            return
        if g.spares or isinstance(self.t.state, Resizing):
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
        is in flight: started, not yet committed)."""
        import ray

        if moment is Moment.SNAPSHOT:
            snaps = self.t.snapshots
            refs = [r for p in (snaps.inflight if snaps is not None else []) for node, r in p.refs.items() if node not in p.results]
        else:  # a flush started and not yet committed by the driver (its parts may all be written)
            return self.t.durable is not None and self.t.durable.inflight is not None
        if not refs:
            return False
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) < len(refs)

    def _inject(self, fault: Fault, moment: Moment, primer: bool = False) -> None:
        self.doing = f"striking {fault}"
        say(f"trial {self.plan.trial}: {fault}" + (f" (struck at a {moment.value})" if moment is not fault.moment else ""))
        try:
            inj = self._strike(fault)
        except Exception as e:  # reported as a fault without an outcome
            inj = Injection(fault, f"stage {fault.stage}", error=f"{type(e).__name__}: {e}")
        self.injections.append(replace(inj, moment=moment, primer=primer))
        self.doing = f"training after {fault}"

    def _strike_in_recovery(self, fault: Fault, until: float) -> None:
        """Strike ``fault`` while the run recovers from the stage just killed (between steps if
        its recovery ended before this saw it)."""
        while time.monotonic() < until and not isinstance(self.t.state, Recovering):
            time.sleep(0.005)
        self._inject(fault, Moment.RECOVERY if isinstance(self.t.state, Recovering) else Moment.STEP)

    def _wait_for_spares(self, until: float) -> None:
        """Hold the run (parked in on_step) until the actors its drain moves stages to have
        started, as a step of real length would: tiny steps outrun an actor's start."""
        g = self.t.group
        while time.monotonic() < until:
            spares = getattr(g, "stage_spares", None)
            if spares and all(g.stage_spare_ready(sp) for sp in spares.values()):
                return
            time.sleep(POLL_S)

    def _manager_pid(self, node: str) -> int | None:
        """The process of the run's snapshot manager on ``node`` (None: there is none, or it is
        dead: a killed manager the run has not replaced yet)."""
        import ray

        handle = self.t.snapshots.managers.get(node) if self.t.snapshots is not None else None
        if handle is None:
            return None
        try:
            return int(ray.get(handle.__ray_call__.remote(_pid), timeout=STRIKE_S))
        except ray.exceptions.RayActorError:
            return None

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
        """The process of stage ``key``'s actor now: asked of the actor itself, else the recorded
        pid if that process is still a stage actor's. A recorded pid can be stale (its actor died
        and the number went to another process: once a raylet, whose SIGKILL took a whole node)."""
        import ray

        try:
            return int(ray.get(self.t.group.actor(key).__ray_call__.remote(_pid), timeout=PID_S))
        except Exception:  # noqa: BLE001 - busy or gone: the recorded pid, if it still is a stage actor's
            pid = self.t.group.pids[key]
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            title = b""
        if not title.startswith(b"ray::StageWorker"):
            raise RuntimeError(f"stage {key.stage}'s actor did not answer and its recorded pid {pid} is no longer a stage actor's process ({title[:40]!r})")
        return pid

    def _strike(self, f: Fault) -> Injection:
        import ray

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
            flush = self.t.durable.inflight if self.t.durable is not None else None
            writing = sorted({n for n, _ in flush.refs.values()}) if flush is not None else []
            node = node if node in writing or not writing else writing[0]
            if flush is None:
                what = "no durable flush in flight"
            else:
                ready, _ = ray.wait(list(flush.refs), num_returns=len(flush.refs), timeout=0)
                what = f"durable flush of step {flush.record.version} ({len(flush.refs) - len(ready)} of {len(flush.refs)} parts still being written)"
            pid, _ = self._kill_manager(f, node)
            return Injection(f, f"snapshot manager of node {node[:8]} (pid {pid}) during the {what}", node)
        if f.kind is FaultKind.NODE:
            self.soak.replace_node(node)
            return Injection(f, f"node {node[:8]} (stage {f.stage}), replaced by a fresh node", node)
        if f.kind is FaultKind.DRAIN:
            request_drain(node, self.soak.options.drain_deadline_s, f"chaos soak: drain of stage {f.stage}'s node")
            self.drained = node
            return Injection(f, f"node {node[:8]} (stage {f.stage}) drained, deadline {self.soak.options.drain_deadline_s:g} s", node)
        raise AssertionError(f"{f.kind} is struck by the chaos hook")

    def _resume(self, now: float, every: bool = False) -> None:
        for pid, at in list(self.paused.items()):
            if every or now >= at:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                del self.paused[pid]

    def finish(self) -> None:
        """After the run: no process left stopped, a drained node replaced, killed managers
        checked for a successor holding a newer committed version."""
        self._resume(0.0, every=True)
        if self.drained is not None:
            self.soak.replace_node(self.drained)
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
        self.cluster = cluster  # given: a test's cluster, kept; else started and shut down here
        self.own_cluster = cluster is None

    # ------------------------------------------------------------------ the cluster
    def _start_cluster(self) -> None:
        from elastic_llm.runtime.session import loopback_cluster

        self.cluster = loopback_cluster(self.options.workers, self.options.cpus_per_node)

    def top_up(self) -> None:
        """Back to ``workers`` live worker nodes. A fresh node that has not joined within
        :data:`JOIN_S` is given up and another one started in its place, once."""
        from elastic_llm.runtime.session import add_loopback_node

        for attempt in range(2):
            self._forget_dead_nodes()  # also those that never joined: Ray does not list them alive
            while len(self.cluster.worker_nodes) < self.options.workers:
                add_loopback_node(self.cluster, self.options.cpus_per_node)
            try:
                self.cluster.wait_for_nodes(timeout=JOIN_S)
                return
            except TimeoutError:
                if attempt:
                    raise
                say(f"a fresh node did not join within {JOIN_S:.0f} s: started another in its place")

    def _forget_dead_nodes(self) -> None:
        """Worker nodes the cluster lists that Ray does not know alive (one the run's node watch
        declared dead, say, or one that never joined) are removed from it: its count of nodes must
        match Ray's."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for node in [n for n in self.cluster.worker_nodes if n.node_id not in alive]:
            say(f"node {node.node_id[:8]} is not alive in Ray (died outside the harness, or never joined): removed from the cluster's list")
            self.cluster.remove_node(node, allow_graceful=False)

    def replace_node(self, node_id: str) -> None:
        """Remove ``node_id`` at once (no grace) and add a fresh node in its place."""
        victim = next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)
        if victim is None:
            raise RuntimeError(f"node {node_id[:12]} is not a worker node of the soak's cluster")
        self.cluster.remove_node(victim, allow_graceful=False)
        self.top_up()

    def _stop_cluster(self) -> None:
        import ray

        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        self.cluster = None

    # ------------------------------------------------------------------ the runs
    def run(self, out_dir: str | Path) -> dict[str, Any]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.cluster is None:
            self._start_cluster()
        runs: list[TrialRun] = []
        aborted = None
        try:
            cfg = self.load([])
            say(f"reference run: {self.plans[0].steps if self.plans else 0}+ steps of {cfg.name}")
            drains = any(f.kind is FaultKind.DRAIN for p in self.plans for f in p.faults)
            resizes = any(f.moment is Moment.RESIZE for p in self.plans for f in p.faults)
            self.steps = max(p.steps for p in self.plans) + (DRAIN_EXTRA_STEPS if drains else 0) + (2 * RESIZE_STEPS if resizes else 0)
            if any(f.kind is FaultKind.DRIVER for p in self.plans for f in p.faults):
                # driver trials train `--max-steps` steps, which sets train.max_steps (the LR schedule's length): so does the reference
                cfg = self.load([f"train.max_steps={self.steps}"])
            reference = self._reference(cfg, self.steps, out / "reference")
            for plan in self.plans:
                try:
                    self.top_up()
                except Exception as e:  # the cluster itself failed: the report keeps the trials run so far
                    aborted = f"before trial {plan.trial} the cluster could not be brought back to {self.options.workers} worker nodes: {type(e).__name__}: {e}"
                    say(f"soak stopped: {aborted}")
                    break
                try:
                    driver = any(f.kind is FaultKind.DRIVER for f in plan.faults)
                    runs.append((self._driver_trial if driver else self._trial)(plan, out / f"trial-{plan.trial}"))
                except SoakAborted as e:
                    say(f"soak stopped: {e}")
                    runs.append(e.run)
                    aborted = str(e)
                    break
        finally:
            if self.own_cluster:
                self._stop_cluster()
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
        """A run whose driver is an ``elastic-llm train`` process: SIGKILLed once its metrics
        show each fault's step, and each time ``elastic-llm train --resume RUN_ID`` started in
        its place (its first step timed from its start); the last one trains to the end."""
        from elastic_llm.runtime.failover import published_committed

        if self.driver_argv is None:
            raise ValueError("driver faults need the run's `elastic-llm train` arguments (Soak(driver_argv=...))")
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        sets = [a for o in ["recovery.driver_grace_s=120", *self._durable_overrides(out)] for a in ("--set", o)]
        base = [sys.executable, "-m", "elastic_llm.cli", "train", *self.driver_argv, *sets, "--address", self.cluster.address,
                "--max-steps", str(self.steps), "--no-progress"]  # the reference's length and LR schedule
        injections: list[Injection] = []
        failovers: list[dict[str, Any]] = []
        segments: list[Path] = []
        run_id = error = hung = None
        deadline = t0 + self.options.trial_timeout_s
        for k in range(len(plan.faults) + 1):
            seg = out / f"metrics-{k}.jsonl"
            segments.append(seg)
            argv = [*base, "--metrics-out", str(seg), *(["--resume", run_id] if run_id else [])]
            started = time.monotonic()
            with open(out / f"driver-{k}.log", "w") as log:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
                fault = plan.faults[k] if k < len(plan.faults) else None
                first = None
                while proc.poll() is None and time.monotonic() < deadline:
                    lines = _jsonl(seg)
                    steps = [x["step"] for x in lines if "loss" in x]
                    if steps and first is None:
                        first = time.monotonic() - started
                    if run_id is None:
                        run_id = next((ev.run_id for ev in map(events.parse, lines) if isinstance(ev, events.Start)), None)
                    # struck once past its step with a snapshot committed (before the first one a
                    # driver's death is beyond what memory can bring back: the durable tier's case)
                    if fault is not None and steps and max(steps) >= fault.step and run_id and published_committed(run_id) is not None:
                        break
                    time.sleep(POLL_S / 2)
                if proc.poll() is None and time.monotonic() >= deadline:
                    proc.kill()
                    hung = f"driver {k} not done by the trial's deadline"
                    proc.wait()
                    break
                if k > 0:
                    back = [ev for ev in map(events.parse, _jsonl(seg)) if isinstance(ev, events.Reattach)]
                    failovers[-1].update(source="memory" if back else "durable", step=back[0].step if back else None,
                                         seconds=round(first, 3) if first is not None else None)
                if fault is None or proc.poll() is not None:  # the last driver, or one that ended before its fault
                    code = proc.wait()
                    if code != 0:
                        error = f"driver {k} exited {code}: {(out / f'driver-{k}.log').read_text()[-400:].strip()}"
                    break
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            rec = published_committed(run_id) if run_id else None
            committed = rec.version if rec is not None else None
            trained = max([x["step"] for x in _jsonl(seg) if "loss" in x], default=0)
            say(f"trial {plan.trial}: {fault} (driver pid {proc.pid} at step {trained}, committed {committed})")
            injections.append(Injection(fault, f"driver pid {proc.pid} (run {run_id}) in step {trained + 1}, step {committed} committed"))
            failovers.append({"fault_step": fault.step, "committed": committed})
        history: dict[int, float] = {}
        for seg in segments:  # a re-run step keeps its last loss
            history.update({x["step"]: x["loss"] for x in _jsonl(seg) if "loss" in x})
        durable, durable_error = None, None
        if error is None and hung is None:
            durable, durable_error = verify_durable_dir(self.load(self._durable_overrides(out)))
        return TrialRun(plan, injections, history, seconds=time.monotonic() - t0, error=error, hung=hung,
                        durable=durable, durable_error=durable_error, failovers=failovers)

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
                say(f"trial {plan.trial} hung: {hung}")
                trial.close()
                t.request_stop()
                thread.join(STOP_S)
                if thread.is_alive():  # stuck inside Ray: ending the run's actors fails what it waits on
                    t.shutdown()
                    thread.join(STOP_S)
            trial.finish()
        except Exception as e:  # the harness itself failed: judged as a run that did not finish
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
