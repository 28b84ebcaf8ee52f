"""Carrying out the recovery sources that take state from other stages rather than from a copy
of the lost one: CheckFree / CheckFree+ (rebuild from the neighbours) and ``redundant`` (promote
the copy the predecessor trains); and the CheckFree+ mirrors that make the first and last stage
rebuildable.

Owns: which actors each of those reads (the donors' gradient norms and CheckFree's weights, the
mirror holders) and what each rebuild reports (the weights, the CRC-32 of the rebuilt
parameters); the state moves through :class:`~elastic_llm.controller.ports.StageActors`
primitives, actor to actor. Never decides which source serves a lost stage (the pure
:class:`~elastic_llm.recovery.policy.RecoveryPolicy` does).
"""

from __future__ import annotations

from typing import Any

from elastic_llm.controller.ports import StageActors
from elastic_llm.recovery.checkfree import weights
from elastic_llm.recovery.policy import Action, Source
from elastic_llm.snapshot.records import ShardKey


def rebuild_from_neighbours(group: StageActors, actions: list[Action], step: int, lr_scale: float) -> dict[ShardKey, dict[str, Any]]:
    """Rebuild every (new, empty) actor of ``actions`` at ``step`` from its donors; returns per
    rebuilt actor what the recovery record says about it."""
    out: dict[ShardKey, dict[str, Any]] = {}
    for a in actions:
        key = ShardKey(a.stage, a.replica)
        if a.source is Source.CHECKFREE:
            nxt, prev = a.donors
            norms = group.state.grad_norms([nxt, prev])
            w_next, w_prev = weights(norms[nxt], norms[prev])
            crc = group.state.rebuild(key, step, lr_scale, w_next, w_prev, (nxt, prev), None)
            out[key] = {"weights": [w_next, w_prev], "donors": [k.stage for k in a.donors]}
        else:  # checkfree_plus: copy the neighbour's layers, the embedding / head from its mirror
            crc = group.state.rebuild(key, step, lr_scale, 1.0, 0.0, (a.donors[0],), a.mirror)
            out[key] = {"donors": [a.donors[0].stage], "mirror": a.mirror is not None}
        out[key]["params_crc32"] = crc
        out[key]["lr_scale"] = lr_scale
    return out


def promote_copies(group: StageActors, actions: list[Action]) -> None:
    """Each new actor takes its state from the redundant copy its predecessor trains, and its own
    copy of its successor from that successor's state."""
    for a in actions:
        holder, successor = a.donors
        group.state.promote(ShardKey(a.stage, a.replica), holder, successor)


def refresh_mirrors(group: StageActors, step: int) -> None:
    """Copy every replica's embedding onto stage 1 and final norm + LM head onto stage n-2
    (CheckFree+)."""
    n = group.stages
    pairs = []
    for r in range(group.width):
        pairs += [(ShardKey(0, r), ShardKey(1, r)), (ShardKey(n - 1, r), ShardKey(n - 2, r))]
    group.state.mirror(pairs, step)
