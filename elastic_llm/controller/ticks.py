"""Where a run's time goes, by state, and what other threads ask of it.

Owns: the seconds (on the run's clock) and the driver process's CPU seconds spent in each
state's handler (:meth:`Ticks.count`; counted also when a handler is interrupted), as the runtime
reads them (a simulation leaves its own bookkeeping out); the requests of other threads
(:class:`Requests`), applied by the run's own thread. Never decides anything.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elastic_llm.clock import Clock



class Ticks:
    def __init__(self, clock: Clock, cpu: Callable[[], float]) -> None:
        self.clock, self.read_cpu = clock, cpu
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # the controller's own CPU (the runtime's reading: a simulation leaves out its own bookkeeping)

    @contextmanager
    def count(self, state: str) -> Iterator[None]:
        t, cpu = self.clock.perf_counter(), self.read_cpu()
        try:
            yield
        finally:
            self.seconds[state] = self.seconds.get(state, 0.0) + self.clock.perf_counter() - t
            self.cpu[state] = self.cpu.get(state, 0.0) + self.read_cpu() - cpu


class Requests:
    """What other threads ask of a running controller (a signal handler, a replay, a soak harness):
    stop at the next step boundary, or train more steps than asked. Queued here and applied by
    the run's own thread at the next step boundary (:meth:`take`): nobody else writes its fields."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()

    def stop(self) -> None:
        self._queue.put(("stop", 0))

    def extend(self, steps: int) -> None:
        self._queue.put(("extend", steps))

    def take(self) -> tuple[bool, int]:
        """(whether a stop was asked for, steps to add) since the last call."""
        stop, extra = False, 0
        while True:
            try:
                what, n = self._queue.get_nowait()
            except queue.Empty:
                return stop, extra
            stop, extra = stop or what == "stop", extra + (n if what == "extend" else 0)
