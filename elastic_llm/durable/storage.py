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


GATHER = 1 << 20  # local writes smaller than this gather in a reused buffer (fewer system calls)
STAGING = 4 << 20  # that buffer's size


class StorageError(OSError):
    """The storage path cannot be used; the message names it and the fix."""


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
    def writer(self, rel: str, max_mb_s: float = 0.0) -> Iterator["Writer"]:
        """Stream a file. On a local disk: straight to the file descriptor (small writes gathered
        into one reused buffer, large ones written from the caller's memory), then fsynced before
        the context ends, with the writer's ``during_sync`` (if set) run meanwhile on this thread.
        Elsewhere: pyarrow's output stream (``during_sync`` runs after it closed)."""
        if self.local:
            fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            w: Writer = FileWriter(fd, max_mb_s)
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


_staging = threading.local()  # per writing thread: the reused buffer small writes gather in


class FileWriter(Writer):
    """A local file by its descriptor: writes under :data:`GATHER` bytes gather in a reused
    buffer of :data:`STAGING` bytes, larger ones go from the caller's memory in one call; the
    close fsyncs on a helper thread while ``during_sync`` runs on this one (one fsync per file)."""

    def __init__(self, fd: int, max_mb_s: float) -> None:
        super().__init__(None, max_mb_s)
        self.fd = fd
        if getattr(_staging, "buf", None) is None:
            _staging.buf = bytearray(STAGING)
        self.buf = memoryview(_staging.buf)
        self.used = 0

    def _put(self, view: memoryview) -> None:
        if len(view) < GATHER:
            if self.used + len(view) > len(self.buf):
                self._drain()
            self.buf[self.used : self.used + len(view)] = view
            self.used += len(view)
            return
        self._drain()
        self._write_all(view)

    def _drain(self) -> None:
        if self.used:
            self._write_all(self.buf[: self.used])
            self.used = 0

    def _write_all(self, view: memoryview) -> None:
        while len(view):
            view = view[os.write(self.fd, view) :]

    def close(self, sync: bool) -> None:
        try:
            if sync:
                self._drain()
                failed: list[OSError] = []

                def fsync() -> None:
                    try:
                        os.fsync(self.fd)
                    except OSError as e:  # raised in the writer's thread below
                        failed.append(e)

                syncing = threading.Thread(target=fsync, name="elastic-llm-fsync")
                syncing.start()
                try:
                    if self.during_sync is not None:
                        self.during_sync()
                finally:
                    syncing.join()
                if failed:
                    raise failed[0]
        finally:
            os.close(self.fd)


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
