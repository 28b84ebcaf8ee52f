"""Starting a run on its runtime: the parts it is made of, and where its first step comes from.

Owns: assembling a run's parts on the ports of its :class:`~elastic_llm.controller.ports.Runtime`
(:func:`open_parts`: the run's monitor feed, its snapshot coordinator and managers, the durable
tier, the stage actors and warm standbys, the checkpointing baseline, and the recovery and
elastic executors, in that order: managers before any stage, so a stage's first snapshot has a
home), and the two ways a run starts from earlier state: ``--resume RUN_ID`` (:func:`reattach`:
a dead driver's newest committed in-memory snapshot, read through its surviving managers, shards
on lost nodes rebuilt from parity; without one, its newest durable checkpoint) and
``--resume CHECKPOINT`` (:func:`resume_durable`: every stage reads its layers from a durable
checkpoint of any width or stage count). The same code runs on Ray and in a simulation.
Never runs a step and never decides a recovery.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from elastic_llm import events
from elastic_llm.config import ConfigError, RunConfig
from elastic_llm.controller.checkpoints import CheckpointExecutor
from elastic_llm.controller.elastic import ElasticExecutor
from elastic_llm.controller.links import LinkGuard
from elastic_llm.controller.metrics import MetricsWriter
from elastic_llm.controller.ports import DurableTier, Keepalive, ResumeError, Roster, RunRegistry, Runtime, StageActors, Standbys, Superseded, is_run_id
from elastic_llm.controller.recovery import ModeOptions, RecoveryExecutor
from elastic_llm.data import RunData, open_run_data
from elastic_llm.durable.format import Checkpoint, open_checkpoint
from elastic_llm.durable.restore import check_fits
from elastic_llm.durable.tier import run_storage
from elastic_llm.monitor import Publisher, RunFacts
from elastic_llm.policies import named
from elastic_llm.recovery.policy import SourceLost, UnrecoverableError
from elastic_llm.snapshot.coordinator import SnapshotCoordinator
from elastic_llm.snapshot.groups import check_parity_fits
from elastic_llm.snapshot.records import ShardKey, StageSource, VersionRecord
from elastic_llm.sources import Mode
from elastic_llm.spans import Spans
from elastic_llm.stream import StreamPosition

log = logging.getLogger("elastic_llm.controller")


@dataclass
class RunParts:
    """What a started run is made of (see :func:`open_parts`)."""

    group: StageActors
    standbys: Standbys | None
    snapshots: SnapshotCoordinator | None
    durable: DurableTier | None
    checkpoints: CheckpointExecutor | None
    recovery: RecoveryExecutor
    elastic: ElasticExecutor
    publisher: Publisher | None
    keepalive: Keepalive | None
    nodes: LinkGuard  # the runtime's nodes, with those the run set aside for a cut link
    roster: Roster | None = None  # --resume RUN_ID: the dead driver's stage actors, until taken over (take_over)
    fence: DriverFence | None = None  # driver failover on: whether a newer driver took the run over
    restart_on_resize: bool = False  # recovery.policy restarts every process from the newest durable checkpoint after a grow (ray-train-elastic)


@dataclass(frozen=True)
class Prepared:
    """What a run checked before anything starts: its data, and what ``--resume`` names."""

    data: RunData
    reattach: str | None  # --resume RUN_ID: a run whose driver died
    checkpoint: Checkpoint | None  # --resume CHECKPOINT


def prepare(cfg: RunConfig, runtime: Runtime, resume: str | None) -> Prepared:
    """Open the run's data and check what ``resume`` names (a checkpoint is read now, JSON only:
    a wrong one is refused before any actor starts) and that ``durable.storage_path`` can be
    written (refused now, not at the first flush)."""
    c = cfg
    data = open_run_data(c.data.dir, c.model.seq_len, c.train.seed, c.model.vocab_size, c.data.val_fraction, c.data.tokenizer, c.data.tokenizer_file)
    reattaching, ck = (resume, None) if resume and is_run_id(resume) else (None, open_checkpoint(resume) if resume else None)
    for warning in check_fits(ck, cfg) if ck is not None else []:
        log.warning(warning)
    if cfg.durable.storage_path:
        if runtime.fleet is None:
            raise ConfigError("durable.storage_path is set but this runtime keeps no snapshot managers to flush from: unset it")
        run_storage(cfg)
    return Prepared(data, reattaching, ck)


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run goes on from: the step, the data position after it, how long it took."""

    step: int
    position: StreamPosition | None
    seconds: float
    kept: int = 0  # stage actors taken over whose state was already the one resumed from (nothing restored)


def open_snapshots(cfg: RunConfig, runtime: Runtime, run_id: str, reattach: bool, spans: Spans) -> SnapshotCoordinator | None:
    """The run's snapshot coordinator and one manager per node (``reattach``: the dead driver's
    managers and committed record are taken over first; this driver's new managers get names of
    their own, the old ones may still hold theirs). None without snapshots."""
    if not cfg.snapshots_on or runtime.fleet is None:
        return None
    epoch = 1
    managers: dict[str, Any] = {}
    record = None
    if reattach:
        managers, record = runtime.registry.find(run_id)
        epoch = runtime.registry.epoch(run_id) + 1
    sn = SnapshotCoordinator(cfg, runtime.fleet, run_id, runtime.clock, epoch)
    with spans.span("managers"):
        if reattach:
            sn.managers = managers
            sn.name_tag = f"-r{runtime.rng.getrandbits(16):04x}"
            if managers and record is not None:
                sn.committed = record  # the managers that no longer hold it are replaced
        sn.ensure_managers()
        if sn.committed is not None:
            sn.adopt(sn.committed)
    check_parity_fits(len(sn.managers), cfg.snapshot.parity, cfg.snapshot.group_size)
    return sn


class DriverFence:
    """This driver's epoch against the run's published one. A driver that lived on while
    ``--resume`` started a newer one (it was frozen, or cut off and healed) must not publish its
    committed record over the newer driver's, recover (its plans would kill and start the newer
    driver's actors) or end the run's actors and managers: before each of these it reads the
    run's epoch (one read of the run registry) and, finding a newer one, raises
    :class:`Superseded`, leaving the run to that driver. Decided by the epoch counter, never by
    time; what it sends meanwhile the stages and managers refuse by generation."""

    def __init__(self, registry: RunRegistry, run_id: str, epoch: int) -> None:
        self.registry, self.run_id, self.epoch = registry, run_id, epoch

    def newer(self) -> int | None:
        """The epoch of the driver that took the run over, None while it is this one's."""
        published = self.registry.epoch(self.run_id)
        return published if published > self.epoch else None

    def superseded(self) -> bool:
        """Whether a newer driver took the run over; False when the registry cannot be read (the
        cluster is gone: ending the run's actors fails harmlessly then)."""
        try:
            return self.newer() is not None
        except Exception as e:  # noqa: BLE001 - a driver's end must close its own parts whatever the cluster says
            log.warning("run %s: its registry cannot be read (%s: %s); its parts are ended as usual", self.run_id, type(e).__name__, e)
            return False

    def check(self, what: str) -> None:
        if (newer := self.newer()) is not None:
            raise Superseded(f"run {self.run_id} was taken over by its driver {newer} (--resume) while this one (driver {self.epoch}) lived on: "
                             f"this driver stops before {what} and leaves the run's actors, managers and record to it")


def publish_run(cfg: RunConfig, runtime: Runtime, run_id: str, sn: SnapshotCoordinator, group: StageActors) -> tuple[Keepalive, DriverFence] | None:
    """Driver failover (``recovery.driver_grace_s`` > 0): publish the run's config, this driver
    and each committed record, and keep the managers and the stage actors alive (the roster of the
    stage actors is published at every change of membership: :func:`publish_roster`). Returns
    the keepalive and the :class:`DriverFence` (None without failover)."""
    if sn.grace_s <= 0:
        return None
    registry = runtime.registry
    registry.publish_run(run_id, cfg.to_dict(), sn.epoch)
    fence = DriverFence(registry, run_id, sn.epoch)

    def publish(record: VersionRecord) -> None:
        fence.check(f"publishing its committed step {record.version}")
        registry.publish_committed(run_id, record)

    sn.on_commit = publish
    log.info("run %s: if this driver dies, `elastic-llm train --resume %s` with the same config goes on from its snapshots in memory "
             "within recovery.driver_grace_s=%g s", run_id, run_id, sn.grace_s)
    return registry.keepalive(lambda: [(h, None) for h in list(sn.managers.values())] + group.handover.leased(), min(5.0, sn.grace_s / 4)), fence


def retire(runtime: Runtime, cfg: RunConfig, run_id: str, spans: Spans) -> Roster | None:
    """``--resume RUN_ID``, before this driver's actors take the run's names: check the model is
    the run's, read the dead driver's roster, and end what of its actors is not taken over.
    Returns the roster (None: none published)."""
    runtime.registry.check_same_model(run_id, cfg.to_dict())
    roster = runtime.registry.roster(run_id)
    keep = frozenset(name for a in roster["actors"] if (name := a.get("name"))) if roster else frozenset()
    with spans.span("retire"):
        runtime.registry.retire_old_driver(run_id, keep, keep_standbys=cfg.recovery.standby != 0)
    return roster


def publish_roster(runtime: Runtime, run_id: str, parts: RunParts) -> None:
    """The stage actors of the width as a next driver takes them over (with failover on)."""
    if parts.keepalive is not None:
        runtime.registry.publish_roster(run_id, parts.group.handover.roster())


def take_over(parts: RunParts) -> set[ShardKey]:
    """``--resume RUN_ID``: the dead driver's stage actors that answer (and its warm standbys)
    become this driver's, their state in place (once: the roster is used up); returns the keys
    adopted (the others are started afresh, and every state past the committed snapshot is rolled
    back, by :func:`reattach`). Nothing without a roster."""
    roster, parts.roster = parts.roster, None
    if roster is None:
        return set()
    adopted = parts.group.handover.take_over(roster)
    if parts.standbys is not None and parts.standbys.enabled:
        n = parts.standbys.take_over()
        if n:
            log.info("--resume: %d warm standbys of the run taken over", n)
    log.info("--resume: %d of the run's %d stage actors taken over with their state", len(adopted), len(roster.get("actors", [])))
    return adopted


def open_parts(cfg: RunConfig, runtime: Runtime, run_id: str, reattach: bool, metrics: MetricsWriter, data_dir: str,
               facts: Callable[[], RunFacts], spans: Spans) -> RunParts:
    """Assemble the run's parts on ``runtime`` (nothing is placed yet: see :meth:`Trainer.setup`);
    ``reattach`` (``--resume RUN_ID``): first end what of the dead driver's actors is not taken over
    (:func:`retire`), before this driver's take the run's names."""
    roster = retire(runtime, cfg, run_id, spans) if reattach else None
    publisher = Publisher(facts, runtime.monitor, runtime.clock)  # the run's monitor (Ray: the run-<id> actor): its status and metrics
    metrics.observers.append(publisher.on_record)
    sn = open_snapshots(cfg, runtime, run_id, reattach, spans)
    durable = runtime.durable(cfg, sn, data_dir, metrics) if sn is not None else None  # None: the run has no durable tier
    if sn is not None:
        sn.durable = durable
    standbys = runtime.standbys(cfg, run_id)
    group = runtime.group(cfg, run_id, standbys)
    failover = publish_run(cfg, runtime, run_id, sn, group) if sn is not None else None
    keepalive, fence = failover if failover is not None else (None, None)
    checkpoints = None
    if cfg.recovery.mode == Mode.CHECKPOINT:
        checkpoints = CheckpointExecutor(group, cfg.recovery.checkpoint_every, cfg.recovery.checkpoint_dir, runtime.clock)
    min_width = cfg.elastic.bounds(cfg.parallel.dp)[0]
    policy = named(cfg.recovery.policy)
    options = ModeOptions(Mode(cfg.recovery.mode), cfg.mirrors, cfg.checkfree.lr_scale, checkpoints, durable, policy.restart_all, policy.whole_replicas)
    nodes = LinkGuard(runtime.nodes, runtime.clock, cfg.recovery, metrics)
    elastic = ElasticExecutor(group, sn, cfg, nodes, runtime.clock)
    recovery = RecoveryExecutor(group, sn, cfg.snapshot.parity, min_width, options, nodes, standbys, elastic.protect, fence.check if fence else None)
    return RunParts(group, standbys, sn, durable, checkpoints, recovery, elastic, publisher, keepalive, nodes, roster, fence, policy.restart_on_resize)


def reattach(runtime: Runtime, run_id: str, group: StageActors, sn: SnapshotCoordinator | None, driver_grace_s: float) -> Resumed:
    """``--resume RUN_ID``: every stage actor whose state is not the dead driver's newest committed
    snapshot (a new one, or one taken over that went past it) restores it from the managers
    (shards on lost nodes rebuilt from parity); one taken over that holds it keeps its state.
    Raises :class:`ResumeError` (nothing in memory) naming why; the caller may fall back to the
    durable tier."""
    t = runtime.clock.perf_counter()
    rec = sn.committed if sn is not None else None
    try:
        if sn is None or rec is None:
            raise UnrecoverableError("its snapshot managers or its committed record are gone")
        steps = group.reset_survivors(runtime.nodes.alive())  # a step the dead driver left running is dropped
        need = [k for k in group.keys() if steps.get(k) != rec.version]
        srcs: dict[ShardKey, StageSource] | None = None
        for _ in range(len(sn.managers) + 1):  # a shard that fails to load counts its node lost: look again
            dead = sn.dead_managers(runtime.nodes.alive())
            try:
                srcs = {k: sn.fetch_stage_state(k.stage, k.replica, dead) for k in need}
                break
            except SourceLost as e:
                log.warning("--resume %s: %s; looking again", run_id, e)
        if srcs is None:
            raise UnrecoverableError("every snapshot part failed to load")
        if srcs:
            group.state.load_parts(srcs)
    except (UnrecoverableError, *runtime.errors) as e:  # type: ignore[misc]  # the runtime's errors: a tuple of exception types
        raise ResumeError(
            f"--resume {run_id}: nothing to resume from in memory ({str(e).splitlines()[0]}; its driver died more than "
            f"recovery.driver_grace_s={driver_grace_s:g} s ago, or too many of its nodes went)"
        ) from None
    raw = rec.shard(ShardKey(0, 0)).data_position()
    seconds = runtime.clock.perf_counter() - t
    kept = len(group.keys()) - len(need)
    log.info("resumed run %s from its committed in-memory snapshot of step %d in %.1f s (%d stage actors kept their state, %d restored)",
             run_id, rec.version, seconds, kept, len(need))
    return Resumed(rec.version, StreamPosition.of(raw) if raw else None, seconds, kept)


def resume_durable(runtime: Runtime, group: StageActors, ck: Checkpoint) -> Resumed:
    """Every stage loads its layers from the durable checkpoint ``ck`` (whatever width or stage
    count wrote it); a damaged or foreign file is refused with its :class:`DurableError`."""
    t = runtime.clock.perf_counter()
    group.state.load_durable(group.keys(), ck.storage.uri, ck.name)
    raw = ck.manifest.get("data_position")
    seconds = runtime.clock.perf_counter() - t
    log.info("resumed from %s at step %d (%s replica(s) x %s stages then) in %.1f s", ck.uri, ck.step, ck.manifest.get("width"), ck.manifest.get("stages"), seconds)
    return Resumed(ck.step, StreamPosition.of(raw) if raw else None, seconds)


def start_from(runtime: Runtime, cfg: RunConfig, parts: RunParts, run_id: str, reattaching: bool, ck: Checkpoint | None,
               metrics: MetricsWriter, spans: Spans) -> Resumed | None:
    """Where a run's first step comes from: a dead driver's snapshot (``--resume RUN_ID``;
    without one, its newest durable checkpoint), a durable checkpoint (``--resume CHECKPOINT``),
    or nothing (None: step 0). One metrics line for how it resumed."""
    at = None
    if reattaching:
        with spans.span("reattach"):
            try:
                at = reattach(runtime, run_id, parts.group, parts.snapshots, cfg.recovery.driver_grace_s)
            except ResumeError as e:
                if not cfg.durable.storage_path:
                    raise ResumeError(f"{e} and durable.storage_path is not set: start a new run") from None
                log.warning("%s: the newest durable checkpoint instead", e)
                ck = open_checkpoint(run_storage(cfg).uri)
            else:
                managers = len(parts.snapshots.managers) if parts.snapshots is not None else 0
                metrics.emit(events.Reattach(step=at.step, run_id=run_id, seconds=at.seconds, managers=managers, kept=at.kept,
                                             restored=len(parts.group.keys()) - at.kept))
    if ck is not None:
        with spans.span("resume"):
            at = resume_durable(runtime, parts.group, ck)
        metrics.emit(events.Resume(step=ck.step, path=ck.uri, seconds=at.seconds, width_then=ck.manifest.get("width"), stages_then=ck.manifest.get("stages")))
    return at


def committed_step(parts: RunParts | None, step: int) -> int:
    """The newest step a committed snapshot, a checkpoint or a durable checkpoint holds (after a
    rollback to the durable tier, until the next snapshot commits: the durable one); without
    any of them, ``step`` (the last completed one)."""
    if parts is not None and parts.checkpoints is not None:
        latest = parts.checkpoints.latest()
        return latest[0] if latest else 0
    if parts is None or parts.snapshots is None:
        return step
    rec = parts.snapshots.committed
    durable = parts.durable.latest() if parts.durable is not None else None
    return max(rec.version if rec is not None else 0, durable[0] if durable is not None else 0)


def close_parts(parts: RunParts | None, runtime: Runtime, run_id: str, metrics: MetricsWriter) -> list[tuple[str, Callable[[], None]]]:
    """What ends a run's parts, in order, each with what it ends (the caller runs every one)."""
    if parts is None:
        return []
    steps: list[tuple[str, Callable[[], None]]] = []
    if parts.keepalive is not None:
        steps.append(("keepalive", parts.keepalive.stop))
    if parts.fence is not None and parts.fence.superseded():  # a newer driver has the run: nothing of it is ended here
        log.warning("run %s was taken over by a newer driver: its stage actors and snapshot managers are left to it", run_id)
    else:
        if parts.keepalive is not None:  # a driver that ends cleanly: its managers end with it, nothing is left to resume
            steps.append(("run registry", lambda: runtime.registry.forget(run_id)))
        steps.append(("stage actors", parts.group.shutdown))
        if parts.snapshots is not None:
            steps.append(("snapshot managers", parts.snapshots.shutdown))
    if parts.publisher is not None:
        pub = parts.publisher

        def end_monitor() -> None:
            if pub.on_record in metrics.observers:
                metrics.observers.remove(pub.on_record)
            pub.close()

        steps.append(("monitor", end_monitor))
    if parts.checkpoints is not None:
        steps.append(("checkpoints", parts.checkpoints.close))
    return steps
