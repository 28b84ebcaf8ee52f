"""The processes a soak strikes from outside a run: which process a stage or a manager runs in now.

Owns: finding the process of a stage actor (asked of the actor itself; else its recorded pid, if
that process is still a stage actor's: a recorded pid can be stale, its number given to another
process) and of a node's snapshot manager, and resuming stopped processes when their pause is
over. Never decides what to strike or when (:mod:`.runner` does).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from elastic_llm.controller.ports import StageActors
from elastic_llm.snapshot.records import ShardKey


def _pid(actor_self: Any) -> int:  # runs inside an actor (``__ray_call__``)
    return os.getpid()


def manager_pid(snapshots: Any, node: str, timeout_s: float) -> int | None:
    """The process of the run's snapshot manager on ``node`` (None: there is none, or it is
    dead: a killed manager the run has not replaced yet)."""
    import ray

    handle = snapshots.managers.get(node) if snapshots is not None else None
    if handle is None:
        return None
    try:
        return int(ray.get(handle.__ray_call__.remote(_pid), timeout=timeout_s))
    except ray.exceptions.RayActorError:
        return None


def stage_pid(group: StageActors, key: ShardKey, timeout_s: float) -> int:
    """The process of stage ``key``'s actor now (see the module's docstring)."""
    import ray

    actor: Any = group.actors[key.replica][key.stage]  # a Ray actor: this soak runs on Ray
    try:
        return int(ray.get(actor.__ray_call__.remote(_pid), timeout=timeout_s))
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # gone, or busy: the recorded pid, if it still is a stage actor's
        pid = group.pids[key]
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        title = b""
    if not title.startswith(b"ray::StageWorker"):
        raise RuntimeError(f"stage {key.stage}'s actor did not answer and its recorded pid {pid} is no longer a stage actor's process ({title[:40]!r})")
    return pid


def resume_paused(paused: dict[int, float], now: float, every: bool = False) -> dict[int, float]:
    """SIGCONT the stopped processes whose pause is over (``every``: all of them); the rest."""
    left = {}
    for pid, at in paused.items():
        if not (every or now >= at):
            left[pid] = at
            continue
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # it died meanwhile: nothing to resume
            continue
    return left
