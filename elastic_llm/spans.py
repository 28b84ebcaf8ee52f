"""A small span tracer: named wall-clock intervals the executors record around their work.

Owns: :class:`Spans` (``with spans.span("actor"): ...`` records ``(name, start, end)`` by
``time.perf_counter``) and summing them over a window (:meth:`Spans.totals`). The controller puts
the totals of a recovery, drain or resize into its metrics line (``plan_s``, ``actor_s``,
``state_s``), so benchmarks read where the time went instead of wrapping product methods.
Never decides or waits; keeps only the last :data:`KEEP` spans.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

KEEP = 4096  # spans kept (older ones are dropped)


class Spans:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # a simulation passes its simulated perf_counter
        self.records: deque[tuple[str, float, float]] = deque(maxlen=KEEP)
        self._open: dict[str, int] = {}  # names of the spans in progress (a nested one of the same name is not recorded)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        outer = self._open.get(name, 0) == 0
        self._open[name] = self._open.get(name, 0) + 1
        t = self.clock()
        try:
            yield
        finally:
            self._open[name] -= 1
            if outer:
                self.records.append((name, t, self.clock()))

    def totals(self, since: float, until: float | None = None) -> dict[str, float]:
        """Seconds per span name (as ``<name>_s``) of the spans that started in [since, until]
        (a span inside another of the same name counts once, as the outer one)."""
        out: dict[str, float] = {}
        for name, t0, t1 in self.records:
            if t0 >= since and (until is None or t0 <= until):
                out[f"{name}_s"] = out.get(f"{name}_s", 0.0) + (t1 - t0)
        return out


NULL = Spans()  # for executors built without a tracer (tests)
