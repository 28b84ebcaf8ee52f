"""Loading a stage's state from a durable checkpoint, and checking a checkpoint fits a run.

Owns: whether a checkpoint may be loaded into a run (:func:`check_fits`: same model, else a clear
error before anything is loaded), and turning a checkpoint's tensors into the byte layout of a
live stage (:func:`stage_state`): tensors are found by global name, so a stage of a run with
another data-parallel width, or another number of stages, takes exactly its layers. Runs inside
the stage actor (the bytes never pass through the driver). Never unpickles.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import numpy as np

from elastic_llm.config import RunConfig
from elastic_llm.durable.format import Checkpoint, DurableError, global_name


def check_fits(ck: Checkpoint, cfg: RunConfig) -> list[str]:
    """Raise :class:`DurableError` if ``ck`` is of another model; return warnings for other
    differences that change the math (the run goes on with its own config)."""
    m = ck.manifest
    mine, theirs = asdict(cfg.model), m.get("model") or {}
    if theirs != mine:
        diff = sorted(k for k in set(mine) | set(theirs) if theirs.get(k) != mine.get(k))
        what = ", ".join(f"model.{k}: {theirs.get(k)} there, {mine.get(k)} here" for k in diff[:4])
        raise DurableError(f"{ck.uri} is a checkpoint of another model ({what}): resume it with the config it was written with")
    old = m.get("config", {})
    keys = [f"{sec}.{k}" for sec in ("train", "parallel", "data") for k in set(old.get(sec, {})) | set(asdict(getattr(cfg, sec)))
            if old.get(sec, {}).get(k) != asdict(getattr(cfg, sec)).get(k)]
    return [f"{ck.uri} was written with other settings ({', '.join(sorted(keys)[:6])}): resuming with this run's"] if keys else []


def stage_state(ck: Checkpoint, entries: list[Any], nbytes: int, layer_ids: list[int], stage: int, replica: int, config_hash: str, buffer: np.ndarray) -> dict[str, Any]:
    """Fill ``buffer`` (``nbytes``, the live stage's layout ``entries``) from the checkpoint and
    return the manifest :func:`elastic_llm.snapshot.state.restore` takes: the JSON state of the
    same stage and replica in the checkpoint (the nearest one if the run was narrower or had
    fewer stages then), with this stage's layout."""
    names = {e.name: global_name(e.name, layer_ids) for e in entries}
    recs = ck.manifest["tensors"]
    for e in entries:  # before any byte is read: a checkpoint whose tensors do not fit this stage
        rec = recs.get(names[e.name])
        if rec is not None and (tuple(rec["shape"]) != tuple(e.shape) or rec["dtype"] != e.dtype):
            raise DurableError(f"{ck.uri}: tensor {names[e.name]} is {rec['dtype']}{rec['shape']}, this stage needs {e.dtype}{list(e.shape)}")
    ck.read_into({names[e.name]: buffer[e.offset : e.offset + e.nbytes] for e in entries})  # straight into the buffer, CRC-checked there
    end = 0
    for e in sorted(entries, key=lambda e: e.offset):  # the layout's padding, if any
        buffer[end : e.offset] = 0
        end = max(end, e.offset + e.nbytes)
    buffer[end:nbytes] = 0
    states = ck.manifest["states"]
    s = str(stage) if str(stage) in states else str(max(int(k) for k in states))
    by_replica = states[s]
    r = str(replica) if str(replica) in by_replica else str(max(int(k) for k in by_replica))
    state = dict(by_replica[r])
    state.update(
        format="elastic-llm-stage-state", format_version=1, stage=stage, nbytes=nbytes, config_hash=config_hash,
        entries=[e.to_json() for e in entries], slice=[0, nbytes],
    )
    json.dumps(state)  # only JSON went in
    return state
