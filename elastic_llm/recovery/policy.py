"""RecoveryPolicy: observed failure in, recovery plan out (their types: :mod:`.plans`). Pure: no
Ray, no clock, no I/O.

Owns the choice of source per ``recovery.mode`` (the observation carries it), and the named
``recovery.policy``'s three switches (:mod:`elastic_llm.policies`): every process restarted from the
durable checkpoint at the width that fits (``restart_all``), a replica taken out whole
(``whole_replicas``), or neither:
- ``lossless`` (default): the ladder below, CheckFree / CheckFree+ as its last rung;
- ``checkfree`` / ``checkfree_plus``: a data-parallel peer if one holds the same state, else the
  stage is rebuilt from its neighbours (:mod:`elastic_llm.recovery.checkfree`), no rollback;
- ``redundant``: the lost stage's copy held by its predecessor is promoted (lossless, no rollback);
- ``checkpoint``: everyone rolls back to the newest checkpoint (or the initial state).

The lossless ladder (cheapest lossless source first), after one elastic decision: a
replica whose lost stages cannot be placed now (no capacity) is dropped when a whole replica
survives and at least ``min_width`` replicas remain (shrink: no rollback, the run goes on
narrower; the remaining replicas are renumbered 0..w-1 and the plan speaks of the new numbers).
Only as many go as make room, chosen so that their survivors take the most lost places in the
kept replicas (borrow and merge, as Oobleck reassembles pipelines): a borrowed actor keeps its
process and state, so the kept replicas need the fewest new actors and copies. A kept replica
whose lost actor would still start a new process (no warm standby where it goes) is dropped
too while twice such replicas are fewer than the kept ones: a start stalls every kept replica,
a drop costs that replica a spare's start and join.
1. the stage process died, its node and snapshot manager live: restore from the local manager;
2. a data-parallel peer of the lost replica is alive: copy its state;
3. the node is lost, at most m nodes of its erasure group are lost: rebuild from parity;
4. no in-memory copy survives but a durable checkpoint exists: everyone rolls back to it
   (lossless to that step; the plan's reason says why the snapshot could not serve); no snapshot
   committed yet in a run that began at step 0 and has committed nothing since: everyone goes
   back to the initial state (lossless: the seed's weights, the data's start; a failure in a
   run's first steps, before its first snapshot commits, loses no committed step);
5. otherwise nothing lossless survives: every lost stage without a peer is rebuilt from its
   neighbours (CheckFree, lossy, no rollback), the plan's reason says why; only when that is
   impossible too (a neighbour lost as well) :class:`UnrecoverableError` names what was lost.

Whenever the source is older than the healthy stages (a snapshot of step v while the others
finished later steps, or stages disagree on their step), everyone rolls back to v: lossless.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Callable, Iterable

import numpy as np

from elastic_llm.recovery.checkfree import Rebuild, plan_rebuild
from elastic_llm.recovery.plans import Action, Member, Observation, RecoveryPlan
from elastic_llm.sources import LOSSY, Mode, RollbackFrom, Source, SourceLost, UnrecoverableError
from elastic_llm.snapshot.records import ShardKey

__all__ = ["LOSSY", "Mode", "Action", "Member", "Observation", "RecoveryPlan", "RecoveryPolicy", "RollbackFrom", "Source", "SourceLost", "UnrecoverableError"]


def fewest_drops(need: dict[int, int], stages: int, free_slots: int) -> list[int]:
    """The fewest broken replicas to drop so the others' lost actors fit: ``need`` is replica ->
    its lost actors that need a new slot. A dropped replica needs none and frees the slots of
    the rest of its actors, so each drop gains ``stages`` slots whichever it is: the count is
    ceil((sum(need) - free) / stages); the most broken go first (fewest new processes for the
    ones kept), the highest index among equals. Pure."""
    total, free, drop = sum(need.values()), free_slots, []
    for r in sorted(need, key=lambda r: (-need[r], -r)):
        if total <= free:
            break
        drop.append(r)
        total -= need[r]
        free += stages - need[r]
    return drop


def borrows(lost: dict[int, frozenset[int]], drop: Iterable[int], stages: int) -> tuple[tuple[int, int, int], ...]:
    """Borrow and merge: which survivor of a dropped replica takes which lost place of a kept
    one, as (stage, from replica, to replica); per stage the lowest kept replicas first, each
    from the lowest dropped replica that still holds that stage. A borrowed actor keeps its
    process, slot and state (all replicas are at one step): only its links and replica number
    change. Pure."""
    gone = sorted(set(drop) & set(lost))
    kept = sorted(set(lost) - set(gone))
    out = []
    for s in range(stages):
        takers = [r for r in kept if s in lost[r]]
        givers = [r for r in gone if s not in lost[r]]
        out += [(s, g, t) for t, g in zip(takers, givers)]
    return tuple(out)


MERGE_SEARCH = 2000  # subsets searched exhaustively; beyond this, a local search from the most broken


def merge_drops(lost: dict[int, frozenset[int]], stages: int, count: int) -> tuple[int, ...]:
    """Which ``count`` broken replicas to drop (``lost``: replica -> its lost stages) so the kept
    ones are made whole with the fewest new actors, their lost places taken by the dropped ones'
    survivors (:func:`borrows`); among equals the fewest borrows, then the most broken, then
    the highest index. Every choice of ``count`` frees the same room (:func:`fewest_drops`), so
    the width is the same: only the copies differ. Exhaustive while there are at most
    :data:`MERGE_SEARCH` choices, else swaps from the most broken until none helps. Pure."""
    reps = sorted(lost, key=lambda r: (-len(lost[r]), -r))
    count = min(count, len(reps))
    if count <= 0:
        return ()
    index = {r: i for i, r in enumerate(reps)}
    holes = np.zeros((len(reps), stages), dtype=np.int32)  # holes[i, s]: replica reps[i] lost stage s
    for r, gone in lost.items():
        holes[index[r], sorted(gone)] = 1
    sizes = holes.sum(axis=1)
    everyone = holes.sum(axis=0)

    def cost(drop: frozenset[int]) -> tuple[int, int, int, tuple[int, ...]]:
        rows = [index[r] for r in drop]
        dropped = holes[rows].sum(axis=0)
        new = int(np.maximum(0, (everyone - dropped) - (len(rows) - dropped)).sum())  # kept holes less the dropped ones' survivors, per stage
        kept_lost = int(sizes.sum() - sizes[rows].sum())
        return (new, kept_lost - new, -int(sizes[rows].sum()), tuple(sorted(-r for r in drop)))

    if math.comb(len(reps), count) <= MERGE_SEARCH:
        best = min((frozenset(c) for c in itertools.combinations(reps, count)), key=cost)
        return tuple(sorted(best))
    best = frozenset(reps[:count])
    best_cost = cost(best)
    for _ in range(2 * count):
        step = min(((best - {a}) | {b} for a in best for b in reps if b not in best), key=cost)
        if cost(step) >= best_cost:
            break
        best, best_cost = step, cost(step)
    return tuple(sorted(best))


def replicas_to_drop(obs: Observation) -> tuple[int, ...]:
    """Broken replicas that cannot be placed now and may go, never below ``min_width``: while a
    whole replica survives (every stage alive, all at one step); or, when every replica is
    broken (a burst of losses across a large fleet), while every survivor is at one step and
    the replicas kept still hold (or borrow) a live copy of every stage between them, so each
    of their lost actors copies a kept peer (as many of the candidates as keep that true,
    highest first). With ``free_slots`` known, as many as make room (:func:`fewest_drops`:
    dropping a replica frees its survivors' slots for the others), chosen so that the
    dropped ones' survivors fill the most lost places of the kept ones (:func:`merge_drops`);
    else the runtime's ``unplaceable`` replicas."""
    width = 1 + max((m.replica for m in obs.members), default=-1)
    broken = {m.replica for m in obs.members if not m.alive}
    whole = [r for r in range(width) if r not in broken]
    lost = _lost_stages(obs)
    if obs.free_slots is not None:
        fewest = fewest_drops(new_slots(obs), obs.n_stages, obs.free_slots)
        candidates = sorted(merge_drops(lost, obs.n_stages, len(fewest)) if _one_step(obs) else fewest)
    else:
        candidates = sorted(broken & obs.unplaceable)
    room = max(0, width - obs.min_width)
    drop = candidates[len(candidates) - room :] if room < len(candidates) else candidates
    if whole:
        whole_steps = {m.step for m in obs.members if m.replica in whole}
        return tuple(drop) if len(whole_steps) == 1 else ()
    if not _one_step(obs):
        return ()
    stages = {m.stage for m in obs.members}
    while drop:
        gone = set(drop)
        held = {m.stage for m in obs.members if m.alive and m.replica not in gone} | {s for s, _, _ in borrows(lost, gone, obs.n_stages)}
        if held == stages:
            return tuple(drop)
        drop = drop[1:]  # keep the lowest candidate too
    return ()


def new_slots(obs: Observation) -> dict[int, int]:
    """Broken replica -> its lost actors that need a new slot (their reservation is not placed). Pure."""
    placed = {k for k, _ in obs.bundle_nodes}
    need: dict[int, int] = {}
    for m in obs.members:
        if not m.alive and ShardKey(m.stage, m.replica) not in placed:
            need[m.replica] = need.get(m.replica, 0) + 1
    return need


def restart_drops(obs: Observation) -> tuple[int, ...]:
    """When every process restarts from the durable checkpoint (a restart policy, or
    replica-group with no whole replica left): the broken replicas to drop so that the others'
    actors fit now (:func:`fewest_drops`; no survivor needs to hold anything), never below
    ``min_width`` (a fixed width drops none and waits for its nodes). Pure."""
    width = 1 + max((m.replica for m in obs.members), default=-1)
    if obs.free_slots is None:
        candidates = sorted({m.replica for m in obs.members if not m.alive} & obs.unplaceable)
    else:
        candidates = sorted(fewest_drops(new_slots(obs), obs.n_stages, obs.free_slots))
    room = max(0, width - max(1, obs.min_width))
    return tuple(candidates[len(candidates) - room:] if room < len(candidates) else candidates)


def _lost_stages(obs: Observation) -> dict[int, frozenset[int]]:
    out: dict[int, set[int]] = {}
    for m in obs.members:
        if not m.alive:
            out.setdefault(m.replica, set()).add(m.stage)
    return {r: frozenset(s) for r, s in out.items()}


def _one_step(obs: Observation) -> bool:
    """Every live actor has completed the same steps (their states are interchangeable)."""
    return len({m.step for m in obs.members if m.alive}) <= 1


def with_borrows(obs: Observation, drop: tuple[int, ...]) -> tuple[Observation, tuple[tuple[ShardKey, ShardKey], ...]]:
    """``obs`` after the dropped replicas' survivors took the kept ones' lost places (the
    taker's member alive on the giver's node, no reservation needed), and the pairs (giver,
    taker) in the observed numbering. Nothing is borrowed unless every live actor is at one
    step. Pure."""
    if not drop or not _one_step(obs):
        return obs, ()
    triples = borrows(_lost_stages(obs), drop, obs.n_stages)
    if not triples:
        return obs, ()
    by_key = {ShardKey(m.stage, m.replica): m for m in obs.members}
    pairs = tuple((ShardKey(s, g), ShardKey(s, t)) for s, g, t in triples)
    takers = {t: by_key[g] for g, t in pairs}
    members = tuple(replace(m, alive=True, node=takers[k].node, step=takers[k].step) if (k := ShardKey(m.stage, m.replica)) in takers else m
                    for m in obs.members)
    bundles = tuple((k, n) for k, n in obs.bundle_nodes if k not in takers)
    return replace(obs, members=members, bundle_nodes=bundles), pairs


def without_replicas(obs: Observation, drop: tuple[int, ...]) -> Observation:
    """``obs`` as if ``drop`` were gone, the other replicas renumbered 0..w-1 in order."""
    kept = sorted({m.replica for m in obs.members} - set(drop))
    new = {old: i for i, old in enumerate(kept)}
    members = tuple(replace(m, replica=new[m.replica]) for m in obs.members if m.replica in new)
    bundles = tuple((ShardKey(k.stage, new[k.replica]), n) for k, n in obs.bundle_nodes if k.replica in new)
    return replace(obs, members=members, unplaceable=frozenset(new[r] for r in obs.unplaceable if r in new), bundle_nodes=bundles, free_slots=None)


def freed_places(obs: Observation, drop: tuple[int, ...], kept: Observation, givers: set[ShardKey]) -> tuple[tuple[ShardKey, str], ...]:
    """Where the kept replicas' lost actors that had no reservation will start: in the free slots
    and those the dropped replicas free (their survivors that were not borrowed, on live nodes),
    first one on each node with a ready warm standby (as many as it has ready), so that the
    standby there becomes the actor (:func:`assign_standbys`: an adoption instead of a process
    start), then the rest in order. ``obs`` is numbered as observed, ``kept`` after the drop. Pure."""
    placed = {k for k, _ in kept.bundle_nodes}
    homeless = sorted(ShardKey(m.stage, m.replica) for m in kept.members if not m.alive and ShardKey(m.stage, m.replica) not in placed)
    if not homeless:
        return ()
    freed = [m.node for m in sorted(obs.members, key=lambda m: (m.replica, m.stage))
             if m.replica in drop and m.alive and ShardKey(m.stage, m.replica) not in givers and m.node not in obs.dead_nodes]
    freed += [node for node, n in obs.free_nodes for _ in range(n)]
    ready = dict(obs.standbys)
    for _, node in kept.bundle_nodes:  # standbys the reserved places adopt first
        if ready.get(node, 0) > 0:
            ready[node] -= 1
    first, rest = [], []
    for node in freed:
        if ready.get(node, 0) > 0:
            ready[node] -= 1
            first.append(node)
        else:
            rest.append(node)
    return tuple(zip(homeless, first + rest))


def _alive_by_stage(alive: list[Member]) -> dict[int, list[Member]]:
    """The live members of each stage, in observation order (the first is the peer a copy uses)."""
    out: dict[int, list[Member]] = {}
    for m in alive:
        out.setdefault(m.stage, []).append(m)
    return out


def kept_in_rollback(obs: Observation) -> tuple[ShardKey, ...]:
    """The survivors of a rollback to the committed snapshot that are already there: their
    completed steps are its step (the failed step's partial work was dropped), so their state is
    the version's and they restore nothing. Pure."""
    return tuple(sorted(ShardKey(m.stage, m.replica) for m in obs.members if m.alive and m.step is not None and m.step == obs.committed))


def own_copies(obs: Observation) -> tuple[ShardKey, ...]:
    """The survivors a rollback to the committed snapshot restores from their own background
    copy (observed to hold it; not those already there); every other actor's state comes
    through the snapshot managers. Pure."""
    alive = {ShardKey(m.stage, m.replica) for m in obs.members if m.alive}
    return tuple(sorted((alive & obs.own_copies) - set(kept_in_rollback(obs))))


def assign_standbys(plan: RecoveryPlan, obs: Observation) -> RecoveryPlan:
    """Which lost actors a warm standby becomes: an actor whose reservation is placed on a node
    with a ready standby adopts it (in action order, one standby each); the others start a new
    process. Without ``standby_anywhere`` (a GPU run whose standbys hold no device) only an actor
    whose node lives (its device is free there) adopts. ``obs`` must use the plan's replica
    numbers. Pure."""
    left = dict(obs.standbys)
    where = dict(obs.bundle_nodes)
    old_node = {ShardKey(m.stage, m.replica): m.node for m in obs.members}
    actions = []
    for a in plan.actions:
        key = ShardKey(a.stage, a.replica)
        node = where.get(key)
        ok = node is not None and left.get(node, 0) > 0 and (obs.standby_anywhere or (node == old_node.get(key) and node not in obs.dead_nodes))
        if ok and node is not None:
            left[node] -= 1
        actions.append(replace(a, adopt=node if ok else None))
    return replace(plan, actions=tuple(actions))


class RecoveryPolicy:
    def decide(self, obs: Observation) -> RecoveryPlan:
        if obs.whole_replicas:
            return self._whole_replicas(obs)
        if obs.restart_all:
            return self._restart_fitting(obs, "recovery.policy restarts every process at a failure")
        drop = replicas_to_drop(obs)
        if not drop:
            plan = assign_standbys(self._ladder(obs), obs)
            fit = restart_drops(obs) if plan.rollback_from in (RollbackFrom.DURABLE, RollbackFrom.INITIAL) else ()
            if fit:  # everyone loads the checkpoint anyway: at the width that fits now, not waiting for nodes
                return self._shrunk(obs, fit, borrow=False)
            return plan
        plan = self._shrunk(obs, drop)
        kept = sorted({m.replica for m in obs.members} - set(drop))
        cold = {kept[a.replica] for a in plan.actions if a.adopt is None}
        if cold and plan.rollback_to is None and 2 * len(cold) < len(kept) and len(kept) - len(cold) >= max(1, obs.min_width):
            # a new process stalls every kept replica for its start; dropping the replicas that need one costs
            # each of them about a start and a join (a spare replica grows it back): cheaper while 2 x those < kept
            more = self._shrunk(obs, tuple(sorted(set(drop) | cold)))
            if more.rollback_to is None:
                return more
        return plan

    def _whole_replicas(self, obs: Observation) -> RecoveryPlan:
        """replica-group: every replica with a lost stage goes while a whole replica survives
        (the others train on, no rollback); with none whole, everyone restarts from the newest
        durable checkpoint."""
        broken = sorted({m.replica for m in obs.members if not m.alive})
        if not broken:
            return self._ladder(obs)
        width = 1 + max(m.replica for m in obs.members)
        if len(broken) < width and width - len(broken) >= max(1, obs.min_width) and _one_step(obs):
            plan = self._shrunk(obs, tuple(broken), borrow=False)
            why = f"recovery.policy=replica-group: replica(s) {broken} lost a stage and go out whole, {width} -> {width - len(broken)} replicas; the others train on"
            return replace(plan, reason=why, why_width="a lost stage takes its replica out (recovery.policy=replica-group)")
        return self._restart_fitting(obs, f"no whole replica of {width} survives")

    def _restart_fitting(self, obs: Observation, why: str) -> RecoveryPlan:
        """Every process restarts from the newest durable checkpoint, at the widest width whose
        actors fit (:func:`restart_drops`)."""
        drop = restart_drops(obs)
        if not drop:
            return assign_standbys(self._restart(obs, why), obs)
        return self._shrunk(obs, drop, borrow=False, then=lambda kept: self._restart(kept, why))

    def _restart(self, obs: Observation, why: str) -> RecoveryPlan:
        """Every process ends and starts again from the newest durable checkpoint (the initial
        state without one): the restart_all policies, and replica-group with no whole replica."""
        source = Source.DURABLE if obs.durable is not None else Source.INITIAL
        everyone = tuple(Action(m.stage, m.replica, source) for m in obs.members)  # every actor a new process, survivors too
        if obs.durable is not None:
            plan = self._durable(obs, why)
            return replace(plan, actions=everyone, restart=True, reason=f"every process restarts ({why}): everyone loads the durable checkpoint of step {obs.durable}")
        plan = self._initial(obs, why)
        return replace(plan, actions=everyone, restart=True,
                       reason=f"every process restarts ({why}), no durable checkpoint yet: everyone goes back to the initial state (step 0)")

    def _shrunk(self, obs: Observation, drop: tuple[int, ...], borrow: bool = True, then: Callable[[Observation], RecoveryPlan] | None = None) -> RecoveryPlan:
        """``drop`` goes first; ``then`` (default: the ladder) plans for the replicas kept."""
        width = 1 + max(m.replica for m in obs.members)
        merged, pairs = with_borrows(obs, drop) if borrow else (obs, ())
        kept = without_replicas(merged, drop)
        kept = replace(kept, bundle_nodes=kept.bundle_nodes + freed_places(merged, drop, kept, {g for g, _ in pairs}))
        plan = assign_standbys((then or self._ladder)(kept), kept)
        why = (
            f"replica(s) {list(drop)} lost stages that cannot be placed now (no capacity): dropped, "
            f"{width} -> {width - len(drop)} replicas; "
        )
        if pairs:
            why += f"{len(pairs)} of their survivors take lost places in the kept replicas (borrow and merge); "
        return replace(plan, drop_replicas=drop, width=(width, width - len(drop)), reason=why + plan.reason, borrow=pairs)

    def _ladder(self, obs: Observation) -> RecoveryPlan:
        if obs.mode in (Mode.CHECKFREE, Mode.CHECKFREE_PLUS):
            return self._checkfree_mode(obs)
        if obs.mode == Mode.REDUNDANT:
            return self._redundant(obs)
        if obs.mode == Mode.CHECKPOINT:
            return self._checkpoint(obs)
        return self._lossless(obs)

    def _lossless(self, obs: Observation) -> RecoveryPlan:
        lost = [m for m in obs.members if not m.alive]
        alive = [m for m in obs.members if m.alive]
        steps = {m.step for m in alive if m.step is not None}  # alive members always know their step
        consistent = len(steps) <= 1
        current = max(steps) if steps else None
        shard_node = dict(obs.shard_nodes)
        lost_shards = tuple(sorted(k for k, n in obs.shard_nodes if n in obs.dead_managers))

        def snapshot_available() -> str | None:
            """Why the committed snapshot cannot serve, or None if it can."""
            if obs.committed is None:
                return "no snapshot has been committed yet"
            if not lost_shards:
                return None
            for group in obs.groups:
                gone = [n for n in group if n in obs.dead_managers]
                if len(gone) > obs.parity:
                    return (
                        f"{len(gone)} nodes ({', '.join(n[:8] for n in gone)}) of an erasure group of {len(group)} lost "
                        f"their snapshots but parity covers "
                        f"{obs.parity}: raise snapshot.parity or add durable checkpoints"
                    )
            grouped = {n for g in obs.groups for n in g}
            if any(shard_node[k] in obs.dead_managers and shard_node[k] not in grouped for k in lost_shards):
                return "lost shards are not covered by any erasure group (one node, or fewer than snapshot.parity + 1: no parity)"
            return None

        snap_problem = snapshot_available()
        actions: list[Action] = []
        need_snapshot = False
        peers_of = _alive_by_stage(alive)  # one pass: looking peers up per lost actor was quadratic at 2,000 actors
        for m in lost:
            peers = peers_of.get(m.stage, [])
            key = ShardKey(m.stage, m.replica)
            if peers and consistent:
                actions.append(Action(m.stage, m.replica, Source.DP_PEER, peer=peers[0].replica))
                continue
            if snap_problem is not None and obs.durable is not None:
                return self._durable(obs, snap_problem)
            if snap_problem is not None:
                return self._initial(obs, snap_problem) if obs.from_start and obs.committed is None else self._last_rung(obs, snap_problem)
            need_snapshot = True
            source = Source.PARITY if key in lost_shards or shard_node.get(key) in obs.dead_managers else Source.LOCAL_SMP
            actions.append(Action(m.stage, m.replica, source))
        if need_snapshot:
            reason = f"restored stages come from the snapshot of step {obs.committed}"
            if current is not None and current != obs.committed:
                reason += f", older than the healthy stages (step {current}): everyone rolls back"
            return RecoveryPlan(tuple(actions), obs.committed, reason, lost_shards, own_copies=own_copies(obs), kept=kept_in_rollback(obs))
        if not consistent:
            if snap_problem is not None and obs.durable is not None:
                return self._durable(obs, f"stages disagree on their step ({sorted(steps)}) and {snap_problem}")
            if snap_problem is not None and obs.from_start and obs.committed is None:
                return self._initial(obs, f"stages disagree on their step ({sorted(steps)}) and {snap_problem}")
            if snap_problem is not None:
                raise UnrecoverableError(f"stages disagree on their step ({sorted(steps)}) and {snap_problem}")
            return RecoveryPlan(tuple(actions), obs.committed, f"stages disagree on their step ({sorted(steps)}): everyone rolls back", lost_shards,
                                own_copies=own_copies(obs), kept=kept_in_rollback(obs))
        reason = "data-parallel peers hold the same state" if actions else "no stage lost"
        return RecoveryPlan(tuple(actions), None, reason + f"; step {current} is replayed", lost_shards)

    # ------------------------------------------------------------------ beyond the lossless ladder
    def _durable(self, obs: Observation, why: str) -> RecoveryPlan:
        """Everyone rolls back to the newest durable checkpoint (lost stages come from it too)."""
        assert obs.durable is not None
        current = max((m.step or 0 for m in obs.members if m.alive), default=0)
        actions = tuple(Action(m.stage, m.replica, Source.DURABLE) for m in obs.members if not m.alive)
        reason = f"no in-memory copy survives ({why}): everyone rolls back from step {current} to the durable checkpoint of step {obs.durable}"
        return RecoveryPlan(actions, obs.durable, reason, rollback_from=RollbackFrom.DURABLE)

    def _rebuilds(self, obs: Observation, why: str) -> tuple[Action, ...]:
        """CheckFree actions for every lost member without a data-parallel peer at one step
        (a peer copy for the others); raises :class:`UnrecoverableError` if any cannot be done."""
        alive = [m for m in obs.members if m.alive]
        steps = {m.step for m in alive if m.step is not None}
        if len(steps) > 1:
            raise UnrecoverableError(f"stages disagree on their step ({sorted(steps)}) and {why}")
        alive_keys = frozenset(ShardKey(m.stage, m.replica) for m in alive)
        actions = []
        peers_of = _alive_by_stage(alive)
        for m in (m for m in obs.members if not m.alive):
            peers = peers_of.get(m.stage, [])
            if peers:
                actions.append(Action(m.stage, m.replica, Source.DP_PEER, peer=peers[0].replica))
                continue
            rb = plan_rebuild(m.stage, m.replica, obs.n_stages, alive_keys, obs.mirrors, reinit=obs.mode != Mode.LOSSLESS)
            if not isinstance(rb, Rebuild):
                raise UnrecoverableError(f"stage {m.stage} replica {m.replica} is lost, {why}, and it cannot be rebuilt from its neighbours: {rb}")
            actions.append(Action(m.stage, m.replica, rb.source, donors=rb.donors, mirror=rb.mirror))
        return tuple(actions)

    def _initial(self, obs: Observation, why: str) -> RecoveryPlan:
        """Everyone goes back to the run's initial state (step 0, the seed's weights, the data's
        start): lossless while nothing was committed since the run began there."""
        current = max((m.step or 0 for m in obs.members if m.alive), default=0)
        actions = tuple(Action(m.stage, m.replica, Source.INITIAL) for m in obs.members if not m.alive)
        reason = (f"no lossless copy survives ({why}), but nothing was committed since the run began: everyone goes back from "
                  f"step {current} to the initial state (step 0, the seed's weights), no committed step lost")
        return RecoveryPlan(actions, 0, reason, rollback_from=RollbackFrom.INITIAL)

    def _last_rung(self, obs: Observation, snap_problem: str) -> RecoveryPlan:
        actions = self._rebuilds(obs, f"no lossless copy survives ({snap_problem})")
        rebuilt = [a for a in actions if not a.lossless]
        reason = (
            f"no lossless copy survives ({snap_problem}): stage(s) {[a.stage for a in rebuilt]} rebuilt from their neighbours "
            "(CheckFree, lossy); healthy stages keep their state"
        )
        return RecoveryPlan(actions, None, reason)

    def _checkfree_mode(self, obs: Observation) -> RecoveryPlan:
        actions = self._rebuilds(obs, f"recovery.mode={obs.mode} keeps no snapshots")
        if not actions:
            return RecoveryPlan((), None, "no stage lost")
        how = "; ".join(sorted({a.source for a in actions}))
        return RecoveryPlan(actions, None, f"recovery.mode={obs.mode}: {how}, healthy stages keep their state")

    def _redundant(self, obs: Observation) -> RecoveryPlan:
        """Promote the copy the predecessor trains (ring: the last stage holds stage 0's); the new
        actor's own copy of its successor comes from that successor. A lost stage whose holder or
        successor is lost too copies a live replica's same stage (and its copy), as a lossless
        data-parallel peer; with none, the run cannot go on."""
        alive = {ShardKey(m.stage, m.replica): m for m in obs.members if m.alive}
        steps = {m.step for m in alive.values() if m.step is not None}
        if len(steps) > 1:
            raise UnrecoverableError(f"stages disagree on their step ({sorted(steps)}): redundant copies cannot line up")
        n = obs.n_stages
        actions = []
        for m in (m for m in obs.members if not m.alive):
            holder, successor = ShardKey((m.stage - 1) % n, m.replica), ShardKey((m.stage + 1) % n, m.replica)
            gone = [k.stage for k in (holder, successor) if k not in alive]
            peers = sorted(k.replica for k in alive if k.stage == m.stage)
            if gone and not peers:
                raise UnrecoverableError(
                    f"stage {m.stage} replica {m.replica} is lost and so are stage(s) {gone}, which hold its redundant copy "
                    f"or the copy it held, and no other replica holds stage {m.stage}: recovery.mode=redundant covers one lost "
                    "stage of every two neighbours of a replica"
                )
            actions.append(Action(m.stage, m.replica, Source.DP_PEER, peer=peers[0]) if gone else Action(m.stage, m.replica, Source.REDUNDANT, donors=(holder, successor)))
        how = "; ".join(sorted({"the predecessor's redundant copy is promoted" if a.source is Source.REDUNDANT else "a live replica's stage is copied" for a in actions}))
        return RecoveryPlan(tuple(actions), None, how or "no stage lost")

    def _checkpoint(self, obs: Observation) -> RecoveryPlan:
        lost = [m for m in obs.members if not m.alive]
        to = obs.checkpoint if obs.checkpoint is not None else 0
        current = max((m.step or 0 for m in obs.members if m.alive), default=0)
        actions = tuple(Action(m.stage, m.replica, Source.CHECKPOINT) for m in lost)
        where = f"the checkpoint of step {to}" if to else "the initial state (no checkpoint yet)"
        return RecoveryPlan(actions, to, f"everyone rolls back from step {current} to {where}", rollback_from=RollbackFrom.CHECKPOINT)
