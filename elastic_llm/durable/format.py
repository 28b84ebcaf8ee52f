"""The durable checkpoint format: safetensors shards, a JSON manifest, a commit marker.

Owns: the layout ``{run}/checkpoint_{step:08d}/`` (Ray Train's convention, so each directory
opens with ``ray.train.Checkpoint.from_directory``) holding ``stage_{s:03d}_part_{p:03d}-g{generation}.
safetensors`` (the flushed version's attempt: a zombie's late write of an older attempt never lands in
a file the manifest names; whole tensors under global names: ``param/layers.7.attn.wqkv.weight``,
``optim/layers.7.attn.wqkv.weight/exp_avg``), ``manifest.json`` (config identity, step, data
position, per-stage RNG / schedule state of every replica, per tensor: file, dtype, shape,
CRC-32) and ``COMMITTED`` (the manifest's SHA-256, written last); the global names; writing one
shard by streaming byte ranges into it; reading and verifying. Never talks to Ray and never
decides when to write.

Shards are written here rather than by ``safetensors.save_file`` because that builds every tensor
as a Python ``bytes`` first (a second copy of the state in host memory); the streamed file is the
plain safetensors layout (8-byte header length, JSON header, tensors back to back) and is read
back with the ``safetensors`` library. Nothing here unpickles: a file is JSON or tensor bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic_llm.stream import TOKENIZER_FILE
from elastic_llm.durable.storage import Storage, StorageError, Syncs
from elastic_llm.snapshot.erasure import checksum
from elastic_llm.tensors import host_bytes

FORMAT = "elastic-llm-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
TOKENIZER = TOKENIZER_FILE
_DIR = re.compile(r"^checkpoint_(\d{8})$")
SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64", "int32": "I32", "uint8": "U8"}
_LAYER = re.compile(r"^layers\.(\d+)\.")


class DurableError(RuntimeError):
    """A durable checkpoint cannot be used; the message names the file and the fix."""


def checkpoint_dir(step: int) -> str:
    return f"checkpoint_{step:08d}"


def shard_file(stage: int, part: int, tag: str = "") -> str:
    """``tag``: the generation of the attempt that wrote it (``-g1.37``: driver 1, attempt 37)."""
    return f"stage_{stage:03d}_part_{part:03d}{tag}.safetensors"


def step_of(name: str) -> int | None:
    m = _DIR.match(name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- global names
def global_name(local: str, layer_ids: list[int]) -> str:
    """A stage's state entry name (``param/layers.0.x`` / ``optim/layers.0.x/exp_avg``) with the
    layer index made global (layer 0 of a stage holding layers 6..8 is layer 6)."""
    kind, rest = local.split("/", 1)

    def sub(m: re.Match[str]) -> str:
        return f"layers.{layer_ids[int(m.group(1))]}."

    return f"{kind}/{_LAYER.sub(sub, rest, count=1)}"


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its global name, dtype, shape and where its bytes lie in the stage's state."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    src: int
    nbytes: int


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    crc32: int


@dataclass(frozen=True)
class PartResult:
    stage: int
    part: int
    file: str
    nbytes: int
    seconds: float
    tensors: tuple[TensorRecord, ...]


# --------------------------------------------------------------------------- writing a shard
def safetensors_header(tensors: Iterable[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header (space-padded to 8 bytes) of a safetensors file whose
    tensors follow back to back in the given order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    pos = 0
    for t in tensors:
        if t.dtype not in SAFETENSORS_DTYPE:
            raise DurableError(f"tensor {t.name} has dtype {t.dtype}, which safetensors cannot store")
        header[t.name] = {"dtype": SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shard(
    storage: Storage, rel: str, tensors: list[TensorSpec], read: Callable[[int, int], Iterator[np.ndarray]], metadata: dict[str, str], max_mb_s: float = 0.0,
    verify: Callable[[], None] | None = None, syncs: Syncs | None = None,
) -> tuple[int, tuple[TensorRecord, ...]]:
    """Stream ``tensors`` into the safetensors file ``rel``: ``read(lo, hi)`` yields the stage
    state's bytes [lo, hi) in pieces (views, no copies), each CRC-32'd as it is written. Returns
    (bytes written, records with each tensor's CRC-32). ``verify``: run while the file is made
    durable (it raises to refuse what was written); ``syncs``: the file is durable (and
    verified) only once they are finished (:meth:`Storage.writer`)."""
    records = []
    with storage.writer(rel, max_mb_s, syncs) as w:
        w.during_sync = verify
        w.write(safetensors_header(tensors, metadata))
        for t in tensors:
            crc = 0
            for chunk in read(t.src, t.src + t.nbytes):
                crc = checksum(chunk, crc)
                w.write(chunk)
            records.append(TensorRecord(t.name, t.dtype, t.shape, crc))
        return w.nbytes, tuple(records)


# --------------------------------------------------------------------------- manifest and commit
def make_manifest(cfg: Any, step: int, run_name: str, states: list[tuple[int, int, str]], parts: list[PartResult], tokenizer_file: str | None) -> dict[str, Any]:
    """The manifest of checkpoint ``step``: ``states`` are (stage, replica, the shard manifest a
    stage wrote with its snapshot copy: RNG, LR schedule, data position); ``parts`` the written
    shard files with their tensors' CRC-32."""
    files, tensors = part_entries(parts)
    return {**manifest_base(cfg, step, run_name, states, tokenizer_file), "files": files, "tensors": tensors}


def part_entries(parts: list[PartResult]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest's ``files`` and ``tensors`` of the written shard files ``parts``."""
    tensors, files = {}, {}
    for part in sorted(parts, key=lambda x: (x.stage, x.part)):
        files[part.file] = {"stage": part.stage, "part": part.part, "nbytes": part.nbytes}
        for t in part.tensors:
            tensors[t.name] = {"file": part.file, "dtype": t.dtype, "shape": list(t.shape), "crc32": t.crc32, "stage": part.stage}
    return files, tensors


@dataclass(frozen=True)
class Draft:
    """A checkpoint's manifest but its files, already encoded: the durable tier drafts it while
    the managers write (its stages' RNG states make it about 100 KB on tiny: encoding and
    hashing it whole took 1.8 ms of the flush's path to its marker). :meth:`finish` adds the files."""

    head: bytes  # the JSON object of manifest_base without its closing brace

    def finish(self, parts: list[PartResult]) -> tuple[bytes, dict[str, Any]]:
        """(the manifest's bytes, its ``files``) once ``parts`` are written."""
        files, tensors = part_entries(parts)
        tail = json.dumps({"files": files, "tensors": tensors}, sort_keys=True, separators=(",", ":")).encode()
        return self.head + b"," + tail[1:], files


def draft(cfg: Any, step: int, run_name: str, states: list[tuple[int, int, str]], tokenizer_file: str | None) -> Draft:
    """:class:`Draft` of checkpoint ``step``'s manifest (:func:`manifest_base`, encoded)."""
    return Draft(manifest_bytes(manifest_base(cfg, step, run_name, states, tokenizer_file))[:-1])


def manifest_base(cfg: Any, step: int, run_name: str, states: list[tuple[int, int, str]], tokenizer_file: str | None) -> dict[str, Any]:
    """Everything in the manifest of checkpoint ``step`` but its ``files`` and ``tensors``
    (:func:`make_manifest`, :class:`Draft`)."""
    from dataclasses import asdict

    by_stage: dict[str, dict[str, Any]] = {}
    position = None
    for stage, replica, text in sorted(states):
        state = json.loads(text)
        for k in ("entries", "nbytes", "slice", "format", "format_version"):
            state.pop(k, None)
        by_stage.setdefault(str(stage), {})[str(replica)] = state
        position = position if position is not None else state.get("data_position")
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "run_name": run_name,
        "step": step,
        "config_hash": cfg.config_hash(),
        "model": asdict(cfg.model),
        "config": cfg.to_dict(),
        "tokenizer_file": tokenizer_file,
        "stages": cfg.parallel.stages,
        "width": 1 + max((r for _, r, _ in states), default=0),
        "data_position": position,
        "states": by_stage,
    }


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """Compact JSON (``json``'s C encoder; indenting falls back to its Python one, 2-3 ms of a
    52 MB flush's commit). ``python -m json.tool manifest.json`` shows it indented."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def commit(storage: Storage, ckpt: str, manifest: dict[str, Any]) -> str:
    """Write the manifest, then the marker naming its SHA-256 (never durable before the manifest;
    no rename of the manifest needed: until the marker names it, it is not trusted). Returns the digest."""
    return commit_bytes(storage, ckpt, int(manifest["step"]), manifest_bytes(manifest))


def commit_bytes(storage: Storage, ckpt: str, step: int, data: bytes) -> str:
    """:func:`commit` of a manifest already encoded (:meth:`Draft.finish`)."""
    digest = hashlib.sha256(data).hexdigest()
    storage.write_then_mark(f"{ckpt}/{MANIFEST}", data, f"{ckpt}/{MARKER}", json.dumps({"step": step, "manifest_sha256": digest}).encode())
    return digest


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory of a run as :func:`list_checkpoints` sees it."""

    name: str
    step: int
    committed: bool
    problem: str | None = None  # why it is not trusted (None: marker and manifest agree)


def _read_json(storage: Storage, rel: str, what: str) -> dict[str, Any]:
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError:
        raise DurableError(f"{storage.display(rel)} is missing: {what}") from None
    except OSError as e:
        raise DurableError(f"{storage.display(rel)} cannot be read ({e})") from None
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DurableError(f"{storage.display(rel)} is not JSON: the checkpoint is corrupted or not an elastic-llm checkpoint") from None
    if not isinstance(value, dict):
        raise DurableError(f"{storage.display(rel)} is not a JSON object: not an elastic-llm checkpoint")
    return value


def read_manifest(storage: Storage, ckpt: str) -> dict[str, Any]:
    """The manifest of a committed checkpoint, after checking the marker's digest of it."""
    marker = _read_json(storage, f"{ckpt}/{MARKER}", "the checkpoint was never committed (a flush did not finish): use an older one")
    try:
        data = storage.read_bytes(f"{ckpt}/{MANIFEST}")
    except FileNotFoundError:
        raise DurableError(f"{storage.display(ckpt)} has a commit marker but no {MANIFEST}: the checkpoint is damaged, use an older one") from None
    if hashlib.sha256(data).hexdigest() != marker.get("manifest_sha256"):
        raise DurableError(f"{storage.display(ckpt + '/' + MANIFEST)} does not match its commit marker's SHA-256: the manifest was changed or damaged")
    m = json.loads(data)
    if m.get("format") != FORMAT:
        raise DurableError(f"{storage.display(ckpt)} is not an elastic-llm checkpoint (format {m.get('format')!r})")
    if m.get("format_version") != FORMAT_VERSION:
        raise DurableError(f"{storage.display(ckpt)} has format version {m.get('format_version')}, this elastic-llm reads {FORMAT_VERSION}")
    return m


def list_checkpoints(run: Storage) -> list[Entry]:
    """Every ``checkpoint_*`` directory of a run, oldest first, with whether it is trusted."""
    out = []
    for name in run.list_dirs():
        step = step_of(name)
        if step is None:
            continue
        try:
            read_manifest(run, name)
            out.append(Entry(name, step, True))
        except DurableError as e:
            out.append(Entry(name, step, False, str(e)))
    return out


def runs_in(root: Storage) -> list[str]:
    """The run directories directly under ``root`` (those holding ``checkpoint_*`` directories):
    what a ``durable.storage_path`` holds."""
    return [d for d in root.list_dirs() if any(step_of(n) is not None for n in root.list_dirs(d))]


def storage_root_problem(root: Storage) -> str | None:
    """The message for a storage root given where a run directory belongs (it holds runs, not
    checkpoints), or None when ``root`` holds no runs."""
    runs = runs_in(root)
    if not runs:
        return None
    shown = ", ".join(runs[:5]) + (f" and {len(runs) - 5} more" if len(runs) > 5 else "")
    return f"{root.display()} holds the runs {shown}, not checkpoints: give a run directory, e.g. {root.display(runs[0])}"


def newest_committed(run: Storage) -> Entry | None:
    trusted = [e for e in list_checkpoints(run) if e.committed]
    return trusted[-1] if trusted else None


# --------------------------------------------------------------------------- reading
class Checkpoint:
    """One committed checkpoint: its manifest, and its tensors read back and verified."""

    def __init__(self, storage: Storage, name: str) -> None:
        self.storage = storage
        self.name = name
        self.manifest = read_manifest(storage, name)
        self.step = int(self.manifest["step"])

    @property
    def uri(self) -> str:
        return self.storage.display(self.name)

    def file_tensors(self, file: str, names: set[str] | None = None) -> dict[str, Any]:
        """The tensors of one shard file (all, or ``names``), each checked against its CRC-32."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        rel = f"{self.name}/{file}"
        try:
            data = self.storage.read_bytes(rel)
        except FileNotFoundError:
            raise DurableError(f"{self.storage.display(rel)} is missing: the checkpoint is incomplete, use an older one") from None
        try:
            tensors = load(data)
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise DurableError(
                f"{self.storage.display(rel)} is not a safetensors file ({str(e).splitlines()[0]}): refused without running or unpickling anything"
            ) from None
        want = self.manifest["files"].get(file, {}).get("nbytes")
        if want is not None and len(data) != want:
            raise DurableError(f"{self.storage.display(rel)} has {len(data)} bytes, the manifest says {want}: truncated or replaced")
        out = {}
        for name, t in tensors.items():
            if names is not None and name not in names:
                continue
            rec = self.manifest["tensors"].get(name)
            if rec is None or rec["file"] != file:
                raise DurableError(f"{self.storage.display(rel)} holds tensor {name!r}, which the manifest does not list there: foreign file")
            if str(t.dtype).removeprefix("torch.") != rec["dtype"] or list(t.shape) != rec["shape"]:
                raise DurableError(f"tensor {name} in {self.storage.display(rel)} is {t.dtype}{list(t.shape)}, the manifest says {rec['dtype']}{rec['shape']}")
            if checksum(host_bytes(t)) != rec["crc32"]:
                raise DurableError(f"tensor {name} in {self.storage.display(rel)} fails its CRC-32: the file is corrupted, use an older checkpoint")
            out[name] = t
        return out

    def read_into(self, dest: dict[str, np.ndarray]) -> None:
        """Read the tensors named in ``dest`` (global name -> a writable uint8 array of exactly
        their bytes) straight from their files into it: the safetensors header is parsed as JSON
        and checked against the manifest, each tensor's bytes are read at their offset into its
        destination (no intermediate copy on a local disk) and checked against their CRC-32 there.
        Raises :class:`DurableError` naming the file for anything that does not match; what is
        in ``dest`` is then undefined (the caller loads nothing)."""
        recs = self.manifest["tensors"]
        missing = sorted(set(dest) - set(recs))
        if missing:
            raise DurableError(f"{self.uri} has no tensor(s) {missing[:3]}: it was written by another model")
        by_file: dict[str, list[str]] = {}
        for n in dest:
            by_file.setdefault(recs[n]["file"], []).append(n)
        for file, names in sorted(by_file.items()):
            rel = f"{self.name}/{file}"
            try:
                self._read_file(rel, names, dest)
            except FileNotFoundError:
                raise DurableError(f"{self.storage.display(rel)} is missing: the checkpoint is incomplete, use an older one") from None

    def _read_file(self, rel: str, names: list[str], dest: dict[str, np.ndarray]) -> None:
        recs = self.manifest["tensors"]
        file = rel.rsplit("/", 1)[1]
        with self.storage.reader(rel) as f:
            header, start = self._header(rel, f)
            for n in names:
                at = header.get(n)
                if at is None:
                    raise DurableError(f"{self.uri}: tensor {n} listed in the manifest is not in {file}: the checkpoint is damaged")
                lo, hi = at["data_offsets"]
                if hi - lo != dest[n].nbytes:
                    raise DurableError(f"tensor {n} in {self.storage.display(rel)} has {hi - lo} bytes, this stage needs {dest[n].nbytes}")
                if f.read_at(start + lo, dest[n]) != dest[n].nbytes:
                    raise DurableError(f"{self.storage.display(rel)} ends inside tensor {n}: truncated, use an older checkpoint")
                if checksum(dest[n]) != recs[n]["crc32"]:
                    raise DurableError(f"tensor {n} in {self.storage.display(rel)} fails its CRC-32: the file is corrupted, use an older checkpoint")

    def _header(self, rel: str, f: Any) -> tuple[dict[str, Any], int]:
        """The safetensors header of the open file ``f`` (``rel``), every entry checked against
        the manifest, and where the tensor data starts."""
        file = rel.rsplit("/", 1)[1]
        size, want = f.size, self.manifest["files"].get(file, {}).get("nbytes")

        def refuse(why: str) -> DurableError:
            return DurableError(f"{self.storage.display(rel)} is not a safetensors file ({why}): refused without running or unpickling anything")

        head = np.zeros(8, np.uint8)
        if f.read_at(0, head) != 8:
            raise refuse("shorter than its 8-byte header length")
        n = int(head.view("<u8")[0])
        if n > min(size - 8, 100 << 20):
            raise refuse(f"a header of {n} bytes in a file of {size}")
        raw = np.zeros(n, np.uint8)
        f.read_at(8, raw)
        try:
            header = json.loads(raw.tobytes())
        except (UnicodeDecodeError, ValueError) as e:
            raise refuse(f"its header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise refuse("its header is not a JSON object")
        if want is not None and size != want:
            raise DurableError(f"{self.storage.display(rel)} has {size} bytes, the manifest says {want}: truncated or replaced")
        dtypes = {v: k for k, v in SAFETENSORS_DTYPE.items()}
        for name, at in header.items():
            if name == "__metadata__":
                continue
            rec = self.manifest["tensors"].get(name)
            if rec is None or rec["file"] != file:
                raise DurableError(f"{self.storage.display(rel)} holds tensor {name!r}, which the manifest does not list there: foreign file")
            if not isinstance(at, dict) or dtypes.get(str(at.get("dtype"))) != rec["dtype"] or at.get("shape") != rec["shape"]:
                raise DurableError(f"tensor {name} in {self.storage.display(rel)} is {at.get('dtype') if isinstance(at, dict) else at}"
                                   f"{at.get('shape') if isinstance(at, dict) else ''}, the manifest says {rec['dtype']}{rec['shape']}")
            lo, hi = at.get("data_offsets", (None, None))
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= size - 8 - n):
                raise refuse(f"tensor {name}'s data_offsets {at.get('data_offsets')} lie outside the file")
        return header, 8 + n

    def tensors(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """Tensors by global name (all of them, or ``names``), verified."""
        wanted = set(names) if names is not None else set(self.manifest["tensors"])
        missing = sorted(wanted - set(self.manifest["tensors"]))
        if missing:
            raise DurableError(f"{self.uri} has no tensor(s) {missing[:3]}: it was written by another model")
        files = sorted({self.manifest["tensors"][n]["file"] for n in wanted})
        out: dict[str, Any] = {}
        for f in files:
            out.update(self.file_tensors(f, wanted))
        lost = sorted(wanted - set(out))
        if lost:
            raise DurableError(f"{self.uri}: tensor(s) {lost[:3]} listed in the manifest are not in their files: the checkpoint is damaged")
        return out

    def verify(self) -> dict[str, Any]:
        """Read every file and check every tensor; returns a summary (raises on the first problem)."""
        n = nbytes = 0
        for f in sorted(self.manifest["files"]):
            n += len(self.file_tensors(f))
            nbytes += int(self.manifest["files"][f]["nbytes"])
        if n != len(self.manifest["tensors"]):
            raise DurableError(f"{self.uri}: {n} tensors found, the manifest lists {len(self.manifest['tensors'])}")
        return {"checkpoint": self.uri, "step": self.step, "tensors": n, "bytes": nbytes, "files": len(self.manifest["files"]), "ok": True}

    def model_tensors(self) -> dict[str, Any]:
        """The model's parameters only, by their global module names (``layers.3.attn.wo.weight``)."""
        names = [n for n in self.manifest["tensors"] if n.startswith("param/")]
        return {n.removeprefix("param/"): t for n, t in self.tensors(names).items()}


def open_checkpoint(uri: str) -> Checkpoint:
    """A checkpoint directory, or a run directory (its newest committed checkpoint)."""
    storage = Storage(uri)
    try:
        if storage.exists(MARKER) or storage.exists(MANIFEST) or step_of(storage.root.rsplit("/", 1)[-1]) is not None:
            run, name = storage.split()
            return Checkpoint(run, name)
        if not storage.is_dir():
            raise DurableError(f"{storage.display()} does not exist: give a checkpoint directory or a run directory of durable checkpoints")
        entry = newest_committed(storage)
    except StorageError as e:
        raise DurableError(str(e)) from None
    if entry is None:
        seen = list_checkpoints(storage)
        problem = None if seen else storage_root_problem(storage)
        if problem is None:
            why = f" ({len(seen)} uncommitted: {seen[-1].problem})" if seen else ""
            problem = f"{storage.display()} holds no committed checkpoint{why}: give another directory"
        raise DurableError(problem)
    return Checkpoint(storage, entry.name)


def prune(run: Storage, keep_last: int, busy: str | None = None) -> list[str]:
    """Delete all but the newest ``keep_last`` committed checkpoints, and uncommitted directories
    older than the newest committed one (partial flushes), except ``busy`` (a flush in
    progress). Never deletes the newest committed checkpoint. Returns the names deleted."""
    entries = list_checkpoints(run)
    committed = [e for e in entries if e.committed]
    if not committed:
        return []
    newest = committed[-1].step
    keep = {e.name for e in committed[-max(1, keep_last) :]}
    gone = []
    for e in entries:
        if e.name in keep or e.name == busy or (not e.committed and e.step >= newest):
            continue
        run.delete_dir(e.name)
        gone.append(e.name)
    return gone
