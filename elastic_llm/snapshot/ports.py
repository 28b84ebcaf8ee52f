"""The snapshot coordinator's seams: its managers as it calls them (:class:`ManagerHandle`,
started and ended by a :class:`ManagerFleet`), how it waits for their answers (:class:`Calls`:
Ray's, or a simulation's), the error a call to a lost manager raises (:class:`ManagerLost`) and the
durable tier as it drives it (:class:`Flusher`). Types only."""

from __future__ import annotations

from typing import Protocol

from elastic_llm.snapshot.records import VersionRecord


class Flush(Protocol):
    """A durable flush in flight."""

    @property
    def record(self) -> VersionRecord: ...  # the version it writes


class Flusher(Protocol):
    """What the coordinator needs of the durable tier (it never imports it): at each commit,
    whether that version is flushed, the flush in flight (its version stays pinned), and
    starting a flush."""

    @property
    def inflight(self) -> Flush | None: ...  # the flush in flight, or None

    def wants(self, record: VersionRecord) -> bool: ...

    def start(self, record: VersionRecord) -> None: ...


class ManagerLost(RuntimeError):
    """A manager's call failed because an actor or node it involved is gone: the manager itself,
    a peer manager it relayed to, or a stage it called. What :class:`Calls` ``get`` raises for
    Ray's death errors (``cause``: Ray's own, e.g. ``ActorDiedError``), so the coordinator tells
    a lost manager from a bug in the code without importing Ray."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(str(cause))


Ref = object  # an answer to come (a Ray ObjectRef, or a simulated one): opaque to the coordinator


class Calls(Protocol):
    """How the coordinator waits for and reads its managers' answers: Ray's ``wait`` and ``get``
    (:class:`RayCalls`), or a simulation's over simulated managers. ``get`` raises what the
    manager's method raised, :class:`ManagerLost` when an actor or node the call involved is gone,
    ``TimeoutError`` when there is no answer within ``timeout``."""

    def wait(self, refs: list[Ref], num_returns: int, timeout: float | None) -> tuple[list[Ref], list[Ref]]: ...

    def get(self, ref: Ref, timeout: float | None = None) -> object: ...  # the caller says what it asked for (``cast``)


class Remote(Protocol):
    """One method of a manager: ``handle.method.remote(*args)`` returns a ref for :class:`Calls`."""

    def remote(self, *args: object) -> Ref: ...


class ManagerHandle(Protocol):
    """A node's snapshot manager as the coordinator, the durable tier and the keepalive call it
    (:class:`~elastic_llm.snapshot.manager.SnapshotManager` as a Ray actor, or a simulated one)."""

    held: Remote  # () -> {version: committed}
    snapshot_version: Remote  # (ManagerPlan) -> ManagerPart
    relay_versions: Remote  # ((Known member, ManagerPlan), ...) -> the group's ManagerParts (the first member starts the others')
    relay: Remote  # (method, args, handles) -> None once all ran it: commit or discard passed on to the handles
    commit: Remote  # (version, flush, keep, floor) -> None; floor: the driver's membership generation (elastic_llm.snapshot.fence)
    discard: Remote  # (version, attempt, floor) -> None
    discard_all: Remote  # (floor) -> None
    shard_parts: Remote  # (version, key) -> refs of its pieces
    endpoint: Remote  # () -> (host, port) of its piece server, where a rebuild reads its (or an adopted role's) chunks and parity
    adopt: Remote  # (version, role, source handle) -> bytes: a draining node's part copied here (:mod:`rehome`)
    flush_part: Remote  # (NodeFlush, carrying the driver's floor) -> the node's written parts
    unpin: Remote  # (version) -> None
    keepalive: Remote  # () -> None


class ManagerFleet(Protocol):
    """Where the managers live: one per live node that can host stages. ``start`` returns at
    once (``held`` answers once it runs); ``end`` stops one. Ray: detached actors pinned to their
    node (:class:`RayManagers`); a simulation: simulated managers."""

    @property
    def calls(self) -> Calls: ...

    def nodes(self) -> set[str]: ...

    def domains(self) -> dict[str, str]: ...  # node -> failure domain (zone, launch batch), for the nodes that have one

    def start(self, node: str, name: str, run_id: str, grace_s: float) -> ManagerHandle: ...

    def end(self, handle: ManagerHandle) -> None: ...
