"""SnapshotManager: one Ray actor per node that owns the node's in-memory snapshots and parity.

Owns: the shards that stages on its node hand over (each a flat uint8 array + JSON manifest,
received as an actor-method argument so the bytes sit in the node's object store and stay
readable after the sending stage dies), their checksums, the parity chunks this node holds for
its erasure group, two-phase versions (pending until committed; older versions freed on commit),
and rebuilding a lost node's shards from the surviving chunks and parity.

Never decides anything: the controller tells it which version to encode, commit or rebuild.
Never unpickles data it did not produce: shards are numpy arrays and manifests are JSON text.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elastic_llm.snapshot.erasure import ReedSolomon, TooManyErasuresError, checksum
from elastic_llm.snapshot.layout import ParityLayout


class SnapshotMissingError(LookupError):
    """The requested snapshot version or shard is not held here."""


@dataclass
class Version:
    shards: dict[str, tuple[np.ndarray, str, int]] = field(default_factory=dict)  # key -> (bytes, manifest, crc)
    parity: dict[int, tuple[np.ndarray, int]] = field(default_factory=dict)  # region -> (parity chunk, crc)
    committed: bool = False
    verified: set[str] = field(default_factory=set)  # shards whose checksum was checked since put


def blob_plan(sizes: dict[str, int]) -> list[tuple[str, int, int]]:
    """(key, offset, nbytes) of every shard in a node's blob: shards concatenated in key order."""
    out, offset = [], 0
    for key in sorted(sizes):
        out.append((key, offset, sizes[key]))
        offset += sizes[key]
    return out


class SnapshotManager:
    """Body of the per-node snapshot actor (``smp-<node id>``)."""

    def __init__(self, node_id: str, codec_backend: str = "auto") -> None:
        self.node_id = node_id
        self.codec_backend = codec_backend
        self.versions: dict[int, Version] = {}
        self.lock = threading.Lock()
        self._codecs: dict[tuple[int, int], ReedSolomon] = {}

    def _codec(self, k: int, m: int) -> ReedSolomon:
        if (k, m) not in self._codecs:
            self._codecs[(k, m)] = ReedSolomon(k, m, backend=self.codec_backend)
        return self._codecs[(k, m)]

    def _version(self, version: int) -> Version:
        try:
            return self.versions[version]
        except KeyError:
            raise SnapshotMissingError(f"snapshot version {version} is not held by {self.node_id} (held: {sorted(self.versions)})") from None

    # ------------------------------------------------------------------ phase 1: shards in
    def put_shard(self, version: int, key: str, data: np.ndarray, manifest: str) -> dict[str, Any]:
        """Keep a stage's shard of ``version``. ``data`` is a zero-copy view into the object store."""
        crc = checksum(data)
        with self.lock:
            self.versions.setdefault(version, Version()).shards[key] = (data, manifest, crc)
        return {"key": key, "nbytes": int(data.nbytes), "checksum": crc, "node_id": self.node_id, "manifest": manifest}

    def shard_sizes(self, version: int) -> dict[str, int]:
        return {k: int(v[0].nbytes) for k, v in self._version(version).shards.items()}

    def get_shard(self, version: int, key: str, verify: bool = True) -> tuple[np.ndarray, str]:
        v = self._version(version)
        if key not in v.shards:
            raise SnapshotMissingError(f"shard {key} of version {version} is not held by {self.node_id}")
        data, manifest, crc = v.shards[key]
        if verify and checksum(data) != crc:
            raise SnapshotMissingError(f"shard {key} of version {version} on {self.node_id} fails its checksum")
        return data, manifest

    def get_chunk(self, version: int, chunk: int, chunk_size: int, sizes: dict[str, int] | None = None) -> np.ndarray:
        """Chunk ``chunk`` of this node's blob for ``version`` (zero-padded past the blob's end).

        ``sizes`` is the blob's content as recorded by the controller ({} for a node holding no
        shard of this version: its blob is all padding)."""
        out = np.zeros(chunk_size, dtype=np.uint8)
        if sizes is not None and not sizes:
            return out
        v = self._version(version)
        plan = blob_plan(sizes if sizes is not None else {k: int(s[0].nbytes) for k, s in v.shards.items()})
        missing = [key for key, _, _ in plan if key not in v.shards]
        if missing:
            raise SnapshotMissingError(f"shards {missing} of version {version} are not held by {self.node_id}")
        for key, _, _ in plan:  # never serve (or encode parity over) silently corrupted bytes
            if key not in v.verified:
                if checksum(v.shards[key][0]) != v.shards[key][2]:
                    raise SnapshotMissingError(f"shard {key} of version {version} on {self.node_id} fails its checksum")
                v.verified.add(key)
        lo, hi = chunk * chunk_size, (chunk + 1) * chunk_size
        for key, offset, nbytes in plan:
            a, b = max(lo, offset), min(hi, offset + nbytes)
            if a < b:
                out[a - lo : b - lo] = v.shards[key][0][a - offset : b - offset]
        return out

    # ------------------------------------------------------------------ phase 2: parity
    def encode_parity(self, version: int, n: int, m: int, me: int, peers: list[Any], chunk_size: int, sizes: list[dict[str, int]]) -> dict[int, int]:
        """Compute the parity chunks this node holds for ``version``; return {region: crc}.

        ``peers[j]`` is the SnapshotManager of group member j (``peers[me]`` is this actor),
        ``sizes[j]`` its blob content. Data chunks are pulled from their owners through the object
        store.
        """
        import ray

        layout = ParityLayout(n, m)
        rs = self._codec(layout.k, m)
        out: dict[int, int] = {}
        for region, row in layout.parity_regions(me):
            refs = []
            for j in layout.data_nodes(region):
                c = layout.chunk_of(j, region)
                refs.append(self.get_chunk(version, c, chunk_size, sizes[j]) if j == me else peers[j].get_chunk.remote(version, c, chunk_size, sizes[j]))
            data = [r if isinstance(r, np.ndarray) else None for r in refs]
            pending = [i for i, r in enumerate(refs) if not isinstance(r, np.ndarray)]
            for i, arr in zip(pending, ray.get([refs[i] for i in pending])):
                data[i] = arr
            parity = rs.encode(data)[row]
            with self.lock:
                self.versions.setdefault(version, Version()).parity[region] = (parity, checksum(parity))
            out[region] = checksum(parity)
        return out

    def get_parity(self, version: int, region: int) -> np.ndarray:
        v = self._version(version)
        if region not in v.parity:
            raise SnapshotMissingError(f"parity of region {region}, version {version} is not held by {self.node_id}")
        arr, crc = v.parity[region]
        if checksum(arr) != crc:
            raise SnapshotMissingError(f"parity of region {region}, version {version} on {self.node_id} fails its checksum")
        return arr

    def commit(self, version: int) -> list[int]:
        """Mark ``version`` committed and free every older version. Returns the versions held."""
        with self.lock:
            if version in self.versions:  # a manager with no part in this version just frees older ones
                self.versions[version].committed = True
            for old in [v for v in self.versions if v < version]:
                del self.versions[old]
            return sorted(self.versions)

    def corrupt_shard(self, key: str) -> list[int]:
        """Fault injection: flip one byte of ``key`` in every held version, keeping the recorded
        checksums (silent corruption). Returns the versions corrupted."""
        hit = []
        with self.lock:
            for version, v in self.versions.items():
                if key in v.shards:
                    data, manifest, crc = v.shards[key]
                    bad = np.array(data, copy=True)
                    bad[len(bad) // 2] ^= 0xFF
                    v.shards[key] = (bad, manifest, crc)
                    v.verified.discard(key)
                    hit.append(version)
        return hit

    def discard(self, version: int) -> None:
        with self.lock:
            self.versions.pop(version, None)

    def held(self) -> dict[int, dict[str, Any]]:
        return {v: {"committed": x.committed, "shards": sorted(x.shards), "parity": sorted(x.parity)} for v, x in self.versions.items()}

    # ------------------------------------------------------------------ rebuild
    def rebuild_blob(
        self,
        version: int,
        n: int,
        m: int,
        lost: list[int],
        target: int,
        peers: list[Any | None],
        chunk_size: int,
        sizes: list[dict[str, int]],
    ) -> np.ndarray:
        """Reconstruct member ``target``'s blob of ``version`` from the surviving members.

        ``lost`` are the group members that are gone (``peers[j]`` is None for them); ``sizes[j]``
        member j's blob content (from the controller's record).
        """
        import ray

        layout = ParityLayout(n, m)
        lost_set = set(lost)
        if not layout.recoverable(lost_set):
            raise TooManyErasuresError(layout.k, m, sorted(lost_set), [])
        rs = self._codec(layout.k, m)
        blob = np.zeros(chunk_size * layout.k, dtype=np.uint8)
        for c in range(layout.k):
            region = layout.region_of(target, c)
            word = layout.codeword(region)
            refs: list[Any] = []
            for sym in word:
                if sym.node in lost_set:
                    refs.append(None)
                elif sym.chunk is not None:
                    refs.append(peers[sym.node].get_chunk.remote(version, sym.chunk, chunk_size, sizes[sym.node]))
                else:
                    refs.append(peers[sym.node].get_parity.remote(version, region))
            shards: list[np.ndarray | None] = []
            for r in refs:
                if r is None:
                    shards.append(None)
                    continue
                try:
                    shards.append(ray.get(r))
                except Exception:  # a member died or a chunk failed its checksum: one more erasure
                    shards.append(None)
            data = rs.decode(shards)
            pos = next(i for i, s in enumerate(word) if s.node == target)
            blob[c * chunk_size : (c + 1) * chunk_size] = data[pos]
        return blob[: sum(sizes[target].values())]
