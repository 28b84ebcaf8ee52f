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
from typing import Any, Protocol

import numpy as np
import torch
from elastic_llm.tensors import host

FORMAT = "elastic-llm-stage-state"
FORMAT_VERSION = 1
ALIGN = 64


class Optimizer(Protocol):
    """What a snapshot reads and writes of a stage's AdamW (:class:`elastic_llm.pipeline.optim.StageAdamW`):
    its parameter groups' fields and its per-parameter tensors."""

    param_groups: list[dict[str, object]]
    state: dict[torch.Tensor, dict[str, torch.Tensor]]


class Schedule(Protocol):
    """What a snapshot reads and writes of a stage's LR schedule (:class:`elastic_llm.pipeline.optim.StageSchedule`)."""

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state: dict[str, object]) -> None: ...


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




def ensure_optimizer_state(module: torch.nn.Module, optimizer: Optimizer) -> None:
    """Create AdamW's per-parameter state (zero moments, step 0) up front, as its first step would.

    Zeros are what AdamW's first step starts from, so results are bit-identical; having the state
    exist from the start lets it live in the stage's arena and be restored into a fresh stage."""
    for p in module.parameters():
        st = optimizer.state.setdefault(p, {})
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)  # AdamW keeps step on the CPU unless capturable/fused
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_tensors(module: torch.nn.Module, optimizer: Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the state, in a fixed order: parameters, then the optimizer state by kind
    (all ``exp_avg``, all ``exp_avg_sq``, ..., all ``step``), so tensors of one device are adjacent.

    These are identical on all data-parallel replicas of a stage, so replicas can each write a
    slice. RNG states differ per replica and travel in the JSON part instead.
    """
    named = list(module.named_parameters())
    out: list[tuple[str, torch.Tensor]] = [(f"param/{n}", p) for n, p in named]
    keys = sorted({k for _, p in named for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)}, key=lambda k: (k == "step", k))
    for key in keys:
        for n, p in named:
            value = optimizer.state.get(p, {}).get(key)
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


class StateArena:
    """The stage's live state packed into contiguous memory laid out exactly like the snapshot.

    Parameters and optimizer tensors become views into one uint8 block per device (normally one
    block in all), at the offsets of :class:`StateLayout`. Capturing a snapshot is then one copy per
    block into the reused buffer, and restoring one copy back: no per-tensor loop, no allocation.
    The optimizer updates its tensors in place, so the views stay valid for the whole run.
    """

    def __init__(self, module: torch.nn.Module, optimizer: Optimizer) -> None:
        ensure_optimizer_state(module, optimizer)
        tensors = state_tensors(module, optimizer)
        self.layout = StateLayout(tensors)
        # consecutive entries on one device share a block: [(device, lo, hi, block)]
        self.blocks: list[tuple[torch.device, int, int, torch.Tensor]] = []
        runs: list[list[int]] = []
        for i, (_, t) in enumerate(tensors):
            if runs and tensors[runs[-1][0]][1].device == t.device:
                runs[-1].append(i)
            else:
                runs.append([i])
        views: dict[int, torch.Tensor] = {}
        entries = self.layout.entries
        for run in runs:
            lo = entries[run[0]].offset
            hi = entries[run[-1]].offset + -(-entries[run[-1]].nbytes // ALIGN) * ALIGN
            device = tensors[run[0]][1].device
            block = torch.zeros(hi - lo, dtype=torch.uint8, device=device)  # written once: pages are warm
            self.blocks.append((device, lo, hi, block))
            for i in run:
                e, (_, t) = entries[i], tensors[i]
                view = block[e.offset - lo : e.offset - lo + e.nbytes].view(t.dtype).view(t.shape)
                view.copy_(t.detach())
                views[i] = view
        by_name = {name: views[i] for i, (name, _) in enumerate(tensors)}
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.data = by_name[f"param/{n}"]
            for n, p in module.named_parameters():
                st = optimizer.state[p]
                for key in list(st):
                    if torch.is_tensor(st[key]):
                        st[key] = by_name[f"optim/{n}/{key}"]
        self._streams: dict[torch.device, Any] = {}  # CUDA copy streams, one per device

    def capture(self, buffer: np.ndarray, lo: int = 0, hi: int | None = None, after: Any = None) -> None:
        """Copy bytes [lo, hi) of the state into ``buffer`` at the same offsets (GIL released).

        Blocks on a CUDA device are copied on a stream of their own (so the copy overlaps the
        compute stream's next forward/backward) into ``buffer`` (pinned memory), ordered after the
        CUDA event ``after`` (recorded on the compute stream when the optimizer step was queued;
        None: one recorded now on the device's current stream, so a capture outside the step, a
        checkpoint's, a peer's or a promotion's, never reads weights the optimizer is still
        writing); returns once the copy is complete. Every capture of a stage's state goes
        through here."""
        hi = self.layout.nbytes if hi is None else hi
        dst = torch.from_numpy(buffer)
        streams = []
        for device, a0, b0, block in self.blocks:
            a, b = max(lo, a0), min(hi, b0)
            if a >= b:
                continue
            if device.type != "cuda":
                dst[a:b].copy_(block[a - a0 : b - a0])
                continue
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_event(after if after is not None else torch.cuda.current_stream(device).record_event())
            with torch.cuda.stream(stream):
                dst[a:b].copy_(block[a - a0 : b - a0], non_blocking=True)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()

    def load(self, parts: list[tuple[int, np.ndarray]]) -> None:
        """Copy ``parts`` ((offset, bytes) that together cover the whole layout) into the arena; a
        part that is the arena's own memory (read straight into :meth:`host_view`) is in place."""
        for offset, data in parts:
            src = torch.from_numpy(np.asarray(data))
            end = offset + src.numel()
            for _device, a0, b0, block in self.blocks:
                a, b = max(offset, a0), min(end, b0)
                if a < b and src[a - offset :].data_ptr() != block[a - a0 :].data_ptr():
                    block[a - a0 : b - a0].copy_(src[a - offset : b - offset])

    def host_view(self) -> np.ndarray | None:
        """The whole state's bytes as one writable numpy view of the arena, when it is one block in
        host memory (a CPU stage); None otherwise (a GPU stage reads into a host buffer first)."""
        if len(self.blocks) != 1 or self.blocks[0][0].type != "cpu" or self.blocks[0][1] != 0:
            return None
        return host(self.blocks[0][3])[: self.layout.nbytes]  # a view: the arena's own memory


def json_state(
    optimizer: Optimizer,
    scheduler: Schedule,
    step: int,
    data_position: dict[str, int] | None,
    config_hash: str,
) -> dict[str, Any]:
    np_state: Any = np.random.get_state()  # the legacy tuple form
    py_state = random.getstate()
    sched = scheduler.state_dict()  # lr_lambdas are plain functions: saved as None, rebuilt from config
    return {
        "step": step,
        "config_hash": config_hash,
        "data_position": data_position,
        "scheduler": sched,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "rng_numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "rng_python": [py_state[0], list(py_state[1]), py_state[2]],
        "rng_torch": base64.b64encode(host(torch.get_rng_state()).tobytes()).decode(),
        "rng_cuda": [base64.b64encode(host(s).tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
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
    parts: list[tuple[int, np.ndarray]],
    manifest: dict[str, Any],
    arena: StateArena,
    optimizer: Optimizer,
    scheduler: Schedule,
    config_hash: str,
    stage: int,
) -> dict[str, Any]:
    """Load parameters, optimizer, scheduler and RNG states; return the JSON part.

    ``parts`` are (byte offset, bytes) pieces of the state that together cover it (one buffer at
    offset 0, or data-parallel slices / snapshot pieces). Every entry and the coverage are checked
    against the live stage first, so nothing is modified if the snapshot does not fit.
    """
    if manifest.get("config_hash") != config_hash:
        raise SnapshotFormatError(
            f"snapshot was taken with config {manifest.get('config_hash')}, this run is {config_hash}: "
            "restore it with the config it was written with"
        )
    if manifest.get("stage") != stage:
        raise SnapshotFormatError(f"snapshot is of stage {manifest.get('stage')}, not stage {stage}")
    try:
        entries = [Entry.from_json(e) for e in manifest["entries"]]
        nbytes = int(manifest["nbytes"])
    except (KeyError, TypeError, ValueError) as err:
        raise SnapshotFormatError(f"snapshot manifest is malformed ({type(err).__name__}: {err}): the snapshot is corrupted") from None
    if nbytes != arena.layout.nbytes:
        raise SnapshotFormatError(f"snapshot holds {nbytes} bytes of state, this stage has {arena.layout.nbytes}: it is not this stage's snapshot")
    live = {e.name: e for e in arena.layout.entries}
    names = {e.name for e in entries}
    if names != set(live):
        missing, extra = sorted(set(live) - names)[:3], sorted(names - set(live))[:3]
        raise SnapshotFormatError(f"snapshot does not fit this stage: missing {missing}, unexpected {extra}")
    for e in entries:
        mine = live[e.name]
        if e.shape != mine.shape or e.dtype != mine.dtype or e.nbytes != mine.nbytes:
            raise SnapshotFormatError(f"entry {e.name}: snapshot has {e.dtype}{list(e.shape)}, stage has {mine.dtype}{list(mine.shape)}")
        if e.offset != mine.offset:
            raise SnapshotFormatError(f"entry {e.name} lies at byte {e.offset}, this stage's layout has it at {mine.offset}: corrupted manifest")
    covered = 0
    for offset, data in sorted(parts, key=lambda p: p[0]):
        if offset != covered:
            raise SnapshotFormatError(f"snapshot bytes [{min(offset, covered)}, {max(offset, covered)}) are missing or given twice: incomplete snapshot")
        covered += len(data)
    if covered < nbytes:
        raise SnapshotFormatError(f"snapshot buffer has {covered} bytes, manifest says {nbytes}: truncated")
    try:
        scheduler.load_state_dict(dict(manifest["scheduler"]))
    except (KeyError, TypeError, ValueError) as err:
        raise SnapshotFormatError(f"snapshot manifest's LR schedule is unreadable ({err}): the snapshot is corrupted") from None
    with torch.no_grad():
        arena.load(parts)
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(manifest["rng_torch"])), dtype=torch.uint8))
    for i, state in enumerate(manifest.get("rng_cuda", [])):
        if torch.cuda.is_available() and i < torch.cuda.device_count():
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8), i)
    for group, saved in zip(optimizer.param_groups, manifest["param_groups"]):
        for k, v in saved.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    kind, keys, pos, has_gauss, cached = manifest["rng_numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = manifest["rng_python"]
    random.setstate((version, tuple(internal), gauss))
    return manifest
