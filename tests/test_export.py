"""Export to Hugging Face: transformers' LlamaForCausalLM gives our logits (fp32, within 1e-4)."""

import pytest
import torch

from elastic_llm.export import ExportError, to_hf_state_dict, write_hf
from elastic_llm.model import ModelShape, build_full_model

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")

SHAPE = ModelShape(vocab_size=300, dim=64, n_heads=4, n_layers=3, seq_len=32, ffn_hidden=128, rope_theta=500000.0)


@pytest.fixture(scope="module")
def ours():
    model = build_full_model(SHAPE, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the initial distribution, norms included: nothing passes by symmetry
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def hf_logits(path, tokens, attn="eager"):
    hf = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation=attn).eval()
    with torch.no_grad():
        return hf(tokens).logits


def test_hf_llama_gives_our_logits(ours, tmp_path):
    tensors = dict(ours.named_parameters())
    out = write_hf(SHAPE, tensors, tmp_path / "hf")
    tokens = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mine = ours(tokens)
    for attn in ("eager", "sdpa"):
        assert (hf_logits(out, tokens, attn) - mine).abs().max().item() < 1e-4


def test_without_the_rope_conversion_the_logits_differ(ours, tmp_path):
    from safetensors.torch import save_file

    out = write_hf(SHAPE, dict(ours.named_parameters()), tmp_path / "hf")
    save_file(to_hf_state_dict(SHAPE, dict(ours.named_parameters()), convert_rope=False), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokens = torch.randint(0, SHAPE.vocab_size, (1, SHAPE.seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf_logits(out, tokens) - ours(tokens)).abs().max().item() > 1e-3


def test_refusals(ours, tmp_path):
    tensors = dict(ours.named_parameters())
    with pytest.raises(ExportError, match="missing \\['head.weight'\\]"):
        write_hf(SHAPE, {k: v for k, v in tensors.items() if k != "head.weight"}, tmp_path / "a")
    with pytest.raises(ExportError, match="unexpected \\['layers.3.attn_norm.weight'\\]"):
        write_hf(SHAPE, dict(tensors, **{"layers.3.attn_norm.weight": torch.ones(SHAPE.dim)}), tmp_path / "a")
    bad = dict(tensors, **{"norm.weight": torch.ones(3)})
    with pytest.raises(ExportError, match="norm.weight has shape \\[3\\]"):
        write_hf(SHAPE, bad, tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("keep me")
    with pytest.raises(ExportError, match="not empty"):
        write_hf(SHAPE, tensors, tmp_path / "c")
    assert (tmp_path / "c" / "x").read_text() == "keep me"
    (tmp_path / "d").write_text("a file")
    with pytest.raises(ExportError, match="is a file"):
        write_hf(SHAPE, tensors, tmp_path / "d")
    with pytest.raises(ExportError, match="eos_id=300 is outside"):
        write_hf(SHAPE, tensors, tmp_path / "e", eos_id=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]  # nothing half written
    (tmp_path / "empty").mkdir()
    assert (write_hf(SHAPE, tensors, tmp_path / "empty") / "model.safetensors").is_file()  # an empty directory is fine


def test_a_crash_leaves_no_half_export(ours, tmp_path, monkeypatch):
    import safetensors.torch

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        write_hf(SHAPE, dict(ours.named_parameters()), tmp_path / "hf", eos_id=0)
    assert list(tmp_path.iterdir()) == []  # neither the target nor the temporary directory


def test_byte_model_exports_weights_only(tmp_path):
    """No tokenizer: config/weights only; the end-of-text id is null unless given (LlamaConfig
    would otherwise default bos/eos to 1 and 2, ordinary byte tokens)."""
    shape = ModelShape(vocab_size=256, dim=32, n_heads=2, n_layers=1, seq_len=16, ffn_hidden=64)
    tensors = dict(build_full_model(shape, seed=0).named_parameters())
    plain = write_hf(shape, tensors, tmp_path / "plain")
    assert sorted(p.name for p in plain.iterdir()) == ["config.json", "model.safetensors"]
    cfg = transformers.AutoConfig.from_pretrained(str(plain))
    assert (cfg.bos_token_id, cfg.eos_token_id) == (None, None)
    nul = write_hf(shape, tensors, tmp_path / "nul", eos_id=0)
    assert sorted(p.name for p in nul.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert transformers.AutoConfig.from_pretrained(str(nul)).eos_token_id == 0
    gen = transformers.GenerationConfig.from_pretrained(str(nul))
    assert (gen.bos_token_id, gen.eos_token_id) == (0, 0)


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "the quick brown fox jumps over the lazy dog"] * 50, trainer)
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.get_vocab_size() > 256  # some merges were learnt
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_tokenizer_travels_with_the_export(ours, tmp_path, bpe_file):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe_file))
    out = write_hf(SHAPE, dict(ours.named_parameters()), tmp_path / "hf", tokenizer_file=bpe_file)
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def g(y):\n    return the fox<|endoftext|>"
    ids = tok.encode(text).ids
    assert ids[-1] == 0 and any(i > 256 for i in ids)  # the special token and merged tokens are exercised
    assert auto(text, add_special_tokens=False)["input_ids"] == ids
    assert auto.decode(ids) == text
    assert auto.eos_token_id == 0 and auto.model_max_length == SHAPE.seq_len
    assert transformers.AutoConfig.from_pretrained(str(out)).eos_token_id == 0
    assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == 0


def test_tokenizer_refusals(ours, tmp_path, bpe_file):
    tensors = dict(ours.named_parameters())
    with pytest.raises(ExportError, match="eos_id=5 but .* at id 0"):
        write_hf(SHAPE, tensors, tmp_path / "a", tokenizer_file=bpe_file, eos_id=5)
    small = ModelShape(vocab_size=257, dim=32, n_heads=2, n_layers=1, seq_len=16, ffn_hidden=64)
    with pytest.raises(ExportError, match="vocab_size is 257: not this model's tokenizer"):
        write_hf(small, dict(build_full_model(small, seed=0).named_parameters()), tmp_path / "b", tokenizer_file=bpe_file)
    assert list(tmp_path.iterdir()) == []


def test_cli_exports_a_durable_checkpoint(tmp_path):
    """`elastic-llm export CHECKPOINT --format hf --out DIR` on a checkpoint written by two stages:
    Hugging Face gives the logits of our whole model holding the checkpoint's weights."""
    from elastic_llm.cli import main
    from elastic_llm.durable.format import open_checkpoint
    from elastic_llm.durable.storage import Storage
    from tests.test_durable import config, trained_workers, write_checkpoint

    cfg = config()
    name = write_checkpoint(Storage(str(tmp_path / "run")), cfg, trained_workers(cfg), 2)
    assert main(["export", str(tmp_path / "run" / name), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2  # not empty: refused
    whole = build_full_model(cfg.model.shape(), seed=0).eval()
    whole.load_state_dict(open_checkpoint(str(tmp_path / "run")).model_tensors())
    tokens = torch.randint(0, 256, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (hf_logits(tmp_path / "hf", tokens) - whole(tokens)).abs().max().item() < 1e-4
