"""Recovery executor: observes what a failure left, then carries out a :class:`RecoveryPlan`.

Owns: the order of a recovery's side effects. First :meth:`RecoveryExecutor.observe`: let the
failed step's calls finish, reset the survivors (their pending snapshot calls give up; when every
actor answered and no node is dead or suspect, the failed step's own links are probed and one
side of a cut pair is set aside, its actors then lost:
:class:`~elastic_llm.controller.links.LinkGuard`), commit what completed and drop the versions in flight, then look (once) at nodes, actors and snapshot
managers and return a frozen :class:`Observation`. Then :meth:`RecoveryExecutor.execute`:
release the spare replicas started for growth when lost actors need their slots, replace dead
managers and lost actors, and restore state from the plan's sources (own copies,
snapshot managers, parity, data-parallel peers, the neighbours for CheckFree, the predecessor's
redundant copy, checkpoint files, the durable tier, the run's initial state (every actor a new
process); a survivor the plan says already holds the
rollback's version restores nothing). A node found gone on the way (Ray's scheduler refuses to
place a manager there) raises :class:`~elastic_llm.sources.NodeGone` before anything starts. Never decides: the plan comes from the pure
:class:`~elastic_llm.recovery.policy.RecoveryPolicy`. A failure inside either step propagates;
the controller observes again and re-plans.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any

from elastic_llm import events
from elastic_llm.controller.checkpoints import CheckpointExecutor
from elastic_llm.controller.neighbours import promote_copies, rebuild_from_neighbours
from elastic_llm.controller.links import LinkGuard
from elastic_llm.controller.ports import DurableTier, Nodes, StageActors, Standbys
from elastic_llm.pipeline.executor import StepExecutor
from elastic_llm.recovery.failure import StepFailure
from elastic_llm.recovery.policy import LOSSY, Member, Mode, Observation, RecoveryPlan, RollbackFrom, Source
from elastic_llm.snapshot.coordinator import SnapshotCoordinator
from elastic_llm.snapshot.records import ShardKey, StageSource
from elastic_llm.sources import NodeGone, SourceLost
from elastic_llm.stream import StreamPosition

log = logging.getLogger("elastic_llm.controller")
COMMIT_S = 60.0  # after a failure, how long versions in flight get to commit


@dataclass(frozen=True)
class RecoveryOutcome:
    plan: RecoveryPlan
    step: int  # completed steps after the recovery (the rollback target, or unchanged)
    rollback_steps: int
    sources: tuple[tuple[ShardKey, str], ...]  # restored actor -> where its state came from
    survivors_from_own_copy: int
    data_position: StreamPosition | None  # where the data stream resumes (None: unchanged)
    details: tuple[tuple[ShardKey, dict[str, Any]], ...] = ()  # per rebuilt actor: CheckFree weights, CRC-32 of its parameters


def build_observation(
    steps: dict[ShardKey, int | None],
    nodes: dict[ShardKey, str],
    alive_nodes: set[str],
    dead_managers: frozenset[str],
    snapshots: SnapshotCoordinator | None,
    parity: int,
    min_width: int = 1,
    free_at: dict[str, int] | None = None,
    mode: Mode = Mode.LOSSLESS,
    mirrors: bool = False,
    checkpoint: int | None = None,
    durable: int | None = None,
    standbys: dict[str, int] | None = None,
    bundle_nodes: dict[ShardKey, str | None] | None = None,
    standby_anywhere: bool = True,
    own_copies: frozenset[ShardKey] = frozenset(),
    from_start: bool = False,
) -> Observation:
    """Assemble the policy's input from what was seen (pure)."""
    members = tuple(Member(k.stage, k.replica, nodes.get(k, ""), steps[k] is not None, steps[k]) for k in sorted(steps))
    dead_nodes = frozenset(n for n in set(nodes.values()) if n not in alive_nodes)
    rec = snapshots.committed if snapshots is not None else None
    return Observation(
        members=members,
        dead_nodes=dead_nodes,
        dead_managers=frozenset(dead_managers | dead_nodes) if snapshots is not None else dead_nodes,
        committed=rec.version if rec else None,
        shard_nodes=tuple((s.key, rec.home(s.node_id)) for s in rec.shards) if rec else (),  # where the parts are now (re-homed or not)
        groups=rec.placed if rec else (),
        parity=parity,
        min_width=min_width,
        free_slots=sum(free_at.values()) if free_at is not None else None,
        free_nodes=tuple(sorted(free_at.items())) if free_at is not None else (),
        mode=mode,
        mirrors=mirrors,
        checkpoint=checkpoint,
        durable=durable,
        standbys=tuple(sorted((n, c) for n, c in (standbys or {}).items() if c > 0 and n in alive_nodes)),
        bundle_nodes=tuple(sorted((k, n) for k, n in (bundle_nodes or {}).items() if n is not None and n in alive_nodes)),
        standby_anywhere=standby_anywhere,
        own_copies=own_copies,
        from_start=from_start,
    )


@dataclass(frozen=True)
class ModeOptions:
    """What the executor needs of ``recovery.mode`` beyond the lossless ladder."""

    mode: Mode = Mode.LOSSLESS
    mirrors: bool = False
    lr_scale: float = 1.1
    checkpoints: CheckpointExecutor | None = None
    durable: DurableTier | None = None  # the newest durable checkpoint: the last rung before CheckFree
    restart_all: bool = False  # recovery.policy (elastic_llm.policies): every recovery restarts every process from the newest durable checkpoint
    whole_replicas: bool = False  # recovery.policy: a lost stage takes its whole replica out


class RecoveryExecutor:
    """Observes and carries out recovery plans on the run's ports (whatever runtime provides
    them): the same code on Ray and in a simulation."""

    def __init__(self, group: StageActors, snapshots: SnapshotCoordinator | None, parity: int, min_width: int, options: ModeOptions,
                 nodes: LinkGuard, standbys: Standbys | None, meanwhile: Callable[[], None] | None = None,
                 fence: Callable[[str], None] | None = None) -> None:
        """``fence``: raises :class:`~elastic_llm.controller.ports.Superseded` once a newer driver
        took the run over (checked before each observation: a plan would act on its actors)."""
        self.group = group
        self.fence = fence
        self.meanwhile = meanwhile  # called about every second while new processes start (notices seen then re-home parts at once)
        self.nodes = nodes  # probed once more before looking: a node whose actor call failed is known dead now
        self.standbys = standbys
        self.snapshots = snapshots
        self.parity = parity
        self.min_width = min_width
        self.options = options
        self.bad_own_copies: set[tuple[ShardKey, int]] = set()  # (survivor, version) whose own copy failed its checksums when a plan named it
        self.initial_position: StreamPosition | None = None  # where the data stream began (a run that began at step 0): a rollback to the initial state resumes there

    def observe(self, runner: StepExecutor | None, failed_step: int, from_start: bool = False) -> Observation:
        """``from_start``: the run began at step 0 and has committed nothing since (going back
        to its initial state loses nothing committed)."""
        if self.fence is not None:
            self.fence(f"recovering from the failure of step {failed_step}")
        self.nodes.sweep()  # before waiting for the failed step's calls: a dead node's calls then fail at once
        if runner is not None:
            runner.settle()
        suspects = self.nodes.suspects()  # one view for the whole observation
        alive_nodes = self.nodes.alive() - suspects  # a suspect's actors and parts are not waited for: lost
        steps = self.group.reset_survivors(alive_nodes)
        if all(st is not None for st in steps.values()) and set(self.group.nodes.values()) <= alive_nodes:  # nothing lost: were the step's own links cut?
            aside = self.nodes.check(failed_step, Counter(self.group.nodes.values()))
            if aside is not None:  # its side's actors and parts are lost, as a suspect's
                suspects, alive_nodes = suspects | {aside}, alive_nodes - {aside}
                steps = {k: None if self.group.nodes.get(k) == aside else st for k, st in steps.items()}
        sn = self.snapshots
        dead_managers: frozenset[str] = frozenset()
        if sn is not None:
            sn.note_alive(alive_nodes)  # no commit or discard waits on a manager of a dead node
            sn.abandon_pending(from_version=failed_step)  # the failed step's snapshot cannot complete
            sn.poll(block=True, timeout=COMMIT_S)  # commit what completed before the failure
            sn.abandon_pending()
            lost_parts = sn.lost_parts(alive_nodes)
            for node, why in sorted(lost_parts.items()):
                log.info("the snapshot part of step %s on node %s is lost: %s", sn.committed.version if sn.committed else None, node[:12], why)
            dead_managers = frozenset(lost_parts)
        o = self.options
        ckpt = o.checkpoints.latest() if o.checkpoints is not None else None
        durable = o.durable.latest() if o.durable is not None else None
        lost = [k for k, st in steps.items() if st is None]
        avoid = frozenset(self.nodes.draining()) | frozenset(suspects)
        # a lost actor whose stage spare (started for a drain, late for the move) is placed takes
        # it; one whose slot went with its node gets a new one (none outlives its node)
        taken = self.group.resize.take_stage_spares(lost) if lost and self.group.spares.of() else []
        if taken:
            log.info("%d lost stage actors take the places of their stage spares (started for a drain): %s", len(taken), ", ".join(map(str, taken)))
        self.group.placement.renew(lost, avoid=avoid)
        moved = {k.replica for k in lost if (n := self.group.nodes.get(k)) not in alive_nodes or n in avoid}  # avoid: given up at a drain
        free_at = self.group.placement.free_per_node(avoid) if moved else None
        standbys = self.standbys.ready() if self.standbys is not None and self.standbys.enabled else {}
        par = self.group.cfg.parallel
        anywhere = not par.gpus_per_actor or self.group.cfg.recovery.standby_gpus
        obs = build_observation(
            steps, dict(self.group.nodes), alive_nodes, dead_managers, sn, self.parity, self.min_width, free_at,
            o.mode, o.mirrors, ckpt[0] if ckpt else None, durable[0] if durable else None,
            standbys, self.group.placement.bundle_nodes(lost) if lost else {}, anywhere, self._own_copies(steps),
            from_start and self.initial_position is not None,
        )
        return replace(obs, restart_all=o.restart_all, whole_replicas=o.whole_replicas)

    def _own_copies(self, steps: dict[ShardKey, int | None]) -> frozenset[ShardKey]:
        """Survivors whose own background copy holds the whole committed version (only a run of
        one replica whose version was taken at width 1 has whole copies), less those whose copy
        failed its checksums when an earlier plan named it."""
        rec = self.snapshots.committed if self.snapshots is not None else None
        if rec is None or rec.width != 1 or self.group.width != 1:
            return frozenset()
        survivors = [k for k, st in steps.items() if st is not None and (k, rec.version) not in self.bad_own_copies]
        return frozenset(self.group.state.holds_own_copy(survivors, rec.version)) if survivors else frozenset()

    def execute(self, plan: RecoveryPlan, obs: Observation, step: int) -> RecoveryOutcome:
        """Carry ``plan`` out. New actors that did not get their state are killed again if
        anything fails, so the next observation sees them as lost."""
        g = self.group
        if plan.borrow:
            g.resize.borrow(list(plan.borrow))
        if plan.drop_replicas:
            g.resize.drop_replicas(plan.drop_replicas)
        lost = [ShardKey(a.stage, a.replica) for a in plan.actions]
        if plan.rollback_from is RollbackFrom.INITIAL or plan.restart:  # every actor a new process (or an adopted standby)
            survivors = sorted(set(g.keys()) - set(lost))
            for key in sorted(g.keys()) if plan.restart else survivors:  # a restart policy's plan names the survivors too
                g.kill(key)
            lost += survivors
        grown = g.spares.replicas()
        where = g.placement.bundle_nodes(lost) if grown else {}
        if grown and any(where.get(k) is None for k in lost):
            # the run's own width comes first: replicas started for growth give their slots up (the
            # elastic look starts them again once there is room left)
            log.info("recovery: %d spare replica(s) started to grow give their slots to the lost actors", len(grown))
            for spare in grown:
                g.spares.cancel(spare)
        if self.snapshots is not None:
            with g.spans.span("managers"):
                refused = self.snapshots.ensure_managers(self.nodes.alive())
            if refused:  # the plan was made with these nodes alive: made again without them
                raise NodeGone(refused, "Ray's scheduler refused a snapshot manager there")
        g.placement.place(at_once=True, avoid=frozenset(self.nodes.draining()) | frozenset(self.nodes.suspects()))
        try:
            fetched = {}
            if plan.rollback_to is not None and plan.rollback_from is RollbackFrom.SNAPSHOT:
                with g.spans.span("state"):  # before any new process starts: a source found gone re-plans at once
                    fetched = self._fetch(plan, obs)
            g.replace(lost, {ShardKey(a.stage, a.replica): a.adopt for a in plan.actions if a.adopt is not None}, self.meanwhile)
            if plan.drop_replicas:
                g.resize.set_width()
            with g.spans.span("state"):
                if plan.rollback_to is not None and plan.rollback_from is RollbackFrom.CHECKPOINT:
                    return self._from_checkpoint(plan, step)
                if plan.rollback_to is not None and plan.rollback_from is RollbackFrom.DURABLE:
                    return self._from_durable(plan, step)
                if plan.rollback_from is RollbackFrom.INITIAL:
                    sources = tuple((k, Source.INITIAL) for k in lost)
                    return RecoveryOutcome(plan, 0, step, sources, 0, self.initial_position)
                if plan.rollback_to is not None:
                    decoded = g.state.load_parts(fetched)
                    rec = self.snapshots.committed if self.snapshots else None
                    raw = rec.shard(ShardKey(0, 0)).data_position() if rec else None
                    position = StreamPosition.of(raw) if raw else None
                    sources = tuple((k, src.source) for k, src in fetched.items())
                    rebuilt = tuple((k, {"state_bytes": n, "transfer_s": s}) for k, (n, s) in decoded.items() if n)
                    return RecoveryOutcome(plan, plan.rollback_to, step - plan.rollback_to, sources, len(plan.own_copies), position, rebuilt)
                done = {m.step for m in obs.members if m.alive and m.step is not None}  # one step (else the plan rolls back)
                at = max(done) if done else step
                copied = self._copy_from_peers(plan)
                details = {**copied, **rebuild_from_neighbours(g, [a for a in plan.actions if a.source in LOSSY], at, self.options.lr_scale)}
                promote_copies(g, [a for a in plan.actions if a.source is Source.REDUNDANT])
        except BaseException:
            for key in lost:
                g.kill(key)
            raise
        sources = tuple((ShardKey(a.stage, a.replica), a.source) for a in plan.actions)
        return RecoveryOutcome(plan, at, 0, sources, 0, None, tuple(details.items()))

    def _from_checkpoint(self, plan: RecoveryPlan, step: int) -> RecoveryOutcome:
        """Everyone loads the checkpoint of ``plan.rollback_to`` (step 0 is written at the start)."""
        ck = self.options.checkpoints
        assert ck is not None and plan.rollback_to is not None, "a checkpoint rollback needs the checkpoint executor"
        latest = ck.latest()
        if latest is None or latest[0] != plan.rollback_to:
            raise RuntimeError(f"checkpoint of step {plan.rollback_to} is not the newest committed one under {ck.root} ({latest})")
        ck.restore(plan.rollback_to)
        sources = tuple((ShardKey(a.stage, a.replica), a.source) for a in plan.actions)
        return RecoveryOutcome(plan, plan.rollback_to, step - plan.rollback_to, sources, 0, latest[1])

    def _from_durable(self, plan: RecoveryPlan, step: int) -> RecoveryOutcome:
        """Every stage loads the newest durable checkpoint (each reads its own tensors from
        storage); the snapshot versions held in memory are newer than it and are forgotten."""
        tier = self.options.durable
        assert tier is not None and plan.rollback_to is not None, "a durable rollback needs the durable tier"
        latest = tier.latest()
        if latest is not None and latest[0] > plan.rollback_to:  # a flush in flight committed while the plan was made
            raise SourceLost(f"the durable checkpoint of step {latest[0]} committed after the plan named step {plan.rollback_to}")
        if latest is None or latest[0] != plan.rollback_to:
            raise RuntimeError(f"durable checkpoint of step {plan.rollback_to} is not the newest committed one ({latest})")
        tier.reset()
        if self.snapshots is not None:
            self.snapshots.forget_all()
        uri, position = tier.checkpoint(latest[1])
        self.group.state.load_durable(self.group.keys(), uri, latest[1])
        sources = tuple((ShardKey(a.stage, a.replica), a.source) for a in plan.actions)
        return RecoveryOutcome(plan, plan.rollback_to, step - plan.rollback_to, sources, 0, position)

    def _fetch(self, plan: RecoveryPlan, obs: Observation) -> dict[ShardKey, StageSource]:
        """The part of a snapshot rollback that needs no new process, done before any starts, so
        that a source found gone re-plans at once: the survivors the plan names restore from their
        own background copy (checked against the recorded checksums; one that fails is left out of
        later observations), and where the committed state of every other actor is (its snapshot
        managers' pieces; for the shards on nodes the plan counts lost, the recipes of their parity
        rebuilds, which the restored stages follow). Raises :class:`SourceLost` for a copy or piece that fails where the plan
        expected it."""
        sn = self.snapshots
        assert sn is not None and sn.committed is not None, "a rollback plan needs a committed snapshot"
        rec = sn.committed
        if plan.own_copies:
            own = list(plan.own_copies)
            failed = self.group.state.restore_own_copies(own, rec.version, {k: rec.shard(k).pieces for k in own})
            if failed:
                self.bad_own_copies.update((k, rec.version) for k in failed)
                raise SourceLost(f"the own copy of step {rec.version} held by {', '.join(map(str, failed))} failed its checksums")
        mine = set(plan.own_copies) | set(plan.kept)  # the survivors already at the version restore nothing
        return {k: sn.fetch_stage_state(k.stage, k.replica, obs.dead_managers) for k in self.group.keys() if k not in mine}

    def _copy_from_peers(self, plan: RecoveryPlan) -> dict[ShardKey, dict[str, Any]]:
        """Lost replicas copy the whole state of a live data-parallel peer; per copy its bytes
        and the target's seconds (for the recovery's lines)."""
        pairs = []
        for a in (a for a in plan.actions if a.source is Source.DP_PEER):
            assert a.peer is not None, f"{a}: a dp_peer action names its peer"
            pairs.append((ShardKey(a.stage, a.peer), ShardKey(a.stage, a.replica)))
        got = self.group.state.copy_stages(pairs) if pairs else {}
        return {k: {"state_bytes": int(n), "transfer_s": float(t)} for k, (n, t) in got.items()}


def gone_since(nodes: Nodes, alive: set[str], err: BaseException, what: str) -> frozenset[str]:
    """The nodes of ``alive`` (as they were when a recovery, resize or drain started) found gone
    once it failed with ``err``: those Ray's scheduler refused (:class:`NodeGone`, declared lost
    now: the refusal is the declaration) and those that died meanwhile; logged with ``what``
    failed. Their loss is the plan's news, not a failure of the run's own. A node the run already
    knew dead when the work started is not among them (a plan that failed on it would loop)."""
    if isinstance(err, NodeGone):
        nodes.declare_gone(err.nodes & alive, err.why)
    nodes.sweep()
    gone = frozenset(alive - nodes.alive())
    if gone:
        log.warning("%s: node(s) %s went meanwhile (%s); planning again without them, charged to nothing",
                    what, ", ".join(sorted(n[:12] for n in gone)), StepFailure.from_exception(0, err).error)
    return gone


def recovery_records(outcome: RecoveryOutcome, failure: StepFailure, seconds: float, committed_lost: int = 0,
                     spans: dict[str, float] | None = None) -> list[events.Recovery]:
    """The metrics lines of a finished recovery: one per restored actor (one with source
    ``none`` when nothing was lost). ``committed_lost``: committed steps the rollback undid
    (0 when it went back to the newest committed snapshot); ``spans``: where its time went. Pure."""
    plan = outcome.plan
    common: dict[str, Any] = dict(
        step=failure.step, rollback_steps=outcome.rollback_steps, committed_steps_lost=committed_lost,
        seconds=seconds, reason=plan.reason, failure=str(failure), failed_op=failure.op, spans=dict(spans or {}),
    )
    if not plan.actions:
        return [events.Recovery(stage=None, replica=None, source="none", lossless=True, **common)]
    restored = dict(outcome.sources)
    details = dict(outcome.details)
    return [
        events.Recovery(
            stage=a.stage, replica=a.replica, source=restored.get(ShardKey(a.stage, a.replica), a.source), lossless=a.lossless,
            survivors_restored_from_own_copy=outcome.survivors_from_own_copy, **details.get(ShardKey(a.stage, a.replica), {}), **common,
        )
        for a in plan.actions
    ]
