"""JSON-lines metrics of a run: one line per step, one per event.

Owns: the metrics file (its missing parent directories are created; a place that cannot be
written is refused with :class:`MetricsError` when the writer is made, before any line), and
handing every line to its observers (the run's monitor actor). Event lines come from the typed
events of :mod:`elastic_llm.events` (:meth:`MetricsWriter.emit`), step lines as dicts.
Never decides anything; flushed per line so a crash loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import IO, Any, TypeVar

from elastic_llm.clock import Clock
from elastic_llm.events import Event

E = TypeVar("E", bound=Event)


class MetricsError(OSError):
    """The metrics file cannot be written; the message names it and the fix."""


class MetricsWriter:
    def __init__(self, path: str | Path | None, clock: Clock | None = None) -> None:
        self.clock = clock  # stamps each event's time (a simulation's clock); None: the time the event was made
        self.file: IO[str] | None = None
        self.observers: list[Callable[[Mapping[str, Any]], None]] = []
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self.file = open(path, "w")
            except OSError as e:
                raise MetricsError(f"cannot write the metrics file {path} ({why_unwritable(Path(path), e)}): give a path in a directory you can write") from None

    def write(self, record: dict[str, Any]) -> None:
        """A step line."""
        self._line(record, record)

    def emit(self, event: E) -> E:
        """Write ``event``'s line (:meth:`~elastic_llm.events.Event.record`); the observers get
        the event itself (it reads as its line). Returns the event (stamped with the writer's
        clock, if it has one)."""
        if self.clock is not None:
            event = dataclasses.replace(event, time=self.clock.time())
        self._line(event, event.record())
        return event

    def _line(self, seen: Mapping[str, Any], record: dict[str, Any]) -> None:
        for observe in self.observers:
            observe(seen)
        if self.file:
            self.file.write(json.dumps(record, default=str) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None


def why_unwritable(path: Path, error: OSError) -> str:
    """What stands in the way of writing the file ``path``: a directory in its place, a file in
    place of a parent directory, or what the system said (permission denied, read-only, ...)."""
    for p in (path, *path.parents):
        if not p.exists():
            continue
        if p == path and p.is_dir():
            return f"{p} is a directory"
        if p != path and not p.is_dir():
            return f"{p} is a file, not a directory"
        break
    return error.strerror or str(error)
