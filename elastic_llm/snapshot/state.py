"""A stage's training state as one flat byte buffer plus a JSON manifest: no pickle anywhere.

Owns: the byte layout of a stage's state (parameters, AdamW moments and step counts, torch RNG
states), the JSON part (LR scheduler, optimizer hyper-parameters, numpy and python RNG states,
data position, step, config hash), copying state into a reused, preallocated buffer (the whole
buffer, or one data-parallel replica's 1/DP slice of it), and restoring from it bit for bit.
Never talks to Ray: snapshot managers move the bytes, this module only packs and unpacks them.

Loading checks the manifest against the live module (names, shapes, dtypes, sizes, config hash)
and refuses a foreign or corrupted snapshot with :class:`SnapshotFormatError`.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

FORMAT = "elastic-llm-stage-state"
FORMAT_VERSION = 1
ALIGN = 64


class SnapshotFormatError(ValueError):
    """A snapshot does not match this stage (foreign, corrupted or from another config)."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @staticmethod
    def from_json(item: list[Any]) -> "Entry":
        name, dtype, shape, offset, nbytes = item
        return Entry(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes))




def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def state_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the state, in a fixed order: parameters, then each one's optimizer state.

    These are identical on all data-parallel replicas of a stage, so replicas can each write a
    slice. RNG states differ per replica and travel in the JSON part instead.
    """
    out: list[tuple[str, torch.Tensor]] = []
    named = list(module.named_parameters())
    out += [(f"param/{n}", p) for n, p in named]
    for n, p in named:
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(value):
                out.append((f"optim/{n}/{key}", value))
    return out


class StateLayout:
    """Offsets of every state tensor in the flat buffer; fixed for a stage once built."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        entries = []
        offset = 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(Entry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        self.entries = entries
        self.nbytes = offset

    def slice_bounds(self, replica: int, dp: int) -> tuple[int, int]:
        """Byte range that replica ``replica`` of ``dp`` writes (ALIGN-aligned)."""
        per = -(-self.nbytes // (dp * ALIGN)) * ALIGN
        return min(self.nbytes, replica * per), min(self.nbytes, (replica + 1) * per)


def copy_into(buffer: np.ndarray, layout: StateLayout, tensors: list[tuple[str, torch.Tensor]], lo: int = 0, hi: int | None = None) -> None:
    """Copy the bytes [lo, hi) of the state into ``buffer`` (same offsets). GIL released in copy_."""
    hi = layout.nbytes if hi is None else hi
    dst = torch.from_numpy(buffer)
    for e, (_, t) in zip(layout.entries, tensors):
        a, b = max(lo, e.offset), min(hi, e.offset + e.nbytes)
        if a >= b:
            continue
        src = _byte_view(t)[a - e.offset : b - e.offset]
        dst[a:b].copy_(src, non_blocking=src.is_cuda)


def json_state(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int,
    data_position: dict[str, int] | None,
    config_hash: str,
) -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    sched = scheduler.state_dict()  # lr_lambdas are plain functions: saved as None, rebuilt from config
    return {
        "step": step,
        "config_hash": config_hash,
        "data_position": data_position,
        "scheduler": sched,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]],
        "rng_numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "rng_python": [py_state[0], list(py_state[1]), py_state[2]],
        "rng_torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "rng_cuda": [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else [],
    }


def make_manifest(layout: StateLayout, extra: dict[str, Any], stage: int) -> str:
    return json.dumps(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "stage": stage,
            "nbytes": layout.nbytes,
            "entries": [e.to_json() for e in layout.entries],
            **extra,
        }
    )


def parse_manifest(text: str | bytes) -> dict[str, Any]:
    try:
        m = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SnapshotFormatError(f"snapshot manifest is not JSON ({e}): the snapshot is corrupted or not an elastic-llm snapshot") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise SnapshotFormatError("not an elastic-llm stage snapshot (format field missing): refusing to load it")
    if m.get("format_version") != FORMAT_VERSION:
        raise SnapshotFormatError(f"snapshot format version {m.get('format_version')} is not {FORMAT_VERSION}: written by another elastic-llm version")
    return m


def restore(
    buffer: np.ndarray,
    manifest: dict[str, Any],
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    config_hash: str,
    stage: int,
) -> dict[str, Any]:
    """Load parameters, optimizer, scheduler and RNG states from ``buffer``; return the JSON part.

    Every entry is checked against the live stage first, so nothing is modified if the snapshot
    does not fit.
    """
    if manifest.get("config_hash") != config_hash:
        raise SnapshotFormatError(
            f"snapshot was taken with config {manifest.get('config_hash')}, this run is {config_hash}: "
            "restore it with the config it was written with"
        )
    if manifest.get("stage") != stage:
        raise SnapshotFormatError(f"snapshot is of stage {manifest.get('stage')}, not stage {stage}")
    if len(buffer) < int(manifest["nbytes"]):
        raise SnapshotFormatError(f"snapshot buffer has {len(buffer)} bytes, manifest says {manifest['nbytes']}: truncated")
    entries = [Entry.from_json(e) for e in manifest["entries"]]
    params = dict(module.named_parameters())
    # optimizer state may not exist yet on a fresh stage: create it so shapes can be filled
    for p in params.values():
        st = optimizer.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    targets: dict[str, torch.Tensor] = {}
    for n, p in params.items():
        targets[f"param/{n}"] = p
        for key, value in optimizer.state[p].items():
            if torch.is_tensor(value):
                targets[f"optim/{n}/{key}"] = value
    names = {e.name for e in entries}
    if names != set(targets):
        missing, extra = sorted(set(targets) - names)[:3], sorted(names - set(targets))[:3]
        raise SnapshotFormatError(f"snapshot does not fit this stage: missing {missing}, unexpected {extra}")
    for e in entries:
        if e.offset < 0 or e.offset + e.nbytes > len(buffer):
            raise SnapshotFormatError(f"entry {e.name} lies outside the snapshot buffer: corrupted manifest")
        t = targets[e.name]
        if tuple(t.shape) != e.shape or str(t.dtype).removeprefix("torch.") != e.dtype or t.numel() * t.element_size() != e.nbytes:
            raise SnapshotFormatError(f"entry {e.name}: snapshot has {e.dtype}{list(e.shape)}, stage has {t.dtype}{list(t.shape)}")
    src = torch.from_numpy(buffer)
    with torch.no_grad():
        for e in entries:
            _byte_view(targets[e.name]).copy_(src[e.offset : e.offset + e.nbytes])
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(manifest["rng_torch"])), dtype=torch.uint8))
    for i, state in enumerate(manifest.get("rng_cuda", [])):
        if torch.cuda.is_available() and i < torch.cuda.device_count():
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8), i)
    for group, saved in zip(optimizer.param_groups, manifest["param_groups"]):
        for k, v in saved.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    scheduler.load_state_dict(dict(manifest["scheduler"]))
    kind, keys, pos, has_gauss, cached = manifest["rng_numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = manifest["rng_python"]
    random.setstate((version, tuple(internal), gauss))
    return manifest
