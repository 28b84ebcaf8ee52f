"""The controller's clock, as a seam: the real one reads ``time``; a simulation passes its own.

Owns: :class:`Clock` (the four readings the controller and the snapshot coordinator take:
``perf_counter`` for durations, ``monotonic`` for deadlines, ``time`` for wall-clock instants
such as a drain's deadline, and ``sleep``) and :data:`SYSTEM`, the real one. Never decides
anything; :mod:`elastic_llm.sim` gives a simulated clock whose ``sleep`` advances simulated time.
"""

from __future__ import annotations

import time as _time
from typing import Protocol


class Clock(Protocol):
    def perf_counter(self) -> float: ...

    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The machine's clocks."""

    perf_counter = staticmethod(_time.perf_counter)
    monotonic = staticmethod(_time.monotonic)
    time = staticmethod(_time.time)
    sleep = staticmethod(_time.sleep)


SYSTEM: Clock = SystemClock()
