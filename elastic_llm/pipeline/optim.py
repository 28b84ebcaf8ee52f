"""A stage's optimizer and learning-rate schedule: AdamW (weight decay on matrices only) and a
linear warm-up then cosine decay.

Owns :class:`StageAdamW`, :class:`StageSchedule`, :func:`build_optimizer` and :func:`lr_factor`,
shared by the stage actor, its redundant copy (``recovery.mode: redundant``) and the benchmarks'
single-process peers, so all compute the same update. Never holds state beyond what it builds for
the caller.

Why not ``torch.optim.AdamW`` itself: every method of ``torch.optim.Optimizer`` (its constructor,
``step``, ``zero_grad``, ``state_dict``) imports torch's compiler stack (``torch._dynamo``) on first
use, 1.3 s of CPU in every process that builds one: every stage actor, warm standby and respawned
stage paid it before its first step. :class:`StageAdamW` runs the very update
``torch.optim.AdamW.step`` runs (torch's public functional ``torch.optim.adamw.adamw``, ``foreach``),
on the same per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``) and the same parameter
group fields, so its results are bit-identical to torch's (``tests/test_optim.py`` checks it step by
step against ``torch.optim.AdamW`` with ``LambdaLR``) and snapshots keep their layout and fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.adamw import adamw

from elastic_llm.config import TrainConfig

Group = dict[str, Any]  # torch's own type for a parameter group: its fields differ in type


def lr_factor(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at ``step``: linear warm-up, then cosine down to ``min_ratio``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StageAdamW:
    """AdamW over parameter groups, as ``torch.optim.AdamW(groups, lr, betas, foreach=True)``.

    ``param_groups``: one dict per group with torch's fields (``params``, ``lr``, ``betas``,
    ``eps``, ``weight_decay``, ... and the schedule's ``initial_lr``); ``state``: per parameter,
    ``step`` (a float32 scalar on the CPU, as torch keeps it), ``exp_avg`` and ``exp_avg_sq``,
    created by the first :meth:`step` that sees the parameter's gradient (or up front by
    :func:`elastic_llm.snapshot.state.ensure_optimizer_state`)."""

    def __init__(self, groups: list[Group], lr: float, betas: tuple[float, float], eps: float = 1e-8) -> None:
        defaults: Group = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": 1e-2,
            "amsgrad": False,
            "maximize": False,
            "foreach": True,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
        }
        self.param_groups: list[Group] = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update of every parameter that has a gradient (torch's ``foreach`` kernels)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state.get(p) or self._fresh(p) for p in params]
            beta1, beta2 = group["betas"]
            adamw(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                [s["step"] for s in states],
                foreach=True,
                has_complex=any(torch.is_complex(p) for p in params),
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

    def _fresh(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero moments and step 0, as torch's AdamW creates them at a parameter's first update."""
        st = {
            "step": torch.zeros((), dtype=torch.float32),  # on the CPU: torch keeps it there unless capturable/fused
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
        self.state[p] = st
        return st

    def zero_grad(self) -> None:
        """Drop every gradient (``set_to_none``, as torch's default)."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


class StageSchedule:
    """The LR of each group = its ``initial_lr`` x ``factor(step)``, as ``torch.optim.lr_scheduler.LambdaLR``
    sets it (one factor for every group); :meth:`state_dict` has LambdaLR's fields, so snapshots
    and checkpoints keep their format."""

    def __init__(self, optimizer: StageAdamW, factor: Callable[[int], float]) -> None:
        self.optimizer, self.factor = optimizer, factor
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.base_lrs: list[float] = [float(g["initial_lr"]) for g in optimizer.param_groups]
        self.last_epoch = -1
        self.step()

    def step(self) -> None:
        """Advance one step and set every group's LR."""
        self.last_epoch += 1
        self._apply()

    def _apply(self) -> None:
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = base * self.factor(self.last_epoch)

    def resume(self, step: int, lr_scale: float) -> None:
        """Stand at ``step`` with every peak LR x ``lr_scale`` (a stage rebuilt by CheckFree)."""
        self.base_lrs = [lr * lr_scale for lr in self.base_lrs]
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["initial_lr"] = base
        self.last_epoch = step
        self._apply()

    def state_dict(self) -> dict[str, object]:
        return {
            "base_lrs": list(self.base_lrs),
            "last_epoch": self.last_epoch,
            "_step_count": self.last_epoch + 1,
            "_is_initial": False,
            "_get_lr_called_within_step": False,
            "_last_lr": [g["lr"] for g in self.optimizer.param_groups],
            "lr_lambdas": [None] * len(self.base_lrs),  # the factor is rebuilt from the config, never saved
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Take ``base_lrs`` and ``last_epoch`` (the groups' LRs come back with the groups, as with LambdaLR)."""
        base, last = state.get("base_lrs"), state.get("last_epoch")
        if not isinstance(base, list) or len(base) != len(self.base_lrs) or not all(isinstance(v, (int, float)) for v in base) or not isinstance(last, int):
            raise ValueError(f"the saved LR schedule is malformed (base_lrs {base!r}, last_epoch {last!r}; this stage has {len(self.base_lrs)} groups)")
        self.base_lrs, self.last_epoch = [float(v) for v in base], last


def build_optimizer(module: torch.nn.Module, train: TrainConfig) -> tuple[StageAdamW, StageSchedule]:
    """A stage's AdamW (weight decay on matrices only) and its LR schedule (:func:`lr_factor`)."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    optimizer = StageAdamW(
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train.lr,
        betas=(train.beta1, train.beta2),
    )
    min_ratio = train.min_lr / train.lr
    return optimizer, StageSchedule(optimizer, lambda s: lr_factor(s, train.warmup_steps, train.max_steps, min_ratio))
