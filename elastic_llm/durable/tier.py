"""The durable tier on the driver: which committed snapshots go to storage, and committing them.

Owns: the run's directory ``{durable.storage_path}/{run_name}``; at each committed snapshot,
whether it is flushed (every ``durable.every``-th, or Young/Daly's interval with ``auto``; one
flush at a time, never waited for by a training step); sending every snapshot manager its parts
(:func:`elastic_llm.durable.flush.plan_parts`); once all parts are written, the manifest and then
the commit marker; pruning to ``durable.keep_last``; the newest committed checkpoint; the final
flush when a run ends. Never restores (the recovery executor and the stages do) and never writes
tensor bytes itself: they go from the managers' object stores straight to storage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from elastic_llm import cadence, events
from elastic_llm.clock import SYSTEM, Clock
from elastic_llm.config import RunConfig
from elastic_llm.durable import format as fmt
from elastic_llm.durable.flush import StageTensors, by_node, plan_parts
from elastic_llm.durable.storage import Storage, StorageError
from elastic_llm.shape import stage_layer_range
from elastic_llm.snapshot.ports import Calls, ManagerHandle
from elastic_llm.snapshot.records import VersionRecord
from elastic_llm.stream import StreamPosition

log = logging.getLogger("elastic_llm.durable")
FLUSH_S = 1800.0  # longest a flush may take before it is abandoned
PING_S = 10.0


@dataclass
class DurableStats:
    flushed: int = 0
    failed: int = 0
    skipped: int = 0  # due while a flush was in flight
    bytes: int = 0
    seconds: float = 0.0  # wall time of the flushes (in the background)
    last_gbps: float = 0.0
    pruned: list[str] = field(default_factory=list)
    fenced: int = 0  # shard files of older attempts found beside a committed checkpoint's own (a zombie's late flush), never named by its manifest


class Snapshots(Protocol):
    """What the tier needs of the snapshot coordinator (it never imports it): the managers that
    write the parts and how to wait for their answers, the newest committed version, and the
    snapshot interval (for ``auto``)."""

    managers: dict[str, ManagerHandle]  # node -> SnapshotManager handle
    calls: Calls  # the coordinator's (wait / get)
    committed: VersionRecord | None
    floor: int  # the driver's membership generation, sent with each flush (elastic_llm.snapshot.fence)

    @property
    def every(self) -> int: ...  # steps between versions (read only)


@dataclass
class _Flush:
    record: VersionRecord
    refs: dict[Any, Any]  # ref -> (node, NodeFlush): one call per writing node
    started: float
    draft: fmt.Draft  # the manifest but its files, drafted while the managers write
    results: list[Any] = field(default_factory=list)


def run_storage(cfg: RunConfig) -> Storage:
    """The run's directory ``{durable.storage_path}/{run_name}``, created and proved writable
    (a file written and deleted in it); :class:`StorageError` naming ``durable.storage_path`` and
    the fix when it cannot be opened or written. The trainer calls it before Ray starts."""
    du = cfg.durable
    assert du.storage_path, "the durable tier needs durable.storage_path"
    try:
        run = Storage(du.storage_path).child(du.run_name or cfg.name)
    except StorageError as e:
        raise StorageError(f"durable.storage_path: {e}") from None
    try:
        run.probe_write()
    except OSError as e:
        raise StorageError(
            f"durable.storage_path={du.storage_path!r} cannot be written ({e}): give a directory or URI this user may create "
            "and write files in, or leave durable.storage_path unset to train without durable checkpoints"
        ) from None
    return run


class DurableTier:
    def __init__(self, cfg: RunConfig, coordinator: Snapshots, data_dir: str | None = None, metrics: Any = None, clock: Clock = SYSTEM) -> None:
        du = cfg.durable
        self.cfg = cfg
        self.clock = clock
        self.coordinator = coordinator
        self.metrics = metrics
        self.data_dir = data_dir
        self.run = run_storage(cfg)
        self.auto = du.every == "auto"
        self.turns = cadence.FlushTurns(1 if self.auto else int(du.every))  # auto: the first commit is flushed, to measure the cost
        self.why = "auto: the first committed snapshot is flushed to measure the cost" if self.auto else f"durable.every={du.every}"
        self.inflight: _Flush | None = None
        self.stats = DurableStats()
        self.cost = cadence.Ema(alpha=0.5)
        newest = fmt.newest_committed(self.run)
        self.newest: tuple[int, str] | None = (newest.step, newest.name) if newest else None
        self.flushed_version = newest.step if newest else -1
        self.step_s = cadence.Ema()
        self.elapsed_s = 0.0
        self.failures = 0
        self.tensors = StageTensors(lambda s: list(stage_layer_range(cfg.model.n_layers, cfg.parallel.stages, s)))

    # ------------------------------------------------------------------ inputs from the run
    def observe(self, step_s: float, elapsed_s: float, failures: int) -> None:
        """What the run measured: a step's time, the time trained, the failures and preemption waves seen."""
        self.step_s.add(step_s)
        self.elapsed_s, self.failures = elapsed_s, failures

    def _choose(self) -> None:
        """``durable.every: auto``: Young/Daly from the flush cost and the observed MTBF."""
        if not self.auto or self.cost.value is None or self.step_s.value is None:
            return
        mtbf = cadence.mtbf_s(self.elapsed_s, self.failures, self.cfg.durable.mtbf_h * 3600)
        interval = cadence.young_daly_s(self.cost.value, mtbf)
        snap_every = self.coordinator.every
        every = cadence.flush_every(interval, snap_every, self.step_s.value)
        seen = f"{self.failures} failures or preemption waves in {self.elapsed_s:.0f} s" if self.failures else f"no failure yet, durable.mtbf_h={self.cfg.durable.mtbf_h}"
        self.why = f"auto: sqrt(2 x {self.cost.value:.2f} s flush x {mtbf:.0f} s MTBF ({seen})) = {interval:.0f} s = {every} snapshots"
        if self.metrics is not None:  # once per flush: flushes are rare
            self.metrics.emit(events.DurableEvery(
                every=every, previous=self.every, interval_s=interval, flush_cost_s=self.cost.value, mtbf_s=mtbf,
                snapshot_every=snap_every, step_s=self.step_s.value, why=self.why,
            ))
        self.turns.every = every

    # ------------------------------------------------------------------ at every commit
    def wants(self, record: VersionRecord) -> bool:
        """Whether ``record`` (being committed now) is flushed; its managers then pin it."""
        wanted = self.turns.wants(self.inflight is not None)
        self.stats.skipped = self.turns.skipped
        return wanted

    def start(self, record: VersionRecord) -> None:
        """Send every writer its parts of ``record`` (pinned by its managers), then build the
        manifest but its files while they write. Returns at once."""
        self.turns.started()
        t0 = self.clock.perf_counter()
        managers = self.coordinator.managers
        du = self.cfg.durable
        plans = plan_parts(record, self.run.uri, self.tensors, managers, du.max_write_mb_s, du.flush_nice)
        refs = {}
        for node, batch in by_node(plans, self.coordinator.floor).items():
            if node not in managers:
                self._fail(record, f"the snapshot manager of node {node[:12]} is gone")
                return
            refs[managers[node].flush_part.remote(batch)] = (node, batch)
        states = [(s.key.stage, s.key.replica, s.manifest) for s in record.shards]
        tokenizer = self._copy_tokenizer(fmt.checkpoint_dir(record.version))
        self.inflight = _Flush(record, refs, t0, fmt.draft(self.cfg, record.version, self.run.root.rsplit("/", 1)[-1], states, tokenizer))

    def poll(self, block: bool = False, timeout: float = FLUSH_S) -> None:
        """Commit the flush in flight once every part is written (``block``: wait for it)."""
        f = self.inflight
        if f is None:
            return
        calls = self.coordinator.calls
        pending = [r for r in f.refs if r not in {x[0] for x in f.results}]
        done = calls.wait(pending, len(pending), timeout if block else 0)[0] if pending else []
        for ref in done:
            try:
                f.results.append((ref, calls.get(ref, timeout=0)))
            except Exception as e:  # a manager died mid-flush, storage refused a write, ...
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                self._fail(f.record, lines[-1] if lines else type(e).__name__)
                return
        if len(f.results) < len(f.refs):
            if block or self.clock.perf_counter() - f.started > FLUSH_S:
                self._fail(f.record, f"not written after {self.clock.perf_counter() - f.started:.0f} s")
            return
        try:
            self._commit(f)
        except OSError as e:
            self._fail(f.record, f"the manifest could not be written: {e}")

    def _commit(self, f: _Flush) -> None:
        rec = f.record
        ckpt = fmt.checkpoint_dir(rec.version)
        data, files = f.draft.finish([part for _, written in f.results for part in written])
        fmt.commit_bytes(self.run, ckpt, rec.version, data)
        seconds = self.clock.perf_counter() - f.started  # durable from here on: the flush's time ends
        self._strays(rec.version, ckpt, {f.rsplit("/", 1)[-1] for f in files})
        nbytes = sum(v["nbytes"] for v in files.values())
        self.inflight = None
        self._unpin(rec.version)
        self.newest = (rec.version, ckpt)
        self.flushed_version = rec.version
        st = self.stats
        st.flushed += 1
        st.bytes += nbytes
        st.seconds += seconds
        st.last_gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        self.cost.add(seconds)
        pruned = fmt.prune(self.run, self.cfg.durable.keep_last)
        st.pruned += pruned
        self._choose()
        if self.metrics is not None:
            self.metrics.emit(events.Durable(
                step=rec.version, path=self.run.display(ckpt), seconds=seconds, bytes=nbytes, gbps=st.last_gbps,
                every=self.every, why=self.why, pruned=pruned,
            ))
        log.info("durable checkpoint of step %d: %s (%.1f MB in %.2f s)", rec.version, self.run.display(ckpt), nbytes / 1e6, seconds)

    def _strays(self, step: int, ckpt: str, named: set[str]) -> None:
        """Shard files in ``ckpt`` that its manifest does not name: an older attempt's at this
        step (a zombie manager's flush, or a failed flush's). Never read (files carry their
        attempt's generation); counted and named in a ``fenced`` line, deleted with the directory."""
        strays = [f for f in self.run.list_files(ckpt) if f.endswith(".safetensors") and f not in named]
        if strays:
            self.stats.fenced += len(strays)
            log.warning("checkpoint of step %d: %d shard files of an older attempt beside its own, not in its manifest: %s", step, len(strays), ", ".join(strays))
            if self.metrics is not None:
                self.metrics.emit(events.Fenced(step=step, count=len(strays), what=[f"{ckpt}/{f}: a flush of an older attempt, not in the manifest" for f in strays]))

    def _copy_tokenizer(self, ckpt: str) -> str | None:
        """The run's tokenizer.json beside the weights (an export needs it), if the data has one."""
        if not self.data_dir:
            return None
        try:
            src = Storage(str(self.data_dir))
            if not src.exists(fmt.TOKENIZER):
                return None
            self.run.makedirs(ckpt)  # (the managers, writing meanwhile, make it too)
            self.run.write_bytes(f"{ckpt}/{fmt.TOKENIZER}", src.read_bytes(fmt.TOKENIZER))
        except OSError as e:
            log.warning("tokenizer not copied into %s: %s", ckpt, e)
            return None
        return fmt.TOKENIZER

    def _fail(self, record: VersionRecord, why: str) -> None:
        self.inflight = None
        self.stats.failed += 1
        self._unpin(record.version)
        log.warning("durable flush of step %d abandoned: %s (the previous checkpoint stays; the partial one is deleted later)", record.version, why)
        if self.metrics is not None:
            self.metrics.emit(events.DurableFailed(step=record.version, reason=why))

    def _unpin(self, version: int) -> None:
        for m in self.coordinator.managers.values():
            m.unpin.remote(version)

    # ------------------------------------------------------------------ queries and the end
    @property
    def every(self) -> int:
        """Flush every this many committed snapshots (``durable.every``, or auto's choice)."""
        return self.turns.every

    def latest(self) -> tuple[int, str] | None:
        """(step, directory name) of the newest committed checkpoint."""
        return self.newest

    def flushing(self) -> tuple[int, list[str], int] | None:
        """The flush in flight: (its version, the nodes writing it, parts not written yet); None
        when there is none. No waiting."""
        f = self.inflight
        if f is None:
            return None
        ready, _ = self.coordinator.calls.wait(list(f.refs), len(f.refs), 0)
        return f.record.version, sorted({n for n, _ in f.refs.values()}), sum(len(b.plans) for r, (_, b) in f.refs.items() if r not in ready)

    def checkpoint(self, name: str) -> tuple[str, StreamPosition | None]:
        """(the run directory's URI, the data position) of committed checkpoint ``name``."""
        raw = fmt.Checkpoint(self.run, name).manifest.get("data_position")
        return self.run.uri, StreamPosition.of(raw) if raw else None

    def finish(self, timeout: float = FLUSH_S) -> None:
        """When the run ends: wait for the flush in flight, then flush the newest committed
        snapshot if it is newer than the newest checkpoint, and wait for that too."""
        self.poll(block=True, timeout=timeout)
        rec = self.coordinator.committed
        if rec is not None and rec.version > self.flushed_version:  # the newest committed version: nothing frees it
            self.start(rec)
            self.poll(block=True, timeout=timeout)

    def reset(self) -> None:
        """After a rollback to a durable checkpoint: the flush in flight (of a newer version) is dropped."""
        if self.inflight is not None:
            self._fail(self.inflight.record, "the run rolled back to an older checkpoint")
