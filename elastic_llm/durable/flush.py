"""Flushing one committed snapshot version to durable storage: what each manager writes.

Owns: cutting a committed version into shard files (:func:`plan_parts`, pure: stage ``s``'s
tensors go into as many parts as the version has data-parallel slices, part ``r`` holding the
tensors that start in slice ``r``, written by the manager that holds that slice), the
:class:`NodeFlush` a manager receives (its node's :class:`FlushPlan` s, one call per node), and
:func:`write_part`, which a snapshot manager runs to stream a part from the snapshot pieces in
the object store into one safetensors file (a node's parts one after the other, made durable together).

Memory: the manager maps its own pieces (zero-copy views of the object store) and pulls only the
pieces of other nodes' slices that its tensors overlap (a tensor crossing a slice boundary), so
the extra host memory of a flush is bounded by one part, not by the version. Never decides when
to flush, never commits (the driver writes the manifest and marker once every part is in).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from elastic_llm.durable.format import PartResult, TensorSpec, checkpoint_dir, global_name, shard_file, write_shard
from elastic_llm.durable.storage import Storage, StorageHung, Syncs
from elastic_llm.priority import nicer
from elastic_llm.snapshot.erasure import checksum
from elastic_llm.snapshot.records import Piece, ShardKey, VersionRecord, generation

log = logging.getLogger("elastic_llm.durable")
WRITE_S = 1500.0
"""Longest a node's writer thread (:func:`write_parts`) is waited for before its call fails.
Shorter than the driver's own deadline for a flush (``FLUSH_S``, 1800 s, in
:mod:`elastic_llm.durable.tier`), so that the driver hears which file hung and for how long
rather than failing the flush without a reason; a part written that long is a storage that
does not answer (a write or open that never returns), and the snapshot manager goes on
answering its other calls while the previous checkpoint stays the newest."""


@dataclass(frozen=True)
class SliceSource:
    """One data-parallel slice of a stage's state in the object store: held by ``manager``."""

    key: ShardKey
    lo: int
    pieces: tuple[Piece, ...]
    manager: Any  # SnapshotManager handle (None: the writing manager itself)
    node_id: str


@dataclass(frozen=True)
class FlushPlan:
    version: int
    storage_uri: str  # the run's directory
    stage: int
    part: int
    file: str  # relative to the run's directory: checkpoint_XXXXXXXX/stage_..._part_....safetensors
    tensors: tuple[TensorSpec, ...]
    slices: tuple[SliceSource, ...]
    max_mb_s: float = 0.0
    nice: int = 10  # how much nicer than its manager the writing thread runs (elastic_llm.priority.nicer): training on the same cores goes first


@dataclass(frozen=True)
class NodeFlush:
    """One node's parts of a flush: what its snapshot manager is sent (one call, not one per part)."""

    version: int
    plans: tuple[FlushPlan, ...]
    floor: int = 0  # the driver's membership generation: a manager of a newer one refuses it (elastic_llm.snapshot.fence)

    def write(self, local: Callable[[ShardKey], list[np.ndarray] | None]) -> list[PartResult]:
        """Carried out by the node's snapshot manager (:func:`write_parts`): the manager is handed
        this and never imports this module."""
        return write_parts(self.plans, local)


def by_node(plans: list[tuple[str, FlushPlan]], floor: int = 0) -> dict[str, NodeFlush]:
    """The plans of :func:`plan_parts` gathered per writing node; ``floor``: the driver's membership generation."""
    nodes: dict[str, list[FlushPlan]] = {}
    for node, plan in plans:
        nodes.setdefault(node, []).append(plan)
    return {node: NodeFlush(ps[0].version, tuple(ps), floor) for node, ps in nodes.items()}


def stage_tensors(manifest: str, layer_ids: list[int]) -> list[TensorSpec]:
    """The tensors of a stage's state (from a shard's manifest) under their global names."""
    m = json.loads(manifest)
    out = []
    for name, dtype, shape, offset, nbytes in m["entries"]:
        out.append(TensorSpec(global_name(name, layer_ids), dtype, tuple(shape), int(offset), int(nbytes)))
    return out


class StageTensors:
    """:func:`stage_tensors` of each stage, read from its manifest once per run: a stage's layout
    (its tensors, their order and sizes) is fixed by the model and the stage for the whole run,
    while parsing a manifest (its RNG states are long JSON lists) and naming its tensors took 2 ms
    of each flush's path on tiny. A manifest of another size than the one read is read again."""

    def __init__(self, layers_of: Callable[[int], list[int]]) -> None:
        self.layers_of = layers_of
        self._read: dict[tuple[int, int], list[TensorSpec]] = {}

    def __call__(self, stage: int, nbytes: int, manifest: str) -> list[TensorSpec]:
        """The tensors of ``stage``, whose state is ``nbytes`` long (``manifest``: one of its shards')."""
        if (stage, nbytes) not in self._read:
            self._read[(stage, nbytes)] = stage_tensors(manifest, self.layers_of(stage))
        return self._read[(stage, nbytes)]


def plan_parts(
    record: VersionRecord, storage_uri: str, tensors_of: Callable[[int, int, str], list[TensorSpec]], managers: dict[str, Any], max_mb_s: float = 0.0, nice: int = 10
) -> list[tuple[str, FlushPlan]]:
    """(node, plan) per shard file of ``record``: the writer is the node holding the part's slice
    now (re-homed or not). ``tensors_of(stage, nbytes, manifest)``: the tensors of the stage, whose
    state is ``nbytes`` long (:func:`stage_tensors` of its layers, or :class:`StageTensors`)."""
    plans = []
    for stage in sorted({s.key.stage for s in record.shards}):
        slices = sorted((s for s in record.shards if s.key.stage == stage), key=lambda s: s.lo)
        tensors = tensors_of(stage, sum(s.nbytes for s in slices), slices[0].manifest)
        sources = tuple(SliceSource(s.key, s.lo, s.pieces, managers.get(record.home(s.node_id)), record.home(s.node_id)) for s in slices)
        for part, sl in enumerate(slices):
            hi = sl.lo + sl.nbytes if part < len(slices) - 1 else None
            mine = tuple(t for t in tensors if t.src >= sl.lo and (hi is None or t.src < hi))
            file = f"{checkpoint_dir(record.version)}/{shard_file(stage, part, f'-g{generation(record.attempt)}')}"
            plans.append((record.home(sl.node_id), FlushPlan(record.version, storage_uri, stage, part, file, mine, sources, max_mb_s, nice)))
    return plans


class PieceReader:
    """Byte ranges of a stage's state from the pieces of its slices, fetched on first use (their
    lengths checked then) and checked against their recorded CRC-32s by :meth:`recheck` once
    written, while the file is fsynced: the bytes are views of object-store memory (no copy), so
    a piece that differs from its record (damaged before or during the write) would otherwise
    reach the file, and the file's own checksums (taken as it is written) would vouch for it. A
    part that fails it is never committed."""

    def __init__(self, plan: FlushPlan, local: Callable[[ShardKey], list[np.ndarray] | None]) -> None:
        self.pieces = sorted(((p, s) for s in plan.slices for p in s.pieces if p.length), key=lambda ps: ps[0].offset)
        self.local = local
        self.version = plan.version
        self._arrays: dict[ShardKey, list[np.ndarray]] = {}

    def _slice_arrays(self, src: SliceSource) -> list[np.ndarray]:
        import ray

        if src.key not in self._arrays:
            arrays = self.local(src.key)
            if arrays is None:
                if src.manager is None:
                    raise RuntimeError(f"{src.key} of step {self.version}: its snapshot manager on {src.node_id[:12]} is gone")
                refs = ray.get(src.manager.shard_parts.remote(self.version, src.key), timeout=600)
                arrays = [np.asarray(a) for a in ray.get(refs, timeout=600)]
            for arr, piece in zip(arrays, src.pieces):
                if len(arr) != piece.length:
                    raise RuntimeError(f"a piece of {src.key}, step {self.version} is {len(arr)} bytes, its record says {piece.length}: not flushed")
            self._arrays[src.key] = arrays
        return self._arrays[src.key]

    def recheck(self) -> None:
        """Every piece fetched so far still has its recorded CRC-32 (after the write)."""
        for key, arrays in self._arrays.items():
            src = next(s for _, s in self.pieces if s.key == key)
            for arr, piece in zip(arrays, src.pieces):
                if checksum(arr) != piece.crc:
                    raise RuntimeError(f"a piece of {key}, step {self.version} fails its checksum (damaged in memory): not flushed")

    def read(self, lo: int, hi: int) -> Iterator[np.ndarray]:
        for piece, src in self.pieces:
            a, b = max(lo, piece.offset), min(hi, piece.offset + piece.length)
            if a >= b:
                continue
            arr = self._slice_arrays(src)[src.pieces.index(piece)]
            yield arr[a - piece.offset : b - piece.offset]


def write_part(plan: FlushPlan, local: Callable[[ShardKey], list[np.ndarray] | None]) -> PartResult:
    """Stream ``plan``'s tensors into its file (run inside the snapshot manager holding the slice),
    on a thread of its own ``plan.nice`` steps nicer than its manager (Linux sets it per thread; the kernel's copy
    into the page cache is charged to that thread too). ``local(key)``: this manager's own pieces
    of ``key`` (None if it does not hold them)."""
    return write_parts((plan,), local)[0]


def write_parts(plans: tuple[FlushPlan, ...], local: Callable[[ShardKey], list[np.ndarray] | None]) -> list[PartResult]:
    """:func:`write_part` of every plan, one after the other on one thread (the plans'
    ``nice`` steps nicer than its manager), each file's bytes sent on to the device as they are written
    (:meth:`~elastic_llm.durable.storage.Storage.writer`) and every file fsynced at the end,
    together, while the pieces are checked against their records (one wait for the disk per
    node, not one per part; on the 2-core VM one thread writing tiny's four parts this way took
    26 ms, four threads in parallel 27 ms with twice the CPU). A part's ``seconds`` run until all
    are durable. The thread is joined before an error is raised, for at most :data:`WRITE_S`: a
    storage that hangs raises :class:`~elastic_llm.durable.storage.StorageHung` naming the file
    being written then (the thread is left to end on its own)."""
    out: list[Any] = []
    where = plans[0].storage_uri.split("?", 1)[0]  # (a URI's options left out of messages)
    doing = [f"starting to write under {where}"]  # what the thread is at, for the message if it hangs

    def run() -> None:
        try:
            nicer(max(p.nice for p in plans))  # relative to the manager's own (Ray's workers run at nice 15)
            t0 = time.perf_counter()
            syncs = Syncs()
            written: list[PartResult] = []
            try:
                for plan in plans:
                    doing[0] = f"writing {where}/{plan.file}"
                    written.append(_write_part(plan, local, syncs))
            except BaseException:
                syncs.abandon()
                raise
            doing[0] = f"the fsync of its {len(plans)} file(s) under {where}"
            syncs.finish()
            seconds = time.perf_counter() - t0
            out.extend(replace(r, seconds=seconds) for r in written)
        except BaseException as e:  # re-raised in the caller's thread
            out.append(e)

    worker = threading.Thread(target=run, name=f"flush-{plans[0].version}", daemon=True)
    t0 = time.monotonic()
    worker.start()
    worker.join(WRITE_S)
    if worker.is_alive():
        why = (f"step {plans[0].version}: {doing[0]} has not ended after {time.monotonic() - t0:.3g} s (WRITE_S={WRITE_S:g}): the storage "
               "does not answer (a lost mount, a stuck device); nothing of this flush is committed and the previous checkpoint stays the "
               "newest; check that storage (durable.storage_path)")
        log.warning("%s", why)
        raise StorageHung(why)
    if out and isinstance(out[-1], BaseException):
        raise out[-1]
    return out


def _write_part(plan: FlushPlan, local: Callable[[ShardKey], list[np.ndarray] | None], syncs: Syncs | None = None) -> PartResult:
    t0 = time.perf_counter()
    storage = Storage(plan.storage_uri)
    storage.makedirs(plan.file.rsplit("/", 1)[0])
    reader = PieceReader(plan, local)
    meta = {"format": "pt", "elastic_llm": "checkpoint shard", "stage": str(plan.stage), "part": str(plan.part), "step": str(plan.version)}
    nbytes, records = write_shard(storage, plan.file, list(plan.tensors), reader.read, meta, plan.max_mb_s, verify=reader.recheck, syncs=syncs)
    return PartResult(plan.stage, plan.part, plan.file.rsplit("/", 1)[1], nbytes, time.perf_counter() - t0, records)
