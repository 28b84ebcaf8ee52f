"""The read side of prepared data: the token-shard format, the tokenizer that goes with it, and
the resumable deterministic token stream a run trains on.

Owns: the format's words (``meta.json`` fields, :data:`FORMAT_VERSION`, the EOS conventions,
:data:`TOKENIZER_FILE`), :class:`DataError`, reading ``meta.json``, the checked ``tokenizer.json``
and the ``train-*`` / ``val-*`` Parquet shards (local paths or URIs through ``pyarrow.fs``), and
:class:`TokenStream`, whose :class:`StreamPosition` (epoch, index) is plain state that can be
saved and restored exactly. Never writes anything, never trains a tokenizer and never touches Ray
or the model: preparing data (``elastic_llm.data``) sits above this and writes what it reads.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow.fs as pafs
    from tokenizers import Tokenizer

EOS = 0  # byte tokenizer: NUL separates documents (source text never contains it)
BYTE_VOCAB = 256
EOS_TOKEN = "<|endoftext|>"  # bpe: the special token that separates documents (id 0 when trained here)
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1


class DataError(ValueError):
    """Unusable data input; the message names the path and the fix."""


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) of a URI (``s3://...``, ``gs://...``), else of a local path."""
    import pyarrow as pa  # here, not at the top: a stage process imports this module for its positions and never reads data
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, ValueError):
        return pafs.LocalFileSystem(), os.path.abspath(uri)


def read_bytes(uri: str | Path) -> bytes:
    """A tokenizer file's bytes (local path or URI)."""
    fs, path = resolve(str(uri))
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError):
        raise DataError(f"tokenizer file {uri} cannot be read: check the path or URI") from None


def sha256(data: bytes) -> str:
    """Hex digest, as meta.json records a tokenizer's."""
    return hashlib.sha256(data).hexdigest()


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
    return _parse_tokenizer(read_bytes(path), str(path))


def tokenizer_vocab_size(tok: Tokenizer) -> int:
    """One more than the largest token id (added tokens included): what model.vocab_size must cover."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 65536 else np.uint32


def read_meta(data_dir: str | Path) -> dict:
    fs, path = resolve(str(data_dir))
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
    fs, path = resolve(str(data_dir))
    try:
        with fs.open_input_stream(f"{path}/{TOKENIZER_FILE}") as f:
            raw = f.read()
    except (FileNotFoundError, OSError):
        raise DataError(f"{data_dir} has no {TOKENIZER_FILE} though its meta.json says tokenizer {meta['tokenizer']!r}: prepare the data again") from None
    if sha256(raw) != meta.get("tokenizer_sha256"):
        raise DataError(
            f"{data_dir}/{TOKENIZER_FILE} has sha256 {sha256(raw)[:16]}..., meta.json records {str(meta.get('tokenizer_sha256'))[:16]}...: "
            "it is not the tokenizer the shards were encoded with; prepare the data again"
        )
    return _parse_tokenizer(raw, f"{data_dir}/{TOKENIZER_FILE}")


def load_split(data_dir: str | Path, split: str) -> np.ndarray:
    """All documents of a split as one flat array (uint16, uint32 for vocabularies over 65536),
    each document followed by the EOS id of meta.json."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    eos = read_meta(data_dir)["eos"]
    fs, path = resolve(str(data_dir))
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


@dataclass(frozen=True)
class StreamPosition:
    """Where a token stream is: what crosses actor boundaries and goes into snapshots (as
    :meth:`to_dict` in their JSON) and comes back from them (:meth:`of`)."""

    epoch: int = 0
    index: int = 0  # sequences consumed in this epoch

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def of(cls, value: "StreamPosition | Mapping[str, Any]") -> "StreamPosition":
        """A position from itself or from its JSON form; :class:`DataError` if it is not one."""
        if isinstance(value, StreamPosition):
            return value
        try:
            return cls(int(value["epoch"]), int(value["index"]))
        except (KeyError, TypeError, ValueError):
            raise DataError(f"data position {value!r} is not {{epoch, index}}: was it saved by elastic-llm?") from None


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
            epoch, index = self.position.epoch, self.position.index
            if index >= self.n_windows:
                epoch, index = epoch + 1, 0
            start = int(self._order(epoch)[index]) * self.seq_len
            rows[r] = self.tokens[start : start + self.seq_len + 1]
            self.position = StreamPosition(epoch, index + 1)
        return rows[:, :-1], rows[:, 1:]

    def at(self) -> StreamPosition:
        """Where the stream is now."""
        return self.position

    def seek(self, position: StreamPosition | Mapping[str, Any]) -> None:
        """Go to ``position`` (a saved one, or its JSON form): the batches that followed it follow."""
        pos = StreamPosition.of(position)
        if pos.epoch < 0 or not 0 <= pos.index <= self.n_windows:
            raise DataError(f"data position {pos.to_dict()} does not fit this corpus of {self.n_windows} windows: was it saved for other data?")
        self.position = pos

    def state_dict(self) -> dict[str, int]:
        return self.position.to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seek(state)


@dataclass
class RunData:
    """A run's data: where it lives, the training stream (seeded), the validation tokens and
    the tokenizer (None for bytes)."""

    dir: str
    train: "TokenStream"
    val: np.ndarray
    tokenizer: Tokenizer | None = None


def open_prepared(where: str, seq_len: int, seed: int, vocab_size: int, tokenizer: str = "byte") -> RunData:
    """Prepared data in ``where`` as a run reads it: the training stream in the run's seeded
    order, the validation tokens and the tokenizer. Refuses data prepared with another tokenizer
    than ``tokenizer``, or whose vocabulary the model lacks."""
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
