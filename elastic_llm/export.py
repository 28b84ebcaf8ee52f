"""Export to Hugging Face ``transformers``: a ``LlamaForCausalLM`` directory from our tensors.

Owns: the mapping of our global parameter names (``layers.3.attn.wqkv.weight``, ...) to Hugging
Face's Llama names, splitting the fused q/k/v projection, converting the rotary layout (ours
rotates interleaved pairs (x[2j], x[2j+1]); Hugging Face rotates halves (x[j], x[j + hd/2]): the
rows of q and k are permuted per head, which leaves every attention score unchanged), the
``config.json``, and the tokenizer files ``AutoTokenizer`` reads when the run had a BPE tokenizer
(byte-token models export weights only). Writes into a temporary directory beside the target and
renames it, so a crash leaves no half export. Never reads checkpoints (the CLI hands it tensors
from :class:`elastic_llm.durable.format.Checkpoint`) and never unpickles.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from elastic_llm.model import ModelShape

EOS_TOKEN = "<|endoftext|>"


class ExportError(ValueError):
    """The tensors or the target directory cannot be exported; the message names which."""


def hf_config(shape: ModelShape, eos_id: int | None = None) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_hidden,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_heads,
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
        "torch_dtype": "float32",
    }
    if eos_id is not None:
        cfg.update(bos_token_id=eos_id, eos_token_id=eos_id)
    return cfg


def rope_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection reordered per head from interleaved pairs to halves."""
    hd = w.shape[0] // n_heads
    order = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    return w.view(n_heads, hd, -1)[:, order, :].reshape(w.shape)


def to_hf_state_dict(shape: ModelShape, tensors: Mapping[str, torch.Tensor], convert_rope: bool = True) -> dict[str, torch.Tensor]:
    """Our global names -> Hugging Face Llama names (``convert_rope=False`` only to show that the
    conversion matters)."""
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


def write_hf(shape: ModelShape, tensors: Mapping[str, torch.Tensor], out_dir: str | Path, tokenizer_file: str | Path | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (and the tokenizer, if given) to ``out_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not empty: give a new directory with --out")
    state = to_hf_state_dict(shape, tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        eos_id = None
        if tokenizer_file is not None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tokenizer_file))
            eos_id = tok.token_to_id(EOS_TOKEN)
            if eos_id is None:
                raise ExportError(f"{tokenizer_file} has no {EOS_TOKEN} token: not a tokenizer elastic-llm prepared")
            shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
            (tmp / "tokenizer_config.json").write_text(json.dumps({
                "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN,
                "model_max_length": shape.seq_len, "clean_up_tokenization_spaces": False,
            }, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_config(shape, eos_id), indent=2))
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
