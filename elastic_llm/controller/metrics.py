"""JSON-lines metrics of a run: one line per step, one per event.

Owns: the metrics file, and handing every line to its observers (the run's monitor actor).
Never decides anything; flushed per line so a crash loses nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any, Callable


class MetricsWriter:
    def __init__(self, path: str | Path | None) -> None:
        self.file: IO[str] | None = None
        self.observers: list[Callable[[dict[str, Any]], None]] = []
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "w")

    def write(self, record: dict[str, Any]) -> None:
        for observe in self.observers:
            observe(record)
        if self.file:
            self.file.write(json.dumps(record, default=str) + "\n")
            self.file.flush()

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        record = {"event": name, "time": time.time(), **fields}
        self.write(record)
        return record

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
