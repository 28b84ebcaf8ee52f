"""Carry a soak's fault schedule out on a loopback Ray cluster, against real runs.

Owns: the loopback ``ray.cluster_utils.Cluster`` of a soak (a head without CPUs plus
``workers`` nodes), the reference run (undisturbed, same config and seed; trained once and
shared by the trials, whose configs are the same), and each trial's soaked run: it trains in a
thread while this (main) thread strikes each fault from outside the run once the fault's step
finished: SIGKILL of a stage's or a snapshot manager's process, removal of a node (a fresh node
takes its place), a Ray drain (the drained node is removed and replaced once the run has left
it; until its drain line the next fault waits and the run is lengthened by up to
:data:`DRAIN_EXTRA_STEPS`), SIGSTOP then SIGCONT of a stage (a straggler). Corruption goes through the run's own chaos
hook (``kill: smp, corrupt: true`` plus a kill of that stage in the next step), which reaches
the manager's object store. A trial that does not end by its deadline is abandoned and the
cluster replaced.
Never judges anything (report does) and never sends traffic off loopback. Nodes are added and
removed from the main thread, which ``Cluster`` requires; the run's on_step callback waits
while a fault strikes, so the run is between two steps when it is hit, and the snapshots in
flight are waited for first (faults during a snapshot or a recovery are not soaked yet).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from elastic_llm.config import RunConfig, load_config
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.soak.plan import Fault, FaultKind, TrialPlan
from elastic_llm.soak.report import Injection, TrialRun, build_report, write_report

POLL_S = 0.1
STRIKE_S = 60.0  # longest one fault may take to strike
STOP_S = 30.0  # after a trial's deadline, how long its run gets to stop
DRAIN_EXTRA_STEPS = 10  # most steps a run is lengthened while a drain's moves are still under way


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


def losses(history: list[dict[str, Any]]) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history}  # a re-run step keeps its last loss


def corrupt_events(plan: TrialPlan) -> list[str]:
    """The run's chaos events that carry out ``plan``'s corrupt faults: flip a byte of the stage's
    shard in its node's manager, and kill the stage in the same (next) step so that its recovery
    needs that shard. Pure."""
    out = []
    for f in plan.faults:
        if f.kind is FaultKind.CORRUPT:
            hit = f.step + 1
            out += [f"{{step: {hit}, kill: smp, stage: {f.stage}, corrupt: true}}", f"{{step: {hit}, kill: stage, stage: {f.stage}, how: sigkill}}"]
    return out


class _Trial:
    """One soaked run: the run's thread asks, the main thread strikes."""

    def __init__(self, soak: "Soak", plan: TrialPlan, trainer: Any) -> None:
        self.soak, self.plan, self.t = soak, plan, trainer
        self.asks: queue.Queue[tuple[int, threading.Event]] = queue.Queue()
        self.injections: list[Injection] = []
        self.history: list[dict[str, Any]] = []
        self.error: str | None = None
        self.paused: dict[int, float] = {}  # pid -> when to SIGCONT it
        self.drained: str | None = None  # node drained, to be removed once the run has left it
        self.later: dict[int, Fault] = {}  # faults deferred while a drain is under way, by their new step
        self.extra = 0  # steps added to the run while a drain was under way
        self.managers: list[tuple[int, str, Any, int]] = []  # (injection index, node, old handle, step)
        self.doing = "starting"

    # --------------------------------------------------------------- the run's thread
    def fit(self) -> None:
        try:
            self.history = self.t.fit(self.plan.steps, on_step=self.on_step)
        except BaseException as e:  # judged as a failed invariant
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def on_step(self, record: dict[str, Any]) -> None:
        done = threading.Event()
        self.asks.put((record["step"], done))
        done.wait(STRIKE_S)

    # --------------------------------------------------------------- the main thread
    def drive(self, thread: threading.Thread, deadline: float) -> str | None:
        """Serve the run's asks until it ends; what it was doing if ``deadline`` passes first."""
        due = {f.step: f for f in self.plan.faults if f.kind is not FaultKind.CORRUPT}
        corrupt = {f.step: f for f in self.plan.faults if f.kind is FaultKind.CORRUPT}
        while thread.is_alive():
            self._resume(time.monotonic())
            if time.monotonic() > deadline:
                return f"state {self.t.state.name} at step {self.t.step} ({self.doing})"
            try:
                step, done = self.asks.get(timeout=POLL_S)
            except queue.Empty:
                continue
            self.doing = f"training after step {step}"
            try:
                self._between_steps(step, due.pop(step, None), corrupt.pop(step, None))
            finally:
                done.set()
        return None

    def _between_steps(self, step: int, fault: Fault | None, corrupt: Fault | None) -> None:
        if self.drained is not None and any(d.get("node") == self.drained for d in self.t.drains):
            self.soak.replace_node(self.drained)  # the run left it: it goes, a fresh node comes
            self.drained = None
        if self.drained is not None:  # its stages still move (their new actors start): one fault at a time
            self.doing = f"waiting for the stage spares of the drain of node {self.drained[:8]}"
            self._wait_for_spares(time.monotonic() + self.soak.options.drain_deadline_s / 2)
            if fault is not None:
                self.later[step + 1] = replace(fault, step=step + 1)
                fault = None
            if step >= self.t.end - 1 and self.extra < DRAIN_EXTRA_STEPS:  # the run ends after the drain, not during it
                self.t.end += 1
                self.extra += 1
        if step in self.later:
            if fault is not None:  # two due at once: the deferred one waits one more step
                self.later[step + 1] = replace(self.later.pop(step), step=step + 1)
            else:
                fault = self.later.pop(step)
        if (fault is not None or corrupt is not None) and self.t.snapshots is not None:
            self.doing = f"waiting for the snapshots in flight after step {step}"
            self.t.snapshots.poll(block=True)  # faults strike between snapshots, not during one (the run is parked in on_step)
        if corrupt is not None:  # struck by the run's chaos hook in the next step
            key = ShardKey(corrupt.stage, 0)
            self.injections.append(Injection(corrupt, f"stage {corrupt.stage}'s shard on node {self.t.group.nodes[key][:8]} (chaos hook), then the stage killed"))
        if fault is not None:
            self.doing = f"striking {fault}"
            say(f"trial {self.plan.trial}: {fault}")
            try:
                self.injections.append(self._strike(fault))
            except Exception as e:  # reported as a fault without an outcome
                self.injections.append(Injection(fault, f"stage {fault.stage}", error=f"{type(e).__name__}: {e}"))
            self.doing = f"training after {fault}"

    def _wait_for_spares(self, until: float) -> None:
        """Hold the run (parked in on_step) until the actors its drain moves stages to have
        started, as a step of real length would: tiny steps outrun an actor's start."""
        g = self.t.group
        while time.monotonic() < until:
            spares = getattr(g, "stage_spares", None)
            if spares and all(g.stage_spare_ready(sp) for sp in spares.values()):
                return
            time.sleep(POLL_S)

    def _strike(self, f: Fault) -> Injection:
        import ray

        from elastic_llm.controller.drains import request_drain

        key = ShardKey(f.stage, 0)
        node = self.t.group.nodes[key]
        if f.kind is FaultKind.STAGE:
            pid = self.t.group.pids[key]
            os.kill(pid, signal.SIGKILL)
            return Injection(f, f"stage {f.stage} (pid {pid}, node {node[:8]})", node)
        if f.kind is FaultKind.PAUSE:
            pid = self.t.group.pids[key]
            os.kill(pid, signal.SIGSTOP)
            self.paused[pid] = time.monotonic() + self.soak.options.pause_s
            return Injection(f, f"stage {f.stage} (pid {pid}, node {node[:8]}) stopped for {self.soak.options.pause_s:g} s", node)
        if f.kind is FaultKind.MANAGER:
            handle = self.t.snapshots.managers[node]
            pid = ray.get(handle.__ray_call__.remote(_pid), timeout=STRIKE_S)
            os.kill(pid, signal.SIGKILL)
            self.managers.append((len(self.injections), node, handle, f.step))
            return Injection(f, f"snapshot manager of node {node[:8]} (pid {pid}), stage {f.stage}'s node", node)
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
        snaps = self.t.snapshots
        committed = snaps.committed.version if snaps is not None and snaps.committed is not None else -1
        for i, node, old, step in self.managers:
            new = snaps.managers.get(node) if snaps is not None else None
            replaced = (new is not None and new is not old and committed > step) or (new is None and committed > step)
            inj = self.injections[i]
            self.injections[i] = Injection(inj.fault, inj.target, inj.node, inj.error, replaced)


class Soak:
    """A soak: ``Soak(load, plans, options).run(out_dir) -> report``; ``load(extra)`` builds the
    run config with ``extra`` overrides (the trials' chaos events) appended."""

    def __init__(self, load: Callable[[list[str]], RunConfig], plans: list[TrialPlan], options: SoakOptions, cluster: Any = None) -> None:
        self.load, self.plans, self.options = load, plans, options
        self.cluster = cluster  # given: a test's cluster, kept; else started and shut down here
        self.own_cluster = cluster is None

    # ------------------------------------------------------------------ the cluster
    def _start_cluster(self) -> None:
        from elastic_llm.controller.session import loopback_cluster

        self.cluster = loopback_cluster(self.options.workers, self.options.cpus_per_node)

    def top_up(self) -> None:
        """Back to ``workers`` live worker nodes."""
        from elastic_llm.controller.session import add_loopback_node

        while len(self.cluster.worker_nodes) < self.options.workers:
            add_loopback_node(self.cluster, self.options.cpus_per_node)
        self.cluster.wait_for_nodes()

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
        try:
            cfg = self.load([])
            say(f"reference run: {self.plans[0].steps if self.plans else 0}+ steps of {cfg.name}")
            drains = any(f.kind is FaultKind.DRAIN for p in self.plans for f in p.faults)
            reference = self._reference(cfg, max(p.steps for p in self.plans) + (DRAIN_EXTRA_STEPS if drains else 0), out / "reference")
            for plan in self.plans:
                self.top_up()
                runs.append(self._trial(plan, out / f"trial-{plan.trial}"))
        finally:
            if self.own_cluster:
                self._stop_cluster()
        meta = {"config": cfg.name, "seed": self.options.seed, "faults_per_trial": len(self.plans[0].faults),
                "kinds": sorted({f.kind.value for p in self.plans for f in p.faults}), "reference_steps": len(reference)}
        report = build_report(meta, reference, runs)
        write_report(out, report)
        return report

    def _reference(self, cfg: RunConfig, steps: int, out: Path) -> dict[int, float]:
        from elastic_llm.controller import Trainer

        out.mkdir(parents=True, exist_ok=True)
        t = Trainer(cfg, cluster=self.cluster, metrics_out=out / "metrics.jsonl", progress=False)
        try:
            return losses(t.fit(steps))
        finally:
            t.shutdown()

    def _trial(self, plan: TrialPlan, out: Path) -> TrialRun:
        from elastic_llm.controller import Trainer

        out.mkdir(parents=True, exist_ok=True)
        events = corrupt_events(plan)
        cfg = self.load([f"chaos.events=[{', '.join(events)}]"] if events else [])
        t0 = time.monotonic()
        t = Trainer(cfg, cluster=self.cluster, metrics_out=out / "metrics.jsonl", progress=False)
        trial = _Trial(self, plan, t)
        hung = None
        try:
            t.setup()
            thread = threading.Thread(target=trial.fit, daemon=True, name=f"soak-trial-{plan.trial}")
            thread.start()
            hung = trial.drive(thread, t0 + self.options.trial_timeout_s)
            if hung is not None:
                say(f"trial {plan.trial} hung: {hung}")
                t.request_stop()
                thread.join(STOP_S)
            trial.finish()
        except Exception as e:  # the harness itself failed: judged as a run that did not finish
            trial.error = trial.error or f"harness: {type(e).__name__}: {e}"
        finally:
            trial._resume(0.0, every=True)
            if hung is None:
                t.shutdown()
        run = TrialRun(plan, trial.injections, losses(trial.history), list(t.recoveries), list(t.drains), list(t.resizes),
                       time.monotonic() - t0, trial.error, hung)
        if hung is not None and self.own_cluster:  # the run may hold actors anywhere: start afresh
            self._stop_cluster()
            self._start_cluster()
        return run
