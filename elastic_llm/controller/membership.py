"""The run's membership table: one for both runtimes.

Owns: which stage actors make up the run (``width`` replicas of ``stages`` stages, keyed by
:class:`~elastic_llm.snapshot.records.ShardKey`), the node each runs on, which have answered
since they were started (``ready``), which are a late stage spare that took a lost key's place
and has no state yet (``fresh``: when its process is up), and the per-actor columns a runtime
keeps beside them (Ray: handles, pids, devices, placement groups; simulated: the step each
holds). And every change of it: hosting a key on a node, adding a replica, dropping replicas
and renumbering the rest in order, borrowing a dropped replica's actors for a kept one's lost
keys, and installing a spare as a key's actor. Each change moves every column with its key, so
no runtime renumbers its own tables.

Also the read-only view both runtimes' stage actors give of it (:class:`Members`) and the book
of spares they have started and not installed yet (:class:`SpareBook`).

Pure bookkeeping: it starts, kills and places nothing, and answers no question about liveness;
:mod:`elastic_llm.runtime.actors` (Ray) and :mod:`elastic_llm.sim.actors` (simulated time) do
that and keep one of these. ``on_host`` tells a runtime each change of a key's node (the
simulation counts the actors per node with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Generic, TypeVar

from elastic_llm.snapshot.records import ShardKey

T = TypeVar("T")
R = TypeVar("R")
M = TypeVar("M", bound="Members")
K = TypeVar("K")


class Column(MutableMapping[ShardKey, T]):
    """One per-actor value a runtime keeps (a handle, a pid, the step held), moved with its key
    by every change of the :class:`Membership` it was made by."""

    def __init__(self) -> None:
        self._by_key: dict[ShardKey, T] = {}

    def __getitem__(self, key: ShardKey) -> T:
        return self._by_key[key]

    def __setitem__(self, key: ShardKey, value: T) -> None:
        self._by_key[key] = value

    def __delitem__(self, key: ShardKey) -> None:
        del self._by_key[key]

    def __iter__(self) -> Iterator[ShardKey]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def _move(self, moves: dict[ShardKey, ShardKey], dropped: set[ShardKey]) -> None:
        old = self._by_key
        self._by_key = {moves.get(k, k): v for k, v in old.items() if k not in dropped}


class Membership:
    """``width`` x ``stages`` keys, their nodes, ``ready`` and ``fresh`` keys and the runtime's
    columns (see the module's opening)."""

    def __init__(self, stages: int, width: int, on_host: Callable[[str | None, str | None], None] | None = None) -> None:
        self.stages = stages
        self.width = width
        self.nodes: dict[ShardKey, str] = {}
        self.ready: set[ShardKey] = set()
        self.fresh: dict[ShardKey, float] = {}  # a late stage spare took the key: when its process is up (0.0: unknown, already asked)
        self._columns: list[Column[object]] = []
        self._on_host = on_host

    def column(self) -> Column[T]:
        """A new per-actor column, moved with its keys from now on."""
        col: Column[T] = Column()
        self._columns.append(col)  # type: ignore[arg-type]  # stored without its value type: only moved, never read here
        return col

    def keys(self) -> list[ShardKey]:
        return [ShardKey(s, r) for r in range(self.width) for s in range(self.stages)]

    def replicas_on(self, nodes: Iterable[str]) -> list[int]:
        """Replicas with at least one actor on ``nodes``."""
        on = set(nodes)
        return sorted({k.replica for k, n in self.nodes.items() if n in on and k.replica < self.width})

    def host(self, key: ShardKey, node: str | None) -> None:
        """``key``'s actor runs on ``node`` now (None: on no node: its slot went with it)."""
        old = self.nodes.pop(key, None)
        if node is not None:
            self.nodes[key] = node
        if self._on_host is not None and old != node:
            self._on_host(old, node)

    def forget(self, key: ShardKey) -> None:
        """``key``'s actor is gone (killed, or found dead): not ready, not fresh; its node and
        columns stay until it is replaced or its replica dropped."""
        self.ready.discard(key)
        self.fresh.pop(key, None)

    def add_replica(self, nodes: list[str]) -> int:
        """A started replica (one actor per stage, on ``nodes``) joins as the last; its index."""
        r = self.width
        self.width += 1
        for s, n in enumerate(nodes):
            self.host(ShardKey(s, r), n)
            self.ready.add(ShardKey(s, r))
        return r

    def install(self, key: ShardKey, node: str, up_at: float | None = None) -> None:
        """A stage spare on ``node`` becomes ``key``'s actor: with the old actor's state (a drain's
        swap: ``up_at`` None, it is ready), or in a lost key's place with no state yet (``fresh``:
        its process is up at ``up_at``; the recovery gives it its state)."""
        self.host(key, node)
        if up_at is None:
            self.fresh.pop(key, None)
            self.ready.add(key)
        else:
            self.ready.discard(key)
            self.fresh[key] = up_at

    def borrow(self, pairs: list[tuple[ShardKey, ShardKey]]) -> None:
        """Borrow and merge: each giver's actor (of a replica dropped next) becomes its taker's (a
        lost key of a kept replica), with its node, readiness and every column; whatever the
        taker had is let go (the runtime ended it first)."""
        for giver, taker in pairs:
            self._apply({giver: taker}, {taker})

    def drop_replicas(self, replicas: Iterable[int]) -> dict[int, int]:
        """Remove ``replicas``; the others are renumbered 0..w-1 in their order. Returns old
        replica index -> new one, for the kept."""
        gone = set(replicas)
        kept = [r for r in range(self.width) if r not in gone]
        renumber = {old: new for new, old in enumerate(kept)}
        moves = {ShardKey(s, old): ShardKey(s, new) for old, new in renumber.items() if old != new for s in range(self.stages)}
        self._apply(moves, {ShardKey(s, r) for r in gone for s in range(self.stages)})
        self.width = len(kept)
        return renumber

    def _apply(self, moves: dict[ShardKey, ShardKey], dropped: set[ShardKey]) -> None:
        """Let the ``dropped`` keys' entries go, then move each key in ``moves`` to its new one."""
        if self._on_host is not None:
            for k in sorted(dropped & set(self.nodes)):
                self._on_host(self.nodes[k], None)
        nodes = {moves.get(k, k): n for k, n in self.nodes.items() if k not in dropped}
        ready = {moves.get(k, k) for k in self.ready if k not in dropped}
        fresh = {moves.get(k, k): t for k, t in self.fresh.items() if k not in dropped}
        self.nodes.clear()  # changed in place: a reader holding them (an executor's node_of) sees the change
        self.nodes.update(nodes)
        self.ready.clear()
        self.ready.update(ready)
        self.fresh.clear()
        self.fresh.update(fresh)
        for col in self._columns:
            col._move(moves, dropped)


class Members:
    """The membership as a runtime's stage actors show it (read-only; a mixin of both runtimes'
    groups, which keep their :class:`Membership` as ``table``)."""

    table: Membership

    @property
    def width(self) -> int:
        return self.table.width

    @property
    def nodes(self) -> dict[ShardKey, str]:
        return self.table.nodes

    @property
    def ready(self) -> set[ShardKey]:
        return self.table.ready

    def keys(self) -> list[ShardKey]:
        return self.table.keys()

    def replicas_on(self, nodes: frozenset[str]) -> list[int]:
        """Replicas with at least one actor on ``nodes``."""
        return self.table.replicas_on(nodes)

    # the small ports of :class:`~elastic_llm.controller.ports.StageActors`: each runtime's group
    # implements them all, so each is the group itself, seen through one port
    @property
    def placement(self: M) -> M:
        return self

    @property
    def resize(self: M) -> M:
        return self

    @property
    def state(self: M) -> M:
        return self

    @property
    def handover(self: M) -> M:
        return self

    @property
    def hits(self: M) -> M:
        return self


class SpareBook(Generic[R, K]):
    """Which spares a runtime has started and not yet installed or given up: whole replicas
    (``R``) in the order they were started, single stage spares (``K``) by the key each is for
    (one per key). The bookkeeping of both runtimes' ``Spares``; what a spare is, is theirs."""

    def __init__(self) -> None:
        self._replicas: list[R] = []
        self._stages: dict[ShardKey, K] = {}

    def add_replica(self, spare: R) -> R:
        self._replicas.append(spare)
        return spare

    def add_stage(self, key: ShardKey, spare: K) -> K:
        self._stages[key] = spare
        return spare

    def remove(self, spare: R | K, key: ShardKey | None) -> None:
        """Forget ``spare`` (a stage spare only while it is still its key's)."""
        if key is None:
            self._replicas = [r for r in self._replicas if r is not spare]
        elif self._stages.get(key) is spare:
            del self._stages[key]

    def replicas(self) -> list[R]:
        return list(self._replicas)

    def of(self) -> dict[ShardKey, K]:
        """The stage spares, by the key each is for."""
        return dict(self._stages)
