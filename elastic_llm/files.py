"""Writing a file all or nothing.

Owns: :func:`write_atomic`, a write through a temporary file beside the target and
``os.replace`` (optionally fsynced first), so a reader sees the old file or the whole new one,
never a part. Never decides what to write or where.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: Path, mode: str, write: Callable[[IO[Any]], object], fsync: bool = False) -> None:
    """Write ``path`` through ``write(f)`` on a temporary file beside it, then rename it into place.
    ``fsync``: force the bytes to disk before the rename (checkpoint files)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; these files are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
