"""What a recovery plan is made of: the observation the policy decides from (:class:`Member`,
:class:`Observation`) and the plan it returns (:class:`Action`, :class:`RecoveryPlan`). Frozen
data, pure: the words :mod:`elastic_llm.recovery.policy` and the controller's executor share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_llm.snapshot.records import ShardKey
from elastic_llm.sources import Mode, RollbackFrom, Source


@dataclass(frozen=True)
class Member:
    """One (stage, replica) actor as observed after a failure."""

    stage: int
    replica: int
    node: str
    alive: bool
    step: int | None  # completed optimizer steps, None if dead


@dataclass(frozen=True)
class Observation:
    members: tuple[Member, ...]
    dead_nodes: frozenset[str]
    dead_managers: frozenset[str]  # nodes whose snapshot manager is gone (dead nodes included)
    committed: int | None  # latest committed snapshot version
    shard_nodes: tuple[tuple[ShardKey, str], ...] = ()  # (shard, node holding it) of the committed version
    groups: tuple[tuple[str, ...], ...] = ()  # erasure groups of the committed version
    parity: int = 0
    min_width: int = 1  # elastic.min_replicas: never shrink below this many replicas
    unplaceable: frozenset[int] = frozenset()  # replicas whose lost stages cannot be placed now (the runtime's greedy view; see free_slots)
    free_slots: int | None = None  # free actor slots off draining and suspect nodes when lost actors need new ones (the fewest replicas that make room go: fewest_drops)
    free_nodes: tuple[tuple[str, int], ...] = ()  # where those free slots are: (node, free slots)
    mode: Mode = Mode.LOSSLESS  # recovery.mode
    mirrors: bool = False  # embedding / LM head mirrored on the neighbouring stages
    checkpoint: int | None = None  # mode checkpoint: the newest checkpoint's step (0: the initial state)
    durable: int | None = None  # the newest committed durable checkpoint's step (None: none)
    standbys: tuple[tuple[str, int], ...] = ()  # (node, warm standbys ready on it)
    bundle_nodes: tuple[tuple[ShardKey, str], ...] = ()  # lost actors whose reservation is placed: (actor, node it is on now)
    standby_anywhere: bool = True  # a standby may take a stage on any node (CPU runs, or standbys holding a GPU); else only where the dead actor's device is
    own_copies: frozenset[ShardKey] = frozenset()  # survivors whose own background copy holds the whole committed version (a run of one replica)
    from_start: bool = False  # the run began at step 0 from the seed's weights and has committed nothing since: going back there loses nothing committed
    restart_all: bool = False  # recovery.policy restarts every process from the newest durable checkpoint (restart, ray-train-elastic)
    whole_replicas: bool = False  # recovery.policy takes a replica out whole when one of its stages is lost (replica-group)

    @property
    def n_stages(self) -> int:
        return 1 + max((m.stage for m in self.members), default=-1)


@dataclass(frozen=True)
class Action:
    stage: int
    replica: int
    source: Source
    peer: int | None = None  # replica to copy from, for dp_peer
    donors: tuple[ShardKey, ...] = ()  # checkfree: (next, prev); checkfree_plus: (neighbour,); redundant: (holder of the copy, successor)
    mirror: ShardKey | None = None  # checkfree_plus: the stage holding the embedding / head mirror
    adopt: str | None = None  # node whose warm standby becomes this actor; None: a new actor process starts in its bundle

    @property
    def lossless(self) -> bool:
        return Source(self.source).lossless

    def __str__(self) -> str:
        extra = f" from replica {self.peer}" if self.peer is not None else ""
        if self.donors:
            extra += " from " + ", ".join(f"stage {k.stage} replica {k.replica}" for k in self.donors)
        actor = f"standby on {self.adopt[:12]}" if self.adopt is not None else "new process"
        return f"stage {self.stage} replica {self.replica}: {self.source}{extra} ({actor})"


@dataclass(frozen=True)
class RecoveryPlan:
    actions: tuple[Action, ...]
    rollback_to: int | None  # every stage restores this committed version; None: keep current state
    reason: str
    lost_shards: tuple[ShardKey, ...] = field(default=())  # shards that must be rebuilt from parity
    drop_replicas: tuple[int, ...] = ()  # replicas (numbered as observed) dropped first; actions use the new numbers
    width: tuple[int, int] | None = None  # (from, to) when replicas are dropped
    rollback_from: RollbackFrom = RollbackFrom.SNAPSHOT  # where everyone's state of rollback_to comes from
    own_copies: tuple[ShardKey, ...] = ()  # a snapshot rollback: survivors that restore from their own background copy (the others: their snapshot managers, parity for lost_shards)
    borrow: tuple[tuple[ShardKey, ShardKey], ...] = ()  # (giver, taker), numbered as observed: a dropped replica's survivor becomes a kept replica's lost actor
    kept: tuple[ShardKey, ...] = ()  # a snapshot rollback: survivors whose state already is rollback_to's (they restore nothing)
    why_width: str = "lost stages could not be placed"  # the resize line's reason when replicas are dropped
    restart: bool = False  # every survivor's process ends too and starts again with the lost ones (restart_all policies)

    def __str__(self) -> str:
        rb = f"roll back to step {self.rollback_to}" if self.rollback_to is not None else "no rollback"
        drop = f"drop replica(s) {list(self.drop_replicas)}; " if self.drop_replicas else ""
        if self.borrow:
            drop += f"{len(self.borrow)} of their actor(s) take lost places in kept replicas; "
        own = f" ({len(self.own_copies)} survivor(s) from their own copy)" if self.own_copies else ""
        own += f" ({len(self.kept)} survivor(s) already there)" if self.kept else ""
        return f"RecoveryPlan({drop}{'; '.join(map(str, self.actions)) or 'nothing lost'}; {rb}{own}; {self.reason})"
