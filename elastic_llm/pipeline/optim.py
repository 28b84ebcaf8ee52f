"""A stage's optimizer and learning-rate schedule: AdamW (weight decay on matrices only) and a
linear warm-up then cosine decay.

Owns :func:`build_optimizer` and :func:`lr_factor`, shared by the stage actor, its redundant copy
(``recovery.mode: redundant``) and the benchmarks' single-process peers, so all compute the same
update. Never holds state: the caller keeps what it builds.
"""

from __future__ import annotations

import math

import torch

from elastic_llm.config import TrainConfig


def lr_factor(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at ``step``: linear warm-up, then cosine down to ``min_ratio``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(module: torch.nn.Module, train: TrainConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """A stage's AdamW (weight decay on matrices only) and its LR schedule (:func:`lr_factor`)."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        foreach=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, train.warmup_steps, train.max_steps, train.min_lr / train.lr),
    )
    return optimizer, scheduler
