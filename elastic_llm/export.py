"""Export to Hugging Face ``transformers``: a ``LlamaForCausalLM`` directory from our tensors.

Owns: the mapping of our global parameter names (``layers.3.attn.wqkv.weight``, ...) to Hugging
Face's Llama names, splitting the fused q/k/v projection, converting the rotary layout (ours
rotates interleaved pairs (x[2j], x[2j+1]); Hugging Face rotates halves (x[j], x[j + hd/2]): the
rows of q and k are permuted the same way per head, which leaves every attention score
unchanged), the ``config.json`` / ``generation_config.json``, and the tokenizer files
``AutoTokenizer`` reads when the run had a BPE tokenizer. Byte-token models (vocab 256, no
tokenizer file) export weights only: Hugging Face has no tokenizer for raw UTF-8 byte ids, so the
caller feeds ``list(text.encode())`` itself (end of text is NUL, id 0: pass ``eos_id=0``).
Writes into a temporary directory beside the target and renames it, so a crash leaves no half
export; refuses a non-empty target. Never reads checkpoints (the CLI hands it tensors from
:class:`elastic_llm.durable.format.Checkpoint`), never unpickles, never downloads.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from elastic_llm.stream import EOS_TOKEN
from elastic_llm.shape import ModelShape



class ExportError(ValueError):
    """The tensors or the target directory cannot be exported; the message names which."""


def hf_config(shape: ModelShape, eos_id: int | None = None) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` of ``shape``.

    The rotary base is written both ways: ``rope_parameters`` (what transformers 5.x reads) and
    the flat ``rope_theta`` (what 4.x reads; 5.x folds it into ``rope_parameters``, same value).
    ``bos_token_id``/``eos_token_id`` are ``eos_id`` (``<|endoftext|>`` begins and ends a document)
    and written as null when unknown: left out, ``LlamaConfig`` would default them to 1 and 2,
    ordinary tokens of our vocabularies."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_hidden,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_heads,
        "head_dim": shape.dim // shape.n_heads,
        "num_hidden_layers": shape.n_layers,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.seq_len,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},  # transformers 5.x
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",  # transformers 4.x
        "dtype": "float32",  # transformers 5.x
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
    }


def rope_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection reordered per head from interleaved pairs to halves."""
    hd = w.shape[0] // n_heads
    order = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    return w.view(n_heads, hd, -1)[:, order, :].reshape(w.shape)


def to_hf_state_dict(shape: ModelShape, tensors: Mapping[str, torch.Tensor], convert_rope: bool = True) -> dict[str, torch.Tensor]:
    """Our global names -> Hugging Face Llama names, as contiguous fp32 copies.

    Raises :class:`ExportError` naming the tensor when one is missing, unexpected or of the
    wrong shape. ``convert_rope=False`` (tests only) skips the q/k row permutation, to show that
    it matters."""
    if shape.n_heads < 1 or shape.dim % shape.n_heads or (shape.dim // shape.n_heads) % 2:
        raise ExportError(f"dim={shape.dim} with n_heads={shape.n_heads} gives no even head size: not a model elastic-llm trains")
    d, v, f = shape.dim, shape.vocab_size, shape.ffn_hidden
    want: dict[str, tuple[int, ...]] = {"embed.weight": (v, d), "norm.weight": (d,), "head.weight": (v, d)}
    for i in range(shape.n_layers):
        want.update({
            f"layers.{i}.attn_norm.weight": (d,), f"layers.{i}.attn.wqkv.weight": (3 * d, d), f"layers.{i}.attn.wo.weight": (d, d),
            f"layers.{i}.mlp_norm.weight": (d,), f"layers.{i}.mlp.w_gate.weight": (f, d), f"layers.{i}.mlp.w_up.weight": (f, d),
            f"layers.{i}.mlp.w_down.weight": (d, f),
        })
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ExportError(f"the tensors do not form this model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shp in want.items():
        if tuple(tensors[name].shape) != shp:
            raise ExportError(f"tensor {name} has shape {list(tensors[name].shape)}, the model needs {list(shp)}")
    rope = (lambda w: rope_to_halves(w, shape.n_heads)) if convert_rope else (lambda w: w)
    out = {"model.embed_tokens.weight": tensors["embed.weight"], "model.norm.weight": tensors["norm.weight"], "lm_head.weight": tensors["head.weight"]}
    for i in range(shape.n_layers):
        q, k, val = tensors[f"layers.{i}.attn.wqkv.weight"].split(d, dim=0)
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": rope(q), p + "self_attn.k_proj.weight": rope(k), p + "self_attn.v_proj.weight": val,
            p + "self_attn.o_proj.weight": tensors[f"layers.{i}.attn.wo.weight"],
            p + "mlp.gate_proj.weight": tensors[f"layers.{i}.mlp.w_gate.weight"], p + "mlp.up_proj.weight": tensors[f"layers.{i}.mlp.w_up.weight"],
            p + "mlp.down_proj.weight": tensors[f"layers.{i}.mlp.w_down.weight"],
            p + "input_layernorm.weight": tensors[f"layers.{i}.attn_norm.weight"], p + "post_attention_layernorm.weight": tensors[f"layers.{i}.mlp_norm.weight"],
        })
    return {k: t.detach().to(torch.float32).contiguous().clone() for k, t in out.items()}


def write_hf(
    shape: ModelShape,
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    tokenizer_file: str | Path | None = None,
    eos_id: int | None = None,
) -> Path:
    """Write a ``LlamaForCausalLM`` directory to ``out_dir`` (which must not exist, or be empty).

    Always ``config.json`` and ``model.safetensors`` (fp32). With ``tokenizer_file`` (a Hugging
    Face ``tokenizers`` ``tokenizer.json`` holding ``<|endoftext|>``) also ``tokenizer.json`` and
    ``tokenizer_config.json``, so ``AutoTokenizer.from_pretrained(out_dir)`` works; the end-of-text
    id is then the tokenizer's (``eos_id``, if given, must agree). Without one (byte-token models)
    only the weights go out and ``eos_id`` (NUL, 0, for our byte tokenizer) is recorded if given.
    ``generation_config.json`` is written when the end-of-text id is known. Returns ``out_dir``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is a file: give a new directory with --out")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} already exists and is not empty: give a new directory with --out")
    state = to_hf_state_dict(shape, tensors)
    tok_config = None
    if tokenizer_file is not None:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise ExportError(f"{tokenizer_file} is not a tokenizer.json that Hugging Face tokenizers reads: {e}") from e
        tok_eos = tok.token_to_id(EOS_TOKEN)
        if tok_eos is None:
            raise ExportError(f"{tokenizer_file} has no {EOS_TOKEN} token: not a tokenizer elastic-llm prepared")
        if eos_id is not None and eos_id != tok_eos:
            raise ExportError(f"eos_id={eos_id} but {tokenizer_file} has {EOS_TOKEN} at id {tok_eos}")
        n_tok = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        if n_tok > shape.vocab_size:
            raise ExportError(f"{tokenizer_file} has ids up to {n_tok - 1}, the model's vocab_size is {shape.vocab_size}: not this model's tokenizer")
        eos_id = tok_eos
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "unk_token": EOS_TOKEN,
            "model_max_length": shape.seq_len,
            "clean_up_tokenization_spaces": False,
        }
    if eos_id is not None and not 0 <= eos_id < shape.vocab_size:
        raise ExportError(f"eos_id={eos_id} is outside the vocabulary [0, {shape.vocab_size})")
    out.parent.mkdir(parents=True, exist_ok=True)
    # mkdir (not mkdtemp, which makes 0700) so the export gets the umask's permissions.
    tmp = out.parent / f".{out.name}.export-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if tok_config is not None and tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
            _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "config.json", hf_config(shape, eos_id))
        if eos_id is not None:
            _write_json(tmp / "generation_config.json", {"bos_token_id": eos_id, "eos_token_id": eos_id})
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            out.rmdir()  # empty (checked above); fails loudly if someone filled it meanwhile
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
