"""Ray's view of draining nodes: which nodes announced their end, and until when.

Owns: the one call into Ray's private API that lists draining nodes (the same call Ray Train
v2's preemption watcher reads: ``ray._private.state.state.get_draining_nodes()``), turning its
answer into the controller's :class:`~elastic_llm.controller.drains.Drain` records, and asking
Ray to drain a node (what ``ray drain-node`` does; used by the spot watcher, the replay and
tests). Never decides what to do about a drain: the controller does.
"""

from __future__ import annotations

import time

from elastic_llm.controller.drains import Drain

DRAIN_REASON_PREEMPTION = "DRAIN_NODE_REASON_PREEMPTION"


def draining_nodes() -> dict[str, Drain]:
    """Nodes Ray marks as draining now, by node id (hex). Needs a connected Ray driver.

    Ray answers ``{node_id_hex: deadline_ms}`` with 0 for "no deadline". The call is private to
    Ray (no public API lists drains in Ray 2.60); if a Ray upgrade removes it, this raises a
    clear error instead of silently seeing no drains."""
    import ray

    try:
        raw = ray._private.state.state.get_draining_nodes()
    except AttributeError as e:  # pragma: no cover - depends on the Ray version
        raise RuntimeError(
            f"this Ray ({ray.__version__}) has no ray._private.state.state.get_draining_nodes(): "
            "elastic-llm cannot see preemption drains; use Ray 2.40 to 2.60"
        ) from e
    return {node: Drain(node, ms / 1000.0 if ms else None) for node, ms in (raw or {}).items()}


def request_drain(node_id: str, deadline_s: float | None, message: str, address: str | None = None) -> None:
    """Ask Ray to drain ``node_id`` for preemption, ``deadline_s`` from now (None: no deadline),
    as ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` does. Raises RuntimeError if Ray
    refuses. Ray only marks the node; removing it when the deadline passes is the caller's job."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = address or ray.get_runtime_context().gcs_address
    deadline_ms = int((time.time() + deadline_s) * 1000) if deadline_s is not None else 0
    client = ray._raylet.GcsClient(address=gcs)
    accepted, why = client.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value(DRAIN_REASON_PREEMPTION), message, deadline_ms
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id}: {why}")
