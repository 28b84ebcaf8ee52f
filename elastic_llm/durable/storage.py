"""Where durable checkpoints live: a local directory or any pyarrow filesystem URI.

Owns: turning ``durable.storage_path`` (a path, ``file://``, ``s3://bucket/dir?endpoint_override=
host:port&scheme=http``, ``gs://``, ``hdfs://``) into a filesystem and a root, and the few file
operations the durable tier needs: a probe that the root can be written, streaming writes (on a local disk forced to the platter with
fsync before they count as written), whole-file reads, listing, deleting a directory. Never knows
what a checkpoint is (:mod:`elastic_llm.durable.format` does).

On object stores a file becomes visible only when its upload completes, so a half-written
object never exists; on a local disk it can, which is why checkpoints are trusted only through
their commit marker (written last, and on a local disk atomically through a rename).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs


GATHER = 1 << 20  # local writes smaller than this are gathered and go to the file together (fewer system calls)
IOV_MAX = 512  # at most this many of them in one writev (Linux takes 1024)
KICK = 4 << 20  # a local file's written bytes are sent on to the device every this many (see _writeback)
FSYNC_S = 600.0
"""Longest :meth:`Syncs.finish` waits for the fsyncs of its files. A healthy device ends them in
seconds to minutes: each file's bytes were sent on to it every :data:`KICK` as they were written
and the kernel holds writers to its dirty-page limit, so an fsync waits for a tail. One that has not
returned after 10 minutes is a filesystem that hangs (a lost NFS server, a stuck device): the
files are then not durable, and the flush fails instead of holding its snapshot manager forever."""

log = logging.getLogger("elastic_llm.durable")


def _start_writeback() -> Callable[[int, int, int], bool] | None:
    """Linux's ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``: start writing a
    range of a file's dirty pages to the device and return at once (no waiting, no metadata).
    A writer that calls it every :data:`KICK` bytes has the device write while it copies the
    next bytes, so the final fsync waits only for the tail, where a plain write + fsync copies
    everything first and then waits for the device to write it all. Returns False when the call
    failed (the file's final fsync still makes it durable); None where libc has no such call."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    write_only = 2  # SYNC_FILE_RANGE_WRITE

    def kick(fd: int, offset: int, nbytes: int) -> bool:
        return bool(fn(fd, offset, nbytes, write_only) == 0)

    return kick


_writeback = _start_writeback()


class StorageError(OSError):
    """The storage path cannot be used; the message names it and the fix."""


class StorageHung(StorageError):
    """A file operation on the storage did not return within its bound (:data:`FSYNC_S`, the
    flush's ``WRITE_S``): the message names the file and how long it was waited for."""


class Storage:
    """A filesystem and a root path in it. Paths given to the methods are relative to the root."""

    def __init__(self, uri: str) -> None:
        self.uri = str(uri)
        try:
            if "://" in self.uri and not self.uri.startswith("file://"):
                self.fs, self.root = pafs.FileSystem.from_uri(self.uri)
            else:
                path = self.uri[len("file://") :] if self.uri.startswith("file://") else self.uri
                self.fs, self.root = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, OSError) as e:
            raise StorageError(
                f"storage path {self.uri!r} cannot be opened ({e}): give a local directory or a URI such as "
                "s3://bucket/dir?endpoint_override=host:port&scheme=http, gs://bucket/dir or hdfs://host/dir"
            ) from None
        self.root = self.root.rstrip("/") or "/"
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    def __repr__(self) -> str:
        return f"Storage({self.display()!r})"

    def display(self, rel: str = "") -> str:
        """The URI of ``rel`` as a user would write it (query parameters dropped)."""
        if self.local:
            return os.path.join(self.root, rel) if rel else self.root
        parts = urlsplit(self.uri)
        base = f"{parts.scheme}://{self.root}"
        return f"{base}/{rel}" if rel else base

    def child(self, rel: str) -> "Storage":
        """The storage rooted at ``rel`` under this root (same filesystem and options)."""
        if self.local:
            return Storage(self.path(rel))
        parts = urlsplit(self.uri)
        return Storage(f"{parts.scheme}://{self.path(rel)}" + (f"?{parts.query}" if parts.query else ""))

    def split(self) -> tuple["Storage", str]:
        """(the parent directory's storage, this directory's name)."""
        parent, name = self.root.rsplit("/", 1)
        if self.local:
            return Storage(parent or "/"), name
        parts = urlsplit(self.uri)
        return Storage(f"{parts.scheme}://{parent}" + (f"?{parts.query}" if parts.query else "")), name

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    # ------------------------------------------------------------------ writing
    def makedirs(self, rel: str) -> None:
        self.fs.create_dir(self.path(rel), recursive=True)

    @contextmanager
    def writer(self, rel: str, max_mb_s: float = 0.0, syncs: "Syncs | None" = None) -> Iterator["Writer"]:
        """Stream a file. On a local disk: straight to the file descriptor (small writes gathered
        into one ``writev``, large ones written from the caller's memory), then fsynced before
        the context ends, with the writer's ``during_sync`` (if set) run meanwhile on this thread;
        given ``syncs``, the fsync (and ``during_sync``) wait for :meth:`Syncs.finish` instead, so
        a writer of several files waits for the disk once. Elsewhere: pyarrow's output stream
        (``during_sync`` runs after it closed)."""
        if self.local:
            fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            w: Writer = FileWriter(fd, max_mb_s, syncs, self.path(rel))
        else:
            w = Writer(self.fs.open_output_stream(self.path(rel)), max_mb_s)
        ok = False
        try:
            yield w
            ok = True
        finally:
            w.close(sync=ok)

    def write_bytes(self, rel: str, data: bytes, atomic: bool = False) -> None:
        """Write a small file. ``atomic`` on a local disk: through a temporary name and a rename
        (on object stores every upload is atomic anyway)."""
        if not (atomic and self.local):
            with self.writer(rel) as w:
                w.write(data)
            return
        from pathlib import Path

        from elastic_llm.files import write_atomic

        write_atomic(Path(self.path(rel)), "wb", lambda f: f.write(data), fsync=True)
        fsync_path(os.path.dirname(self.path(rel)))

    def write_then_mark(self, rel: str, data: bytes, marker: str, mark: bytes) -> None:
        """Write file ``rel`` and then the marker ``marker`` that vouches for it, the marker never
        durable before the file. On a local disk both are written first and fsynced together (the
        marker under a temporary name), then the marker is renamed into place and the directory
        fsynced: two waits for the disk where writing one after the other takes three. Elsewhere:
        one upload after the other (each is atomic)."""
        if not self.local:
            self.write_bytes(rel, data)
            self.write_bytes(marker, mark)
            return
        final = self.path(marker)
        head, name = os.path.split(marker)
        tmp = os.path.join(head, f".{name}.{uuid.uuid4().hex[:8]}.tmp")  # beside it, hidden (as write_atomic's)
        syncs = Syncs()
        try:
            for r, b in ((rel, data), (tmp, mark)):
                with self.writer(r, syncs=syncs) as w:
                    w.write(b)
            syncs.finish()
            os.replace(self.path(tmp), final)
        except BaseException:
            syncs.abandon()
            if os.path.exists(self.path(tmp)):
                os.remove(self.path(tmp))
            raise
        fsync_path(os.path.dirname(final))

    # ------------------------------------------------------------------ reading
    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    @contextmanager
    def reader(self, rel: str) -> Iterator["Reader"]:
        """A file open for reads at offsets into caller's buffers (:class:`Reader`)."""
        if self.local:
            fd = os.open(self.path(rel), os.O_RDONLY)  # FileNotFoundError: the caller says what is missing
            try:
                yield Reader(os.fstat(fd).st_size, fd, None)
            finally:
                os.close(fd)
            return
        f = self.fs.open_input_file(self.path(rel))
        try:
            yield Reader(f.size(), None, f)
        finally:
            f.close()

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def is_dir(self, rel: str = "") -> bool:
        return self.fs.get_file_info(self.path(rel)).type == pafs.FileType.Directory

    def size(self, rel: str) -> int:
        return int(self.fs.get_file_info(self.path(rel)).size or 0)

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the directories directly under ``rel`` (empty if it does not exist)."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        except (FileNotFoundError, pa.ArrowInvalid):
            return []
        return sorted(os.path.basename(i.path.rstrip("/")) for i in infos if i.type == pafs.FileType.Directory)

    def list_files(self, rel: str = "") -> list[str]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        except (FileNotFoundError, pa.ArrowInvalid):
            return []
        return sorted(os.path.basename(i.path) for i in infos if i.type == pafs.FileType.File)

    def probe_write(self) -> None:
        """Create the root and write, then delete, a small file in it: raises OSError (what the
        filesystem said) when this process cannot. Leaves the root directory behind."""
        probe = f".write-probe-{uuid.uuid4().hex[:8]}"
        self.makedirs("")
        self.write_bytes(probe, b"elastic-llm")
        self.fs.delete_file(self.path(probe))

    def delete_dir(self, rel: str) -> None:
        try:
            self.fs.delete_dir(self.path(rel))
        except FileNotFoundError:
            pass


class Writer:
    """One open output stream; counts bytes and optionally throttles to ``max_mb_s``.
    ``during_sync``: work the caller runs while the file is made durable (see :meth:`Storage.writer`)."""

    def __init__(self, stream: Any, max_mb_s: float) -> None:
        self.stream = stream
        self.nbytes = 0
        self.max_bps = max_mb_s * 1e6
        self.during_sync: Callable[[], None] | None = None
        self._t0 = time.monotonic()

    def write(self, data: Any) -> None:
        self._put(memoryview(data).cast("B"))
        self._throttle(memoryview(data).nbytes)

    def _put(self, view: memoryview) -> None:
        self.stream.write(view)

    def _throttle(self, n: int) -> None:
        self.nbytes += n
        if self.max_bps > 0:
            ahead = self.nbytes / self.max_bps - (time.monotonic() - self._t0)
            if ahead > 0:
                time.sleep(ahead)

    def close(self, sync: bool) -> None:
        self.stream.close()
        if sync and self.during_sync is not None:
            self.during_sync()


class FileWriter(Writer):
    """A local file by its descriptor: writes under :data:`GATHER` bytes are gathered (the
    caller's views, no copy) and go to the file in one ``writev`` of up to :data:`KICK` bytes,
    larger ones from the caller's memory in calls of :data:`KICK` bytes; after each, the device
    is asked to start writing what was just written (:func:`_start_writeback`). The caller's
    buffers must stay unchanged until the writer is closed. The close hands the file to
    ``syncs`` (or to a :class:`Syncs` of its own, finished at once): one fsync per file."""

    def __init__(self, fd: int, max_mb_s: float, syncs: "Syncs | None" = None, path: str = "") -> None:
        super().__init__(None, max_mb_s)
        self.fd, self.path = fd, path
        self.syncs = syncs
        self.gathered: list[memoryview] = []
        self.used = 0  # bytes gathered
        self.offset = 0  # bytes written to the file so far
        self.kicked = 0  # of which the device was asked to write this many
        self.kick = _writeback

    def _put(self, view: memoryview) -> None:
        if len(view) < GATHER:
            self.gathered.append(view)
            self.used += len(view)
            if self.used >= KICK or len(self.gathered) >= IOV_MAX:
                self._drain()
            return
        self._drain()
        while len(view):
            n = os.write(self.fd, view[:KICK])
            view = view[n:]
            self._written(n)

    def _drain(self) -> None:
        views = self.gathered
        while views:
            n = os.writev(self.fd, views)
            self._written(n)
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        self.used = 0

    def _written(self, n: int) -> None:
        self.offset += n
        if self.kick is not None and self.offset - self.kicked >= KICK:
            if not self.kick(self.fd, self.kicked, self.offset - self.kicked):
                self.kick = None  # refused here (not a regular file?): the fsync alone then
            self.kicked = self.offset

    def close(self, sync: bool) -> None:
        if sync:
            try:
                self._drain()
            except BaseException:
                os.close(self.fd)
                raise
            syncs = self.syncs if self.syncs is not None else Syncs()
            syncs.add(self.fd, self.during_sync, self.path)  # the descriptor is the Syncs' to close now
            if self.syncs is None:
                syncs.finish()
        else:
            os.close(self.fd)


class Syncs:
    """Local files written and not yet durable, made durable together by :meth:`finish`: each
    file's fsync on a helper thread of its own (the device writes their tails at once) while each
    file's ``during_sync`` check runs on the caller's thread; every descriptor is closed and the
    first error raised once all have ended, or once :data:`FSYNC_S` has passed: a file whose fsync
    still has not returned then raises :class:`StorageHung` (its descriptor is closed by its
    fsync's thread, if that ever returns). :meth:`abandon` closes them without waiting."""

    def __init__(self) -> None:
        self.files: list[tuple[int, Callable[[], None] | None, str]] = []

    def add(self, fd: int, during_sync: Callable[[], None] | None, path: str = "") -> None:
        self.files.append((fd, during_sync, path))

    def finish(self) -> None:
        files, self.files = self.files, []
        failed: list[OSError] = []
        ended: set[int] = set()  # the descriptors whose fsync returned
        lock, gave_up = threading.Lock(), threading.Event()

        def fsync(fd: int) -> None:
            try:
                os.fsync(fd)
            except OSError as e:  # raised in the caller's thread below
                failed.append(e)
            with lock:
                ended.add(fd)
                if gave_up.is_set():  # the caller no longer waits: the descriptor is this thread's to close
                    os.close(fd)

        threads = [threading.Thread(target=fsync, args=(fd,), name="elastic-llm-fsync", daemon=True) for fd, _, _ in files]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        try:
            for _, check, _ in files:
                if check is not None:
                    check()
        finally:
            for t in threads:
                t.join(max(0.0, t0 + FSYNC_S - time.monotonic()))
            with lock:
                gave_up.set()
                hung = [path or f"descriptor {fd}" for fd, _, path in files if fd not in ended]
                for fd in ended:
                    os.close(fd)
        if hung:
            why = (f"the fsync of {', '.join(hung)} has not returned after {time.monotonic() - t0:.3g} s (FSYNC_S={FSYNC_S:g}): the filesystem "
                   "holding it hangs (a lost NFS server or mount, a stuck device) and the file is not durable; check that storage")
            log.warning("%s", why)
            raise StorageHung(why)
        if failed:
            raise failed[0]

    def abandon(self) -> None:
        files, self.files = self.files, []
        for fd, _, _ in files:
            os.close(fd)


class Reader:
    """Reads of a file at an offset straight into a caller's buffer: ``os.preadv`` on a local
    disk, pyarrow's ``readinto`` elsewhere."""

    def __init__(self, size: int, fd: int | None, f: Any) -> None:
        self.size, self.fd, self.f = size, fd, f

    def read_at(self, offset: int, into: Any) -> int:
        """Fill ``into`` (a writable contiguous buffer) from ``offset``; returns the bytes read
        (fewer at the end of the file)."""
        view = memoryview(into).cast("B")
        if self.fd is not None:
            done = 0
            while done < len(view):
                got = os.preadv(self.fd, [view[done:]], offset + done)
                if got == 0:
                    break
                done += got
            return done
        self.f.seek(offset)
        done = 0
        while done < len(view):
            got = self.f.readinto(view[done:])
            if not got:
                break
            done += got
        return done


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
