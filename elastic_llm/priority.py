"""Thread priority: background work (a snapshot's exchange, a durable flush) gives way to training.

Owns :func:`nicer`, the one way this project lowers a thread's CPU priority: *relative* to the
thread's own niceness, capped at 19. Never absolute: Ray starts its worker processes at nice 15,
so an absolute nice of 5 or 10 (what the exchange and the flush once set) puts background work
ahead of the training step on the same cores. Linux sets niceness per thread; elsewhere (or
without permission) the thread keeps its priority.
"""

from __future__ import annotations

import os
import threading


def nicer(by: int) -> None:
    """Run the calling thread ``by`` steps nicer than it runs now (at most 19)."""
    if by <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (OSError, AttributeError):  # not permitted, or not Linux
        pass
