"""Where a run's stage actors may run on Ray: one placement group per replica, and what is free.

Owns: the reservations of the stage actors (one placement group per data-parallel replica, one
bundle per stage, so a replica can be added, dropped or moved whole; an actor moved alone by a
drain keeps a one-bundle group of its own, or an orphan bundle of its replica's group that no
stage uses any more), where each bundle is placed, moving a lost actor's reservation to an orphan
bundle its replica already holds (:meth:`Reservations.rehome`), Ray's view of the free room
(:meth:`Reservations.free_slots`), which replicas cannot be placed now, and saying what capacity is
missing. Every wait has a deadline: a placement not done within ``PLACE_S`` raises
:class:`~elastic_llm.controller.ports.CapacityUnavailable` (the controller then shrinks or waits).
Never starts an actor (:mod:`.actors` does) and never decides which replicas to place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from elastic_llm.clock import Clock
from elastic_llm.config import RunConfig
from elastic_llm.controller.states import Capacity
from elastic_llm.snapshot.records import ShardKey

log = logging.getLogger("elastic_llm.runtime")
PLACE_S = 5.0  # how long a placement may stay pending before the run waits for capacity instead


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def remove_group(pg: Any) -> None:
    """Release a placement group; one that is already gone (its removal raced a node's end) is
    fine, anything else is logged with its cause."""
    from ray.util import remove_placement_group

    try:
        remove_placement_group(pg)
    except ValueError:  # Ray: "placement group ... does not exist" (already removed)
        pass
    except Exception as e:  # noqa: BLE001 - a release must not stop a shutdown or a resize; said, not swallowed
        log.warning("placement group %s not released: %s: %s", getattr(pg, "id", "?"), type(e).__name__, e)


class Reservations:
    """The placement groups of ``stages`` bundles like ``bundle``, one per replica, and the
    actors moved alone (``patches``)."""

    def __init__(self, cfg: RunConfig, clock: Clock) -> None:
        self.cfg = cfg
        self.clock = clock
        self.stages = cfg.parallel.stages
        self.pgs: list[Any] = []  # one placement group per replica (bundle i: stage i)
        # actors moved alone: their reservation (placement group, bundle): a one-bundle group of their
        # own, or a bundle of their replica's group that no stage uses any more (an "orphan": the
        # bundle of a moved actor, re-placed by Ray once its node went)
        self.patches: dict[ShardKey, tuple[Any, int]] = {}

    @property
    def bundle(self) -> dict[str, float]:
        par = self.cfg.parallel
        b = {"CPU": par.cpus_per_actor}
        if par.gpus_per_actor:
            b["GPU"] = par.gpus_per_actor
        return b

    def new_group(self, bundles: int | None = None, strategy: str | None = None) -> Any:
        from ray.util.placement_group import placement_group

        return placement_group([dict(self.bundle) for _ in range(bundles or self.stages)], strategy=strategy or self.cfg.parallel.placement_strategy)

    def ensure(self, width: int) -> None:
        while len(self.pgs) < width:
            self.pgs.append(self.new_group())

    def reservation(self, key: ShardKey) -> tuple[Any, int]:
        """(placement group, bundle index) that reserves ``key``'s resources."""
        if key in self.patches:
            return self.patches[key]
        return self.pgs[key.replica], key.stage

    def orphans(self, replica: int) -> list[int]:
        """Bundles of ``replica``'s placement group that reserve no actor (their actor moved
        alone): room the run already holds, for moving another of the replica's actors."""
        used = {self.reservation(ShardKey(s, replica)) for s in range(self.stages)}
        pg = self.pgs[replica]
        return [i for i in range(self.stages) if (pg, i) not in used]

    def bundle_nodes_of(self, pg: Any) -> dict[int, str]:
        from ray.util.placement_group import placement_group_table

        return {i: n for i, n in placement_group_table(pg).get("bundles_to_node_id", {}).items() if n}

    def bundle_nodes(self, keys: list[ShardKey]) -> dict[ShardKey, str | None]:
        """Where the bundle (the reservation) of each of ``keys`` is placed now (None: not placed). No waiting."""
        tables: dict[Any, dict[int, str]] = {}
        out: dict[ShardKey, str | None] = {}
        for k in keys:
            if k.replica >= len(self.pgs):
                out[k] = None
                continue
            pg, i = self.reservation(k)
            if pg.id not in tables:
                tables[pg.id] = self.bundle_nodes_of(pg)
            out[k] = tables[pg.id].get(i)
        return out

    def unplaced(self, replicas: Iterable[int], wait_s: float) -> set[int]:
        """Those of ``replicas`` with a reservation still not placed after up to ``wait_s`` seconds (one deadline for all)."""
        deadline = self.clock.monotonic() + wait_s
        pending = set(replicas)
        while True:
            pending = {r for r in pending if any(n is None for n in self.bundle_nodes([ShardKey(s, r) for s in range(self.stages)]).values())}
            if not pending or self.clock.monotonic() >= deadline:
                return pending
            self.clock.sleep(0.1)

    def rehome(self, keys: list[ShardKey], avoid: frozenset[str] = frozenset()) -> list[ShardKey]:
        """Lost actors whose reservation is not placed (its node went) take a placed orphan bundle
        of their replica's group instead, where there is one on a node not in ``avoid``: room the
        run already holds. Changes only which bundle reserves which actor; returns the keys moved."""
        moved = []
        where = self.bundle_nodes([k for k in keys if k.replica < len(self.pgs)])
        for key in keys:
            if key.replica >= len(self.pgs) or where.get(key):
                continue
            pg = self.pgs[key.replica]
            placed = self.bundle_nodes_of(pg)
            spare = next((i for i in self.orphans(key.replica) if placed.get(i) and placed[i] not in avoid), None)
            if spare is None:
                continue
            previous = self.patches.get(key)
            self.patches[key] = (pg, spare)
            if previous is not None and previous[0] is not pg:
                remove_group(previous[0])
            moved.append(key)
        return moved

    def placed_orphans(self, replica: int, avoid: frozenset[str] = frozenset()) -> int:
        """Orphan bundles of ``replica``'s group placed on live nodes not in ``avoid``."""
        where = self.bundle_nodes_of(self.pgs[replica])
        return sum(1 for i in self.orphans(replica) if where.get(i) and where[i] not in avoid)

    def free_slots(self, avoid: frozenset[str] = frozenset()) -> int:
        """How many more bundles like a stage actor's the live nodes not in ``avoid`` have free
        room for now, by Ray's view of available resources (no waiting, no reservation)."""
        import ray

        fit = 0
        for node, free in ray._private.state.state.available_resources_per_node().items():
            if node in avoid:
                continue
            n = int(free.get("CPU", 0.0) // self.bundle["CPU"] + 1e-9)
            if "GPU" in self.bundle:
                n = min(n, int(free.get("GPU", 0.0) // self.bundle["GPU"] + 1e-9))
            fit += n
        return fit

    def unplaceable(self, replicas: Iterable[int], avoid: frozenset[str] = frozenset(), wait_s: float = PLACE_S) -> set[int]:
        """Those of ``replicas`` whose lost bundles cannot be placed, decided from Ray's view at
        once: bundles still pending when the free room of the live nodes (not in ``avoid``) cannot
        hold them are unplaceable now; when the room is there, Ray is placing them and they get up
        to ``wait_s`` (a strict placement strategy may still refuse)."""
        pending = self.unplaced(replicas, 0)
        if not pending:
            return set()
        missing = sum(1 for n in self.bundle_nodes([ShardKey(s, r) for r in pending for s in range(self.stages)]).values() if n is None)
        if self.free_slots(avoid) < missing:
            return pending
        return self.unplaced(pending, wait_s)

    def capacity(self, width: int, keys: list[ShardKey], replicas: int | None = None, standbys: tuple[int, int] | None = None) -> Capacity:
        """What is missing: bundles not placed (all of them before the first placement; or a
        whole ``replicas`` more, when asked about growing) and what the cluster has free."""
        import ray

        if replicas is not None:
            missing = replicas * self.stages
        else:
            missing = (width - len(self.pgs)) * self.stages
            missing += sum(1 for n in self.bundle_nodes([k for k in keys if k.replica < len(self.pgs)]).values() if n is None)
        free = ray.available_resources()
        nodes = sum(1 for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0)
        have = f"{free.get('CPU', 0.0):g} CPUs free on {nodes} node{'s' if nodes != 1 else ''}"
        if "GPU" in self.bundle:
            have += f", {free.get('GPU', 0.0):g} GPUs free"
        if standbys is not None:
            ready, starting = standbys
            have += f", {ready} warm standby process{'es' if ready != 1 else ''}" + (f" ({starting} starting)" if starting else "")
        return Capacity(f"{missing} x {_fmt(self.bundle)}", have)

    def drop(self, r: int) -> None:
        """Release replica ``r``'s groups (its own and its moved actors') and shift the later ones down."""
        own = [self.patches.pop(ShardKey(s, r))[0] for s in range(self.stages) if ShardKey(s, r) in self.patches]
        for pg in {id(p): p for p in [self.pgs[r], *own]}.values():
            remove_group(pg)
        del self.pgs[r]
        moved = {(ShardKey(k.stage, k.replica - 1) if k.replica > r else k): v for k, v in self.patches.items() if k.replica != r}
        self.patches = moved

    def release_all(self) -> None:
        for pg in {id(p): p for p in [*self.pgs, *(pg for pg, _ in self.patches.values())]}.values():
            remove_group(pg)
        self.pgs, self.patches = [], {}
