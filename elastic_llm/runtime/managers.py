"""Snapshot managers as Ray actors: the Ray runtime's :class:`~elastic_llm.snapshot.coordinator.ManagerFleet`.

Owns: :class:`RayCalls` (Ray's ``wait``/``get`` for the coordinator) and :class:`RayManagers`
(where the managers live: one detached, named actor per node with CPUs, pinned to it, and the
failure domain of each node from its labels). The coordinator's bookkeeping lives in
:mod:`elastic_llm.snapshot.coordinator`; this module only reaches Ray.
"""

from __future__ import annotations

import logging
from typing import Any

from elastic_llm.remote import remote_of
from elastic_llm.snapshot.ports import ManagerHandle, ManagerLost
from elastic_llm.snapshot.groups import domain_of
from elastic_llm.snapshot.manager import SnapshotManager
from elastic_llm.sources import NodeGone

log = logging.getLogger("elastic_llm.snapshot")


class RayCalls:
    def wait(self, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        import ray

        return ray.wait(refs, num_returns=num_returns, timeout=timeout)

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        """Ray's ``get``; a manager that Ray's scheduler refuses to start on its node (the node
        is gone, whatever Ray's node table says yet) raises :class:`NodeGone`, a call that an
        actor's or node's death failed (:func:`death_errors`; also when the manager re-raised a
        peer's or a stage's) :class:`ManagerLost`. Anything else the manager raised comes as Ray
        gives it (an instance of the manager's own exception): a bug there is not a lost manager."""
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.ActorUnschedulableError as e:
            raise NodeGone(frozenset(), f"Ray's scheduler refused a snapshot manager there ({str(e).splitlines()[0]})") from e
        except death_errors() as e:
            raise ManagerLost(e) from e


def death_errors() -> tuple[type[BaseException], ...]:
    """Ray's errors for a call whose actor, worker process, object owner or node is gone (an
    actor's task that re-raised one is an instance of it too)."""
    import ray.exceptions as x

    return (x.RayActorError, x.ObjectLostError, x.NodeDiedError, x.WorkerCrashedError, x.LocalRayletDiedError, x.OutOfMemoryError)


class RayManagers:
    """Snapshot managers as Ray actors: detached (when they must outlive a driver), named, with
    no CPU reservation, pinned to their node."""

    def __init__(self, namespace: str, codec: str) -> None:
        self.namespace, self.codec = namespace, codec
        self.calls = RayCalls()

    def nodes(self) -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0}

    def domains(self) -> dict[str, str]:
        """The failure domain of each live node that has one (its labels: :data:`DOMAIN_LABELS`)."""
        import ray

        out = {}
        for n in ray.nodes():
            d = domain_of(n.get("Labels") or {}) if n["Alive"] else None
            if d:
                out[n["NodeID"]] = d
        return out

    def start(self, node: str, name: str, run_id: str, grace_s: float) -> ManagerHandle:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return remote_of(SnapshotManager).options(
            name=name,
            namespace=self.namespace,
            num_cpus=0,
            max_concurrency=16,
            lifetime="detached" if grace_s > 0 else None,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(node, self.codec, run_id, grace_s)

    def end(self, handle: ManagerHandle) -> None:
        import ray

        try:
            ray.kill(handle)
        except Exception as e:  # noqa: BLE001 - one manager that cannot be ended must not stop the others'
            log.warning("snapshot manager not ended: %s: %s", type(e).__name__, e)
