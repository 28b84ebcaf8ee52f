"""The loopback Ray cluster of a soak: a head without CPUs and ``workers`` nodes, kept at that size.

Owns: starting it (unless a test passes its own), bringing it back to ``workers`` live worker
nodes after faults removed some (a fresh node that does not join in time is given up and another
started, once), replacing a node at once, and ending it. Nodes are added and removed from the
main thread, which ``ray.cluster_utils.Cluster`` requires. Never sends traffic off loopback.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("elastic_llm.soak")
JOIN_S = 180.0  # a fresh node's raylet on a loaded 2-core machine can take over Ray's default 30 s to join


class SoakCluster:
    def __init__(self, workers: int, cpus_per_node: float, store_bytes: int, cluster: Any = None) -> None:
        """``store_bytes``: each node's object store (sized to the run's snapshots: a node left at
        Ray's 150 MiB spills every-step snapshots to disk); ``cluster``: a test's own (kept when
        the soak ends); else one is started here."""
        from elastic_llm.runtime.session import loopback_cluster

        self.workers, self.cpus_per_node, self.store_bytes = workers, cpus_per_node, store_bytes
        self.own = cluster is None
        self.cluster = cluster if cluster is not None else loopback_cluster(workers, cpus_per_node, store_bytes)

    @property
    def address(self) -> str:
        return self.cluster.address

    def remove(self, node_id: str) -> None:
        """Remove ``node_id`` at once (no grace), adding nothing."""
        victim = next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)
        if victim is None:
            raise RuntimeError(f"node {node_id[:12]} is not a worker node of the soak's cluster")
        self.cluster.remove_node(victim, allow_graceful=False)

    def top_up(self) -> None:
        """Back to ``workers`` live worker nodes. A fresh node that has not joined within
        :data:`JOIN_S` is given up and another one started in its place, once."""
        from elastic_llm.runtime.session import add_loopback_node

        for attempt in range(2):
            self.forget_dead_nodes()  # also those that never joined: Ray does not list them alive
            while len(self.cluster.worker_nodes) < self.workers:
                add_loopback_node(self.cluster, self.cpus_per_node, self.store_bytes)
            try:
                self.cluster.wait_for_nodes(timeout=JOIN_S)
                return
            except TimeoutError:
                if attempt:
                    raise
                log.warning("a fresh node did not join within %.0f s: started another in its place", JOIN_S)

    def forget_dead_nodes(self) -> None:
        """Worker nodes the cluster lists that Ray does not know alive (one the run's node watch
        declared dead, say, or one that never joined) are removed from it: its count of nodes must
        match Ray's."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for node in [n for n in self.cluster.worker_nodes if n.node_id not in alive]:
            log.warning("node %s is not alive in Ray (died outside the harness, or never joined): removed from the cluster's list", node.node_id[:8])
            self.cluster.remove_node(node, allow_graceful=False)

    def replace_node(self, node_id: str) -> None:
        """Remove ``node_id`` at once (no grace) and add a fresh node in its place."""
        self.remove(node_id)
        self.top_up()

    def stop(self) -> None:
        """End the cluster and this process's Ray if the soak started them (a test's stay)."""
        import ray

        if self.own and self.cluster is not None:
            ray.shutdown()
            self.cluster.shutdown()
            self.cluster = None

