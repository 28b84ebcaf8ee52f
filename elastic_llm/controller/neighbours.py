"""Carrying out the recovery sources that take state from other stages rather than from a copy
of the lost one: CheckFree / CheckFree+ (rebuild from the neighbours) and ``redundant`` (promote
the copy the predecessor trains).

Owns: the actor calls of those sources, object refs only (the neighbours' tensors go actor to
actor; the driver fetches two gradient norms), and what each rebuild reports (the weights, the
CRC-32 of the rebuilt parameters). Never decides which source serves a lost stage (the pure
:class:`~elastic_llm.recovery.policy.RecoveryPolicy` does) and never waits without a deadline.
"""

from __future__ import annotations

from typing import Any

from elastic_llm.controller.actor_group import COPY_S, ActorGroup
from elastic_llm.recovery.checkfree import weights
from elastic_llm.recovery.policy import Action, Source
from elastic_llm.snapshot.records import ShardKey


def rebuild_from_neighbours(group: ActorGroup, actions: list[Action], step: int, lr_scale: float) -> dict[ShardKey, dict[str, Any]]:
    """Rebuild every (new, empty) actor of ``actions`` at ``step`` from its donors; returns per
    rebuilt actor what the recovery record says about it."""
    import ray

    calls, out = [], {}
    for a in actions:
        key = ShardKey(a.stage, a.replica)
        new = group.actor(key)
        if a.source is Source.CHECKFREE:
            nxt, prev = (group.actor(k) for k in a.donors)
            norm_next, norm_prev = ray.get([nxt.grad_norm.remote(), prev.grad_norm.remote()], timeout=COPY_S)
            w_next, w_prev = weights(norm_next, norm_prev)
            call = new.rebuild.remote(step, lr_scale, w_next, w_prev, nxt.layer_params.remote(), prev.layer_params.remote(), None)
            out[key] = {"weights": [w_next, w_prev], "donors": [k.stage for k in a.donors]}
        else:  # checkfree_plus: copy the neighbour's layers, the embedding / head from its mirror
            donor = group.actor(a.donors[0])
            mirror = group.actor(a.mirror).mirror_params.remote() if a.mirror is not None else None
            call = new.rebuild.remote(step, lr_scale, 1.0, 0.0, donor.layer_params.remote(), None, mirror)
            out[key] = {"donors": [a.donors[0].stage], "mirror": a.mirror is not None}
        calls.append((key, call))
    for key, crc in zip([k for k, _ in calls], ray.get([c for _, c in calls], timeout=COPY_S)):
        out[key]["params_crc32"] = crc
        out[key]["lr_scale"] = lr_scale
    return out


def promote_copies(group: ActorGroup, actions: list[Action]) -> None:
    """Each new actor takes its state from the redundant copy its predecessor trains, and its own
    copy of its successor from that successor's state."""
    import ray

    loads = []
    for a in actions:
        holder, successor = a.donors
        new = group.actor(ShardKey(a.stage, a.replica))
        buf, manifest = group.actor(holder).shadow_state.options(num_returns=2).remote()
        loads.append(new.load_state.remote(buf, manifest))
        sbuf, smanifest = group.actor(successor).capture_state.options(num_returns=2).remote()
        loads.append(new.load_shadow.remote(sbuf, smanifest))
    ray.get(loads, timeout=COPY_S)


def refresh_mirrors(group: ActorGroup, step: int) -> list[Any]:
    """Copy every replica's embedding onto stage 1 and final norm + LM head onto stage n-2
    (CheckFree+). Returns the calls' refs; actor call order puts them before the next step's."""
    n, refs = group.stages, []
    for r in range(group.width):
        first, last = group.actor(ShardKey(0, r)), group.actor(ShardKey(n - 1, r))
        refs.append(group.actor(ShardKey(1, r)).hold_mirror.remote(first.mirror_source.remote(), step))
        refs.append(group.actor(ShardKey(n - 2, r)).hold_mirror.remote(last.mirror_source.remote(), step))
    return refs
