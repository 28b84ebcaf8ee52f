"""The model's numbers without torch: its shape, how its layers split into stages, its parameter
count and the loss's chunk size. The config, the memory plan, the simulator and the command
line's refusals read these without importing torch (2 s of CPU a process); the network itself is
:mod:`elastic_llm.model`."""

from __future__ import annotations

from dataclasses import dataclass

LOSS_CHUNK = 256  # tokens per chunk of the LM head's loss under activation checkpointing


@dataclass(frozen=True)
class ModelShape:
    """The numbers that define the network (a view of ``config.ModelConfig``)."""

    vocab_size: int
    dim: int
    n_heads: int
    n_layers: int
    seq_len: int
    ffn_hidden: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def stage_layer_range(n_layers: int, n_stages: int, stage: int) -> range:
    """Layers of ``stage`` when ``n_layers`` are split evenly into ``n_stages`` (validated upstream)."""
    per = n_layers // n_stages
    return range(stage * per, (stage + 1) * per)


def count_parameters(shape: ModelShape) -> int:
    per_layer = 4 * shape.dim * shape.dim + 3 * shape.dim * shape.ffn_hidden + 2 * shape.dim
    return shape.n_layers * per_layer + 2 * shape.vocab_size * shape.dim + shape.dim
