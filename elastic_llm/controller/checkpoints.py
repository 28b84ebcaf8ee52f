"""The checkpointing baseline (``recovery.mode: checkpoint``): a checkpoint of every stage every
``recovery.checkpoint_every`` steps, and rolling everyone back to the newest one.

Owns: when a checkpoint is due, the stages' save / load calls (each stage writes its own files,
:mod:`elastic_llm.checkpoint`), the commit marker written after all of them, and the time spent
(training waits for the checkpoint: that is the cost the baseline pays). Step 0 is checkpointed
when the run starts, so a failure before the first periodic checkpoint rolls back to the
initial state. Never decides to roll back (the policy does).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

from elastic_llm import checkpoint as files
from elastic_llm.clock import Clock
from elastic_llm.controller.ports import StageActors
from elastic_llm.stream import StreamPosition


@dataclass
class CheckpointStats:
    saved: int = 0
    seconds: float = 0.0
    nbytes: int = 0
    steps: list[int] = field(default_factory=list)


class CheckpointExecutor:
    def __init__(self, group: StageActors, every: int, root: str | None, clock: Clock) -> None:
        self.group = group
        self.clock = clock
        self.every = every
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if not root:
            self._tmp = tempfile.TemporaryDirectory(prefix="elastic-llm-ckpt-")
            root = self._tmp.name
        self.root = root
        self.stats = CheckpointStats()
        found = files.latest(self.root)  # this executor writes every checkpoint: kept in memory, not re-read each step
        self._latest = (found[0], StreamPosition.of(found[1]) if found[1] else StreamPosition()) if found else None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, data_position: StreamPosition) -> float:
        """Every stage writes checkpoint ``step``, then the commit marker; returns the seconds."""
        t0 = self.clock.perf_counter()
        self.stats.nbytes += self.group.state.save_checkpoints(self.root, step)
        files.commit(self.root, step, data_position.to_dict())
        self._latest = (step, data_position)
        seconds = self.clock.perf_counter() - t0
        self.stats.saved += 1
        self.stats.seconds += seconds
        self.stats.steps.append(step)
        return seconds

    def latest(self) -> tuple[int, StreamPosition] | None:
        """(step, data position) of the newest committed checkpoint."""
        return self._latest

    def restore(self, step: int) -> None:
        """Every stage loads checkpoint ``step``."""
        self.group.state.load_checkpoints(self.root, step)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
