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
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs


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
        """Stream a file; on a local disk it is fsynced before the context ends."""
        stream = self.fs.open_output_stream(self.path(rel))
        w = Writer(stream, max_mb_s)
        ok = False
        try:
            yield w
            ok = True
        finally:
            stream.close()
            if ok and self.local:
                fsync_path(self.path(rel))

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
    """One open output stream; counts bytes and optionally throttles to ``max_mb_s``."""

    def __init__(self, stream: Any, max_mb_s: float) -> None:
        self.stream = stream
        self.nbytes = 0
        self.max_bps = max_mb_s * 1e6
        self._t0 = time.monotonic()

    def write(self, data: Any) -> None:
        self.stream.write(data)
        self.nbytes += memoryview(data).nbytes
        if self.max_bps > 0:
            ahead = self.nbytes / self.max_bps - (time.monotonic() - self._t0)
            if ahead > 0:
                time.sleep(ahead)


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
