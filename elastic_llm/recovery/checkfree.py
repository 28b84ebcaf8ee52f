"""CheckFree / CheckFree+ math and planning: how a stage with no surviving copy is rebuilt from
its neighbours. Pure: numpy in, numpy out; no Ray, no torch, no clock.

Owns: the averaging weights (the L2 norms of the neighbours' last clipped gradients, + 1e-4),
the weighted average of the neighbours' transformer layers, and which donors rebuild which stage:
- an intermediate stage i: ``(a W_(i+1) + b W_(i-1)) / (a + b)`` with a = ||g_(i+1)||,
  b = ||g_(i-1)||, every tensor of its layers (source ``checkfree``);
- the first (last) stage: a copy of the layers of stage 1 (n-2), which the swapped CheckFree+
  order trained to stand in for it, and its embedding (final norm + LM head) from the mirror that
  stage holds (source ``checkfree_plus``). Without a mirror the embedding (head) keeps the fresh
  initialisation of the new actor, and the plan says so.
The rebuilt stage gets a fresh optimizer with the learning rate x ``checkfree.lr_scale``.
Never fetches or loads anything: the recovery executor moves the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_llm.sources import Source
from elastic_llm.snapshot.records import ShardKey

EPS = 1e-4  # added to both gradient norms: two neighbours that never stepped average evenly


def weights(norm_next: float, norm_prev: float) -> tuple[float, float]:
    """(a, b): the weight of the next and of the previous neighbour."""
    return float(norm_next) + EPS, float(norm_prev) + EPS


def average(w_next: np.ndarray, w_prev: np.ndarray, a: float, b: float) -> np.ndarray:
    """``(a w_next + b w_prev) / (a + b)`` in float32, elementwise (flat layer tensors of the
    two neighbours, same layout)."""
    if w_next.shape != w_prev.shape or w_next.dtype != w_prev.dtype:
        raise ValueError(f"neighbour layers differ: {w_next.dtype}{w_next.shape} vs {w_prev.dtype}{w_prev.shape}")
    a32, b32 = np.float32(a), np.float32(b)
    return (a32 * w_next + b32 * w_prev) / (a32 + b32)


@dataclass(frozen=True)
class Rebuild:
    """How one lost (stage, replica) is rebuilt from neighbours."""

    stage: int
    replica: int
    source: Source  # CHECKFREE (average of two neighbours) | CHECKFREE_PLUS (copy of one neighbour)
    donors: tuple[ShardKey, ...]  # checkfree: (next, prev); checkfree_plus: (the neighbour copied)
    mirror: ShardKey | None  # stage holding the lost stage's embedding / head mirror (None: keep fresh init)
    note: str  # what was approximated, for the log


def plan_rebuild(stage: int, replica: int, n_stages: int, alive: frozenset[ShardKey], mirrors: bool, reinit: bool = True) -> Rebuild | str:
    """The rebuild of (stage, replica) from live neighbours, or why it cannot be done.
    ``reinit``: whether a first / last stage may be rebuilt without a mirror (its embedding or
    head freshly initialised); the lossless ladder says no.

    Neighbours are looked for in the same replica first, then in any replica (replicas of a stage
    hold the same state)."""

    def live(s: int) -> ShardKey | None:
        if ShardKey(s, replica) in alive:
            return ShardKey(s, replica)
        return next((k for k in sorted(alive) if k.stage == s), None)

    if n_stages < 2:
        return "a single stage has no neighbours to rebuild from"
    if 0 < stage < n_stages - 1:
        nxt, prev = live(stage + 1), live(stage - 1)
        if nxt is None or prev is None:
            gone = [s for s, k in ((stage - 1, prev), (stage + 1, nxt)) if k is None]
            return f"stage {stage}: its neighbour stage(s) {gone} are lost too (CheckFree needs both neighbours)"
        return Rebuild(stage, replica, Source.CHECKFREE, (nxt, prev), None, f"stage {stage} = gradient-norm-weighted average of stages {stage + 1} and {stage - 1}")
    neighbour = 1 if stage == 0 else n_stages - 2
    donor = live(neighbour)
    if donor is None:
        return f"stage {stage}: its neighbour stage {neighbour} is lost too"
    part = "embedding" if stage == 0 else "final norm and LM head"
    if not mirrors and not reinit:
        return f"stage {stage}: its {part} has no mirror (checkfree.mirror_every=0)"
    mirror = donor if mirrors else None
    how = f"{part} from the mirror on stage {neighbour}" if mirrors else f"{part} re-initialised (no mirror)"
    return Rebuild(stage, replica, Source.CHECKFREE_PLUS, (donor,), mirror, f"stage {stage} = copy of stage {neighbour}'s layers, {how}")
