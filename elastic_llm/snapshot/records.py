"""Typed records that cross actor boundaries in the snapshot path: small frozen dataclasses.

Owns: the names of things (a shard is a :class:`ShardKey`, never a ``"stage/replica"`` string),
what a stage reports about one snapshot copy (:class:`ShardInfo`), what the coordinator tells a
manager to do for one version (:class:`ManagerPlan`), what a manager reports back
(:class:`ManagerPart`, with what its parity exchange cost: :class:`Exchanged`), the coordinator's
running counts (:class:`SnapshotStats`), what a manager holds (:class:`ManagerState`), the record of a committed version (:class:`VersionRecord`), where a
stage's committed state can be read from (:class:`StageSource`) and how a lost shard of it is rebuilt
from parity (:class:`ParityRebuild`, the recipe the restored stage follows).
Never does I/O, never talks to Ray and never holds bytes: the pieces travel as separate objects.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from elastic_llm.sources import Source
from elastic_llm.snapshot.introductions import Known

ATTEMPT_BITS = 40  # a driver's attempts: its epoch << ATTEMPT_BITS, then one more per version begun


@dataclass(frozen=True, order=True)
class ShardKey:
    """One (stage, data-parallel replica): whose state a shard is."""

    stage: int
    replica: int

    def __str__(self) -> str:
        return f"stage {self.stage} replica {self.replica}"


@dataclass(frozen=True)
class Piece:
    """A byte range of a stage's state and the CRC-32 of its bytes."""

    offset: int
    length: int
    crc: int


@dataclass(frozen=True)
class ShardInfo:
    """What a stage reports about one snapshot copy of its state (its 1/DP slice).

    ``node_id`` is empty as a stage returns it; the manager holding the pieces fills it in."""

    key: ShardKey
    version: int
    lo: int
    nbytes: int
    pieces: tuple[Piece, ...]
    manifest: str  # JSON: layout, RNG states, LR schedule, step, data position
    copy_s: float = 0.0
    node_id: str = ""

    def on_node(self, node_id: str) -> "ShardInfo":
        return replace(self, node_id=node_id)

    def data_position(self) -> dict[str, Any] | None:
        """The data position recorded with this shard, in its JSON form (None: none was;
        :meth:`~elastic_llm.stream.StreamPosition.of` reads it)."""
        return json.loads(self.manifest).get("data_position")


@dataclass(frozen=True)
class ParityInfo:
    region: int
    length: int
    crc: int


@dataclass(frozen=True)
class Exchanged:
    """What a parity holder's reading of its group's data cost (summed over its regions): bytes
    received over the piece servers' links, the wall time from the first request to the last
    byte, and within it the CPU time of encoding; ``crc_s``: the CPU time its own piece server
    spent on the CRC-32s of what it sent since its last part (the sender checks:
    :mod:`~elastic_llm.snapshot.exchange`)."""

    received: int = 0
    wall_s: float = 0.0
    encode_s: float = 0.0
    crc_s: float = 0.0

    def __add__(self, other: "Exchanged") -> "Exchanged":
        return Exchanged(self.received + other.received, self.wall_s + other.wall_s, self.encode_s + other.encode_s, self.crc_s + other.crc_s)


@dataclass(frozen=True)
class ManagerPlan:
    """One manager's part of one version: which of its node's stages to collect, and its place
    in its erasure group (``group`` empty: no parity, a single node)."""

    version: int
    stages: tuple[tuple[ShardKey, Known], ...]  # (key, stage actor) on this node
    group: tuple[str, ...] = ()  # node ids of this node's erasure group
    me: int = 0  # this node's index in ``group``
    peers: tuple[Known, ...] = ()  # the group's managers, in ``group`` order
    parity: int = 1  # parity symbols per codeword
    attempt: int = 0  # which attempt at ``version`` (a step re-run after a rollback is a new one): larger is newer
    floor: int = 0  # the first attempt of the run's membership generation: a plan or offer below it is a zombie's, refused

    def named(self) -> tuple[Known, ...]:
        """Every actor the plan names: its stages, then its group's managers."""
        return (*(s for _, s in self.stages), *self.peers)

    def renamed(self, name: Callable[[Known], Known]) -> "ManagerPlan":
        """The plan with each actor named by ``name`` (a lead forwarding it names by id only what the member holds)."""
        return replace(self, stages=tuple((key, name(s)) for key, s in self.stages), peers=tuple(name(p) for p in self.peers))


@dataclass(frozen=True)
class ManagerPart:
    """A manager's finished part of one version."""

    node_id: str
    shards: tuple[ShardInfo, ...]
    parity: tuple[ParityInfo, ...] = ()
    cpu_s: float = 0.0  # CPU time the manager spent on this version (collecting, encoding parity)
    collect_s: float = 0.0  # wall time until its stages' pieces were in
    exchanged: Exchanged = Exchanged()  # its reading and encoding of the group's data
    fenced: tuple[str, ...] = ()  # what the manager refused as of an older generation since its last part (a zombie's)
    attempt: int = 0  # the attempt it belongs to (its plan's): a version commits only parts of its own attempt

    def cost_s(self) -> float:
        """Time this version cost the node: the manager's CPU time and its stages' copies."""
        return self.cpu_s + sum(s.copy_s for s in self.shards)


@dataclass(frozen=True)
class VersionRecord:
    """A committed version: its erasure groups and every shard with the node that took it.

    A node named in ``groups`` and in a shard's ``node_id`` is a *role*: the member that took
    those pieces (and the parity of its regions). ``homes`` says where a role's pieces live now
    when they were re-homed off a draining node (:meth:`home`); a role not in it is at home."""

    version: int
    groups: tuple[tuple[str, ...], ...]
    shards: tuple[ShardInfo, ...]
    homes: tuple[tuple[str, str], ...] = ()  # (role, node holding its pieces now), for re-homed roles
    attempt: int = 0  # the attempt that committed (ManagerPlan.attempt): its durable files carry it, so a zombie's late write never lands in them

    def home(self, role: str) -> str:
        """The node that holds ``role``'s pieces now."""
        return self._homes.get(role, role)

    @cached_property
    def _homes(self) -> dict[str, str]:
        return dict(self.homes)

    @property
    def placed(self) -> tuple[tuple[str, ...], ...]:
        """The groups as the nodes that hold their members' pieces now (a node holding two
        members of a group is named twice: its loss costs the group both)."""
        return tuple(tuple(self.home(m) for m in g) for g in self.groups)

    def roles_on(self, node: str) -> tuple[str, ...]:
        """The roles whose pieces ``node`` holds now."""
        held = tuple(m for g in self.groups for m in g if self.home(m) == node)
        return held or ((node,) if self.infos_on(node) and not any(node in g for g in self.groups) else ())  # (no groups: a node holds its own)

    def rehomed(self, moves: dict[str, str]) -> "VersionRecord":
        """This record with the roles of ``moves`` held on their new nodes."""
        homes = {**self._homes, **moves}
        return replace(self, homes=tuple(sorted((r, n) for r, n in homes.items() if r != n)))

    @cached_property
    def _by_key(self) -> dict[ShardKey, ShardInfo]:
        return {s.key: s for s in self.shards}

    @cached_property
    def _by_node(self) -> dict[str, tuple[ShardInfo, ...]]:
        out: dict[str, list[ShardInfo]] = {}
        for s in sorted(self.shards, key=lambda s: (s.key.stage, s.key.replica)):
            out.setdefault(s.node_id, []).append(s)
        return {n: tuple(v) for n, v in out.items()}

    def shard(self, key: ShardKey) -> ShardInfo:
        """(Looked up in an index built once: a restore at 1,000 shards asks for each.)"""
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"{key} has no shard in snapshot version {self.version}") from None

    @property
    def width(self) -> int:
        """Data-parallel replicas the run had when this version was taken."""
        return 1 + max((s.key.replica for s in self.shards), default=0)

    def infos_on(self, node: str) -> tuple[ShardInfo, ...]:
        """The shards held on ``node``, in key order (the order chunks are built in)."""
        return self._by_node.get(node, ())

    def group_of(self, node: str) -> tuple[str, ...] | None:
        return next((g for g in self.groups if node in g), None)


@dataclass(frozen=True)
class ParityRebuild:
    """How the stage being restored rebuilds shard ``key`` of version ``version`` from parity:
    the shard was held by member ``target`` of an erasure group of ``n`` nodes with ``parity``
    parity chunks; ``lost`` are the members gone (``peers[j]`` is None for them, else member j's
    manager, asked for its chunks or parity); ``infos[j]``: the shards member j holds for the
    version (from the committed record); :attr:`shard`: what the rebuilt bytes are (the state's
    ``[shard.lo, shard.lo + shard.nbytes)``)."""

    version: int
    key: ShardKey
    n: int
    parity: int
    lost: tuple[int, ...]
    target: int
    peers: tuple[Any, ...]
    infos: tuple[tuple[ShardInfo, ...], ...]
    roles: tuple[str, ...] = ()  # the members' roles (a re-homed member's pieces are asked for by it)

    def role(self, member: int) -> str:
        return self.roles[member] if self.roles else ""

    @property
    def shard(self) -> ShardInfo:
        """The lost shard as its holder reported it (its byte range, pieces and checksums)."""
        return next(i for i in self.infos[self.target] if i.key == self.key)


@dataclass(frozen=True)
class StageSource:
    """Where the committed state of one stage (all its DP slices) can be read: ``refs[i]`` holds
    the bytes at ``offsets[i]`` (its managers' pieces); ``rebuilds``: the slices whose node is lost,
    each rebuilt from parity by the stage itself, decoded into its own state; ``manifest`` is the
    restored replica's; ``sources`` says per slice whether it came from its manager
    (``local_smp``) or was rebuilt (``parity``)."""

    offsets: tuple[int, ...]
    refs: tuple[Any, ...]
    manifest: str
    sources: tuple[Source, ...]
    rebuilds: tuple[ParityRebuild, ...] = ()

    @property
    def source(self) -> Source:
        return Source.PARITY if Source.PARITY in self.sources else Source.LOCAL_SMP


@dataclass(frozen=True)
class ManagerState:
    """What a node's snapshot manager holds now (``state()``; ``elastic-llm status`` shows it)."""

    run: str
    node_id: str
    versions: tuple[int, ...]  # held, oldest first
    committed: int | None  # newest committed version held
    pinned: tuple[int, ...]  # kept for a durable flush
    shards: tuple[ShardKey, ...]  # the stage shards of the newest version held
    parity_regions: int  # parity blocks held for the newest version
    bytes_held: int  # snapshot pieces and parity of every version held


def chunk_pieces(infos: tuple[ShardInfo, ...], chunk: int) -> list[Piece]:
    """The pieces that form data chunk ``chunk`` of a node: piece ``chunk`` of each of its shards,
    in key order (``infos`` as :meth:`VersionRecord.infos_on` returns them)."""
    return [s.pieces[chunk] for s in sorted(infos, key=lambda s: s.key)]


def generation(value: int) -> str:
    """An attempt or floor as ``epoch.n`` (the driver that made it, its n-th attempt)."""
    return f"{value >> ATTEMPT_BITS}.{value & ((1 << ATTEMPT_BITS) - 1)}"


def record_json(record: VersionRecord) -> str:
    """``record`` as JSON text (no pickle: a new driver reads it back with :func:`record_from_json`)."""
    return json.dumps({
        "version": record.version,
        "groups": [list(g) for g in record.groups],
        "homes": [list(h) for h in record.homes],
        "attempt": record.attempt,
        "shards": [
            {"stage": s.key.stage, "replica": s.key.replica, "version": s.version, "lo": s.lo, "nbytes": s.nbytes,
             "pieces": [[p.offset, p.length, p.crc] for p in s.pieces], "manifest": s.manifest, "node_id": s.node_id}
            for s in record.shards
        ],
    })


def record_from_json(text: str | bytes) -> VersionRecord:
    """The :class:`VersionRecord` that :func:`record_json` wrote; ``ValueError`` naming what is
    wrong when the text is not one."""
    try:
        d = json.loads(text)
        shards = tuple(
            ShardInfo(ShardKey(int(s["stage"]), int(s["replica"])), int(s["version"]), int(s["lo"]), int(s["nbytes"]),
                      tuple(Piece(int(o), int(n), int(c)) for o, n, c in s["pieces"]), str(s["manifest"]), node_id=str(s["node_id"]))
            for s in d["shards"]
        )
        homes = tuple((str(r), str(n)) for r, n in d.get("homes", []))
        return VersionRecord(int(d["version"]), tuple(tuple(str(n) for n in g) for g in d["groups"]), shards, homes, int(d.get("attempt", 0)))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a snapshot version record ({type(e).__name__}: {e})") from None


@dataclass
class SnapshotStats:
    """The coordinator's running counts of versions and where their time went."""

    committed: int = 0
    discarded: int = 0
    superseded: int = 0
    skipped: int = 0  # due snapshots skipped while versions were in flight (within max_lag)
    wait_s: float = 0.0  # training time spent waiting for the committed version to catch up
    # where the committed versions' time went, summed over them (``bench snapshot``'s breakdown):
    copy_s: float = 0.0  # the stages' copies into their snapshot buffers (and the pieces' CRC-32s)
    collect_s: float = 0.0  # the managers' waits for their stages' pieces
    exchanged: Exchanged = field(default_factory=Exchanged)  # the parity holders' reading, checking and encoding of their groups' data
    commit_s: float = 0.0  # the driver's commit of each (record, managers told)

    def add_commit(self, parts: list[ManagerPart], commit_s: float) -> None:
        """One more version committed: its parts' copies, collects and exchanges, and the commit's own time."""
        self.committed += 1
        self.copy_s += sum(s.copy_s for part in parts for s in part.shards)
        self.collect_s += sum(part.collect_s for part in parts)
        self.exchanged = sum((part.exchanged for part in parts), self.exchanged)
        self.commit_s += commit_s
