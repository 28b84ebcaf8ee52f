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
import time
from dataclasses import dataclass, field

from elastic_llm import checkpoint as files
from elastic_llm.controller.actor_group import COPY_S, ActorGroup
from elastic_llm.stream import StreamPosition


@dataclass
class CheckpointStats:
    saved: int = 0
    seconds: float = 0.0
    nbytes: int = 0
    steps: list[int] = field(default_factory=list)


class CheckpointExecutor:
    def __init__(self, group: ActorGroup, every: int, root: str | None) -> None:
        self.group = group
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
        import ray

        t0 = time.perf_counter()
        calls = [self.group.actor(k).save_checkpoint.remote(self.root, step) for k in self.group.keys()]
        self.stats.nbytes += sum(ray.get(calls, timeout=COPY_S))
        files.commit(self.root, step, data_position.to_dict())
        self._latest = (step, data_position)
        seconds = time.perf_counter() - t0
        self.stats.saved += 1
        self.stats.seconds += seconds
        self.stats.steps.append(step)
        return seconds

    def latest(self) -> tuple[int, StreamPosition] | None:
        """(step, data position) of the newest committed checkpoint."""
        return self._latest

    def restore(self, step: int) -> None:
        """Every stage loads checkpoint ``step``."""
        import ray

        calls = [self.group.actor(k).load_checkpoint.remote(self.root, step) for k in self.group.keys()]
        ray.get(calls, timeout=COPY_S)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
