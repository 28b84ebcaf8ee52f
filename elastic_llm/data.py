"""Corpus preparation into Parquet token shards, and a resumable deterministic token stream.

Owns: reading text/JSONL/Parquet sources (local paths or URIs through ``pyarrow.fs``),
tokenisation (bytes, or a byte-level BPE that Hugging Face ``tokenizers`` trains on the training
documents or loads from a ``tokenizer.json``), writing ``train-*.parquet`` / ``val-*.parquet``
shards, the ``tokenizer.json`` and ``meta.json`` atomically, and :class:`TokenStream`, whose
position (epoch, index) is plain state that can be saved and restored exactly. Never touches Ray
or the model, and never implements BPE itself: ``tokenizers`` trains, encodes and decodes.

The built-in corpus is the source code of the Python standard library of the running
interpreter: it exists on every machine, so nothing is ever downloaded.

Why ~520 lines: preparing (sources, two tokenizers, shards, atomic output, remote upload) and
reading (meta and tokenizer checks, splits, the resumable stream) share the shard format; keeping
them in one module keeps that format in one place.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS = 0  # byte tokenizer: NUL separates documents (source text never contains it)
BYTE_VOCAB = 256
EOS_TOKEN = "<|endoftext|>"  # bpe: the special token that separates documents (id 0 when trained here)
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_BPE_VOCAB = 8192
ENCODE_BATCH = 256  # documents per tokenizers encode_batch call
FORMAT_VERSION = 1
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".c", ".h", ".json")
SHARD_TOKENS = 8_000_000


class DataError(ValueError):
    """Unusable data input; the message names the path and the fix."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("ELASTIC_LLM_CACHE", Path.home() / ".cache" / "elastic-llm"))


def builtin_corpus_dir(tokenizer: str = "byte", vocab_size: int | None = None, tokenizer_file: str | None = None) -> Path:
    """Where the built-in corpus is cached: one directory per interpreter version and tokenizer
    (``-bpe{vocab_size}`` when trained here, ``-bpe-{sha256 prefix}`` for a given tokenizer file)."""
    import sys

    name = f"corpus-python-stdlib-{sys.version_info.major}.{sys.version_info.minor}"
    if tokenizer == "bpe":
        name += f"-bpe-{_sha256(_read_bytes(tokenizer_file))[:16]}" if tokenizer_file else f"-bpe{vocab_size or DEFAULT_BPE_VOCAB}"
    return default_cache_dir() / name


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


def _split_documents(files: list[tuple[pafs.FileSystem, str]], val_fraction: float) -> Iterator[tuple[str, str]]:
    """(split, document) of every document, in order; the split depends only on path and index."""
    index = 0
    for fs, path in files:
        for doc in _documents(fs, path):
            yield ("val" if _is_val(path, index, val_fraction) else "train"), doc
            index += 1


def _read_bytes(uri: str | Path) -> bytes:
    """A tokenizer file's bytes (local path or URI)."""
    fs, path = _resolve(str(uri))
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError):
        raise DataError(f"tokenizer file {uri} cannot be read: check the path or URI") from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- tokenizers


def tokenize_bytes(text: str) -> np.ndarray:
    tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    tokens[tokens == EOS] = ord(" ")  # keep EOS unambiguous
    return tokens


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens trained on ``texts``: every byte is in
    the initial alphabet (any text encodes, nothing is unknown) and ``<|endoftext|>`` is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < BYTE_VOCAB + 1:
        raise DataError(f"vocab_size={vocab_size} is too small for a byte-level BPE: use at least {BYTE_VOCAB + 1} (256 bytes + {EOS_TOKEN}), e.g. {DEFAULT_BPE_VOCAB}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _parse_tokenizer(raw: bytes, where: str) -> Tokenizer:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception for JSON it cannot read
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise DataError(f"{where} is not a Hugging Face tokenizers JSON file ({why}): pass a tokenizer.json written by tokenizers' Tokenizer.save") from None
    if tok.token_to_id(EOS_TOKEN) is None:
        raise DataError(
            f"{where} has no {EOS_TOKEN} token, the end-of-document token elastic-llm separates documents with: "
            f"add it (tokenizer.add_special_tokens([{EOS_TOKEN!r}])) and save the file again"
        )
    return tok


def load_tokenizer_file(path: str | Path) -> Tokenizer:
    """A ``tokenizer.json`` (local path or URI), refused unless ``tokenizers`` reads it and it has ``<|endoftext|>``."""
    return _parse_tokenizer(_read_bytes(path), str(path))


def tokenizer_vocab_size(tok: Tokenizer) -> int:
    """One more than the largest token id (added tokens included): what model.vocab_size must cover."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 65536 else np.uint32


def _encode(tok: Tokenizer, docs: Iterable[tuple[str, str]]) -> Iterator[tuple[str, np.ndarray]]:
    """(split, token ids) of every (split, document), batched through the tokenizer's Rust encoder."""
    dtype = token_dtype(tokenizer_vocab_size(tok))
    it = iter(docs)
    while batch := list(itertools.islice(it, ENCODE_BATCH)):
        encodings = tok.encode_batch([doc for _, doc in batch], add_special_tokens=False)
        for (split, _), enc in zip(batch, encodings):
            yield split, np.asarray(enc.ids, dtype=dtype)


# --------------------------------------------------------------------------- writing shards


def _is_val(name: str, index: int, val_fraction: float) -> bool:
    return (zlib.crc32(f"{index}:{name}".encode()) % 1_000_000) < val_fraction * 1_000_000


def prepare(
    sources: list[str] | None,
    out_dir: str | Path,
    val_fraction: float = 0.02,
    tokenizer: str = "byte",
    shard_tokens: int = SHARD_TOKENS,
    vocab_size: int | None = None,
    tokenizer_file: str | Path | None = None,
) -> dict:
    """Tokenise ``sources`` (default: the Python standard library) into Parquet shards.

    Writes ``train-NNNNN.parquet``, ``val-NNNNN.parquet`` (column ``tokens``: list<uint16>, or
    list<uint32> for vocabularies over 65536; one row per document), for ``tokenizer="bpe"`` the
    ``tokenizer.json``, and last ``meta.json`` into ``out_dir`` atomically: a crash leaves either
    the old directory or the new one. ``bpe`` trains a byte-level BPE of ``vocab_size`` tokens
    (default 8192) on the training documents (the sources are read twice: to train, then to
    encode), or loads ``tokenizer_file``; a literal ``<|endoftext|>`` in a document encodes as
    EOS, as it would through the exported tokenizer. Returns the meta dict.
    """
    if tokenizer not in ("byte", "bpe"):
        raise DataError(f"tokenizer {tokenizer!r} is not supported: use 'byte' or 'bpe'")
    if tokenizer == "byte" and (vocab_size is not None or tokenizer_file is not None):
        raise DataError("vocab_size and tokenizer_file go with tokenizer='bpe' (byte tokens are always 256): drop them or use tokenizer='bpe'")
    if vocab_size is not None and tokenizer_file is not None:
        raise DataError("pass vocab_size to train a BPE or tokenizer_file to use an existing one, not both")
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
            meta = prepare(sources, Path(local) / "shards", val_fraction, tokenizer, shard_tokens, vocab_size, tokenizer_file)
            _upload(Path(local) / "shards", out_fs, out_path)
        return meta
    tok = None
    if tokenizer == "bpe":
        if tokenizer_file is not None:
            tok = load_tokenizer_file(tokenizer_file)
        else:
            train_docs = (doc for split, doc in _split_documents(files, val_fraction) if split == "train")
            tok = train_bpe(train_docs, DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    value_type = pa.uint16() if tok is None or token_dtype(tokenizer_vocab_size(tok)) == np.uint16 else pa.uint32()
    writers = {s: _ShardWriter(tmp, s, shard_tokens, value_type) for s in ("train", "val")}
    docs = _split_documents(files, val_fraction)
    tokenized = ((split, tokenize_bytes(doc)) for split, doc in docs) if tok is None else _encode(tok, docs)
    n_docs = 0
    for split, tokens in tokenized:
        writers[split].add(tokens)
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
    }
    if tok is not None:
        raw = tok.to_str(pretty=True).encode("utf-8")
        (tmp / TOKENIZER_FILE).write_bytes(raw)
        meta.update(vocab_size=tokenizer_vocab_size(tok), eos=tok.token_to_id(EOS_TOKEN), tokenizer_sha256=_sha256(raw))
    meta |= {
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
    def __init__(self, directory: Path, split: str, shard_tokens: int, value_type: pa.DataType) -> None:
        self.directory, self.split, self.shard_tokens, self.value_type = directory, split, shard_tokens, value_type
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
        values = pa.array(np.concatenate(self.pending), type=self.value_type)
        column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
        pq.write_table(pa.table({"tokens": column}), self.directory / f"{self.split}-{self.shards:05d}.parquet")
        self.shards += 1
        self.pending, self.pending_tokens = [], 0

    def close(self) -> None:
        self.flush()


def ensure_builtin_corpus(val_fraction: float = 0.02, tokenizer: str = "byte", vocab_size: int | None = None, tokenizer_file: str | None = None) -> Path:
    """Prepare the standard-library corpus once per interpreter version and tokenizer (bpe: a
    BPE of ``vocab_size`` tokens trained on it, or ``tokenizer_file``); return its directory."""
    d = builtin_corpus_dir(tokenizer, vocab_size, tokenizer_file)
    if not (d / "meta.json").is_file():
        prepare(None, d, val_fraction=val_fraction, tokenizer=tokenizer, vocab_size=vocab_size, tokenizer_file=tokenizer_file)
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


def load_tokenizer(data_dir: str | Path) -> Tokenizer | None:
    """The ``tokenizers`` tokenizer of prepared data (local path or URI), checked against the
    sha256 in its meta.json; None for byte-tokenised data."""
    meta = read_meta(data_dir)
    if meta["tokenizer"] == "byte":
        return None
    fs, path = _resolve(str(data_dir))
    try:
        with fs.open_input_stream(f"{path}/{TOKENIZER_FILE}") as f:
            raw = f.read()
    except (FileNotFoundError, OSError):
        raise DataError(f"{data_dir} has no {TOKENIZER_FILE} though its meta.json says tokenizer {meta['tokenizer']!r}: prepare the data again") from None
    if _sha256(raw) != meta.get("tokenizer_sha256"):
        raise DataError(
            f"{data_dir}/{TOKENIZER_FILE} has sha256 {_sha256(raw)[:16]}..., meta.json records {str(meta.get('tokenizer_sha256'))[:16]}...: "
            "it is not the tokenizer the shards were encoded with; prepare the data again"
        )
    return _parse_tokenizer(raw, f"{data_dir}/{TOKENIZER_FILE}")


def load_split(data_dir: str | Path, split: str) -> np.ndarray:
    """All documents of a split as one flat array (uint16, uint32 for vocabularies over 65536),
    each document followed by the EOS id of meta.json."""
    eos = read_meta(data_dir)["eos"]
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
            values = chunk.values.to_numpy(zero_copy_only=False)
            values = values[offsets[0] : offsets[-1]]
            parts.append(np.insert(values, offsets[1:] - offsets[0], eos))  # EOS after every document
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
    """A run's data: where it lives, the training stream (seeded), the validation tokens and
    the tokenizer (None for bytes)."""

    dir: str
    train: "TokenStream"
    val: np.ndarray
    tokenizer: Tokenizer | None = None


def open_run_data(
    data_dir: str | None,
    seq_len: int,
    seed: int,
    vocab_size: int,
    val_fraction: float = 0.02,
    tokenizer: str = "byte",
    tokenizer_file: str | None = None,
) -> RunData:
    """The data a run trains on: ``data_dir`` (prepared shards), else the built-in corpus (for
    ``bpe``: encoded with ``tokenizer_file``, or with a BPE of ``vocab_size`` tokens trained on it
    on first use); the training stream in the run's seeded order. Refuses data prepared with
    another tokenizer than ``tokenizer``, or whose vocabulary the model lacks."""
    if data_dir and tokenizer_file:
        raise DataError(f"data.tokenizer_file is for the built-in corpus; data.dir={data_dir} carries its own {TOKENIZER_FILE}: remove one of them")
    if data_dir:
        where = data_dir
    else:
        bpe_vocab = vocab_size if tokenizer == "bpe" and not tokenizer_file else None
        where = str(ensure_builtin_corpus(val_fraction, tokenizer, bpe_vocab, tokenizer_file))
    meta = read_meta(where)
    if meta["tokenizer"] != tokenizer:
        raise DataError(
            f"data in {where} was prepared with tokenizer {meta['tokenizer']!r}, not data.tokenizer={tokenizer!r}: "
            f"set data.tokenizer={meta['tokenizer']} or prepare the data with --tokenizer {tokenizer}"
        )
    if meta["vocab_size"] > vocab_size:
        raise DataError(f"data in {where} has vocab_size {meta['vocab_size']} > model.vocab_size={vocab_size}: raise model.vocab_size")
    tok = load_tokenizer(where)
    return RunData(where, TokenStream(load_split(where, "train"), seq_len, seed), load_split(where, "val"), tok)
