"""What a soak checks of a run besides its losses: its durable checkpoints, and the chaos events
that strike its in-step faults.

Owns: reading a run's newest durable checkpoint back (every tensor against its checksum) and
proving that a flipped byte in a copy of it is refused (:func:`check_checkpoint`); which of a
trial's faults the run's own chaos hook strikes from inside a step (:func:`hook_events`, pure);
a run's losses by step. Never strikes anything and never judges a trial (:mod:`.report` does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.soak.plan import FaultKind, TrialPlan, hooked


def verify_durable(t: Any) -> tuple[str | None, str | None]:
    """A finished run's newest durable checkpoint (see :func:`check_checkpoint`), which must also
    be of the run's newest committed step; (None, None) for a run without a durable tier."""
    if t.durable is None:
        return None, None
    latest = t.durable.latest()
    if latest is None:
        return None, "the run committed no durable checkpoint"
    step, name = latest
    committed = t.snapshots.committed.version if t.snapshots is not None and t.snapshots.committed is not None else None
    if committed is not None and step != committed:
        return None, f"the newest durable checkpoint is of step {step}, the newest committed snapshot of step {committed}"
    return check_checkpoint(t.durable.run, name)


def check_checkpoint(run: Any, name: str) -> tuple[str | None, str | None]:
    """Checkpoint ``name`` of run directory ``run`` read back (every tensor against its checksum),
    and a copy of it with one byte flipped refused: (what verified, None) or (None, why not)."""
    from elastic_llm.durable.format import Checkpoint

    try:
        summary = Checkpoint(run, name).verify()
    except Exception as e:
        return None, f"{name} does not verify: {type(e).__name__}: {e}"
    missed = flip_is_missed(run, name)
    if missed is not None:
        return None, missed
    return f"{name}: {summary['tensors']} tensors, {summary['bytes']} bytes; a byte flipped in a copy of it was detected", None


def flip_is_missed(run: Any, name: str) -> str | None:
    """Copy checkpoint ``name`` of a local run directory, flip one byte in the middle of its
    largest file, and verify the copy: None when the flip is refused with a DurableError, else
    what happened (object stores are not copied: None)."""
    import shutil
    import tempfile

    from elastic_llm.durable.format import Checkpoint, DurableError
    from elastic_llm.durable.storage import Storage

    src = Path(run.root) / name
    if "://" in run.uri and not run.uri.startswith("file://") or not src.is_dir():
        return None
    with tempfile.TemporaryDirectory(prefix="soak-flip-") as tmp:
        shutil.copytree(src, Path(tmp) / name)
        victim = max((f for f in (Path(tmp) / name).iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        try:
            Checkpoint(Storage(tmp), name).verify()
        except DurableError:
            return None
        except Exception as e:
            return f"a flipped byte in {victim.name} of a copy of {name} ended in {type(e).__name__}: {e} instead of a clear DurableError"
        return f"a flipped byte in {victim.name} of a copy of {name} was not detected"


def verify_durable_dir(cfg: RunConfig) -> tuple[str | None, str | None]:
    """The newest committed checkpoint in ``cfg``'s durable run directory (see :func:`check_checkpoint`)."""
    from elastic_llm.durable.format import newest_committed
    from elastic_llm.durable.tier import run_storage

    run = run_storage(cfg)
    newest = newest_committed(run)
    if newest is None:
        return None, "the run committed no durable checkpoint"
    return check_checkpoint(run, newest.name)


def losses(history: list[dict[str, Any]]) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history}  # a re-run step keeps its last loss


def hook_events(plan: TrialPlan) -> list[str]:
    """The run's chaos events that carry out ``plan``'s faults struck from inside a step (pure):
    a corrupt fault flips a byte of the stage's shard in its node's manager and kills the stage in
    the same (next) step, so that its recovery needs that shard; a stage fault aimed at an op
    kills the stage as it starts its first op of that kind in the next step."""
    out = []
    for f in plan.faults:
        hit = f.step + 1
        if f.kind is FaultKind.CORRUPT:
            out += [f"{{step: {hit}, kill: smp, stage: {f.stage}, corrupt: true}}", f"{{step: {hit}, kill: stage, stage: {f.stage}, how: sigkill}}"]
        elif hooked(f):
            out.append(f"{{step: {hit}, kill: stage, stage: {f.stage}, how: sigkill, op: {f.moment.value}}}")
    return out


