"""The run as the cluster sees it: a small ``run-<run id>`` actor that holds the run's status and
recent events, and exports the run's Ray metrics.

Owns: :class:`RunStatus` / :class:`RunEvent` / :class:`RunView` (what ``elastic-llm status``
prints about a run) and :class:`StageState` (what a stage actor says about itself; here, not in
the stage's module, so that ``status`` reads it without importing torch), the :class:`RunMonitor` actor body (named ``run-<run id>``, zero CPUs, on the
driver's node, gone when the driver goes), and :class:`Publisher`, the driver-side end that turns
the trainer's metrics lines into those records and sends them without waiting. (A top-level
module with light imports: the monitor's worker process never imports torch.)
Never decides anything and never slows a step: publishing is one fire-and-forget call per step and
per event, and a monitor that died is simply no longer published to.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Callable, Mapping
from typing import Any

from elastic_llm import events
from elastic_llm.clock import SYSTEM, Clock
from elastic_llm.remote import remote_of
from elastic_llm.snapshot.records import VersionRecord
from elastic_llm.telemetry import Metrics

log = logging.getLogger("elastic_llm.monitor")
KEEP_EVENTS = 20  # recent events a monitor keeps


@dataclass(frozen=True)
class RunStatus:
    run: str
    config: str
    state: str
    step: int
    max_steps: int
    stages: int
    width: int
    loss: float | None = None
    tokens_per_s: float | None = None
    committed_version: int | None = None  # newest committed in-memory snapshot (None: none, or snapshots off)
    erasure_groups: int = 0
    erasure_groups_protected: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class RunEvent:
    """Something that happened to the run: ``kind`` is recovery, resize, drain, reprotect, link_cut, straggler, warning, capacity, state,
    failed or end; ``text`` says it in one line."""

    kind: str
    step: int
    time: float
    text: str
    source: str = ""  # recovery: where the restored state came from
    seconds: float = 0.0  # recovery, resize, drain: how long it took; capacity: seconds waited


@dataclass(frozen=True)
class RunView:
    status: RunStatus
    events: tuple[RunEvent, ...]  # oldest first, at most KEEP_EVENTS
    started: float


@dataclass(frozen=True)
class StageState:
    """What a stage actor is doing now (``state()``; ``elastic-llm status`` shows it)."""

    run: str
    stage: int
    stages: int
    replica: int
    width: int
    role: str  # the part of the model it holds, e.g. "embed+L0-1", "L2-3+head"
    node_id: str | None
    pid: int
    step: int  # completed optimizer steps
    snapshot_version: int | None  # newest step copied for a snapshot (None: none yet)
    copy_in_flight: bool  # a snapshot copy is still being written
    bytes_held: int  # state arena + snapshot copy buffers


def protected_groups(record: VersionRecord | None, alive: set[str] | frozenset[str]) -> tuple[int, int]:
    """(groups, groups with every member node alive) of a committed version. Pure."""
    if record is None:
        return 0, 0
    return len(record.groups), sum(1 for g in record.placed if all(n in alive for n in g))


def event_of(record: Mapping[str, Any]) -> RunEvent | None:
    """The event a metrics line reports (None: a step line, or nothing ``status`` shows). Pure."""
    ev = events.parse(record)
    if ev is None:
        return None
    step, t = int(getattr(ev, "step", None) or 0), float(ev.time or 0.0)
    if isinstance(ev, events.Recovery):
        where = "nothing lost" if ev.stage is None else f"stage {ev.stage} replica {ev.replica}"
        text = f"{where} from {ev.source}, rolled back {ev.rollback_steps or 0} steps"
        return RunEvent("recovery", step, t, text, str(ev.source), float(ev.seconds or 0.0))
    if isinstance(ev, events.Resize):
        return RunEvent("resize", step, t, f"width {ev.from_dp} -> {ev.to_dp} ({ev.reason})", seconds=float(ev.seconds or 0.0))
    if isinstance(ev, events.Drain):
        left = ev.deadline_s
        text = f"node {str(ev.node)[:12]} draining ({'no deadline' if left is None else f'{left:.0f} s left'}): {ev.moved} actors moved"
        return RunEvent("drain", step, t, text, seconds=float(ev.seconds or 0.0))
    if isinstance(ev, events.Reprotect):
        nodes = ", ".join(n[:12] for n in ev.nodes)
        text = (f"snapshot {ev.version} at risk: parts on draining nodes {nodes} have no live node to go to" if ev.how == "stranded" else
                f"snapshot {ev.version} re-protected against {nodes} by {'re-homing their parts' if ev.how == 'rehome' else 'a new version'}"
                if ev.in_time else f"nodes {nodes} went before snapshot {ev.version} was re-protected")
        return RunEvent("reprotect", step, t, text, ev.how, seconds=float(ev.seconds or 0.0))
    if isinstance(ev, events.LinkCut):
        return RunEvent("link_cut", step, t, f"node {ev.set_aside[:12]} set aside for {ev.for_s:.0f} s: cut from {len(ev.pairs)} peer(s)", seconds=float(ev.for_s))
    if isinstance(ev, events.Straggler):
        text = f"node {ev.node[:12]} is a straggler: its links at {ev.node_mb_s:.1f} MB/s (fastest {ev.fastest_mb_s:.1f}) cost {ev.share:.0%} of a step; moved off"
        return RunEvent("straggler", step, t, text, seconds=float(ev.for_s))
    if isinstance(ev, events.RunWarning):
        return RunEvent("warning", step, t, str(ev.message), str(ev.what))
    if isinstance(ev, events.StateChange):
        return RunEvent("state", step, t, f"{ev.old} -> {ev.new}" + (f": {ev.reason}" if ev.reason else ""))
    if isinstance(ev, events.Failed):
        return RunEvent("failed", step, t, str(ev.reason).splitlines()[0] if ev.reason else "failed")
    if isinstance(ev, events.End):
        return RunEvent("end", step, t, f"finished at step {step}")
    return None


class RunMonitor:
    """Body of the ``run-<run id>`` actor."""

    def __init__(self, status: RunStatus) -> None:
        self.status = status
        self.events: list[RunEvent] = []
        self.started = time.time()
        self.metrics = Metrics()
        self._publish_metrics()

    def __repr__(self) -> str:  # Ray's display name of the actor
        return f"Run({self.status.run}, {self.status.config}, {self.status.stages} stages x {self.status.width})"

    def publish(self, status: RunStatus) -> None:
        self.status = status
        self._publish_metrics()

    def record(self, event: RunEvent) -> None:
        run = self.status.run
        if event.kind == "capacity":  # counted, not kept: ticks would push recoveries out
            self.metrics.inc("capacity_wait_seconds", event.seconds, run=run)
            return
        self.events = [*self.events, event][-KEEP_EVENTS:]
        if event.kind == "recovery":
            self.metrics.inc("recoveries", run=run, source=event.source)
        elif event.kind == "resize":
            self.metrics.inc("resizes", run=run)
        elif event.kind == "drain":
            self.metrics.inc("drains", run=run)

    def stop(self) -> None:
        """End this actor (the run ended: its driver calls this)."""
        import ray

        ray.actor.exit_actor()

    def state(self) -> RunView:
        return RunView(self.status, tuple(self.events), self.started)

    def _publish_metrics(self) -> None:
        s, m = self.status, self.metrics
        m.set("step", s.step, run=s.run)
        m.set("width", s.width, run=s.run)
        if s.loss is not None:
            m.set("loss", s.loss, run=s.run)
        if s.tokens_per_s is not None:
            m.set("tokens_per_s", s.tokens_per_s, run=s.run)
        if s.committed_version is not None:
            m.set("snapshot_committed_version", s.committed_version, run=s.run)
            m.set("snapshot_lag_steps", max(0, s.step - s.committed_version), run=s.run)
        m.set("erasure_groups", s.erasure_groups, run=s.run)
        m.set("erasure_groups_protected", s.erasure_groups_protected, run=s.run)


@dataclass(frozen=True)
class RunFacts:
    """What the publisher reads of the run when a metrics line is written (the trainer makes it:
    the publisher never reaches into the trainer)."""

    status: RunStatus  # where the run is (the publisher adds the snapshot fields, loss and speed)
    committed: VersionRecord | None  # the newest committed in-memory snapshot version
    managers: frozenset[str]  # nodes whose snapshot manager lives


class Publisher:
    """The trainer's side: reads the run's facts (``facts()``) when a metrics line is written and
    sends the monitor what changed. Attach :meth:`on_record` to the trainer's :class:`MetricsWriter`."""

    def __init__(self, facts: Callable[[], RunFacts], start: Callable[[RunStatus], Any], clock: Clock = SYSTEM) -> None:
        """``start``: makes the monitor from the run's first status (the runtime's: a Ray actor
        named ``run-<id>`` (:func:`start_monitor`), or a simulation's); ``clock``: where the
        feed's times come from."""
        self.facts = facts
        self.clock = clock
        self.last: RunStatus | None = None
        self.waiting_since: float | None = None  # monotonic time up to which the current wait for capacity is counted
        self.errors = 0  # lines the feed could not send (the monitor is a view: training goes on)
        self.actor = start(self.status())

    def status(self, **changes: Any) -> RunStatus:
        f = self.facts()
        record = f.committed
        groups, protected = protected_groups(record, set(f.managers))
        base = replace(
            f.status, committed_version=record.version if record is not None else None,
            erasure_groups=groups, erasure_groups_protected=protected, time=self.clock.time(),
        )
        if self.last is not None:  # keep the last step's loss and speed between steps
            base = replace(base, loss=self.last.loss, tokens_per_s=self.last.tokens_per_s)
        return replace(base, **changes)

    def on_record(self, record: Mapping[str, Any]) -> None:
        try:
            self._feed(record)
        except Exception as e:  # noqa: BLE001 - the monitor is a view: never let it stop training; the first failure is said
            if self.errors == 0:
                log.warning("the run's monitor feed failed (%s: %s); training goes on", type(e).__name__, e)
            self.errors += 1

    def _feed(self, record: Mapping[str, Any]) -> None:
        typed = events.parse(record)
        if typed is None:
            if "event" not in record:  # a step line
                self._send(self.status(loss=record.get("loss"), tokens_per_s=record.get("tokens_per_s")))
            return
        if isinstance(typed, (events.WaitingForCapacity, events.StateChange)) and self.waiting_since is not None:
            now = self.clock.monotonic()  # count the seconds waited as they pass, and when the wait ends
            self.actor.record.remote(RunEvent("capacity", int(typed.step or 0), self.clock.time(), "", seconds=now - self.waiting_since))
            self.waiting_since = now
        if isinstance(typed, events.StateChange):
            self.waiting_since = self.clock.monotonic() if typed.new == "waiting_for_capacity" else None
        ev = event_of(record)
        if ev is not None:
            self.actor.record.remote(ev)
            self._send(self.status())

    def _send(self, status: RunStatus) -> None:
        self.last = status
        self.actor.publish.remote(status)

    def close(self) -> None:
        """The monitor ends itself (its name is free again)."""
        self.actor.stop.remote()


def start_monitor(namespace: str, status: RunStatus) -> Any:
    """The ``run-<id>`` actor on this (the driver's) node, holding ``status`` first."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return remote_of(RunMonitor).options(
        name=f"run-{status.run}",
        namespace=namespace,
        num_cpus=0,
        max_concurrency=4,  # state() answers while a publish is queued
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
    ).remote(status)
