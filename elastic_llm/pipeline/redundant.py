"""The redundant copy of another stage (``recovery.mode: redundant``, after Bamboo).

Owns: the copy's layers and its own AdamW, its forward on the inputs the real stage gets, its
backward on the gradients the real stage gets (in microbatch order), its update, and packing its
state as a snapshot of that stage so the copy can be promoted. Never talks to Ray: the stage actor
that holds it calls it.
"""

from __future__ import annotations

import numpy as np
import torch

from elastic_llm.config import RunConfig
from elastic_llm.model import build_stage
from elastic_llm.pipeline.copies import pinned
from elastic_llm.pipeline.device import forward


class Shadow:
    """A trained copy of another stage (``recovery.mode: redundant``, after Bamboo): its layers
    and its own AdamW, fed the same inputs and output gradients as the real stage, so it stays
    bit-identical to it and replaces it when it is lost. The compute it costs is real."""

    def __init__(self, cfg: RunConfig, stage: int, device: torch.device) -> None:
        from elastic_llm.pipeline.optim import build_optimizer
        from elastic_llm.snapshot.state import StateArena

        self.cfg, self.stage, self.device = cfg, stage, device
        self.last = stage == cfg.parallel.stages - 1
        self.module = build_stage(cfg.model.shape(), cfg.parallel.stages, stage, cfg.train.seed).to(device)
        self.module.checkpoint_layers = cfg.train.activation_checkpointing == "layers"
        self.optimizer, self.scheduler = build_optimizer(self.module, cfg.train)
        self.arena = StateArena(self.module, self.optimizer)
        self.outputs: dict[int, torch.Tensor] = {}
        self.buffer = np.zeros(self.arena.layout.nbytes, dtype=np.uint8)  # touched once; pinned in place on CUDA (exact size)
        if device.type == "cuda":
            self.buffer = pinned(self.buffer)

    def forward(self, mb: int, x: torch.Tensor, targets: np.ndarray | None, weight: float) -> None:
        """``weight``: the loss weight of microbatch ``mb``, as the real last stage uses it; in the
        precision the real stage runs in (its output as it leaves it)."""
        if self.last and targets is None:
            raise ValueError("the redundant copy of the last stage needs the targets")
        tgt = torch.from_numpy(np.asarray(targets)).to(self.device) if self.last else None
        out = forward(self.cfg.train.precision, self.device, lambda: self.module.run(x.to(self.device), self.module.first, True, self.last, tgt), not self.last)
        self.outputs[mb] = out * weight if self.last else out  # the loss after the head, as the real stage computes it

    def backward(self, grads: tuple[np.ndarray | torch.Tensor, ...], n_micro: int) -> None:
        for mb in range(n_micro):
            out = self.outputs.pop(mb)
            if self.last:
                out.backward()
            else:
                out.backward(torch.as_tensor(grads[mb], device=self.device, dtype=out.dtype))

    def step(self, clip: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()

    def reset(self) -> None:
        self.outputs.clear()
        self.optimizer.zero_grad()

    def capture(self, step: int, config_hash: str) -> tuple[np.ndarray, str]:
        from elastic_llm.snapshot import state as st

        self.arena.capture(self.buffer)
        return self.buffer, st.make_manifest(self.arena.layout, st.json_state(self.optimizer, self.scheduler, step, None, config_hash), self.stage)

    def load(self, buffer: np.ndarray, manifest: str, config_hash: str) -> int:
        from elastic_llm.snapshot import state as st

        m = st.restore([(0, np.asarray(buffer))], st.parse_manifest(manifest), self.arena, self.optimizer, self.scheduler, config_hash, self.stage)
        return int(m["step"])
