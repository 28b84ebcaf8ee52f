"""Corpus preparation into Parquet token shards, and a resumable deterministic token stream.

Owns: reading text/JSONL/Parquet sources (local paths or URIs through ``pyarrow.fs``), byte-level
tokenisation, writing ``train-*.parquet`` / ``val-*.parquet`` shards plus ``meta.json``
atomically, and :class:`TokenStream`, whose position (epoch, index) is plain state that can be
saved and restored exactly. Never touches Ray or the model.

The built-in corpus is the source code of the Python standard library of the running
interpreter: it exists on every machine, so nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

EOS = 0  # byte tokenizer: NUL separates documents (source text never contains it)
BYTE_VOCAB = 256
FORMAT_VERSION = 1
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".c", ".h", ".json")
SHARD_TOKENS = 8_000_000


class DataError(ValueError):
    """Unusable data input; the message names the path and the fix."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("ELASTIC_LLM_CACHE", Path.home() / ".cache" / "elastic-llm"))


def builtin_corpus_dir() -> Path:
    import sys

    return default_cache_dir() / f"corpus-python-stdlib-{sys.version_info.major}.{sys.version_info.minor}"


def stdlib_sources() -> list[str]:
    """The standard library's .py files (site-packages excluded), sorted for determinism."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        str(p) for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )
    if not files:
        raise DataError(f"no .py files found under the standard library at {root}: pass your own sources to prepare")
    return files


# --------------------------------------------------------------------------- reading sources


def _resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, ValueError):
        return pafs.LocalFileSystem(), os.path.abspath(uri)


def _expand(uri: str) -> list[tuple[pafs.FileSystem, str]]:
    fs, path = _resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"data source {uri!r} does not exist: check the path or URI")
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        paths = sorted(
            i.path
            for i in infos
            if i.type == pafs.FileType.File and i.path.endswith(TEXT_SUFFIXES + (".jsonl", ".parquet"))
        )
        return [(fs, p) for p in paths]
    return [(fs, path)]


def _documents(fs: pafs.FileSystem, path: str) -> Iterator[str]:
    if path.endswith(".parquet"):
        with fs.open_input_file(path) as f:
            table = pq.read_table(f)
        if "text" not in table.column_names:
            raise DataError(f"{path}: Parquet source needs a 'text' column (it has {table.column_names})")
        yield from (t for t in table.column("text").to_pylist() if t)
        return
    with fs.open_input_stream(path) as f:
        raw = f.read()
    text = raw.decode("utf-8", errors="replace")
    if path.endswith(".jsonl"):
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); JSONL sources need one object per line") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise DataError(f"{path}:{lineno}: each JSONL line needs a string field 'text'")
            yield doc["text"]
    else:
        yield text


def tokenize_bytes(text: str) -> np.ndarray:
    tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    tokens[tokens == EOS] = ord(" ")  # keep EOS unambiguous
    return tokens


# --------------------------------------------------------------------------- writing shards


def _is_val(name: str, index: int, val_fraction: float) -> bool:
    return (zlib.crc32(f"{index}:{name}".encode()) % 1_000_000) < val_fraction * 1_000_000


def prepare(
    sources: list[str] | None,
    out_dir: str | Path,
    val_fraction: float = 0.02,
    tokenizer: str = "byte",
    shard_tokens: int = SHARD_TOKENS,
) -> dict:
    """Tokenise ``sources`` (default: the Python standard library) into Parquet shards.

    Writes ``train-NNNNN.parquet``, ``val-NNNNN.parquet`` (column ``tokens``: list<uint16>, one
    row per document) and ``meta.json`` into ``out_dir`` atomically: a crash leaves either the old
    directory or the new one. Returns the meta dict.
    """
    if tokenizer != "byte":
        raise DataError(f"tokenizer {tokenizer!r} is not supported: use 'byte'")
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be in (0, 1)")
    builtin = not sources
    files: list[tuple[pafs.FileSystem, str]] = []
    for uri in sources or stdlib_sources():
        files += _expand(uri)
    if not files:
        raise DataError(f"no readable text/JSONL/Parquet files in {sources}: pass files ending in {TEXT_SUFFIXES + ('.jsonl', '.parquet')}")

    out_fs, out_path = _resolve(str(out_dir))
    if not isinstance(out_fs, pafs.LocalFileSystem):
        with tempfile.TemporaryDirectory(prefix="elastic-llm-prepare-") as local:
            meta = prepare(sources, Path(local) / "shards", val_fraction, tokenizer, shard_tokens)
            _upload(Path(local) / "shards", out_fs, out_path)
        return meta
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    writers = {"train": _ShardWriter(tmp, "train", shard_tokens), "val": _ShardWriter(tmp, "val", shard_tokens)}
    n_docs = 0
    for fs, path in files:
        for doc in _documents(fs, path):
            split = "val" if _is_val(path, n_docs, val_fraction) else "train"
            writers[split].add(tokenize_bytes(doc))
            n_docs += 1
    if writers["val"].tokens == 0 or writers["train"].tokens == 0:
        shutil.rmtree(tmp)
        raise DataError(
            f"{n_docs} document(s) are too few to give both a train and a validation split: add sources or change val_fraction"
        )
    for w in writers.values():
        w.close()
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer,
        "vocab_size": BYTE_VOCAB,
        "eos": EOS,
        "documents": n_docs,
        "train_tokens": writers["train"].tokens,
        "val_tokens": writers["val"].tokens,
        "sources": "python-stdlib" if builtin else list(sources or []),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    return meta


def _upload(local: Path, fs: pafs.FileSystem, path: str) -> None:
    """Copy prepared shards to a remote filesystem; meta.json goes last, so a reader that
    finds it finds every shard."""
    fs.create_dir(path, recursive=True)
    files = sorted(local.iterdir(), key=lambda p: p.name == "meta.json")
    for f in files:
        with fs.open_output_stream(f"{path}/{f.name}") as out:
            out.write(f.read_bytes())


class _ShardWriter:
    def __init__(self, directory: Path, split: str, shard_tokens: int) -> None:
        self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.tokens = 0
        self.shards = 0

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        self.tokens += len(tokens)
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        offsets = np.zeros(len(self.pending) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in self.pending], out=offsets[1:])
        values = pa.array(np.concatenate(self.pending), type=pa.uint16())
        column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
        pq.write_table(pa.table({"tokens": column}), self.directory / f"{self.split}-{self.shards:05d}.parquet")
        self.shards += 1
        self.pending, self.pending_tokens = [], 0

    def close(self) -> None:
        self.flush()


def ensure_builtin_corpus(val_fraction: float = 0.02) -> Path:
    """Prepare the standard-library corpus once per interpreter version; return its directory."""
    d = builtin_corpus_dir()
    if not (d / "meta.json").is_file():
        prepare(None, d, val_fraction=val_fraction)
    return d


# --------------------------------------------------------------------------- reading shards


def read_meta(data_dir: str | Path) -> dict:
    fs, path = _resolve(str(data_dir))
    try:
        with fs.open_input_stream(f"{path}/meta.json") as f:
            meta = json.loads(f.read())
    except (FileNotFoundError, OSError):
        raise DataError(f"{data_dir} has no meta.json: run `elastic-llm prepare SOURCES --out {data_dir}` first") from None
    except json.JSONDecodeError:
        raise DataError(f"{data_dir}/meta.json is not valid JSON: prepare the data again") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{data_dir} was prepared in format {meta.get('format_version')}, expected {FORMAT_VERSION}: prepare it again")
    return meta


def load_split(data_dir: str | Path, split: str) -> np.ndarray:
    """All documents of a split as one flat uint16 array, documents separated by EOS."""
    fs, path = _resolve(str(data_dir))
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    shards = sorted(i.path for i in infos if Path(i.path).name.startswith(f"{split}-") and i.path.endswith(".parquet"))
    if not shards:
        raise DataError(f"{data_dir} has no {split}-*.parquet shards: run `elastic-llm prepare` into it")
    parts: list[np.ndarray] = []
    for shard in shards:
        with fs.open_input_file(shard) as f:
            table = pq.read_table(f, columns=["tokens"])
        for chunk in table.column("tokens").chunks:
            offsets = chunk.offsets.to_numpy()
            values = chunk.values.to_numpy(zero_copy_only=False).astype(np.uint16, copy=False)
            values = values[offsets[0] : offsets[-1]]
            parts.append(np.insert(values, offsets[1:] - offsets[0], EOS))  # EOS after every document
    return np.concatenate(parts)


@dataclass
class StreamPosition:
    epoch: int = 0
    index: int = 0  # sequences consumed in this epoch

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}


class TokenStream:
    """Deterministic stream of (input, target) batches of fixed-length windows.

    The token array is cut into non-overlapping windows of ``seq_len + 1`` tokens; every epoch
    visits all of them in a permutation drawn from ``(seed, epoch)``. The position is
    ``(epoch, index)``: restoring it yields exactly the batches that would have followed.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, shuffle: bool = True) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"only {len(tokens)} tokens: fewer than one window of seq_len={seq_len} + 1; use more data or a shorter seq_len")
        self.position = StreamPosition()
        self._perm_epoch = -1
        self._perm = np.arange(self.n_windows)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self._perm
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each int64 (batch_size, seq_len)."""
        rows = np.empty((batch_size, self.seq_len + 1), dtype=np.int64)
        for r in range(batch_size):
            if self.position.index >= self.n_windows:
                self.position = StreamPosition(self.position.epoch + 1, 0)
            start = int(self._order(self.position.epoch)[self.position.index]) * self.seq_len
            rows[r] = self.tokens[start : start + self.seq_len + 1]
            self.position.index += 1
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return self.position.to_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self.n_windows:
            raise DataError(f"data position {state} does not fit this corpus of {self.n_windows} windows: was it saved for other data?")
        self.position = StreamPosition(epoch, index)


@dataclass
class RunData:
    """A run's data: where it lives, the training stream (seeded) and the validation tokens."""

    dir: str
    train: "TokenStream"
    val: np.ndarray


def open_run_data(data_dir: str | None, seq_len: int, seed: int, vocab_size: int, val_fraction: float = 0.02) -> RunData:
    """The data a run trains on: ``data_dir`` (prepared shards), else the built-in corpus; the
    training stream in the run's seeded order. Refuses data whose vocabulary the model lacks."""
    where = data_dir if data_dir else str(ensure_builtin_corpus(val_fraction))
    meta = read_meta(where)
    if meta["vocab_size"] > vocab_size:
        raise DataError(f"data in {where} has vocab_size {meta['vocab_size']} > model.vocab_size={vocab_size}: raise model.vocab_size")
    return RunData(where, TokenStream(load_split(where, "train"), seq_len, seed), load_split(where, "val"))
