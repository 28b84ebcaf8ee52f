"""The ``ray.remote`` of each actor class and remote function, made once per process.

Owns: :func:`remote_of`. Ray uploads an actor class (or remote function) to its GCS once per
``ray.remote`` object and job: it pickles the class and disassembles every method to name it. A
``ray.remote(SnapshotManager)`` made at each manager's start did that again for every manager
(48 ms of the driver's CPU for the disassembly alone, 4 times at a run's start, and on the path
of a recovery that replaces a manager). Made once here, each class goes up once per job; the
per-start settings stay in ``.options(...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_made: dict[tuple[Callable[..., Any], str], Any] = {}


def remote_of(target: Callable[..., Any], **options: object) -> Any:
    """``ray.remote(**options)(target)`` (``target``: a class or function), the same object for
    the same target and options (compared by their ``repr``) for the life of this process."""
    key = (target, repr(sorted(options.items())))
    if key not in _made:
        import ray

        _made[key] = ray.remote(**options)(target) if options else ray.remote(target)
    return _made[key]
