"""SnapshotManager: one Ray actor per node that owns the node's in-memory snapshots and parity.

Owns: the pieces of every stage shard on its node (collected from the stages with
``snapshot_pieces``: return values of a call are owned by the caller, so the pieces sit in this
node's object store owned by this actor and outlive the stage that produced them), their
checksums, the parity this node holds for its erasure group (in reused, preallocated buffers),
versions (in flight until the controller commits one; older ones freed then, unless pinned for a
durable flush), serving its pieces and parity over its piece server to the group's parity holders
and to a stage that rebuilds a lost node's shard (:mod:`elastic_llm.snapshot.rebuild`, which runs
in the restored stage), and writing its part of a committed version to durable storage (the plan of :mod:`elastic_llm.durable.flush`,
a layer up, writes; the manager hands it its pieces and does not import it).

A version runs without the driver in the loop: the controller sends each erasure group's first
manager one ``relay_versions`` call, which sends every member its ``snapshot_version`` call and
answers with the group's parts (commits and discards are relayed too, ~16 managers per driver
call: ``relay``; the driver re-sends a dead relay's share). Plans name actors by id only where the
receiver holds their handles (:mod:`elastic_llm.snapshot.introductions`). The manager collects its
stages' pieces, offers the data chunks of each region to its parity holders (its piece server's
address, the pieces' ranges and checksums: :mod:`elastic_llm.snapshot.exchange`), and encodes its
own regions' parity from each member's piece server as the bytes arrive, checked against the
CRC-32s the server read (never through Ray's object transfer). It answers once its part is complete.

Never decides anything: the controller tells it which version to take, commit or hand out.
Never unpickles data it did not produce: pieces are numpy arrays, manifests JSON text.

Why ~600 lines: it is one Ray actor, and everything it does (collect, offer, encode, commit,
pin and free, hand out pieces and parity, flush) works on the same versions under one lock, with
buffers it preallocates and reuses; the erasure code itself is in :mod:`elastic_llm.snapshot.erasure`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from elastic_llm.clock import SYSTEM
from elastic_llm.lease import Lease, remove_run_groups
from elastic_llm.snapshot import exchange
from elastic_llm.snapshot.erasure import ReedSolomon, checksum
from elastic_llm.snapshot.fence import Fence
from elastic_llm.snapshot.introductions import Acquaintances, Introductions, Known, actor_id
from elastic_llm.snapshot.layout import ParityLayout
from elastic_llm.snapshot.rebuild import SnapshotMissingError
from elastic_llm.snapshot.records import Exchanged, ManagerPart, ManagerPlan, ManagerState, ParityInfo, Piece, ShardInfo, ShardKey, chunk_pieces
from elastic_llm.telemetry import Metrics

log = logging.getLogger(__name__)
WAIT_S = 600.0  # longest a version waits for a stage's copy or a peer's offer
RELAYED = frozenset({"commit", "discard"})  # the calls a manager passes on to others for the driver (relay)



class PartWriter(Protocol):
    """This node's parts of a durable flush as the manager sees them (the durable tier, a layer up, makes them)."""

    version: int
    floor: int  # the driver's membership generation (:mod:`elastic_llm.snapshot.fence`)

    def write(self, local: Callable[[ShardKey], list[np.ndarray] | None]) -> Any:
        """Write the parts; ``local(key)``: this manager's own pieces of ``key`` (None if not held)."""
        ...

@dataclass
class Shard:
    refs: list[Any]  # k piece ObjectRefs, owned by this manager
    info: ShardInfo


@dataclass
class Version:
    shards: dict[ShardKey, Shard] = field(default_factory=dict)
    parity: dict[int, tuple[np.ndarray, int]] = field(default_factory=dict)  # region -> (parity, crc)
    offers: dict[int, dict[int, tuple[tuple[str, int], list[Piece]]]] = field(default_factory=dict)  # region -> member -> (its piece server, pieces)
    committed: bool = False
    pinned: bool = False  # being flushed to durable storage: not freed when a newer version commits
    attempt: int = 0  # the attempt these belong to (ManagerPlan.attempt)
    adopted: dict[str, "Version"] = field(default_factory=dict)  # role -> its pieces and parity, re-homed here off a draining node

    def infos(self) -> tuple[ShardInfo, ...]:
        return tuple(self.shards[k].info for k in sorted(self.shards))

    def every(self) -> list["Version"]:
        """This node's own part and the roles adopted with it."""
        return [self, *self.adopted.values()]


def _read_quietly(refs: list[Any]) -> None:
    """Read the answers in ``refs`` that came, dropping their errors (Ray reports an unread one as unhandled)."""
    import ray

    for ref in refs:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - the caller has reported, or leaves to others, what failed
            continue


class SnapshotManager:
    """Body of the per-node snapshot actor (``smp-<run>-<node id>``)."""

    def __init__(self, node_id: str, codec_backend: str = "auto", run_id: str = "", grace_s: float = 0.0) -> None:
        self.node_id = node_id
        self.run_id = run_id
        self.grace_s = grace_s  # > 0: a detached manager that ends itself this long after its driver's last keepalive
        self.lease = Lease(grace_s, repr(self), SYSTEM, release=lambda: remove_run_groups(run_id)) if grace_s > 0 else None
        self.metrics = Metrics()
        self.codec_backend = codec_backend
        self.versions: dict[int, Version] = {}
        # a committed version displaced by a newer attempt at the same step (a re-protection taken
        # outside a step, after a recovery): reads get it until that attempt commits, and it comes
        # back if that attempt is discarded; the run is never without the version it committed
        self.kept: dict[int, Version] = {}
        self.lock = threading.Condition()
        self.fence = Fence()  # what an older membership generation (a zombie driver or manager) sends is refused
        self._codecs: dict[tuple[int, int], ReedSolomon] = {}
        self._pool: dict[int, list[np.ndarray]] = {}  # freed parity buffers by size, reused
        self._unread: list[Any] = []  # a failed group's members' answers, read later (Ray reports an unread failure as unhandled)
        self._server: exchange.PieceServer | None = None  # started on first use (:meth:`endpoint`)
        self._server_lock = threading.Lock()
        self.known = Acquaintances()  # the actor handles plans were sent with, by id: a plan names most by id only
        self.introduced = Introductions()  # as a group's lead: which handles each member holds

    def __repr__(self) -> str:  # Ray's display name of the actor and its log prefix
        return f"SnapshotManager(node {self.node_id[:8]}, run {self.run_id})"

    def keepalive(self) -> None:
        """A driver of the run lives (see ``recovery.driver_grace_s``): its lease is renewed.
        Once no driver has renewed it for ``grace_s``, the manager ends (its snapshots go with it)
        after removing the run's leftover placement groups: a run nobody resumes leaks nothing."""
        if self.lease is not None:
            self.lease.renew()

    def state(self) -> ManagerState:
        """What this manager holds now (``elastic-llm status``)."""
        with self.lock:
            versions = sorted(self.versions)
            committed = [x for x in versions if self.versions[x].committed]
            newest = self.versions[versions[-1]] if versions else Version()
            every = [p for v in [*self.versions.values(), *self.kept.values()] for p in v.every()]
            held = sum(s.info.nbytes for v in every for s in v.shards.values())
            held += sum(arr.nbytes for v in every for arr, _ in v.parity.values())
            out = ManagerState(run=self.run_id, node_id=self.node_id, versions=tuple(versions), committed=committed[-1] if committed else None,
                               pinned=tuple(x for x in versions if self.versions[x].pinned), shards=tuple(sorted(newest.shards)),
                               parity_regions=len(newest.parity), bytes_held=held)
        self._export(out)
        return out

    def _export(self, st: ManagerState) -> None:
        self.metrics.set("manager_versions_held", len(st.versions), run=self.run_id, node=self.node_id[:12])
        self.metrics.set("manager_bytes_held", st.bytes_held, run=self.run_id, node=self.node_id[:12])

    def endpoint(self) -> tuple[str, int]:
        """Where this manager's piece server listens (started on first use, on this node's
        address): its group's parity holders and rebuilding stages read its symbols there."""
        with self._server_lock:
            if self._server is None:
                self._server = exchange.PieceServer(exchange.node_address(), self._symbol)
            return self._server.address

    def cut_sends(self, nbytes: int) -> None:
        """Fault injection: the next symbol this manager sends is cut after ``nbytes`` of its bytes."""
        self.endpoint()
        assert self._server is not None
        self._server.cut_after = nbytes

    def _symbol(self, version: int, attempt: int, kind: int, index: int, role: str) -> tuple[list[np.ndarray], int]:
        """What the piece server sends for a request: this node's (or adopted ``role``'s) data
        chunk ``index`` of ``version`` as its pieces in key order, or its parity of region
        ``index`` and that parity's CRC-32. ``attempt`` >= 0: only that attempt's (a parity
        holder encoding it); ``exchange.ANY_ATTEMPT``: the version reads are served from (a rebuild)."""
        import ray

        with self.lock:
            if attempt >= 0:
                v = next((w for w in (self.versions.get(version), self.kept.get(version)) if w is not None and w.attempt == attempt), None)
                if v is None:
                    raise SnapshotMissingError(f"step {version}, attempt {attempt} is not held by {self.node_id[:12]} (discarded or superseded)")
            else:
                v = self._version(version, role)
            if kind == exchange.PARITY:
                if index not in v.parity:
                    raise SnapshotMissingError(f"parity of region {index}, version {version} is not held by {self.node_id[:12]}")
                arr, crc = v.parity[index]
                return [arr], crc
            refs = [v.shards[key].refs[index] for key in sorted(v.shards) if index < len(v.shards[key].refs)]
            if len(refs) != len(v.shards):
                raise SnapshotMissingError(f"data chunk {index} of version {version} is not held by {self.node_id[:12]}")
        return [np.asarray(a) for a in ray.get(refs, timeout=WAIT_S)], 0

    def _codec(self, k: int, m: int) -> ReedSolomon:
        if (k, m) not in self._codecs:
            self._codecs[(k, m)] = ReedSolomon(k, m, backend=self.codec_backend)
        return self._codecs[(k, m)]

    def _version(self, version: int, role: str = "") -> Version:
        """The version reads are served from: the committed one kept while a newer attempt at it
        is under way, else the one held; ``role``: the part of that member adopted here."""
        try:
            v = self.kept.get(version) or self.versions[version]
        except KeyError:
            raise SnapshotMissingError(f"snapshot version {version} is not held by {self.node_id} (held: {sorted(self.versions)})") from None
        if not role or role == self.node_id:
            return v
        if role not in v.adopted:
            raise SnapshotMissingError(f"member {role[:12]}'s part of version {version} is not held by {self.node_id}")
        return v.adopted[role]

    def _claim(self, version: int, attempt: int) -> Version | None:
        """The version held for (``version``, ``attempt``), created if absent; an older attempt's
        is freed and replaced; None if a newer attempt holds it (this call is stale). Call with
        the lock held. A step re-run after a rollback snapshots the same version number again:
        a late offer or discard of the earlier attempt must not touch the new one."""
        v = self.versions.get(version)
        if v is not None and v.attempt > attempt:
            return None
        if v is None or v.attempt < attempt:
            if v is not None and v.committed:
                self._free(self.kept.pop(version, Version()))
                self.kept[version] = v
            elif v is not None:
                self._free(v)
            v = self.versions[version] = Version(attempt=attempt)
            self.lock.notify_all()  # an encode waiting on the older attempt gives up
        return v

    def _buffer(self, nbytes: int) -> np.ndarray:
        free = self._pool.get(nbytes)
        if free:
            return free.pop()
        buf = np.empty(nbytes, dtype=np.uint8)
        buf.fill(0)  # touch once: later versions write warm memory
        return buf

    def _free(self, v: Version) -> None:
        for part in v.adopted.values():
            self._free(part)
        v.adopted.clear()
        for arr, _ in v.parity.values():
            self._pool.setdefault(len(arr), []).append(arr)
        v.parity.clear()
        v.shards.clear()
        v.offers.clear()

    # ------------------------------------------------------------------ one version
    def snapshot_version(self, plan: ManagerPlan) -> ManagerPart:
        """Take this node's part of ``plan.version``: collect its stages' pieces, offer the data
        chunks of each region to that region's parity holders, encode the parity it holds."""

        cpu0 = time.thread_time()
        version, group, m, me = plan.version, plan.group, plan.parity, plan.me
        layout = ParityLayout(len(group), m) if group else None
        k = layout.k if layout else 1
        if self.fence.below(plan.attempt, f"a plan of step {version}") or not self.fence.admit(plan.floor, f"a plan of step {version}"):
            raise SnapshotMissingError(f"step {version}, attempt {plan.attempt}: refused, of an older membership generation")
        stages = [(key, self.known.handle(stage, plan.attempt)) for key, stage in plan.stages]  # Unknown (the version fails) if not held
        peers = [self.known.handle(p, plan.attempt) for p in plan.peers]
        with self.lock:
            mine = self._claim(version, plan.attempt)
        if mine is None:
            raise SnapshotMissingError(f"step {version}, attempt {plan.attempt}: a newer attempt at this version is under way")
        calls = {
            key: stage.snapshot_pieces.options(num_returns=k + 1, concurrency_group="snapshot").remote(version, k)
            for key, stage in stages
        }
        t0 = time.perf_counter()
        infos = self._collect(version, calls)
        collect_s = time.perf_counter() - t0
        with self.lock:
            v = self.versions.get(version)
            if v is not mine:
                raise SnapshotMissingError(f"step {version}, attempt {plan.attempt}: discarded or superseded while its pieces were collected")
            for (key, refs), info in zip(calls.items(), infos):
                v.shards[key] = Shard(list(refs[1:]), info.on_node(self.node_id))
        shards = v.infos()
        if layout is None:
            return ManagerPart(self.node_id, shards, cpu_s=time.thread_time() - cpu0, collect_s=collect_s, fenced=self.fence.take(), attempt=plan.attempt)
        for region in range(layout.n):  # offer each data chunk to the holders of its region
            if layout.is_holder(me, region):
                continue
            c = layout.chunk_of(me, region)
            pieces = chunk_pieces(shards, c)
            for h in layout.holders(region):  # the holder reads the bytes from this node's piece server
                peers[h].offer.remote(version, region, me, self.endpoint(), pieces, plan.attempt)
        encoded = [self._encode(v, version, layout, region, row) for region, row in layout.parity_regions(me)]
        exchanged = sum((e for _, e in encoded), Exchanged(crc_s=self._server.take_crc_s() if self._server is not None else 0.0))  # its server's CRC-32s since the last part
        return ManagerPart(self.node_id, shards, tuple(p for p, _ in encoded), time.thread_time() - cpu0, collect_s, exchanged, self.fence.take(), plan.attempt)

    def relay_versions(self, calls: tuple[tuple[Known, ManagerPlan], ...]) -> tuple[ManagerPart, ...]:
        """As its group's first member, start the group's parts of a version (``calls``: each member
        and its plan) and answer with all of them in one value: one driver call per group, not per
        node. Raises the first member's failure as soon as it comes (the driver drops the version)."""
        import ray

        self._read_unread()
        attempt = calls[0][1].attempt
        handles = [self.known.handle(member, attempt) for member, _ in calls]  # a member's plan names by id only what it holds
        plans = [plan.renamed(self.introduced.forwarding(actor_id(h), self.known, attempt)) for h, (_, plan) in zip(handles, calls)]
        refs = [handle.snapshot_version.remote(plan) for handle, plan in zip(handles, plans)]
        parts: dict[Any, ManagerPart] = {}
        waiting = list(refs)
        try:
            while waiting:
                ready, waiting = ray.wait(waiting, num_returns=1, timeout=WAIT_S)
                if not ready:
                    raise TimeoutError(f"step {calls[0][1].version}: {len(waiting)} parts of the group not done after {WAIT_S:.0f} s")
                for ref in ready:
                    parts[ref] = ray.get(ref)
        except BaseException:
            with self.lock:
                self._unread += [r for r in refs if r not in parts]
            for h in [h for h, ref in zip(handles, refs) if ref not in parts]:
                self.introduced.failed(actor_id(h))
            raise
        for h, plan in zip(handles, plans):
            self.introduced.answered(actor_id(h), plan.named(), attempt)
        return tuple(parts[r] for r in refs)

    def _read_unread(self) -> None:
        """Read the answers of failed groups' other members that have come since (their failure,
        if any, was the version's, already reported)."""
        import ray

        with self.lock:
            unread, self._unread = self._unread, []
        if not unread:
            return
        done, rest = ray.wait(unread, num_returns=len(unread), timeout=0)
        _read_quietly(done)  # a failure here failed its version already: the driver dropped it
        with self.lock:
            self._unread += rest

    def relay(self, method: str, args: tuple[Any, ...], handles: list[Any]) -> None:
        """Pass a driver's ``commit`` or ``discard`` (with ``args``) on to ``handles`` (this
        manager's own first) so the driver makes one call per ~16 managers; answers once each
        has run it (a member whose actor died is left to the failure that names it). The driver
        reads the answer: a relay that died before answering is one it re-sends past."""
        import ray

        if method not in RELAYED:
            raise ValueError(f"{method!r} is not relayed (only {sorted(RELAYED)})")
        refs = [getattr(h, method).remote(*args) for h in handles]
        ray.wait(refs, num_returns=len(refs), timeout=WAIT_S)
        _read_quietly(refs)  # a member whose actor died (or still runs it after WAIT_S) is left to the failure that names it

    @staticmethod
    def _collect(version: int, calls: dict[ShardKey, Any]) -> list[ShardInfo]:
        """The stages' infos; if any stage failed, one error naming them (every returned ref is
        retrieved, so Ray reports no unhandled errors for the pieces of a failed call)."""
        import ray

        ray.wait([refs[0] for refs in calls.values()], num_returns=len(calls), timeout=WAIT_S)
        infos, failed = [], []
        for key, refs in calls.items():
            try:
                infos.append(ray.get(refs[0], timeout=0))
            except Exception as e:
                failed.append(f"{key} ({type(e).__name__})")
                _read_quietly(refs[1:])  # the failed call's other returns: its failure is the first return's, counted here
        if failed:
            raise RuntimeError(f"no snapshot of step {version} from stages {', '.join(failed)}")
        return infos

    def offer(self, version: int, region: int, member: int, source: tuple[str, int], pieces: list[Piece], attempt: int = 0) -> None:
        """Group member ``member`` offers its data chunk of ``region`` (its piece server's address,
        the pieces' byte ranges and checksums) to this parity holder; an offer of an older attempt
        than the one held is dropped, one of an older membership refused (:mod:`fence`)."""
        if self.fence.below(attempt, f"a parity offer of step {version} from member {member}"):
            return
        with self.lock:
            v = self._claim(version, attempt)
            if v is None:
                return
            v.offers.setdefault(region, {})[member] = (tuple(source), list(pieces))  # type: ignore[assignment]
            self.lock.notify_all()

    def _encode(self, v: Version, version: int, layout: ParityLayout, region: int, row: int) -> tuple[ParityInfo, Exchanged]:
        """Parity row ``row`` of ``region``: each data member's chunk is read from its piece server
        and encoded as it arrives (blocks that stay in cache, no second pass), every piece's CRC-32
        as its server read it checked against the recorded one; a member whose bytes do not arrive
        whole, or fail that check, fails this node's part."""
        members = layout.data_nodes(region)
        with self.lock:
            ok = self.lock.wait_for(
                lambda: self.versions.get(version) is not v or all(j in v.offers.get(region, {}) for j in members), timeout=WAIT_S
            )
            if self.versions.get(version) is not v:
                raise SnapshotMissingError(f"step {version}, attempt {v.attempt}: discarded or superseded while waiting for its group's data")
            offers = v.offers.get(region, {})
            if not ok:
                late = [j for j in members if j not in offers]
                raise TimeoutError(f"parity of region {region}, step {version}: data of group members {late} never arrived")
            contribs = [offers[j] for j in members]
        exchange.yield_to_training()  # this manager thread serves snapshots only: its reading gives way to the step
        out = self._buffer(max((sum(p.length for p in pieces) for _, pieces in contribs), default=0))
        out.fill(0)
        rs = self._codec(layout.k, layout.m)
        t0 = time.perf_counter()
        deadline = time.monotonic() + WAIT_S
        spent = [0.0]  # CPU seconds of encoding (the CRC-32s are the serving member's: exchange's opening)
        try:
            for sym, (j, (source, pieces)) in enumerate(zip(members, contribs)):
                starts = np.cumsum([0] + [p.length for p in pieces]).tolist()
                update = rs.updater(sym, row)

                def sink(i: int, pos: int, block: np.ndarray, starts: list[int] = starts, update: Callable[[np.ndarray, np.ndarray], None] = update) -> None:
                    if i >= len(starts) - 1 or pos + len(block) > starts[i + 1] - starts[i]:
                        raise exchange.ExchangeError("more bytes than the offer's pieces")
                    a = time.thread_time()
                    update(block, out[starts[i] + pos : starts[i] + pos + len(block)])
                    spent[0] += time.thread_time() - a

                try:
                    got = exchange.stream(source, version, v.attempt, exchange.CHUNK, layout.chunk_of(j, region), "", sink, deadline)
                except exchange.ExchangeError as e:
                    raise SnapshotMissingError(f"step {version}: group member {j}'s data for region {region} did not arrive whole ({e})") from None
                if not got.carries(pieces):
                    raise SnapshotMissingError(f"step {version}: a piece from group member {j} for region {region} fails its checksum")
        except BaseException:
            with self.lock:
                self._pool.setdefault(len(out), []).append(out)  # never kept: a partly encoded parity
            raise
        wall = time.perf_counter() - t0
        crc = checksum(out)
        with self.lock:
            v.parity[region] = (out, crc)
            v.offers.pop(region, None)
        return ParityInfo(region, len(out), crc), Exchanged(sum(p.length for _, pieces in contribs for p in pieces), wall, spent[0])

    # ------------------------------------------------------------------ commit / free
    def commit(self, version: int, pin: bool = False, keep: tuple[int, ...] = (), floor: int = 0) -> list[int]:
        """Mark ``version`` committed and free every older version that is neither pinned nor in
        ``keep``. ``pin``: keep ``version`` until :meth:`unpin` (a durable flush reads it);
        ``keep``: versions the driver is flushing (this actor runs calls on several threads, so
        an older version's own ``commit(pin=True)`` may run after this one). A commit that comes
        after a newer one frees its version unless pinned. Returns the versions held. ``floor``:
        the driver's (:mod:`fence`: a zombie driver's commit changes nothing)."""
        if not self.fence.admit(floor, f"a commit of step {version}"):
            return sorted(self.versions)
        with self.lock:
            if version in self.versions:  # a manager with no part in this version just frees older ones
                self.versions[version].committed = True
                self.versions[version].pinned = self.versions[version].pinned or pin
            for old in [x for x in self.kept if x <= version]:  # the attempt that displaced it committed (or a newer version did)
                self._free(self.kept.pop(old))
            for old in [x for x in self.versions if x < version and x not in keep and not self.versions[x].pinned]:
                self._free(self.versions.pop(old))
            v = self.versions.get(version)
            if v is not None and not v.pinned and any(x > version and w.committed for x, w in self.versions.items()):
                self._free(self.versions.pop(version))
            self.lock.notify_all()
            held = sorted(self.versions)
        self.state()  # refreshes this node's metrics
        return held

    def unpin(self, version: int) -> None:
        """The flush of ``version`` is over: free it if a newer version has committed since."""
        with self.lock:
            v = self.versions.get(version)
            if v is None:
                return
            v.pinned = False
            if any(x > version and w.committed for x, w in self.versions.items()):
                self._free(self.versions.pop(version))

    def discard_all(self, floor: int = 0) -> None:
        """Forget every version (everyone rolled back to a durable checkpoint older than them)."""
        if not self.fence.admit(floor, "a discard of every version"):
            return
        with self.lock:
            for v in list(self.versions):
                self._free(self.versions.pop(v))
            for v in list(self.kept):
                self._free(self.kept.pop(v))
            self.lock.notify_all()

    # ------------------------------------------------------------------ durable flush
    def flush_part(self, plan: "PartWriter") -> Any:
        """Write this node's parts of a committed version to durable storage: the durable tier's
        plan (:class:`~elastic_llm.durable.flush.NodeFlush`) writes, this hands it the pieces."""
        if not self.fence.admit(plan.floor, f"a flush of step {plan.version}"):
            raise SnapshotMissingError(f"the flush of step {plan.version} is refused: its driver is of an older membership generation")
        def local(key: ShardKey) -> list[np.ndarray] | None:
            with self.lock:
                v = self.kept.get(plan.version) or self.versions.get(plan.version)
                if v is None or not any(key in p.shards for p in v.every()):
                    return None
            return self._pieces(plan.version, key, verify=False)[1]  # the flush checks every piece itself

        return plan.write(local)

    def discard(self, version: int, attempt: int | None = None, floor: int = 0) -> None:
        """Forget ``version`` (only up to ``attempt``: a newer attempt's is kept; ``floor``: :meth:`commit`'s)."""
        if not self.fence.admit(floor, f"a discard of step {version}"):
            return
        with self.lock:
            v = self.versions.get(version)
            if v is not None and (attempt is None or v.attempt <= attempt):
                self._free(self.versions.pop(version))
            if version in self.kept and version not in self.versions:  # the attempt that displaced it failed: it is back
                self.versions[version] = self.kept.pop(version)
            self.lock.notify_all()

    def held(self) -> dict[int, bool]:
        """Versions held here -> whether each is committed."""
        return {v: x.committed or v in self.kept for v, x in self.versions.items()}

    # ------------------------------------------------------------------ re-home
    def part_of(self, version: int, role: str = "") -> tuple[int, tuple[ShardInfo, ...], list[list[Any]], tuple[tuple[int, np.ndarray, int], ...]]:
        """Member ``role``'s part of ``version`` as held here (this node's own when empty), for
        a manager that adopts it: its attempt, its shards' infos and piece refs (in key order)
        and its parity (region, bytes, CRC-32)."""
        with self.lock:
            v = self._version(version, role)
            return v.attempt, v.infos(), [list(v.shards[k].refs) for k in sorted(v.shards)], tuple((r, a, c) for r, (a, c) in sorted(v.parity.items()))

    def adopt(self, version: int, role: str, source: Any) -> int:
        """Re-home: copy member ``role``'s part of committed ``version`` from ``source`` (the
        manager of a draining node holding it) into this node's object store and parity buffers,
        every piece checked against its CRC-32; held as adopted by this node's part of the version
        (one of its own if this node took no part) and freed with it. Returns the bytes copied.
        The caller moves the role in the version's record once this answers."""
        import ray

        attempt, infos, refs, parity = ray.get(source.part_of.remote(version, role), timeout=WAIT_S)
        flat = [r for rs in refs for r in rs]
        arrays = ray.get(flat, timeout=WAIT_S) if flat else []
        part, pos, nbytes = Version(attempt=attempt, committed=True), 0, 0
        for info, rs in zip(infos, refs):
            mine = []
            for piece, arr in zip(info.pieces, arrays[pos : pos + len(rs)]):
                arr = np.asarray(arr)
                if len(arr) != piece.length or checksum(arr) != piece.crc:
                    raise SnapshotMissingError(f"a piece of {info.key}, step {version} from {role[:12]} fails its checksum: not adopted")
                mine.append(ray.put(arr))
                nbytes += len(arr)
            pos += len(rs)
            part.shards[info.key] = Shard(mine, info)
        del arrays
        for region, arr, crc in parity:
            if checksum(arr) != crc:
                raise SnapshotMissingError(f"parity of region {region}, step {version} from {role[:12]} fails its checksum: not adopted")
            buf = self._buffer(len(arr))
            buf[:] = arr
            part.parity[region] = (buf, crc)
            nbytes += len(arr)
        with self.lock:
            if any(x > version and w.committed for x, w in self.versions.items()):  # a newer version committed meanwhile
                self._free(part)
                raise SnapshotMissingError(f"step {version} was superseded while {role[:12]}'s part of it was adopted")
            v = self.kept.get(version) or self.versions.setdefault(version, Version(attempt=attempt, committed=True))
            if role in v.adopted:
                self._free(v.adopted.pop(role))
            v.adopted[role] = part
        return nbytes

    # ------------------------------------------------------------------ restore
    def _pieces(self, version: int, key: ShardKey, verify: bool) -> tuple[Shard, list[np.ndarray]]:
        import ray

        shard = next((p.shards[key] for p in self._version(version).every() if key in p.shards), None)
        if shard is None:
            raise SnapshotMissingError(f"shard {key} of version {version} is not held by {self.node_id}")
        arrays = [np.asarray(a) for a in ray.get(shard.refs, timeout=WAIT_S)]
        bad = [i for i, (arr, piece) in enumerate(zip(arrays, shard.info.pieces)) if len(arr) != piece.length or checksum(arr) != piece.crc] if verify else []
        if bad:
            raise SnapshotMissingError(f"piece {bad[0]} of shard {key}, version {version} on {self.node_id} fails its checksum")
        return shard, arrays

    def shard_parts(self, version: int, key: ShardKey, verify: bool = True) -> list[Any]:
        """The piece refs of shard ``key`` of ``version``, their checksums checked: restore passes them on to the stage, no copy here."""
        shard, _ = self._pieces(version, key, verify)
        return list(shard.refs)

    def get_shard(self, version: int, key: ShardKey, verify: bool = True) -> tuple[np.ndarray, str]:
        """Shard ``key`` of ``version`` as one array (+ its manifest)."""
        shard, arrays = self._pieces(version, key, verify)
        return (np.concatenate(arrays) if len(arrays) != 1 else arrays[0]), shard.info.manifest

    # ------------------------------------------------------------------ fault injection
    def corrupt_shard(self, key: ShardKey) -> list[int]:
        """Fault injection: flip one byte of ``key``'s first piece in this node's object store, in
        place (the recorded checksums stay: silent corruption). Returns the versions corrupted."""
        import ray

        hit = []
        with self.lock:
            for version, v in self.versions.items():
                if key in v.shards and v.shards[key].info.pieces[0].length > 0:
                    arr = np.asarray(ray.get(v.shards[key].refs[0]))
                    addr = arr.ctypes.data + len(arr) // 2
                    ctypes.memset(addr, (int(arr[len(arr) // 2]) ^ 0xFF), 1)
                    hit.append(version)
        return hit
