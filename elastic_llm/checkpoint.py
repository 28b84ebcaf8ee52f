"""Periodic checkpoints of ``recovery.mode: checkpoint`` (the checkpointing baseline) in a local
directory.

Owns: the file layout ``{dir}/step-{step:08d}/stage-{s}-{r}.bin`` (the stage's state bytes, the
same layout as a snapshot) with ``stage-{s}-{r}.json`` (its manifest) and, written last, a
``COMMITTED`` marker holding the step and the data position; which checkpoint is the newest
committed one. Files are written to a temporary name and renamed, so a crash leaves no file
that looks complete. Never unpickles: loading reads raw bytes and JSON, and the stage checks the
manifest against itself before using them. Never decides when to checkpoint (the controller does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from elastic_llm.files import write_atomic

MARKER = "COMMITTED"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing or unreadable; the message names it."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _write(path: Path, data: bytes | np.ndarray) -> None:
    """All or nothing, on disk before the rename (a checkpoint must survive a crash)."""
    write_atomic(path, "wb", (lambda f: data.tofile(f)) if isinstance(data, np.ndarray) else (lambda f: f.write(data)), fsync=True)


def write_stage(root: str | Path, step: int, stage: int, replica: int, buffer: np.ndarray, manifest: str) -> int:
    """Write one stage's state of ``step``; returns the bytes written."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    _write(d / f"stage-{stage}-{replica}.bin", np.ascontiguousarray(buffer))
    _write(d / f"stage-{stage}-{replica}.json", manifest.encode())
    return int(buffer.nbytes)


def read_stage(root: str | Path, step: int, stage: int, replica: int) -> tuple[np.ndarray, str]:
    """(state bytes, manifest) of one stage of checkpoint ``step``."""
    d = step_dir(root, step)
    try:
        manifest = (d / f"stage-{stage}-{replica}.json").read_text()
        data = np.fromfile(d / f"stage-{stage}-{replica}.bin", dtype=np.uint8)
    except OSError as e:
        raise CheckpointError(f"checkpoint of step {step} in {d} has no readable file for stage {stage} replica {replica}: {e}") from None
    return data, manifest


def commit(root: str | Path, step: int, data_position: dict[str, int]) -> None:
    """Mark checkpoint ``step`` complete (after every stage wrote its files)."""
    _write(step_dir(root, step) / MARKER, json.dumps({"step": step, "data_position": data_position}).encode())


def latest(root: str | Path) -> tuple[int, dict[str, Any]] | None:
    """(step, data position) of the newest committed checkpoint under ``root``, or None."""
    best: tuple[int, dict[str, Any]] | None = None
    for d in Path(root).glob("step-*"):
        try:
            marker = json.loads((d / MARKER).read_text())
            step = int(marker["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not committed (or not ours): ignored
        if best is None or step > best[0]:
            best = (step, dict(marker.get("data_position") or {}))
    return best
