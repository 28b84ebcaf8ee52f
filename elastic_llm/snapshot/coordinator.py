"""Driver-side bookkeeping of snapshot versions: two-phase commit across snapshot managers.

Owns: one SnapshotManager actor per node (named ``smp-<node id>``), the erasure groups of each
version, the state machine of the version in flight (shards in -> parity encoded -> committed),
the record of the latest committed version (which node holds which shard, sizes, manifests),
and fetching a stage's full state back from the managers, rebuilding lost shards from parity.
It never blocks a training step: :meth:`poll` only looks at finished calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.recovery.policy import UnrecoverableError
from elastic_llm.snapshot.manager import SnapshotManager

log = logging.getLogger("elastic_llm.snapshot")
MAX_INFLIGHT = 2  # versions in flight at once: step t+1's snapshot starts while step t's parity finishes


@dataclass
class VersionRecord:
    version: int
    groups: list[list[str]]
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> info + node_id

    def infos_on(self, node: str) -> dict[str, dict[str, Any]]:
        return {k: s for k, s in self.shards.items() if s["node_id"] == node}


def make_groups(nodes: list[str], size: int, parity: int) -> list[list[str]]:
    """Split nodes (sorted) into erasure groups of ``size``; a short tail joins the last group.
    Groups that cannot hold parity (fewer than parity + 1 nodes) are returned empty."""
    nodes = sorted(nodes)
    if len(nodes) < parity + 1:
        return []
    groups = [nodes[i : i + size] for i in range(0, len(nodes), size)]
    if len(groups) > 1 and len(groups[-1]) < parity + 1:
        tail = groups.pop()
        groups[-1] += tail
    return groups


class SnapshotCoordinator:
    def __init__(self, cfg: RunConfig, namespace: str) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self.managers: dict[str, Any] = {}
        self.inflight: list[dict[str, Any]] = []  # versions in flight, oldest first (at most MAX_INFLIGHT)
        self.committed: VersionRecord | None = None
        self.stats: dict[str, float] = {"committed": 0, "discarded": 0, "superseded": 0, "skipped": 0, "wait_s": 0.0}
        self.events: list[dict[str, Any]] = []
        self.refresh_managers = False

    # ------------------------------------------------------------------ managers
    def ensure_managers(self) -> dict[str, Any]:
        """One live SnapshotManager per alive node (re-created where one died)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0}
        for node in list(self.managers):
            if node not in alive or not self._alive(self.managers[node]):
                del self.managers[node]
        Actor = ray.remote(SnapshotManager)
        for node in sorted(alive - set(self.managers)):
            self.managers[node] = Actor.options(
                name=f"smp-{node[:12]}",
                namespace=self.namespace,
                num_cpus=0,
                max_concurrency=16,
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(node, self.cfg.snapshot.codec)
        ray.get([m.held.remote() for m in self.managers.values()])
        return self.managers

    @staticmethod
    def _alive(handle: Any) -> bool:
        import ray

        try:
            ray.get(handle.held.remote(), timeout=10)
            return True
        except Exception:
            return False

    # ------------------------------------------------------------------ one version
    def begin(self, version: int, stages: list[tuple[Any, int, int, str]]) -> None:
        """Start snapshot ``version``: one call per manager, which collects its node's stage
        copies (the stages' step ``version`` was submitted with ``snapshot=...``), offers chunks
        to parity holders and encodes its parity. Nothing here waits."""
        if not self.can_begin():
            raise RuntimeError(f"snapshots of steps {[p['version'] for p in self.inflight]} are still in flight")
        if self.refresh_managers or any(node not in self.managers for *_, node in stages):
            self.ensure_managers()
            self.refresh_managers = False
        sn = self.cfg.snapshot
        groups = make_groups(sorted(self.managers), sn.group_size, sn.parity)
        group_of = {node: g for g in groups for node in g}
        by_node: dict[str, list[list[Any]]] = {node: [] for node in self.managers}
        lost = []
        for actor, s, r, node in stages:
            if node in by_node:
                by_node[node].append([f"{s}/{r}", actor])
            else:
                lost.append(f"{s}/{r}")
        refs = {}
        for node, handle in self.managers.items():
            group = group_of.get(node, [])
            plan = {
                "stages": by_node[node],
                "group": group,
                "me": group.index(node) if group else 0,
                "peers": [self.managers[n] for n in group],
                "m": sn.parity,
            }
            refs[node] = handle.snapshot_version.remote(version, plan)
        self.inflight.append({"version": version, "refs": refs, "groups": groups, "lost": lost, "results": {}})

    def can_begin(self) -> bool:
        return len(self.inflight) < MAX_INFLIGHT

    def poll(self, block: bool = False) -> None:
        """Commit the newest version whose parts all finished (older ones in flight are then
        superseded and dropped); drop a version as soon as one of its parts failed (which wakes
        the managers still waiting on it). ``block`` waits until nothing is in flight."""
        import ray

        while self.inflight:
            waiting = {ref: (p, node) for p in self.inflight for node, ref in p["refs"].items() if node not in p["results"]}
            ready = []
            if waiting:
                ready, _ = ray.wait(list(waiting), num_returns=1 if block else len(waiting), timeout=None if block else 0)
            for ref in ready:
                p, node = waiting[ref]
                if p not in self.inflight:
                    continue
                try:
                    p["results"][node] = ray.get(ref)
                except Exception as e:  # a manager or a stage died mid-snapshot: drop this version
                    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                    self._discard(p, lines[-1] if lines else type(e).__name__)
            for p in list(self.inflight):
                if p in self.inflight and p["lost"]:
                    self._discard(p, f"stages {p['lost']} had no snapshot manager")
            done = [p for p in self.inflight if len(p["results"]) == len(p["refs"])]
            if done:
                newest = done[-1]
                for p in [p for p in self.inflight if p["version"] < newest["version"]]:
                    self._discard(p, None)  # superseded by the newer complete one
                self._commit(newest)
            if not block:
                return

    def _commit(self, p: dict[str, Any]) -> None:
        record = VersionRecord(p["version"], p["groups"])
        for res in p["results"].values():
            for key, info in res["shards"].items():
                record.shards[key] = {**info, "node_id": res["node_id"]}
        for handle in self.managers.values():  # fire and forget: a dead manager is a later failure
            handle.commit.remote(record.version)
        self.committed = record
        self.inflight.remove(p)
        self.stats["committed"] += 1

    def _discard(self, p: dict[str, Any], why: str | None) -> None:
        """Drop a version in flight: superseded by a newer complete one (``why`` None) or failed."""
        version = p["version"]
        for m in self.managers.values():
            m.discard.remote(version)
        self.inflight.remove(p)
        if why is None:
            self.stats["superseded"] += 1
            return
        self.stats["discarded"] += 1
        self.refresh_managers = True  # a manager may have died: re-create before the next version
        self.events.append({"event": "snapshot_discarded", "version": version, "reason": why})
        log.warning("snapshot of step %d discarded: %s", version, why)

    def abandon_pending(self) -> None:
        """Forget the versions in flight (after a failure); their partial data is discarded."""
        for p in list(self.inflight):
            self._discard(p, "training failure while in flight")

    # ------------------------------------------------------------------ restore
    def fetch_stage_state(self, stage: int, replica: int, dp: int, dead_nodes: set[str]) -> tuple[list[int], list[Any], str, list[str]]:
        """Where the committed state of ``stage`` is (all DP slices): (byte offsets, object refs
        of the bytes at them, manifest of ``replica`` (its RNG), sources used). Shards on dead
        nodes, dead managers or failing their checksums are rebuilt from parity. The refs go
        straight to the stage being restored: no bytes pass through the driver."""
        import ray

        rec = self.committed
        assert rec is not None, "no committed snapshot"
        offsets, refs, sources = [], [], []
        for r in range(dp):
            key = f"{stage}/{r}"
            info = rec.shards[key]
            node = info["node_id"]
            got = None
            if node not in dead_nodes and node in self.managers:
                try:
                    got = ray.get(self.managers[node].shard_parts.remote(rec.version, key))
                    sources.append("local_smp")
                except Exception as e:
                    log.warning("shard %s unavailable on its node (%s): rebuilding from parity", key, str(e).splitlines()[0])
            if got is not None:
                offsets += [p[0] for p in info["pieces"]]
                refs += got["refs"]
            else:
                offsets.append(info["lo"])
                refs.append(self._rebuild_shard(key, dead_nodes | {node}))
                sources.append("parity")
        return offsets, refs, rec.shards[f"{stage}/{replica}"]["manifest"], sources

    def _rebuild_shard(self, key: str, lost_nodes: set[str]) -> Any:
        import ray

        rec = self.committed
        node = rec.shards[key]["node_id"]
        for group in rec.groups:
            if node not in group:
                continue
            lost = [i for i, n in enumerate(group) if n in lost_nodes or n not in self.managers]
            helper = next((self.managers[n] for i, n in enumerate(group) if i not in lost), None)
            if helper is None or len(lost) > self.cfg.snapshot.parity:
                break
            peers = [None if i in lost else self.managers[n] for i, n in enumerate(group)]
            infos = [rec.infos_on(n) for n in group]
            [ref] = ray.get(helper.rebuild_shard.remote(rec.version, key, len(group), self.cfg.snapshot.parity, lost, group.index(node), peers, infos))
            return ref
        raise UnrecoverableError(
            f"shard {key} of step {rec.version} cannot be rebuilt: more nodes of its erasure group are lost than "
            f"snapshot.parity={self.cfg.snapshot.parity} covers"
        )
