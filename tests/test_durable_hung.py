"""A durable flush on a storage that hangs (an open, a write or an fsync that never returns) fails
after its bound instead of holding the snapshot manager forever: the failure names the file and
how long it was waited for, the previous checkpoint stays the newest, and the tier flushes the
next version once the storage answers again. Real files without Ray: a FIFO whose open blocks
until a reader comes, an fsync held at ``os.fsync`` until the test lets it go; the bounds
(``FSYNC_S``, ``WRITE_S``) are made short, and nothing asserts how long anything took."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace

import pytest

from elastic_llm.durable import flush, storage
from elastic_llm.durable.tier import DurableTier
from elastic_llm.snapshot.erasure import checksum
from elastic_llm.snapshot.records import Piece, ShardInfo, ShardKey, VersionRecord
from tests.test_coordinator_errors import Calls, Ref  # a manager's answers: a value, or what its call raised
from tests.test_durable import config, trained_workers, write_checkpoint

pytestmark = pytest.mark.timeout(120)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_an_fsync_that_never_returns_fails_the_files_at_the_bound_and_its_descriptor_is_closed_when_it_returns(tmp_path, monkeypatch, caplog):
    st = storage.Storage(str(tmp_path))
    entered, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/hangs"):
            entered.set()
            release.wait()  # the device never answers, until the test says so
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(storage, "FSYNC_S", 0.2)
    before = open_fds()
    syncs = storage.Syncs()
    for name in ("fine", "hangs"):
        with st.writer(name, syncs=syncs) as w:
            w.write(name.encode() * 100)
    with caplog.at_level(logging.WARNING, "elastic_llm.durable"), pytest.raises(storage.StorageHung) as hung:
        syncs.finish()
    assert entered.is_set() and not release.is_set()  # it returned while the fsync still hung
    assert f"the fsync of {tmp_path}/hangs has not returned after" in str(hung.value) and "FSYNC_S=0.2" in str(hung.value)
    assert "check that storage" in str(hung.value) and f"{tmp_path}/hangs has not returned" in caplog.text
    assert open_fds() == before + 1  # only the hung file's descriptor is still open: its fsync's thread holds it
    release.set()
    for t in threads_named("elastic-llm-fsync"):
        t.join()
    assert open_fds() == before  # closed by that thread once its fsync returned


class Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        try:
            return Ref(self.fn(*args))
        except Exception as e:  # noqa: BLE001 - as Ray's get would raise it on the driver
            return Ref(error=e)


class Manager:
    """A node's snapshot manager as the tier calls it: ``flush_part`` runs the tier's plan over
    the pieces it holds (what :meth:`SnapshotManager.flush_part` does), in the caller's process."""

    def __init__(self, pieces: dict[ShardKey, object]) -> None:
        self.flush_part = Method(lambda batch: batch.write(lambda key: [pieces[key]] if key in pieces else None))
        self.unpin = Method(lambda version: None)


class Snapshots:
    def __init__(self, managers: dict[str, Manager]) -> None:
        self.managers, self.calls, self.committed, self.every = managers, Calls(), None, 1
        self.floor = 0  # the driver's membership generation, sent with each flush


class Events:
    def __init__(self) -> None:
        self.seen: list[object] = []

    def emit(self, event: object) -> None:
        self.seen.append(event)


def test_a_flush_whose_write_never_returns_fails_at_the_bound_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    cfg = config(extra=(f"durable.storage_path={tmp_path}", "durable.run_name=run", "durable.flush_nice=0"))
    workers = trained_workers(cfg)
    write_checkpoint(storage.Storage(str(tmp_path / "run")), cfg, workers, 2)
    pieces, shards = {}, []
    for w in workers:
        buf, manifest = w.capture_state({"epoch": 0, "index": 7})
        key = ShardKey(w.stage, 0)
        pieces[key] = buf = buf.copy()
        shards.append(ShardInfo(key, 0, 0, len(buf), (Piece(0, len(buf), checksum(buf)),), manifest, node_id="n0"))
    events = Events()
    tier = DurableTier(cfg, Snapshots({"n0": Manager(pieces)}), metrics=events)
    assert tier.latest() == (2, "checkpoint_00000002")

    ckpt = tmp_path / "run" / "checkpoint_00000004"
    ckpt.mkdir()
    fifo = ckpt / "stage_000_part_000-g0.0.safetensors"  # the file of attempt 0 (driver 0, attempt 0)
    os.mkfifo(fifo)  # the first part's open blocks until a reader comes: a storage that does not answer
    monkeypatch.setattr(flush, "WRITE_S", 0.3)
    record = VersionRecord(4, (), tuple(replace(s, version=4) for s in shards))
    tier.start(record)  # the manager's call returns (with its failure) though the write still hangs
    (writer,) = threads_named("flush-4")
    assert writer.is_alive()
    tier.poll(block=True)
    assert tier.inflight is None and tier.stats.failed == 1
    assert tier.latest() == (2, "checkpoint_00000002")  # the previous checkpoint stays the newest
    (failed,) = [e for e in events.seen if type(e).__name__ == "DurableFailed"]
    assert f"writing {tmp_path}/run/checkpoint_00000004/stage_000_part_000-g0.0.safetensors has not ended after" in failed.reason
    assert "WRITE_S=0.3" in failed.reason and "previous checkpoint stays" in failed.reason

    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # the storage answers at last: the open returns, the write finds no reader
    writer.join()
    monkeypatch.undo()  # WRITE_S as shipped for the next flush
    os.remove(fifo)
    record = VersionRecord(6, (), tuple(replace(s, version=6) for s in shards))
    tier.start(record)
    tier.poll(block=True)
    assert tier.latest() == (6, "checkpoint_00000006") and tier.stats.flushed == 1
