"""The stage actors of a simulated run: the :class:`~elastic_llm.controller.ports.StageActors`
primitives (and its small ports, :class:`SimSpares` the ``Spares`` one) on the fleet's actor
slots, in simulated time, with the same :class:`~elastic_llm.controller.membership.Membership`
table as on Ray.

Owns: where each actor runs (an actor slot of a live node; nodes under notice take nothing new),
the actors' processes (a start takes the cost model's ``actor_start_s``, a warm standby's
adoption ``adopt_s``), spares started in the background (placed when there is room, ready once
their processes have started), the step each actor holds, and the primitives that move state
(copies between actors over the network, loads from the snapshot managers' pieces or the durable
tier), each taking the cost model's time. As on Ray, a primitive succeeds only if the actors and
nodes it involves are alive when it ends: one whose node went meanwhile raises :class:`SimLost`
(one of the runtime's ``errors``), and the controller recovers. Never decides anything: the
orchestration above the ports (:mod:`elastic_llm.controller`) is the same code that runs on Ray.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.controller.membership import Column, Members, Membership, SpareBook
from elastic_llm.controller.ports import RESET_S, CapacityUnavailable, PlanNotFollowed, SpareRef, Standbys, Roster
from elastic_llm.controller.states import Capacity
from elastic_llm.shape import count_parameters
from elastic_llm.sim.costs import MB
from elastic_llm.sim.world import SimRef, World
from elastic_llm.snapshot.coordinator import StageMember
from elastic_llm.snapshot.records import Piece, ShardKey, StageSource
from elastic_llm.spans import Spans


class SimLost(RuntimeError):
    """A simulated actor or node that an operation involved was gone when it ended (as Ray's
    ``RayActorError``: the controller observes and recovers)."""


@dataclass(eq=False)
class SimSpare:
    """A spare replica (``key`` None) or stage spare started in the background."""

    key: ShardKey | None
    slots: int  # actor slots it needs (a replica: one per stage)
    started: float
    nodes: list[str] = field(default_factory=list)  # where it was placed (empty while waiting for room)
    ready_s: float = float("inf")  # when its processes have started


class SimActors(Members):
    """``actors[replica][stage]`` (each a :class:`ShardKey`) on the fleet's slots."""

    def __init__(self, cfg: RunConfig, world: World, standbys: Standbys | None) -> None:
        self.cfg, self.world, self.standbys = cfg, world, standbys
        self.charged = world.charged
        self.stages = cfg.parallel.stages
        self.table = Membership(self.stages, cfg.parallel.dp, on_host=self._count)  # width, nodes, ready, fresh (late stage spares: when their process is up)
        self.spawned = False
        self.pids: Column[int] = self.table.column()
        self.at: Column[int | None] = self.table.column()  # the step each actor's state is at (None: a new, empty one)
        self.off: Column[frozenset[str]] = self.table.column()  # lost actors renewed off nodes to avoid: their next slot is not there
        self.spares = SimSpares(self)  # replicas and single stages started in the background, not yet in the width
        self.spans = Spans(world.clock.perf_counter)
        self.parameters = count_parameters(cfg.model.shape())
        self._members: tuple[tuple[tuple[ShardKey, str], ...], list[StageMember]] = ((), [])

    @property
    def fresh(self) -> dict[ShardKey, float]:
        return self.table.fresh


    @property
    def actors(self) -> list[list[object]]:
        """``[replica][stage]``: each actor is its key here; empty until spawned."""
        return [[ShardKey(s, r) for s in range(self.stages)] for r in range(self.width)] if self.spawned else []

    def _count(self, old: str | None, new: str | None) -> None:
        """The actors per node (the world's ``host_counts``) follow each change of a key's node."""
        if old is not None:
            self.world.host_counts[old] -= 1
        if new is not None:
            self.world.host_counts[new] += 1

    # ------------------------------------------------------------------ slots
    def _used(self) -> dict[str, int]:
        used = dict(self.world.host_counts)
        for sp in [*self.spares.replicas(), *self.spares.of().values()]:
            for n in sp.nodes:
                used[n] = used.get(n, 0) + 1
        return used

    def _free(self, avoid: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """(node, free slots) of the live nodes not under notice and not in ``avoid``, by node id."""
        fleet, used = self.world.fleet, self._used()
        draining = fleet.draining()
        return [(n, x.slots - used.get(n, 0)) for n, x in sorted(fleet.nodes.items())
                if x.alive and n not in draining and n not in avoid and x.slots > used.get(n, 0)]

    def _pool(self) -> Standbys | None:
        """The warm standbys, if the run keeps any."""
        return self.standbys if self.standbys is not None and self.standbys.enabled else None

    def _take(self, count: int, avoid: frozenset[str] = frozenset(), first: dict[str, int] | None = None) -> list[str]:
        """``count`` slots packed onto the fewest nodes (after one slot per warm standby ready on
        a node with room, in ``first``: there a standby becomes the actor); CapacityUnavailable if
        there are fewer."""
        out: list[str] = []
        if count <= 0:
            return out
        free = self._free(avoid)
        if first:
            left = dict(free)
            for n, f in free:
                take = min(f, first.get(n, 0), count - len(out))
                out += [n] * take
                left[n] -= take
            free = [(n, f) for n, f in left.items() if f > 0]
            if len(out) == count:
                return out
        for n, f in free:
            out += [n] * min(f, count - len(out))
            if len(out) == count:
                return out
        raise CapacityUnavailable(self.capacity(count))

    def _off(self, keys: list[ShardKey]) -> frozenset[str]:
        """The nodes the slots of ``keys`` are taken off (those renewed off nodes to avoid)."""
        return frozenset().union(*(self.off.get(k, frozenset()) for k in keys))

    def _homeless(self, keys: list[ShardKey]) -> list[ShardKey]:
        fleet = self.world.fleet
        return [k for k in keys if k not in self.nodes or not fleet.is_alive(self.nodes[k])]

    def _gone(self, nodes: Iterable[str]) -> list[str]:
        """Those of ``nodes`` removed by now (an operation that ends now involved them)."""
        fleet, now = self.world.fleet, self.world.clock.now
        return sorted({n for n in nodes if fleet.removed_by(n, now)})

    def _check(self, what: str, nodes: Iterable[str]) -> None:
        gone = self._gone(nodes)
        if gone:
            raise SimLost(f"simulated: {what} failed: node {gone[0]} went before it ended")

    def free_slots(self, avoid: frozenset[str] = frozenset()) -> int:
        with self.charged:
            return sum(f for _, f in self._free(avoid))

    def free_per_node(self, avoid: frozenset[str] = frozenset()) -> dict[str, int]:
        with self.charged:
            return dict(self._free(avoid))

    def place(self, at_once: bool = False, avoid: frozenset[str] = frozenset()) -> None:
        with self.charged:
            need = len(self._homeless(self.keys()))
            if need > sum(f for _, f in self._free(avoid)):
                raise CapacityUnavailable(self.capacity(need))

    def placed(self) -> bool:
        with self.charged:
            return len(self._homeless(self.keys())) <= sum(f for _, f in self._free())

    def capacity(self, replicas: int | None = None) -> Capacity:
        need = replicas * self.stages if replicas is not None else len(self._homeless(self.keys())) or self.stages * self.width
        alive = self.world.fleet.alive()
        return Capacity(need=f"{need} actor slot(s)", have=f"{sum(f for _, f in self._free())} free slot(s) on {len(alive)} live node(s)")

    def bundle_nodes(self, keys: list[ShardKey]) -> dict[ShardKey, str | None]:
        """Where each of ``keys`` would start: its own node if it lives, else the next free slot."""
        with self.charged:
            homeless = self._homeless(keys)
            try:
                pool = self._pool()
                slots = iter(self._take(len(homeless), self._off(homeless), first=pool.ready() if pool is not None else None))
            except CapacityUnavailable:
                return {k: self.nodes.get(k) for k in keys if k not in homeless}
            return {k: next(slots) if k in homeless else self.nodes[k] for k in keys}

    def renew(self, keys: list[ShardKey], avoid: frozenset[str] = frozenset()) -> list[ShardKey]:
        """A slot is taken when its actor starts (:meth:`bundle_nodes`) and none outlives its node;
        a lost actor's slot on a node of ``avoid`` (given up at a drain, or suspect) is let go, and
        its next one is taken off ``avoid`` (as Ray's new placement group for it is made)."""
        with self.charged:
            renewed = [k for k in keys if self.nodes.get(k) in avoid]
            for k in renewed:
                self.table.host(k, None)
                self.off[k] = avoid
            return renewed

    # ------------------------------------------------------------------ actors
    def _start_time(self, keys: list[ShardKey], adopt: dict[ShardKey, str]) -> float:
        c, now = self.world.costs, self.world.clock.now
        return max((max(0.0, self.fresh[k] - now) if k in self.fresh else c.adopt_s if adopt.get(k) else c.actor_start_s for k in keys), default=0.0)

    def spawn_all(self) -> None:
        with self.charged:
            keys = self.keys()
            for k, n in zip(keys, self._take(len(keys))):
                self.table.host(k, n)
            self.spawned = True
            for k in keys:
                self.pids[k], self.at[k] = 1, 0
        self.world.clock.sleep(self.world.costs.actor_start_s)
        self._check("starting the stage actors", [self.nodes[k] for k in keys])
        self.table.ready |= set(keys)
        self._shard_size()

    def replace(self, keys: list[ShardKey], adopt: dict[ShardKey, str] | None = None, meanwhile: Callable[[], None] | None = None) -> None:
        """New processes for ``keys`` (a standby's where the plan adopts one); the clock moves by
        the slowest start, a second at a time with ``meanwhile`` called after each; an actor whose
        node went meanwhile did not start."""
        adopt = adopt or {}
        with self.charged:
            homeless = self._homeless(keys)
            free = dict(self._free())
            for k in homeless:  # an adopted standby's actor runs on its node when a slot is free there
                node = adopt.get(k)
                if node is not None and free.get(node, 0) > 0:
                    self.table.host(k, node)
                    free[node] -= 1
            homeless = self._homeless(homeless)
            slots = iter(self._take(len(homeless), self._off(homeless)))
            for k in keys:
                self.table.host(k, next(slots) if k in homeless else self.nodes[k])
                self.off.pop(k, None)
                self.table.ready.discard(k)
                self.at[k] = None
                if k in self.fresh:
                    continue
                node = adopt.get(k)
                if node is not None and (self.standbys is None or self.standbys.take(node) is None):
                    raise PlanNotFollowed(f"the plan has {k} adopt a warm standby on node {node}, but none is left there")
        with self.spans.span("actor"):
            clock = self.world.clock
            end = clock.now + self._start_time(keys, adopt)
            while clock.now < end:
                clock.sleep(min(1.0, end - clock.now))
                if meanwhile is not None and clock.now < end:
                    meanwhile()
        for k in keys:
            self.table.fresh.pop(k, None)
        self._check("starting replacement actors", [self.nodes[k] for k in keys])
        self.table.ready |= set(keys)

    def kill(self, key: ShardKey) -> None:
        self.table.forget(key)

    def reset_survivors(self, alive_nodes: set[str]) -> dict[ShardKey, int | None]:
        """As on Ray: each ready actor on a live node answers with its completed steps; one on a
        node cut off from the driver does not, so the ask waits its :data:`~elastic_llm.controller.ports.RESET_S` and counts
        it lost (no longer ready)."""
        with self.charged:
            asked = [k for k in self.keys() if k in self.ready and self.nodes.get(k) in alive_nodes]
            silent = {k for k in asked if self.world.fleet.cut_off(self.nodes[k])}
            if silent:
                self.world.clock.sleep(RESET_S)
                self.table.ready -= silent
            return {k: (self.at.get(k) if k in asked and k not in silent else None) for k in self.keys()}

    def borrow(self, pairs: list[tuple[ShardKey, ShardKey]]) -> None:
        """Each giver's actor (its node slot, state and step) becomes the taker's."""
        with self.charged:
            for _, taker in pairs:
                self.kill(taker)
            self.table.borrow(pairs)

    def drop_replicas(self, replicas: Iterable[int]) -> dict[int, int]:
        """Remove ``replicas``; the others are renumbered 0..w-1 in order."""
        with self.charged:
            renumbered = self.table.drop_replicas(replicas)
            self._shard_size()
            return renumbered

    def set_width(self) -> None:
        pass  # one small call per actor: nothing the cost model charges

    def members(self) -> list[StageMember]:
        with self.charged:
            key = tuple(self.nodes.items())
            if self._members[0] != key:
                self._members = (key, [StageMember(k, None, n) for k, n in key])
            return self._members[1]

    def shutdown(self) -> None:
        pass

    # a simulated run has one driver (SimRegistry): nothing to hand over
    def roster(self) -> Roster:
        return {"width": self.width, "stages": self.stages, "actors": []}

    def take_over(self, roster: Roster) -> set[ShardKey]:
        return self._unmodelled("taking a dead driver's actors over")

    def leased(self) -> list[tuple[Any, str | None]]:
        return []

    def _shard_size(self) -> None:
        self.world.shard_mb = self.world.costs.shard_mb(self.parameters, self.stages, self.width)

    def stage_mb(self) -> float:
        return self.world.costs.stage_mb(self.parameters, self.stages)

    # ------------------------------------------------------------------ spares (see SimSpares): placing them, installing them
    def place_spare(self, sp: SimSpare, avoid: frozenset[str] = frozenset()) -> bool:
        """Place a waiting spare if there is room now (as Ray places a pending placement group)."""
        if sp.nodes:
            return True
        pool = self._pool()
        try:
            sp.nodes = self._take(sp.slots, avoid, first=pool.ready() if pool is not None else None)
        except CapacityUnavailable:
            return False
        # as on Ray (ActorGroup.fill): a warm standby ready on a slot's node becomes its actor
        adopted = sum(1 for n in sp.nodes if pool is not None and pool.take(n) is not None)
        c, now = self.world.costs, self.world.clock.now
        sp.ready_s = now + (c.adopt_s if adopted == sp.slots else c.actor_start_s)
        if adopted < sp.slots:
            self.world.starting(now, sp.ready_s, sp.slots - adopted)
        return True

    def adopt(self, ref: SpareRef) -> int:
        spare = own(ref)
        with self.charged:
            self._check("adopting a spare replica", spare.nodes)
            self.spares.taken(spare)
            r = self.table.add_replica(spare.nodes)
            for s in range(self.stages):
                self.at[ShardKey(s, r)] = None
            self._shard_size()
            return r

    def swap_in(self, refs: list[SpareRef]) -> None:
        """The started spares take their keys' state from the old actors (copies over the
        network, all at once, while the old ones live) and their places; both ends of every copy
        must be alive when the copies end."""
        spares = [own(r) for r in refs]
        with self.spans.span("state"):
            self.world.clock.sleep(self.stage_mb() / self.world.costs.network_mb_s)
        for sp in spares:
            assert sp.key is not None
            self._check(f"moving {sp.key} off node {self.nodes[sp.key]}", [self.nodes[sp.key], *sp.nodes])
        with self.charged:
            for sp in spares:
                assert sp.key is not None
                self.spares.taken(sp)
                self.table.install(sp.key, sp.nodes[0])

    def take_stage_spares(self, keys: list[ShardKey]) -> list[ShardKey]:
        """Lost ``keys`` whose stage spare is placed on a live node: the spare's slot becomes the
        key's, and :meth:`replace` waits only for the rest of its start."""
        taken = []
        with self.charged:
            for key in keys:
                sp = self.spares.of().get(key)
                if sp is None or not sp.nodes or self._gone(sp.nodes):
                    continue
                self.spares.taken(sp)
                self.table.install(key, sp.nodes[0], up_at=sp.ready_s)
                taken.append(key)
        return taken

    # ------------------------------------------------------------------ state
    def copy_stages(self, pairs: list[tuple[ShardKey, ShardKey]]) -> dict[ShardKey, tuple[int, float]]:
        """Each target takes its source's state, all copies at once over the network (a source
        sending to several targets sends one after another). Per target: bytes, seconds."""
        if not pairs:
            return {}
        fan_out = max(Counter(src for src, _ in pairs).values())
        seconds = fan_out * self.stage_mb() * self._with_copy() / self.world.costs.network_mb_s
        with self.spans.span("state"):
            self.world.clock.sleep(seconds)
        self._check("copying stage state", [self.nodes[k] for pair in pairs for k in pair])
        for src, dst in pairs:
            self.at[dst] = self.at.get(src)
        return {dst: (int(self.stage_mb() * MB), seconds) for _, dst in pairs}

    def load_parts(self, sources: Mapping[ShardKey, StageSource]) -> dict[ShardKey, tuple[int, float]]:
        """Each actor loads its pieces once they are ready (the managers' reads) after rebuilding
        the shards its source names from parity, one after another (pulling the survivors' chunks
        at the network's rate, decoding at the codec's; a survivor whose node goes meanwhile is one
        more erasure); a piece whose node went before it was ready, or more erasures than a
        rebuild's parity, fails the load. Per actor that rebuilt: bytes, seconds."""
        if not sources:
            return {}
        clock, w = self.world.clock, self.world
        rebuilt: dict[ShardKey, tuple[int, float]] = {}
        with self.spans.span("state"):
            start = clock.now
            for k, src in sources.items():
                end = start
                for r in src.rebuilds:
                    end += w.shard_mb * (r.n - len(r.lost)) / w.costs.network_mb_s + w.shard_mb * r.n / w.costs.parity_mb_s
                    gone = [p.node for p in r.peers if p is not None and w.fleet.removed_by(p.node, end)]
                    if len(r.lost) + len(gone) > r.parity:
                        clock.advance(max(end, clock.now))
                        raise SimLost(f"simulated: node {gone[0]} went while a shard of {k} was rebuilt from it, more erasures than parity {r.parity}")
                if src.rebuilds:
                    rebuilt[k] = (sum(r.shard.nbytes for r in src.rebuilds), end - start)
            ready = max((p.ready_s for src in sources.values() for p in src.refs), default=clock.now)
            clock.advance(max(ready, start + max((s for _, s in rebuilt.values()), default=0.0), clock.now))
            bad = [p for src in sources.values() for p in src.refs if isinstance(p, SimRef) and p.failed()]
            if bad:
                raise SimLost(f"simulated: a snapshot piece on node {bad[0].node} was lost before it was read")
            clock.sleep(self.world.shard_mb / self.world.costs.restore_mb_s)
        self._check("loading snapshot pieces", [self.nodes[k] for k in sources])
        for k, src in sources.items():
            self.at[k] = int(json.loads(src.manifest).get("step", 0)) if src.manifest else None
        return rebuilt

    def holds_own_copy(self, keys: list[ShardKey], version: int) -> set[ShardKey]:
        return set()  # the simulated stages keep no background copy: a rollback reads the managers

    def restore_own_copies(self, keys: list[ShardKey], version: int, pieces: Mapping[ShardKey, tuple[Piece, ...]]) -> list[ShardKey]:
        return list(keys)

    def load_durable(self, keys: list[ShardKey], uri: str, name: str) -> None:
        """Every actor reads its part of the durable checkpoint ``name``."""
        with self.spans.span("state"):
            self.world.clock.sleep(self.world.shard_mb / self.world.costs.flush_mb_s)
        self._check("loading the durable checkpoint", [self.nodes[k] for k in keys])
        digits = re.findall(r"\d+", name)
        for k in keys:
            self.at[k] = int(digits[-1]) if digits else 0

    # fault injection (chaos): a simulation's faults come from its trace and fault schedule
    def kill_process(self, key: ShardKey, how: str) -> None:
        self._unmodelled("chaos")

    def inject_error(self, key: ShardKey, message: str) -> None:
        self._unmodelled("chaos")

    def corrupt_own_copies(self, key: ShardKey) -> None:
        self._unmodelled("chaos")

    def kill_standbys(self, node: str) -> int:
        return self._unmodelled("chaos")

    def _unmodelled(self, what: str) -> Any:
        raise NotImplementedError(f"simulate models recovery.mode lossless and redundant only: {what} is not simulated")

    def grad_norms(self, keys: list[ShardKey]) -> dict[ShardKey, float]:
        return {k: 1.0 for k in keys}  # CheckFree's weights: the simulation computes no gradients

    def rebuild(self, key: ShardKey, step: int, lr_scale: float, a: float, b: float, donors: tuple[ShardKey, ...], mirror: ShardKey | None) -> int:
        """CheckFree: the new actor reads its donors' layers (one after the other over the network)."""
        with self.spans.span("state"):
            self.world.clock.sleep(len(donors) * self.stage_mb() / self.world.costs.network_mb_s)
        self._check(f"rebuilding {key} from its neighbours", [self.nodes[k] for k in (key, *donors, *([mirror] if mirror else []))])
        self.at[key] = step
        return 0

    def promote(self, key: ShardKey, holder: ShardKey, successor: ShardKey) -> None:
        """The new actor reads the holder's copy of its stage and its successor's state (its own
        copy), both over its link."""
        with self.spans.span("state"):
            self.world.clock.sleep(2 * self.stage_mb() / self.world.costs.network_mb_s)
        self._check(f"promoting the copy of {key}", [self.nodes[k] for k in (key, holder, successor)])
        self.at[key] = self.at.get(holder)

    def _with_copy(self) -> int:
        """Stage states a copy moves: with redundant copies, the source's copy of its successor goes along."""
        return 2 if self.cfg.redundant else 1

    def mirror(self, pairs: list[tuple[ShardKey, ShardKey]], step: int) -> None:
        pass  # an embedding or LM head copied to a neighbour, not waited for: nothing the cost model charges

    def save_checkpoints(self, root: str, step: int) -> int:
        return self._unmodelled("the checkpointing baseline")

    def load_checkpoints(self, root: str, step: int) -> None:
        self._unmodelled("the checkpointing baseline")


def own(spare: SpareRef) -> SimSpare:
    """A spare the controller hands back, as the simulated one it is."""
    if not isinstance(spare, SimSpare):
        raise TypeError(f"not a spare of a simulated run: {spare!r}")
    return spare


class SimSpares(SpareBook[SimSpare, SimSpare]):
    """The spares of one :class:`SimActors` (the :class:`~elastic_llm.controller.ports.Spares`
    port in simulated time): placed when there is room, ready once their processes started.
    Queries are pure; :meth:`tend` is the one call that places a waiting spare and starts over,
    off the nodes to avoid, one whose node went (as Ray re-places a lost placement group)."""

    def __init__(self, group: SimActors) -> None:
        super().__init__()
        self.group = group

    def start(self, key: ShardKey | None = None, avoid: frozenset[str] = frozenset()) -> SimSpare:
        g = self.group
        with g.charged:
            sp = SimSpare(key, g.stages if key is None else 1, g.world.clock.now)
            self.add_replica(sp) if key is None else self.add_stage(key, sp)
            g.place_spare(sp, avoid)
            return sp

    def tend(self, avoid: frozenset[str] = frozenset()) -> None:
        g = self.group
        with g.charged:
            for sp in [*self.replicas(), *self.of().values()]:
                if sp.nodes and g._gone(sp.nodes):
                    sp.nodes, sp.ready_s = [], float("inf")
                g.place_spare(sp, avoid)

    def ready(self, ref: SpareRef) -> bool:
        spare = own(ref)
        g = self.group
        return bool(spare.nodes) and not g._gone(spare.nodes) and g.world.clock.now >= spare.ready_s

    def nodes(self, ref: SpareRef) -> frozenset[str]:
        spare = own(ref)
        return frozenset(spare.nodes)

    def age(self, ref: SpareRef) -> float:
        spare = own(ref)
        return self.group.world.clock.now - spare.started

    def cancel(self, ref: SpareRef) -> None:
        spare = own(ref)
        self.remove(spare, spare.key)

    def taken(self, ref: SpareRef) -> None:
        spare = own(ref)
        self.cancel(spare)
