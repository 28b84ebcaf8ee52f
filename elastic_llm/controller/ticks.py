"""Where a run's time goes, by state.

Owns: the seconds (on the run's clock) and the driver process's CPU seconds spent in each
state's handler (:meth:`Ticks.count`; counted also when a handler is interrupted), as the runtime
reads them (a simulation leaves its own bookkeeping out). Never decides anything.
"""

from __future__ import annotations

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
