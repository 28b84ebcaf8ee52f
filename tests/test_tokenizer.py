"""data.tokenizer: bpe — a byte-level BPE from Hugging Face tokenizers, trained or loaded, beside the shards (no Ray)."""

import hashlib
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from elastic_llm import data
from elastic_llm.cli import main
from elastic_llm.config import ConfigError, load_config
from elastic_llm.data import (
    EOS_TOKEN,
    DataError,
    builtin_corpus_dir,
    ensure_builtin_corpus,
    load_split,
    load_tokenizer,
    open_run_data,
    prepare,
    read_meta,
)
from elastic_llm.shape import count_parameters

from .conftest import REPO

DOCS = [f"document {i}: naïve café — ünïcode {i * 7} 日本語 ✓\n" + f"def f{i}(x):\n    return x * {i}  # the quick brown fox\n" * (1 + i % 4) for i in range(60)]


@pytest.fixture
def sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    (src / "notes.md").write_text("# notes\nsome markdown, emoji 🐍 and a tab\there\n" * 20)
    return src


@pytest.fixture
def bpe_dir(sources, tmp_path):
    out = tmp_path / "bpe"
    prepare([str(sources)], out, val_fraction=0.2, tokenizer="bpe", vocab_size=300)
    return out


def rows(directory, split):
    """Token ids of every document of a split, as the shards store them."""
    out = []
    for shard in sorted(directory.glob(f"{split}-*.parquet")):
        out += pq.read_table(shard).column("tokens").to_pylist()
    return out


def test_prepare_bpe_writes_tokenizer_and_meta(bpe_dir):
    meta = read_meta(bpe_dir)
    raw = (bpe_dir / "tokenizer.json").read_bytes()
    assert meta["tokenizer"] == "bpe" and meta["eos"] == 0
    assert meta["tokenizer_sha256"] == hashlib.sha256(raw).hexdigest()
    tok = load_tokenizer(bpe_dir)
    assert tok.token_to_id(EOS_TOKEN) == 0
    assert meta["vocab_size"] == tok.get_vocab_size() == 300  # the corpus has enough pairs for 43 merges
    assert sorted(p.name for p in bpe_dir.iterdir()) == ["meta.json", "tokenizer.json", "train-00000.parquet", "val-00000.parquet"]
    assert pq.read_schema(bpe_dir / "train-00000.parquet").field("tokens").type.value_type == "uint16"
    assert load_tokenizer(f"file://{bpe_dir}").to_str() == tok.to_str()  # URIs too, like read_meta


def test_byte_data_is_unchanged_and_has_no_tokenizer(sources, tmp_path):
    meta = prepare([str(sources)], tmp_path / "bytes", val_fraction=0.2)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eos"]) == ("byte", 256, 0)
    assert "tokenizer_sha256" not in meta and not (tmp_path / "bytes" / "tokenizer.json").exists()
    assert load_tokenizer(tmp_path / "bytes") is None


def test_tokenizer_json_is_checked_against_meta(bpe_dir):
    path = bpe_dir / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["model"]["vocab"]["zzz-swapped"] = tok["model"]["vocab"].pop(next(iter(tok["model"]["vocab"])))
    path.write_text(json.dumps(tok))  # still a valid tokenizer, but not the one the shards were encoded with
    with pytest.raises(DataError, match=r"tokenizer.json has sha256 .* meta.json records .*prepare the data again"):
        load_tokenizer(bpe_dir)
    path.unlink()
    with pytest.raises(DataError, match=r"has no tokenizer.json though its meta.json says tokenizer 'bpe'"):
        load_tokenizer(bpe_dir)


def test_round_trip_of_unicode_text(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    text = "naïve café — 日本語 ✓ 🐍🚀 Ελληνικά עברית\n\tdef x():\x00 return 'ﬁ' e\u0301\r\n  "
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned: fewer tokens than bytes
    assert all(0 < i < 300 for i in ids)


def test_shard_ids_are_the_tokenizers_ids_and_prepare_is_deterministic(sources, bpe_dir, tmp_path):
    tok = load_tokenizer(bpe_dir)
    train, val = rows(bpe_dir, "train"), rows(bpe_dir, "val")
    docs = DOCS + [(sources / "notes.md").read_text()]
    assert train and val and len(train) + len(val) == len(docs)
    assert sorted(train + val) == sorted(tok.encode(d).ids for d in docs)
    flat = load_split(bpe_dir, "train")  # documents in order, each followed by EOS
    np.testing.assert_array_equal(flat, np.concatenate([np.asarray(r + [0], dtype=np.uint16) for r in train]))
    again = tmp_path / "again"
    prepare([str(sources)], again, val_fraction=0.2, tokenizer="bpe", vocab_size=300)
    assert read_meta(again)["tokenizer_sha256"] == read_meta(bpe_dir)["tokenizer_sha256"]
    assert rows(again, "train") == train


def train_tokenizer(path, special_tokens):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(path))
    return tok


def test_tokenizer_file_is_used_with_its_own_eos(sources, tmp_path):
    own = train_tokenizer(tmp_path / "own.json", ["<pad>", EOS_TOKEN])  # end of text is id 1 here
    out = tmp_path / "shards"
    meta = prepare([str(sources)], out, val_fraction=0.2, tokenizer="bpe", tokenizer_file=str(tmp_path / "own.json"))
    assert meta["eos"] == 1 and meta["vocab_size"] == own.get_vocab_size()
    assert load_tokenizer(out).to_str() == own.to_str()
    assert rows(out, "train")[0] in [own.encode(d).ids for d in DOCS + [(sources / "notes.md").read_text()]]
    flat = np.concatenate([load_split(out, "train"), load_split(out, "val")])
    assert int((flat == 1).sum()) == meta["documents"]  # documents are separated by the file's EOS id


def test_bad_tokenizer_files_are_refused_naming_file_and_fix(sources, tmp_path):
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x00\xffnot json at all")
    not_tok = tmp_path / "config.json"
    not_tok.write_text('{"model_type": "llama"}')
    no_eos = tmp_path / "no-eos.json"
    train_tokenizer(no_eos, ["<s>", "</s>"])
    for path in (garbage, not_tok):
        with pytest.raises(DataError, match=rf"{path.name} is not a Hugging Face tokenizers JSON file .*pass a tokenizer.json"):
            prepare([str(sources)], tmp_path / "o", tokenizer="bpe", tokenizer_file=str(path))
    with pytest.raises(DataError, match=r"no-eos.json has no <\|endoftext\|> token, the end-of-document token .*add_special_tokens"):
        prepare([str(sources)], tmp_path / "o", tokenizer="bpe", tokenizer_file=str(no_eos))
    with pytest.raises(DataError, match="missing.json cannot be read"):
        prepare([str(sources)], tmp_path / "o", tokenizer="bpe", tokenizer_file=str(tmp_path / "missing.json"))
    with pytest.raises(DataError, match="vocab_size=100 is too small for a byte-level BPE: use at least 257"):
        prepare([str(sources)], tmp_path / "o", tokenizer="bpe", vocab_size=100)
    with pytest.raises(DataError, match="go with tokenizer='bpe'"):
        prepare([str(sources)], tmp_path / "o", vocab_size=300)
    assert not (tmp_path / "o").exists()


def test_vocabularies_over_65536_are_stored_as_uint32(sources, tmp_path):
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {EOS_TOKEN: 0, **{c: i + 1 for i, c in enumerate(sorted(alphabet))}, "de": 70_000}  # sparse ids: 70001 needed
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("d", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    tok.save(str(tmp_path / "big.json"))
    out = tmp_path / "big"
    meta = prepare([str(sources)], out, val_fraction=0.2, tokenizer="bpe", tokenizer_file=str(tmp_path / "big.json"))
    assert meta["vocab_size"] == 70_001
    assert pq.read_schema(out / "train-00000.parquet").field("tokens").type.value_type == "uint32"
    flat = load_split(out, "train")
    assert flat.dtype == np.uint32 and 70_000 in flat  # "def" starts with the merge "de"
    assert open_run_data(str(out), 16, 0, 70_001, tokenizer="bpe").train.next_batch(2)[0].max() <= 70_000
    with pytest.raises(DataError, match="vocab_size 70001 > model.vocab_size=65536: raise model.vocab_size"):
        open_run_data(str(out), 16, 0, 65_536, tokenizer="bpe")


def test_cli_prepare_bpe(sources, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["prepare", "--tokenizer", "bpe", "--vocab-size", "300", str(sources), "--out", str(out), "--val-fraction", "0.2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["tokenizer"], printed["vocab_size"], printed["out"]) == ("bpe", 300, str(out))
    assert load_tokenizer(out).get_vocab_size() == 300
    own = tmp_path / "own.json"
    train_tokenizer(own, [EOS_TOKEN])
    assert main(["prepare", "--tokenizer", "bpe", "--tokenizer-file", str(own), str(sources), "--out", str(tmp_path / "own"), "--val-fraction", "0.2"]) == 0
    assert read_meta(tmp_path / "own")["vocab_size"] == 280


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--vocab-size", "300"], "error: --vocab-size and --tokenizer-file go with --tokenizer bpe"),
        (["--tokenizer", "bpe", "--vocab-size", "300", "--tokenizer-file", "t.json"], "error: pass --vocab-size to train a BPE or --tokenizer-file"),
        (["--tokenizer", "bpe", "--vocab-size", "100"], "error: vocab_size=100 is too small for a byte-level BPE: use at least 257"),
        (["--tokenizer", "bpe", "--tokenizer-file", "GARBAGE"], "GARBAGE is not a Hugging Face tokenizers JSON file"),
        (["--tokenizer", "bpe", "--no-out"], "error: --out DIR is required when you pass your own sources"),
    ],
)
def test_cli_prepare_refuses_with_exit_2(args, expected, sources, tmp_path, capsys):
    (tmp_path / "GARBAGE").write_text("{oops")
    args = [str(tmp_path / "GARBAGE") if a == "GARBAGE" else a for a in args]
    out = [] if "--no-out" in args else ["--out", str(tmp_path / "o")]
    assert main(["prepare", str(sources), *[a for a in args if a != "--no-out"], *out]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_prepare_unknown_tokenizer_exit_2(sources, capsys):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--tokenizer", "wordpiece", str(sources), "--out", "x"])
    assert e.value.code == 2 and "invalid choice: 'wordpiece'" in capsys.readouterr().err


def test_open_run_data_on_bpe_data(bpe_dir):
    run = open_run_data(str(bpe_dir), 16, 0, 300, tokenizer="bpe")
    assert run.tokenizer is not None and run.tokenizer.get_vocab_size() == 300
    x, y = run.train.next_batch(8)
    assert x.shape == (8, 16) and 0 <= x.min() and max(x.max(), y.max(), run.val.max()) < 300
    assert (x == 0).any() or (run.val == 0).any()  # EOS separates documents
    with pytest.raises(DataError, match=r"prepared with tokenizer 'bpe', not data.tokenizer='byte': set data.tokenizer=bpe"):
        open_run_data(str(bpe_dir), 16, 0, 300)
    with pytest.raises(DataError, match=r"vocab_size 300 > model.vocab_size=299: raise model.vocab_size"):
        open_run_data(str(bpe_dir), 16, 0, 299, tokenizer="bpe")
    with pytest.raises(DataError, match="data.tokenizer_file is for the built-in corpus"):
        open_run_data(str(bpe_dir), 16, 0, 300, tokenizer="bpe", tokenizer_file="t.json")


def test_builtin_corpus_has_a_directory_per_tokenizer(sources, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_LLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "stdlib_sources", lambda: [str(sources)])  # a small stand-in for the standard library
    byte_dir = builtin_corpus_dir()
    assert builtin_corpus_dir("bpe", 300).name == byte_dir.name + "-bpe300"
    assert builtin_corpus_dir("bpe").name == byte_dir.name + "-bpe8192"
    run = open_run_data(None, 16, 0, 300, val_fraction=0.2, tokenizer="bpe")  # data.dir unset: prepared on first use
    assert run.dir == str(byte_dir.parent / (byte_dir.name + "-bpe300"))
    assert read_meta(run.dir)["vocab_size"] == 300 and not byte_dir.exists()
    own = tmp_path / "own.json"
    train_tokenizer(own, [EOS_TOKEN])
    run = open_run_data(None, 16, 0, 300, val_fraction=0.2, tokenizer="bpe", tokenizer_file=str(own))
    sha = hashlib.sha256(own.read_bytes()).hexdigest()[:16]
    assert run.dir.endswith(f"-bpe-{sha}") and read_meta(run.dir)["vocab_size"] == 280
    assert ensure_builtin_corpus(0.2, "bpe", 300) == builtin_corpus_dir("bpe", 300)
    assert open_run_data(None, 16, 0, 256, val_fraction=0.2).dir == str(byte_dir)  # byte runs keep their own corpus


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["data.tokenizer=wordpiece"], "data.tokenizer='wordpiece' is unknown: use one of byte, bpe"),
        (["data.tokenizer=bpe"], "model.vocab_size=256 is too small for data.tokenizer='bpe': use at least 257"),
        (["data.tokenizer_file=t.json"], "data.tokenizer_file='t.json' needs data.tokenizer='bpe' (it is 'byte'): set data.tokenizer=bpe"),
        (["data.tokenizer=bpe", "model.vocab_size=512", "data.tokenizer_file=t.json", "data.dir=/d"], "data.tokenizer_file='t.json' is for the built-in corpus, but data.dir='/d'"),
    ],
)
def test_config_validation(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(REPO, "jobs", "tiny.yaml"), overrides)
    assert expected in str(err.value)
    load_config(os.path.join(REPO, "jobs", "tiny.yaml"), ["data.tokenizer=bpe", "model.vocab_size=512", "data.tokenizer_file=t.json"])


@pytest.mark.parametrize("name,params", [("llama-25m", 25e6), ("llama-124m", 124e6), ("llama-500m", 500e6), ("llama-1.5b", 1.5e9)])
def test_paper_configs_use_bpe_and_match_their_names(name, params):
    cfg = load_config(os.path.join(REPO, "jobs", f"{name}.yaml"))
    assert cfg.data.tokenizer == "bpe" and cfg.model.vocab_size >= 8192
    assert abs(count_parameters(cfg.model.shape()) / params - 1) < 0.10
