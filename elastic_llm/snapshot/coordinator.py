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

import numpy as np

from elastic_llm.config import RunConfig
from elastic_llm.recovery.policy import UnrecoverableError
from elastic_llm.snapshot.erasure import checksum
from elastic_llm.snapshot.manager import SnapshotManager, blob_plan

log = logging.getLogger("elastic_llm.snapshot")


@dataclass
class VersionRecord:
    version: int
    groups: list[list[str]]
    chunk_sizes: list[int]
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> {node_id, nbytes, checksum, manifest}

    def sizes_on(self, node: str) -> dict[str, int]:
        return {k: s["nbytes"] for k, s in self.shards.items() if s["node_id"] == node}


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
        self.pending: dict[str, Any] | None = None  # the version in flight
        self.committed: VersionRecord | None = None
        self.stats: dict[str, float] = {"committed": 0, "discarded": 0, "skipped": 0, "wait_s": 0.0}
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
                max_concurrency=4,
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

    # ------------------------------------------------------------------ phase 1
    def begin(self, version: int, stages: list[tuple[Any, int, int, str]], data_position: dict[str, int]) -> None:
        """Ask every stage (actor, stage, replica, node) to snapshot ``version``; their step
        ``version`` was submitted with ``snapshot=True``, so every one of them gets a call (a
        stage waits for its copy before the next update)."""
        if self.pending is not None:
            raise RuntimeError(f"snapshot of step {self.pending['version']} is still in flight")
        if self.refresh_managers or any(node not in self.managers for *_, node in stages):
            self.ensure_managers()
            self.refresh_managers = False
        refs = {}
        for actor, s, r, node in stages:
            smp = self.managers.get(node)
            if smp is None:  # the node is gone: the step fails too; the stage's copy is released
                refs[f"{s}/{r}"] = actor.snapshot.options(concurrency_group="snapshot").remote(version, None, f"{s}/{r}", data_position)
                continue
            key = f"{s}/{r}"
            refs[key] = actor.snapshot.options(concurrency_group="snapshot").remote(version, smp, key, data_position)
        groups = make_groups(sorted(self.managers), self.cfg.snapshot.group_size, self.cfg.snapshot.parity)
        self.pending = {"version": version, "phase": "shards", "refs": refs, "groups": groups}

    def poll(self, block: bool = False) -> None:
        """Advance the version in flight as far as finished calls allow."""
        import ray

        while self.pending is not None:
            refs = list(self.pending["refs"].values())
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=None if block else 0)
            if len(done) < len(refs):
                return
            try:
                results = ray.get(refs)
            except Exception as e:  # a manager or a stage died mid-snapshot: drop this version
                self._discard(f"{type(e).__name__}: {str(e).splitlines()[0]}")
                return
            if self.pending["phase"] == "shards":
                self._start_parity(dict(zip(self.pending["refs"], results)))
            else:
                self._commit()

    def _start_parity(self, shard_results: dict[str, dict[str, Any]]) -> None:
        version = self.pending["version"]
        sn = self.cfg.snapshot
        groups = self.pending["groups"]  # fixed when the version began
        gone = [n for g in groups for n in g if n not in self.managers]
        if gone:
            self._discard(f"snapshot managers of {len(gone)} group member(s) are gone")
            return
        record = VersionRecord(version, groups, [])
        record.shards = {k: {kk: v[kk] for kk in ("node_id", "nbytes", "checksum", "manifest")} for k, v in shard_results.items()}
        refs = {}
        for g, group in enumerate(groups):
            k = len(group) - sn.parity
            largest = max((sum(record.sizes_on(n).values()) for n in group), default=0)
            chunk = -(-largest // k) if largest else 0
            record.chunk_sizes.append(chunk)
            peers = [self.managers[n] for n in group]
            sizes = [record.sizes_on(n) for n in group]
            for me, node in enumerate(group):
                refs[f"g{g}/{me}"] = self.managers[node].encode_parity.remote(version, len(group), sn.parity, me, peers, chunk, sizes)
        self.pending = {"version": version, "phase": "parity", "refs": refs, "record": record}

    def _commit(self) -> None:
        import ray

        record: VersionRecord = self.pending["record"]
        for ref in [m.commit.remote(record.version) for m in self.managers.values()]:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:  # a manager died after parity: its loss is a later failure
                self.refresh_managers = True
        self.committed = record
        self.pending = None
        self.stats["committed"] += 1

    def _discard(self, why: str) -> None:
        version = self.pending["version"]
        for m in self.managers.values():
            m.discard.remote(version)
        self.pending = None
        self.stats["discarded"] += 1
        self.refresh_managers = True  # a manager may have died: re-create before the next version
        self.events.append({"event": "snapshot_discarded", "version": version, "reason": why})
        log.warning("snapshot of step %d discarded: %s", version, why)

    def abandon_pending(self) -> None:
        """Forget the version in flight (after a failure); its partial data is discarded."""
        if self.pending is not None:
            self._discard("training failure while in flight")

    # ------------------------------------------------------------------ restore
    def fetch_stage_state(self, stage: int, replica: int, dp: int, dead_nodes: set[str]) -> tuple[np.ndarray, str, list[str]]:
        """Full state of ``stage`` at the committed version (all DP slices joined) + the manifest
        of ``replica`` (its RNG). Shards on dead nodes/managers are rebuilt from parity.
        Returns (buffer, manifest, sources used)."""
        import ray

        rec = self.committed
        assert rec is not None, "no committed snapshot"
        parts, sources = [], []
        for r in range(dp):
            key = f"{stage}/{r}"
            info = rec.shards[key]
            node = info["node_id"]
            data = None
            if node not in dead_nodes and node in self.managers:
                try:
                    data, _ = ray.get(self.managers[node].get_shard.remote(rec.version, key))
                    sources.append("local_smp")
                except Exception as e:
                    log.warning("shard %s unavailable on its node (%s): rebuilding from parity", key, str(e).splitlines()[0])
            if data is None:
                data = self._rebuild_shard(key, dead_nodes | {node})
                sources.append("parity")
            if checksum(data) != info["checksum"]:
                raise RuntimeError(f"shard {key} of step {rec.version} fails its checksum after recovery")
            parts.append(np.asarray(data))
        buf = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return buf, rec.shards[f"{stage}/{replica}"]["manifest"], sources

    def _rebuild_shard(self, key: str, lost_nodes: set[str]) -> np.ndarray:
        import ray

        rec = self.committed
        node = rec.shards[key]["node_id"]
        for g, group in enumerate(rec.groups):
            if node not in group:
                continue
            lost = [i for i, n in enumerate(group) if n in lost_nodes or n not in self.managers]
            helper = next((self.managers[n] for i, n in enumerate(group) if i not in lost), None)
            if helper is None or len(lost) > self.cfg.snapshot.parity:
                break
            peers = [None if i in lost else self.managers[n] for i, n in enumerate(group)]
            sizes = [rec.sizes_on(n) for n in group]
            blob = ray.get(
                helper.rebuild_blob.remote(rec.version, len(group), self.cfg.snapshot.parity, lost, group.index(node), peers, rec.chunk_sizes[g], sizes)
            )
            for k, offset, nbytes in blob_plan(rec.sizes_on(node)):
                if k == key:
                    return blob[offset : offset + nbytes]
        raise UnrecoverableError(
            f"shard {key} of step {rec.version} cannot be rebuilt: more nodes of its erasure group are lost than "
            f"snapshot.parity={self.cfg.snapshot.parity} covers"
        )
