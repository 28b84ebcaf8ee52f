"""LLaMA-style decoder, buildable as a whole or as one pipeline stage.

Owns: the layers (RMSNorm, rotary embeddings, SwiGLU MLP, causal attention through
``scaled_dot_product_attention``), their deterministic initialisation, and the split of the
layer stack into stages. Never touches Ray, optimizers or data.

Initialisation is per layer from ``(seed, layer index)``, so a model split into any number of
stages holds exactly the same weights as the unsplit model: the pipeline can be checked against
a single process bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from elastic_llm.shape import LOSS_CHUNK, ModelShape, stage_layer_range


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotary embeddings, each (T, head_dim/2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (even, odd) of the last dimension. x: (B, H, T, hd)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_heads = shape.n_heads
        self.head_dim = shape.dim // shape.n_heads
        self.wqkv = nn.Linear(shape.dim, 3 * shape.dim, bias=False)
        self.wo = nn.Linear(shape.dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.wqkv(x).split(C, dim=-1)  # each (B, T, C)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attn = Attention(shape)
        self.mlp_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.mlp = SwiGLU(shape.dim, shape.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def _init_linear_weights(module: nn.Module, generator: torch.Generator, std: float) -> None:
    for p in module.parameters():
        if p.dim() >= 2:
            with torch.no_grad():
                p.normal_(0.0, std, generator=generator)


def _seeded(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + salt) % (2**63))


class StageModule(nn.Module):
    """The layers of one pipeline stage.

    Stage 0 also holds the token embedding, the last stage the final norm and LM head.
    Input: token ids (B, T) on stage 0, activations (B, T, C) elsewhere. Output: activations
    (B, T, C), or logits (B, T, V) on the last stage.
    """

    EMBED_SALT = 10_000_001
    HEAD_SALT = 10_000_002

    def __init__(self, shape: ModelShape, layers: range, first: bool, last: bool, seed: int) -> None:
        super().__init__()
        self.shape = shape
        self.layer_ids = list(layers)
        self.first, self.last = first, last
        self.checkpoint_layers = False  # train.activation_checkpointing: layers (set by the stage)
        std = 0.02
        # GPT-2 style scaled init for residual projections keeps deep stacks stable.
        resid_std = std / math.sqrt(2 * shape.n_layers)
        if first:
            self.embed = nn.Embedding(shape.vocab_size, shape.dim)
            with torch.no_grad():
                self.embed.weight.normal_(0.0, std, generator=_seeded(seed, self.EMBED_SALT))
        self.layers = nn.ModuleList()
        for layer_id in self.layer_ids:
            block = Block(shape)
            g = _seeded(seed, layer_id)
            _init_linear_weights(block, g, std)
            with torch.no_grad():
                block.attn.wo.weight.normal_(0.0, resid_std, generator=g)
                block.mlp.w_down.weight.normal_(0.0, resid_std, generator=g)
            self.layers.append(block)
        if last:
            self.norm = RMSNorm(shape.dim, shape.norm_eps)
            self.head = nn.Linear(shape.dim, shape.vocab_size, bias=False)
            with torch.no_grad():
                self.head.weight.normal_(0.0, std, generator=_seeded(seed, self.HEAD_SALT))
        cos, sin = rope_tables(shape.dim // shape.n_heads, shape.seq_len, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self.first, True, self.last)

    def run(self, x: torch.Tensor, embed: bool, layers: bool, head: bool, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Some of the stage's parts: the embedding, the transformer layers, the final norm and
        LM head (CheckFree+'s swapped order visits the first and last stage twice); with ``targets``
        the head's mean next-token loss instead of its logits (:meth:`head_loss`)."""
        if embed:
            x = self.embed(x)  # (B, T) -> (B, T, C)
        if layers:
            recompute = self.checkpoint_layers and torch.is_grad_enabled()
            for block in self.layers:  # with checkpointing each layer keeps only its input; its backward runs it again
                x = checkpoint(block, x, self.rope_cos, self.rope_sin, use_reentrant=False) if recompute else block(x, self.rope_cos, self.rope_sin)
        if head:
            return self.head_loss(x, targets) if targets is not None else self.head(self.norm(x))  # the loss, or the logits (B, T, V)
        return x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The final norm, the LM head and the mean next-token loss of ``x`` (B, T, C). With layer
        checkpointing, a microbatch of more than :data:`LOSS_CHUNK` tokens runs in chunks of that
        many, each recomputed in its backward: one chunk's logits and their gradients exist at a
        time, where the whole microbatch's would be the last stage's largest tensors (the loss is
        the chunks' summed losses over the token count: equal to the plain mean up to rounding)."""
        if not (self.checkpoint_layers and torch.is_grad_enabled()) or targets.numel() <= LOSS_CHUNK:
            return lm_loss(self.head(self.norm(x)), targets)
        flat, flat_targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
        total = sum(checkpoint(self._summed_loss, flat[a : a + LOSS_CHUNK], flat_targets[a : a + LOSS_CHUNK], use_reentrant=False)
                    for a in range(0, flat_targets.numel(), LOSS_CHUNK))
        return total / flat_targets.numel()

    def _summed_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.norm(x)).float(), targets, reduction="sum")


def build_stage(shape: ModelShape, n_stages: int, stage: int, seed: int) -> StageModule:
    """The module of one stage of an ``n_stages``-way split."""
    return StageModule(
        shape,
        stage_layer_range(shape.n_layers, n_stages, stage),
        first=stage == 0,
        last=stage == n_stages - 1,
        seed=seed,
    )


def build_full_model(shape: ModelShape, seed: int) -> StageModule:
    """The unsplit model: one 'stage' holding every layer, same weights as any split."""
    return build_stage(shape, 1, 0, seed)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
