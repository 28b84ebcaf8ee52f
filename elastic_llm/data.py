"""Corpus preparation into Parquet token shards, the built-in corpus, and opening a run's data.

Owns: reading text/JSONL/Parquet sources (local paths or URIs through ``pyarrow.fs``),
tokenisation (bytes, or a byte-level BPE that Hugging Face ``tokenizers`` trains on the training
documents or loads from a ``tokenizer.json``), writing ``train-*.parquet`` / ``val-*.parquet``
shards, the ``tokenizer.json`` and ``meta.json`` atomically, the built-in corpus, and
:func:`open_run_data` (a run's data: the built-in corpus prepared on first use, then read). The
format and everything that reads it (the token stream included) live in :mod:`elastic_llm.stream`,
whose names this module also offers to callers that prepare and read. Never touches Ray or the
model, and never implements BPE itself: ``tokenizers`` trains, encodes and decodes.

The built-in corpus is the source code of the Python standard library of the running
interpreter: it exists on every machine, so nothing is ever downloaded.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_llm.stream import (
    BYTE_VOCAB,
    EOS,
    EOS_TOKEN,
    FORMAT_VERSION,
    TOKENIZER_FILE,
    DataError,
    RunData,
    StreamPosition,
    TokenStream,
    read_bytes,
    resolve,
    sha256,
    load_split,
    load_tokenizer,
    load_tokenizer_file,
    open_prepared,
    read_meta,
    token_dtype,
    tokenizer_vocab_size,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [  # this module's own names, and the read side's it offers (see the opening)
    "BYTE_VOCAB", "DEFAULT_BPE_VOCAB", "EOS", "EOS_TOKEN", "FORMAT_VERSION", "SHARD_TOKENS", "TEXT_SUFFIXES", "TOKENIZER_FILE",
    "DataError", "RunData", "StreamPosition", "TokenStream", "builtin_corpus_dir", "default_cache_dir", "ensure_builtin_corpus",
    "load_split", "load_tokenizer", "load_tokenizer_file", "open_run_data", "prepare", "read_meta", "stdlib_sources",
    "token_dtype", "tokenize_bytes", "tokenizer_vocab_size", "train_bpe",
]

DEFAULT_BPE_VOCAB = 8192
ENCODE_BATCH = 256  # documents per tokenizers encode_batch call
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".c", ".h", ".json")
SHARD_TOKENS = 8_000_000


def default_cache_dir() -> Path:
    return Path(os.environ.get("ELASTIC_LLM_CACHE", Path.home() / ".cache" / "elastic-llm"))


def builtin_corpus_dir(tokenizer: str = "byte", vocab_size: int | None = None, tokenizer_file: str | None = None) -> Path:
    """Where the built-in corpus is cached: one directory per interpreter version and tokenizer
    (``-bpe{vocab_size}`` when trained here, ``-bpe-{sha256 prefix}`` for a given tokenizer file)."""
    import sys

    name = f"corpus-python-stdlib-{sys.version_info.major}.{sys.version_info.minor}"
    if tokenizer == "bpe":
        name += f"-bpe-{sha256(read_bytes(tokenizer_file))[:16]}" if tokenizer_file else f"-bpe{vocab_size or DEFAULT_BPE_VOCAB}"
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


def _expand(uri: str) -> list[tuple[pafs.FileSystem, str, str]]:
    """(filesystem, path, split key) of every readable file under ``uri``. The split key is the
    path relative to the directory given (the file's name for a file given), so a corpus gets
    the same train / validation split wherever it lives."""
    fs, path = resolve(uri)
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
        root = path.rstrip("/") + "/"
        return [(fs, p, p.removeprefix(root)) for p in paths]
    return [(fs, path, path.rsplit("/", 1)[-1])]


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


def _split_documents(files: list[tuple[pafs.FileSystem, str, str]], val_fraction: float) -> Iterator[tuple[str, str]]:
    """(split, document) of every document, in order; the split depends only on the file's
    split key (its path within its source) and the document's index."""
    index = 0
    for fs, path, key in files:
        for doc in _documents(fs, path):
            yield ("val" if _is_val(key, index, val_fraction) else "train"), doc
            index += 1


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
    files: list[tuple[pafs.FileSystem, str, str]] = []
    for uri in sources or stdlib_sources():
        files += _expand(uri)
    if not files:
        raise DataError(f"no readable text/JSONL/Parquet files in {sources}: pass files ending in {TEXT_SUFFIXES + ('.jsonl', '.parquet')}")

    out_fs, out_path = resolve(str(out_dir))
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
        meta.update(vocab_size=tokenizer_vocab_size(tok), eos=tok.token_to_id(EOS_TOKEN), tokenizer_sha256=sha256(raw))
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
    on first use), opened by :func:`~elastic_llm.stream.open_prepared`."""
    if data_dir and tokenizer_file:
        raise DataError(f"data.tokenizer_file is for the built-in corpus; data.dir={data_dir} carries its own {TOKENIZER_FILE}: remove one of them")
    if data_dir:
        where = data_dir
    else:
        bpe_vocab = vocab_size if tokenizer == "bpe" and not tokenizer_file else None
        where = str(ensure_builtin_corpus(val_fraction, tokenizer, bpe_vocab, tokenizer_file))
    return open_prepared(where, seq_len, seed, vocab_size, tokenizer)
