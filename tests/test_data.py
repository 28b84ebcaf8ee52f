"""Corpus preparation and the resumable token stream (no Ray)."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_llm.data import EOS, DataError, TokenStream, load_split, prepare, read_meta, stdlib_sources

from .conftest import REPO


@pytest.fixture
def sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 50)
    (src / "b.md").write_text("# title\nsome markdown text é\n" * 40)
    with open(src / "c.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"text": f"json document number {i} " * 5}) + "\n")
    pq.write_table(pa.table({"text": [f"parquet row {i} " * 7 for i in range(30)]}), src / "d.parquet")
    return src


def test_the_split_is_the_same_wherever_the_corpus_lives(sources, tmp_path):
    """The train / validation split depends on a file's path within its source, not on where the
    source directory is (a split keyed on absolute paths once left a 40-file corpus without a
    validation document in one pytest temp directory out of ~70)."""
    import shutil

    moved = tmp_path / "elsewhere" / "deeper" / "corpus"
    shutil.copytree(sources, moved)
    a = prepare([str(sources)], tmp_path / "a", val_fraction=0.2)
    b = prepare([str(moved)], tmp_path / "b", val_fraction=0.2)
    assert (a["train_tokens"], a["val_tokens"]) == (b["train_tokens"], b["val_tokens"])
    assert np.array_equal(load_split(tmp_path / "a", "val"), load_split(tmp_path / "b", "val"))


def test_prepare_reads_text_jsonl_parquet_and_splits(sources, tmp_path):
    out = tmp_path / "shards"
    meta = prepare([str(sources)], out, val_fraction=0.2)
    assert meta["documents"] == 2 + 30 + 30
    assert meta["train_tokens"] > 0 and meta["val_tokens"] > 0
    assert read_meta(out)["vocab_size"] == 256
    train, val = load_split(out, "train"), load_split(out, "val")
    assert train.dtype == np.uint16 and train.max() < 256
    # documents are EOS-terminated; the token count is the content plus one EOS per document
    assert int((train == EOS).sum() + (val == EOS).sum()) == meta["documents"]
    assert len(train) + len(val) == meta["train_tokens"] + meta["val_tokens"] + meta["documents"]
    text = bytes(train[train != EOS].astype(np.uint8)).decode("utf-8", errors="replace") + bytes(val[val != EOS].astype(np.uint8)).decode("utf-8", errors="replace")
    assert "hello world" in text and "json document number 7" in text and "parquet row 3" in text and "é" in text


def test_prepare_accepts_file_uris_and_replaces_atomically(sources, tmp_path):
    out = tmp_path / "shards"
    prepare([f"file://{sources}/a.txt", f"file://{sources}/c.jsonl"], out, val_fraction=0.3)
    first = read_meta(out)
    prepare([str(sources)], out, val_fraction=0.3)
    assert read_meta(out)["documents"] > first["documents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards", "src"]  # no temp or .old leftovers


def test_bad_sources_are_explained(sources, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare([str(tmp_path / "missing")], tmp_path / "o")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: each JSONL line needs a string field 'text'"):
        prepare([str(bad)], tmp_path / "o")
    with pytest.raises(DataError, match="too few"):
        prepare([str(sources / "a.txt")], tmp_path / "o")
    with pytest.raises(DataError, match="has no meta.json"):
        read_meta(tmp_path)


def test_stdlib_is_the_builtin_corpus():
    files = stdlib_sources()
    assert any(f.endswith(os.sep + "os.py") for f in files)
    assert files == sorted(files)


def windows(n_tokens, seq_len, seed=0):
    tokens = (np.arange(n_tokens) % 251).astype(np.uint16)
    return TokenStream(tokens, seq_len, seed)


def test_stream_position_restore_gives_identical_batches():
    a = windows(10_000, 16)
    for _ in range(30):  # crosses an epoch boundary (624 windows / 8 per batch = 78 batches)
        a.next_batch(8)
    state = a.state_dict()
    expected = [a.next_batch(8) for _ in range(80)]
    b = windows(10_000, 16)
    b.load_state_dict(json.loads(json.dumps(state)))  # state is plain JSON
    for (xe, ye), (xb, yb) in zip(expected, (b.next_batch(8) for _ in range(80))):
        np.testing.assert_array_equal(xe, xb)
        np.testing.assert_array_equal(ye, yb)
    assert b.state_dict()["epoch"] >= 1


def test_stream_targets_are_shifted_inputs_and_epochs_cover_every_window():
    s = windows(1_001, 10)
    x, y = s.next_batch(100)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    starts = sorted(int(r[0]) for r in x)
    assert len(set(starts)) == 100  # a permutation: every window once per epoch
    assert s.state_dict() == {"epoch": 0, "index": 100}
    s.next_batch(1)
    assert s.state_dict() == {"epoch": 1, "index": 1}


def test_stream_seed_changes_order_and_bad_positions_are_refused():
    x0, _ = windows(10_000, 16, seed=0).next_batch(4)
    x0b, _ = windows(10_000, 16, seed=0).next_batch(4)
    x1, _ = windows(10_000, 16, seed=1).next_batch(4)
    np.testing.assert_array_equal(x0, x0b)
    assert not np.array_equal(x0, x1)
    with pytest.raises(DataError, match="does not fit this corpus"):
        windows(1_000, 16).load_state_dict({"epoch": 0, "index": 10_000})
    with pytest.raises(DataError, match="fewer than one window"):
        windows(10, 16)


def test_cli_prepare(sources, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_llm.cli", "prepare", str(sources), "--out", str(out), "--val-fraction", "0.2"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["documents"] == 62
    proc = subprocess.run([sys.executable, "-m", "elastic_llm.cli", "prepare", str(tmp_path / "nothing"), "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
