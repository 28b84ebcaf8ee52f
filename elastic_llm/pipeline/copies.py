"""A stage's background snapshot copies: lazy and asynchronous (DataStates-LLM style).

Owns: the reused, pre-touched copy buffers (two that alternate for snapshots, a third for direct
captures; on CUDA pinned in place at their exact size and allocated when the stage starts), the one copy thread, the copies it holds (the last two,
by version), waking a snapshot manager that waits for a copy when the step it waits for is
aborted, and cutting a finished copy into checksummed pieces.
Never decides when to copy (the stage does, when its step is told to) and never talks to Ray.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from elastic_llm.snapshot.erasure import checksum
from elastic_llm.snapshot.records import Piece

WAIT_S = 600.0  # longest a copy may take, or a manager may wait for one


@dataclass
class Copy:
    """One background copy of the state: its version, buffer, byte range and manifest."""

    version: int
    buffer: np.ndarray
    lo: int
    hi: int
    manifest: str
    future: Future


def pinned(buf: np.ndarray) -> np.ndarray:
    """``buf`` page-locked in place for CUDA copies (``cudaHostRegister``): exactly its size,
    where torch's pinned allocator rounds a request up to a power of two (a 2.4 GB state would
    take 4 GB). Stays registered for the process's life, as the copy buffers do."""
    err = torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of a {buf.nbytes}-byte snapshot buffer failed ({err}): the node's pinned-memory limit (ulimit -l) is too low")
    return buf


def piece_size(nbytes: int, k: int) -> int:
    """Bytes per piece when a shard of ``nbytes`` is cut into ``k`` pieces (64-byte multiples;
    the last pieces may be shorter or empty)."""
    return -(-nbytes // (k * 64)) * 64 if nbytes else 0


class BackgroundCopies:
    """Copies of ``arena`` (a :class:`~elastic_llm.snapshot.state.StateArena`) made off the
    training thread; the next optimizer step calls :meth:`wait` before it writes the tensors."""

    def __init__(self, arena: Any, device: torch.device, name: str, delay_s: float = 0.0) -> None:
        self.arena = arena
        self.delay_s = delay_s
        self.device = device
        self.buffers: dict[int, np.ndarray] = {}  # allocated on first use, each on its own (a restore's buffer 2 needs no 0 and 1)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-copy-{name}")
        self.latest: Future | None = None
        self.held: dict[int, Copy] = {}  # version -> copy (at most one per alternating buffer)
        self.next_buffer = 0
        self.changed = threading.Condition()
        self.resets = 0  # bumped by forget_after(): a take() waiting for its step gives up
        self.wait_s = 0.0  # total time the training thread waited for an unfinished copy

    def wait(self) -> None:
        """Block until the latest copy is finished (the optimizer is about to overwrite its source)."""
        if self.latest is not None and not self.latest.done():
            t = time.perf_counter()
            self.latest.result(timeout=WAIT_S)
            self.wait_s += time.perf_counter() - t

    def buffer(self, i: int) -> np.ndarray:
        """Buffer ``i`` (0 and 1 alternate for snapshots, 2 for direct captures), allocated on first
        use (at the stage's start on CUDA: :meth:`preallocate`): exactly the state's size, every
        page touched once, and on CUDA pinned where it lies (:func:`pinned`)."""
        if i not in self.buffers:
            buf = np.empty(self.arena.layout.nbytes, dtype=np.uint8)
            buf.fill(0)  # touch every page once: later copies write warm memory
            self.buffers[i] = pinned(buf) if self.device.type == "cuda" else buf
        return self.buffers[i]

    def preallocate(self) -> None:
        """All three buffers now (a CUDA stage's start): pinning takes time a first snapshot or
        a recovery's capture would otherwise stall on."""
        for i in range(3):
            self.buffer(i)

    def start(self, version: int, lo: int, hi: int, manifest: str) -> None:
        """Copy bytes [lo, hi) of the state in the background as ``version``.

        Two buffers alternate: the pieces of the previous copy may still be on their way into the
        object store while this one is written. The controller keeps at most two versions in
        flight, so a buffer is reused only after its version was collected (or dropped)."""
        buf = self.buffer(self.next_buffer)
        self.next_buffer ^= 1
        after = None
        if self.device.type == "cuda":  # the copy stream starts once the queued update is done
            after = torch.cuda.Event()
            after.record()
        with self.changed:
            self.latest = self.thread.submit(self._copy, buf, lo, hi, after)
            job = Copy(version, buf, lo, hi, manifest, self.latest)
            self.held = {v: c for v, c in self.held.items() if c.buffer is not buf}
            self.held[version] = job
            self.changed.notify_all()

    def _copy(self, buf: np.ndarray, lo: int, hi: int, after: Any = None) -> float:
        t = time.perf_counter()
        self.arena.capture(buf, lo, hi, after)
        if self.delay_s:
            time.sleep(self.delay_s)  # chaos.snapshot_delay_s: a snapshot of known cost
        return time.perf_counter() - t

    def take(self, version: int, who: str, newest: int | None = None) -> tuple[Copy, float]:
        """The finished copy of ``version`` and the seconds it took; waits for it to be started.
        Raises RuntimeError when its step was aborted (:meth:`forget_after`) or never copied, and
        at once when ``version`` is beyond ``newest`` (the stage's step + 1: no later copy can be
        asked for, so the request was made before a rollback; waiting for it would hold the
        stage's snapshot thread from the requests of the steps run again)."""
        if newest is not None and version > newest:
            raise RuntimeError(f"{who}: a snapshot of step {version} was asked for before a rollback to step {newest - 1}; no snapshot of it")
        with self.changed:
            resets = self.resets
            ready = self.changed.wait_for(
                lambda: version in self.held or self.resets != resets or max(self.held, default=0) > version, timeout=WAIT_S
            )
            job = self.held.get(version)
            if self.resets != resets or job is None:
                why = "was aborted or replaced" if ready else "was never marked for a snapshot"
                raise RuntimeError(f"{who}: step {version} {why}; no snapshot of it")
        return job, job.future.result(timeout=WAIT_S)

    @staticmethod
    def pieces(job: Copy, k: int) -> tuple[list[Piece], list[np.ndarray]]:
        """Cut a copy into ``k`` pieces (views, no copy) with their byte ranges and checksums."""
        per = piece_size(job.hi - job.lo, k)
        meta, views = [], []
        for i in range(k):
            a, b = min(job.hi, job.lo + i * per), min(job.hi, job.lo + (i + 1) * per)
            views.append(job.buffer[a:b])
            meta.append(Piece(a, b - a, checksum(views[-1])))
        return meta, views

    def holds(self, version: int, nbytes: int) -> bool:
        """Whether a copy of all ``nbytes`` of ``version`` is held (not checked: :meth:`whole` checks)."""
        job = self.held.get(version)
        return job is not None and (job.lo, job.hi) == (0, nbytes)

    def whole(self, version: int, nbytes: int, pieces: tuple[Piece, ...]) -> Copy | None:
        """The finished copy of all ``nbytes`` of ``version`` if it is held and every byte range
        in ``pieces`` (a committed snapshot's record) has the recorded checksum; else None."""
        job = self.held.get(version)
        if job is None or (job.lo, job.hi) != (0, nbytes):
            return None
        job.future.result(timeout=WAIT_S)
        if sum(p.length for p in pieces) != nbytes:
            return None
        if any(checksum(job.buffer[p.offset : p.offset + p.length]) != p.crc for p in pieces):
            return None
        return job

    def corrupt(self) -> list[int]:
        """Fault injection: flip one byte in the middle of every finished copy, in place (silent
        corruption: a restore from it finds its checksums wrong). Returns the versions hit."""
        self.wait()
        hit = []
        for version, job in sorted(self.held.items()):
            if job.hi > job.lo:
                job.buffer[job.lo + (job.hi - job.lo) // 2] ^= 0xFF
                hit.append(version)
        return hit

    def forget_after(self, step: int) -> None:
        """Drop copies of steps after ``step`` and wake whoever waits for one (a reset or a
        rollback); finished copies up to ``step`` stay (a rollback may restore from them)."""
        self.wait()
        with self.changed:
            self.held = {v: c for v, c in self.held.items() if v <= step}
            self.resets += 1
            self.changed.notify_all()
