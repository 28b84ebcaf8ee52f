"""Where a run's stage actors may run on Ray: one placement group per actor, and what is free.

Owns: the reservation of every stage actor (a placement group of one bundle of its own), where
each is placed, the node each new reservation aims for (:func:`choose_nodes`, pure: a replica's
stages packed onto few nodes for ``PACK``, one per node for ``SPREAD``), making a lost actor's
reservation afresh (:meth:`Reservations.renew`), Ray's view of the free room
(:meth:`Reservations.free_slots`), which replicas cannot be placed now, and saying what capacity is
missing. Every wait has a deadline: a placement not done within ``PLACE_S`` raises
:class:`~elastic_llm.controller.ports.CapacityUnavailable` (the controller then shrinks or waits).
Never starts an actor (:mod:`.actors` does) and never decides which replicas to place.

Why one group per actor, not one per replica: a group whose node died while other bundles of it
live, or whose only bundle's node died, is re-placed by Ray's GCS in a loop that holds a core at
100% for as long as there is no room (measured on Ray 2.60: 15 s of GCS CPU in 15 s, and the
driver's calls to the GCS time out); a group that is new and waits for room costs nothing. So no
group of the run outlives its node: the group of an actor lost with its node, of an actor moved
off a draining node, of a dropped replica, is removed at once and a new one made where needed.
A group of one bundle can be released without touching any other actor. Locality is kept by
aiming each new group at a node (``STRICT_PACK`` with a soft target: if that node has filled up
meanwhile, Ray places it elsewhere).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from elastic_llm.clock import Clock
from elastic_llm.config import RunConfig
from elastic_llm.controller.states import Capacity
from elastic_llm.lease import group_prefix
from elastic_llm.snapshot.records import ShardKey

log = logging.getLogger("elastic_llm.runtime")
PLACE_S = 5.0  # how long a placement may stay pending before the run waits for capacity instead
RESCHEDULING = "RESCHEDULING"  # Ray's state of a group whose node died


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


def choose_nodes(free: Mapping[str, int], n: int, spread: bool, prefer: Sequence[str] = ()) -> list[str | None]:
    """The node each of ``n`` new bundles aims for (pure), given each node's free slots: nodes in
    ``prefer`` first (where the replica's other stages run), then the roomiest (ties by id).
    Packed: fill a node before the next; spread: one bundle per node, round after round. A bundle
    with no free slot left anywhere gets None (Ray places it wherever room appears)."""
    left = {node: slots for node, slots in free.items() if slots > 0}
    order = [p for p in dict.fromkeys(prefer) if p in left]
    order += sorted((node for node in left if node not in order), key=lambda node: (-left[node], node))
    out: list[str | None] = []
    while len(out) < n and order:
        if spread:
            for node in list(order):
                if len(out) == n:
                    break
                out.append(node)
                left[node] -= 1
                if not left[node]:
                    order.remove(node)
        else:
            node = order[0]
            take = min(left[node], n - len(out))
            out += [node] * take
            order.pop(0)
    return out + [None] * (n - len(out))


def kill_actor(handle: Any) -> None:
    """End an actor; one already gone is fine, anything else is logged with its cause."""
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except ray.exceptions.ActorHandleNotFoundError:  # of an earlier Ray session: nothing to end
        pass
    except Exception as e:  # noqa: BLE001 - ending an actor must not stop a shutdown or a recovery; said, not swallowed
        log.warning("actor %r not ended: %s: %s", handle, type(e).__name__, e)


class Reservations:
    """The one-bundle placement groups of the run's stage actors (``groups``), made like
    ``bundle``; spares' groups are made here and handed over when a spare is adopted."""

    def __init__(self, cfg: RunConfig, clock: Clock, run_id: str = "") -> None:
        self.cfg = cfg
        self.clock = clock
        # recovery.driver_grace_s > 0: the groups outlive the driver with the run's stage actors,
        # named so that leases find them (see elastic_llm.lease) and unique to this driver
        self.detached = cfg.outlives_driver and bool(run_id)
        self.name_prefix = f"{group_prefix(run_id)}{secrets.token_hex(3)}."
        self.made = 0
        self.stages = cfg.parallel.stages
        self.spread = cfg.parallel.placement_strategy in ("SPREAD", "STRICT_SPREAD")
        self.groups: dict[ShardKey, Any] = {}  # the reservation of each actor of the width

    @property
    def bundle(self) -> dict[str, float]:
        par = self.cfg.parallel
        b = {"CPU": par.cpus_per_actor}
        if par.gpus_per_actor:
            b["GPU"] = par.gpus_per_actor
        return b

    # ------------------------------------------------------------------ making groups
    def free_per_node(self, avoid: frozenset[str] = frozenset()) -> dict[str, int]:
        """How many more bundles like a stage actor's each live node not in ``avoid`` has room
        for now, by Ray's view of available resources (no waiting, no reservation)."""
        import ray

        out = {}
        for node, free in ray._private.state.state.available_resources_per_node().items():
            if node in avoid:
                continue
            n = int(free.get("CPU", 0.0) // self.bundle["CPU"] + 1e-9)
            if "GPU" in self.bundle:
                n = min(n, int(free.get("GPU", 0.0) // self.bundle["GPU"] + 1e-9))
            out[node] = n
        return out

    def free_slots(self, avoid: frozenset[str] = frozenset()) -> int:
        return sum(self.free_per_node(avoid).values())

    def make(self, n: int, avoid: frozenset[str] = frozenset(), prefer: Sequence[str] = ()) -> list[Any]:
        """``n`` new one-bundle groups, aimed at nodes not in ``avoid`` (returns at once; Ray
        places each when there is room)."""
        from ray.util.placement_group import placement_group

        targets = choose_nodes(self.free_per_node(avoid), n, self.spread, prefer)
        out = []
        for t in targets:
            self.made += 1
            named = {"name": f"{self.name_prefix}{self.made}", "lifetime": "detached"} if self.detached else {}
            out.append(placement_group([dict(self.bundle)], strategy="STRICT_PACK", _soft_target_node_id=t, **named))
        return out

    def ensure(self, width: int, avoid: frozenset[str] = frozenset()) -> None:
        """Every actor of the first ``width`` replicas has a group (new ones packed per replica)."""
        for r in range(width):
            missing = [ShardKey(s, r) for s in range(self.stages) if ShardKey(s, r) not in self.groups]
            if missing:
                for key, pg in zip(missing, self.make(len(missing), avoid, self.homes(r, avoid))):
                    self.groups[key] = pg

    def homes(self, replica: int, avoid: frozenset[str] = frozenset()) -> list[str]:
        """Nodes not in ``avoid`` that the placed groups of ``replica`` are on (where its new ones should go first)."""
        where = self.nodes_of([pg for k, pg in sorted(self.groups.items()) if k.replica == replica])
        return [n for n in where.values() if n and n not in avoid]

    # ------------------------------------------------------------------ where they are
    def table(self) -> dict[str, dict[str, Any]]:
        """Ray's placement group table, by group id (one GCS call)."""
        from ray.util.placement_group import placement_group_table

        return placement_group_table()

    def nodes_of(self, pgs: Iterable[Any], table: dict[str, dict[str, Any]] | None = None) -> dict[Any, str | None]:
        """The node each one-bundle group of ``pgs`` is placed on (None: not placed)."""
        table = self.table() if table is None else table
        out = {}
        for pg in pgs:
            row = table.get(pg.id.hex(), {})
            out[pg] = None if row.get("state") == RESCHEDULING else (row.get("bundles_to_node_id", {}).get(0) or None)
        return out

    def node_of(self, pg: Any) -> str | None:
        return self.nodes_of([pg])[pg]

    def bundle_nodes(self, keys: list[ShardKey]) -> dict[ShardKey, str | None]:
        """Where the reservation of each of ``keys`` is placed now (None: not placed, or none yet). No waiting."""
        where = self.nodes_of(self.groups[k] for k in keys if k in self.groups)
        return {k: where[self.groups[k]] if k in self.groups else None for k in keys}

    def unplaced(self, replicas: Iterable[int], wait_s: float) -> set[int]:
        """Those of ``replicas`` with a reservation still not placed after up to ``wait_s`` seconds (one deadline for all)."""
        deadline = self.clock.monotonic() + wait_s
        pending = set(replicas)
        while True:
            pending = {r for r in pending if any(n is None for n in self.bundle_nodes([ShardKey(s, r) for s in range(self.stages)]).values())}
            if not pending or self.clock.monotonic() >= deadline:
                return pending
            self.clock.sleep(0.1)

    def lost(self, pgs: Iterable[Any]) -> list[Any]:
        """Those of ``pgs`` whose node died (Ray is re-placing them: see the module's opening)."""
        table = self.table()
        return [pg for pg in pgs if table.get(pg.id.hex(), {}).get("state") == RESCHEDULING]

    # ------------------------------------------------------------------ renewing
    def renew(self, keys: list[ShardKey], avoid: frozenset[str] = frozenset()) -> list[ShardKey]:
        """Lost actors whose group went with its node, or sits on a node of ``avoid`` (an actor
        given up at a drain), get a new group (the old one removed, the new one aimed near the
        replica's other stages, off ``avoid``). Returns those keys."""
        lost = set(self.lost([self.groups[k] for k in keys if k in self.groups]))
        where = self.bundle_nodes([k for k in keys if k in self.groups]) if avoid else {}
        renewed = [k for k in keys if self.groups.get(k) in lost or where.get(k) in avoid]
        for key in renewed:
            remove_group(self.groups.pop(key))
        for key in renewed:
            self.groups[key], = self.make(1, avoid, self.homes(key.replica, avoid))
        return renewed

    def unplaceable(self, replicas: Iterable[int], avoid: frozenset[str] = frozenset(), wait_s: float = PLACE_S) -> set[int]:
        """Those of ``replicas`` whose lost bundles cannot be placed, decided from Ray's view at
        once: bundles still pending when the free room of the live nodes (not in ``avoid``) cannot
        hold them are unplaceable now; when the room is there, Ray is placing them and they get up
        to ``wait_s``."""
        pending = self.unplaced(replicas, 0)
        if not pending:
            return set()
        missing = sum(1 for n in self.bundle_nodes([ShardKey(s, r) for r in pending for s in range(self.stages)]).values() if n is None)
        if self.free_slots(avoid) < missing:
            return pending
        return self.unplaced(pending, wait_s)

    def capacity(self, width: int, replicas: int | None = None, standbys: tuple[int, int] | None = None) -> Capacity:
        """What is missing: bundles not placed (all of them before the first placement; or a
        whole ``replicas`` more, when asked about growing) and what the cluster has free."""
        import ray

        if replicas is not None:
            missing = replicas * self.stages
        else:
            keys = [ShardKey(s, r) for r in range(width) for s in range(self.stages)]
            missing = sum(1 for n in self.bundle_nodes(keys).values() if n is None)
        free = ray.available_resources()
        nodes = sum(1 for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0)
        have = f"{free.get('CPU', 0.0):g} CPUs free on {nodes} node{'s' if nodes != 1 else ''}"
        if "GPU" in self.bundle:
            have += f", {free.get('GPU', 0.0):g} GPUs free"
        if standbys is not None:
            ready, starting = standbys
            have += f", {ready} warm standby process{'es' if ready != 1 else ''}" + (f" ({starting} starting)" if starting else "")
        return Capacity(f"{missing} x {_fmt(self.bundle)}", have)

    # ------------------------------------------------------------------ releasing
    def release(self, key: ShardKey) -> None:
        if key in self.groups:
            remove_group(self.groups.pop(key))

    def drop(self, r: int) -> None:
        """Release replica ``r``'s groups and shift the later ones down."""
        for s in range(self.stages):
            self.release(ShardKey(s, r))
        self.groups = {(ShardKey(k.stage, k.replica - 1) if k.replica > r else k): pg for k, pg in self.groups.items()}

    def release_all(self) -> None:
        for pg in self.groups.values():
            remove_group(pg)
        self.groups = {}
