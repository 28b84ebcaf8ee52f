"""Spares on Ray: stage actors started in the background ahead of a need.

Owns: spare replicas (one placement group per stage; a grow, or a drain's whole-replica move)
and stage spares (one actor for one key elsewhere: a drain's per-stage move), from their
reservation to the moment they start; the :class:`~elastic_llm.controller.ports.Spares` port on
Ray. Queries are pure (a spare's readiness, nodes, age); :meth:`RaySpares.tend` is the one call
that gives a placed spare its actors (a warm standby of its node where one is ready, else a new
process) and starts over, off the nodes to avoid and near its replica, one whose node went.
Installing a started spare in the width (adopting a replica, swapping stage spares in, a late
stage spare taking a lost key) changes the membership: :mod:`.actors` does it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from elastic_llm.clock import Clock
from elastic_llm.controller.membership import SpareBook
from elastic_llm.controller.ports import SpareRef
from elastic_llm.runtime.placement import Reservations, kill_actor, remove_group
from elastic_llm.snapshot.records import ShardKey


@dataclass(eq=False)
class Spare:
    """A replica started in the background: its placement groups (one per stage) and, once they
    are placed and tended, its actors (warm standbys adopted on the bundles' nodes, or new
    processes) and the calls that answer when they have started."""

    pgs: tuple[Any, ...]
    started: float  # Clock.monotonic
    actors: tuple[Any, ...] = ()
    infos: tuple[Any, ...] = ()
    adopted: int = 0  # how many of its actors are adopted standbys
    key: ShardKey | None = None  # a whole replica: no key of its own


@dataclass(eq=False)
class StageSpare:
    """One stage actor started in the background to take over ``key`` (a per-stage drain move):
    its one-bundle placement group and, once placed and tended, its actor and the call that
    answers once it has started."""

    key: ShardKey
    pg: Any
    started: float
    actor: Any = None
    info: Any = None
    adopted: bool = False


def own(spare: SpareRef) -> Spare | StageSpare:
    """A spare the controller hands back, as the Ray one it is."""
    if not isinstance(spare, (Spare, StageSpare)):
        raise TypeError(f"not a spare of a Ray run: {spare!r}")
    return spare


class Owner(Protocol):
    """What the spares need of the :class:`~elastic_llm.runtime.actors.ActorGroup` they belong to."""

    clock: Clock
    stages: int
    slots: Reservations

    @property
    def width(self) -> int: ...
    def fill(self, pgs: tuple[Any, ...], keys: list[ShardKey], width: int) -> list[tuple[Any, Any, bool]]: ...


class RaySpares(SpareBook[Spare, StageSpare]):
    """The spares of one :class:`~elastic_llm.runtime.actors.ActorGroup`."""

    def __init__(self, group: Owner) -> None:
        super().__init__()
        self.group = group

    def start(self, key: ShardKey | None = None, avoid: frozenset[str] = frozenset()) -> Spare | StageSpare:
        """Reserve room for a whole replica (``key`` None) or for one more actor of ``key``, off
        ``avoid`` (and, for a key, near its replica's other stages); nothing waits. Ray places no
        new bundle on a draining node either."""
        g = self.group
        now = g.clock.monotonic()
        if key is None:
            return self.add_replica(Spare(tuple(g.slots.make(g.stages, avoid)), now))
        return self.add_stage(key, StageSpare(key, g.slots.make(1, avoid, g.slots.homes(key.replica, avoid))[0], now))

    def tend(self, avoid: frozenset[str] = frozenset()) -> None:
        """Give each placed spare its actors, and start over (off ``avoid``, a stage spare near
        its replica) each one whose node went. The one call here that starts anything."""
        g = self.group
        for spare in self.replicas():
            lost = set(g.slots.lost(spare.pgs))
            if lost:
                self._end(spare.actors, lost)
                spare.pgs = tuple(pg if pg not in lost else g.slots.make(1, avoid)[0] for pg in spare.pgs)
                spare.actors, spare.infos, spare.adopted = (), (), 0
            if not spare.actors and all(n is not None for n in g.slots.nodes_of(spare.pgs).values()):
                made = g.fill(spare.pgs, [ShardKey(s, g.width) for s in range(g.stages)], g.width + 1)
                spare.actors, spare.infos = tuple(a for a, _, _ in made), tuple(i for _, i, _ in made)
                spare.adopted = sum(1 for _, _, ad in made if ad)
        for stage in self.of().values():
            if g.slots.lost([stage.pg]):
                self._end((stage.actor,) if stage.actor is not None else (), {stage.pg})
                stage.pg = g.slots.make(1, avoid, g.slots.homes(stage.key.replica, avoid))[0]
                stage.actor, stage.info, stage.adopted = None, None, False
            self.fill_stage(stage)

    def fill_stage(self, stage: StageSpare) -> None:
        """Give a placed stage spare its actor if it has none (it starts now)."""
        g = self.group
        if stage.actor is None and g.slots.node_of(stage.pg) is not None:
            (stage.actor, stage.info, stage.adopted), = g.fill((stage.pg,), [stage.key], g.width)

    @staticmethod
    def _end(actors: tuple[Any, ...], groups: set[Any]) -> None:
        for a in actors:
            kill_actor(a)
        for pg in groups:
            remove_group(pg)

    def ready(self, ref: SpareRef) -> bool:
        """Whether every actor of ``spare`` has started (no waiting, nothing started)."""
        import ray

        spare = own(ref)
        calls = list(spare.infos) if isinstance(spare, Spare) else [spare.info] if spare.info is not None else []
        if not calls:
            return False
        done, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
        return len(done) == len(calls)

    def nodes(self, ref: SpareRef) -> frozenset[str]:
        """The nodes its bundles are placed on (empty while unplaced)."""
        spare = own(ref)
        pgs = spare.pgs if isinstance(spare, Spare) else (spare.pg,)
        return frozenset(n for n in self.group.slots.nodes_of(pgs).values() if n)

    def age(self, ref: SpareRef) -> float:
        return self.group.clock.monotonic() - own(ref).started

    def cancel(self, ref: SpareRef) -> None:
        """Stop its actors and release its placement groups."""
        spare = own(ref)
        self.remove(spare, spare.key)
        if isinstance(spare, Spare):
            self._end(spare.actors, set(spare.pgs))
        else:
            self._end((spare.actor,) if spare.actor is not None else (), {spare.pg})

    def taken(self, ref: SpareRef) -> None:
        """``spare`` was installed in the width (its actors and groups are the run's now)."""
        spare = own(ref)
        self.remove(spare, spare.key)
