"""The controller's ports: everything it touches outside its own process, as typed protocols.

Owns: the contract between the controller (its state machine, :mod:`.trainer`, and the
orchestration that carries plans out: :mod:`.setup`, :mod:`.stepping`, :mod:`.recovery`,
:mod:`.elastic`, :mod:`.neighbours`, :mod:`.checkpoints`) and a runtime that provides the
primitives: :class:`StageActors` (the stage actors and their membership) with its small ports
:class:`Placement` (actor slots), :class:`Spares` (actors started ahead), :class:`Resizes`
(changes of the width and of who runs as a key), :class:`StateMoves` (the calls that move state
between actors and stores), :class:`Handover` (driver failover) and chaos's
:class:`~elastic_llm.chaos.StageHits`; :class:`Nodes` (liveness, drains and probes of the links between nodes),
:class:`Standbys` (warm processes), :class:`RunRegistry` (what a new driver finds of a run whose
driver died), :class:`Faults` (fault injection), :class:`DurableTier` and the snapshot managers
(:class:`~elastic_llm.snapshot.coordinator.ManagerFleet`, owned by the snapshot package), the
step executor (:class:`~elastic_llm.pipeline.executor.StepExecutor`), the monitor actor, the
clock (:class:`~elastic_llm.clock.Clock`) and every random draw (:attr:`Runtime.rng`), bundled in
:class:`Runtime`. :mod:`elastic_llm.runtime` implements them on Ray; :mod:`elastic_llm.sim` in
simulated time. Both run the same controller: nothing above these ports asks which it runs on.

The style of every port here: a dozen methods or fewer; typed throughout (no untyped seam: an actor's
handle is the opaque :data:`ActorRef`, JSON a :class:`Roster` or :data:`Json`); what the
controller reads of a runtime's state is a read-only property (the membership is one
:class:`~elastic_llm.controller.membership.Membership` table in both runtimes, changed only
through :class:`Resizes` and :class:`StageActors`' own calls); a query is pure (it places or starts
nothing: asking whether a spare is ready starts no process), and one explicit call starts what a
plan asks for (:meth:`Spares.start`, :meth:`Spares.tend`). ``tests/test_contract.py`` holds both
runtimes' primitives to the same facts.

Also the exceptions a runtime raises that the orchestration acts on (:class:`CapacityUnavailable`,
:class:`PlanNotFollowed`); the others a runtime raises when an actor or node it called died are
:attr:`Runtime.errors`. Never implements anything.
"""

from __future__ import annotations

import random
import re
from typing import Callable, Iterable, Mapping, Protocol, Sequence, TypedDict

from elastic_llm.chaos import FaultTargets, StageHits
from elastic_llm.clock import Clock
from elastic_llm.config import RunConfig
from elastic_llm.controller.drains import Drain, NodeDeath
from elastic_llm.controller.states import Capacity
from elastic_llm.monitor import RunStatus
from elastic_llm.pipeline.executor import StepExecutor
from elastic_llm.controller.metrics import MetricsWriter
from elastic_llm.snapshot.coordinator import SnapshotCoordinator, StageMember
from elastic_llm.snapshot.ports import Flush, ManagerFleet
from elastic_llm.snapshot.records import Piece, ShardKey, StageSource, VersionRecord
from elastic_llm.spans import Spans
from elastic_llm.stream import StreamPosition

RESET_S = 60.0  # longest the survivors of a failed step may take to reset (:meth:`StageActors.reset_survivors`, both runtimes)


class CapacityUnavailable(RuntimeError):
    """The actors' slots cannot all be placed now; ``capacity`` says what is missing."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        super().__init__(str(capacity))


class PlanNotFollowed(RuntimeError):
    """The runtime could not carry out what the plan said (e.g. the standby it names is gone):
    nothing was decided instead; the controller observes again and re-plans."""


class ResumeError(RuntimeError):
    """A run cannot be resumed as asked; the message says why and what to do."""


class Superseded(Exception):
    """A newer driver took this run over (``--resume RUN_ID`` while this one lived on, frozen or
    cut off): this driver stops without publishing, recovering or ending anything of the run."""


ActorRef = object  # a runtime's handle of an actor: opaque above the ports (the step executor and the runtime use it)
Json = dict[str, object]  # a JSON object


class RosterRow(TypedDict):
    stage: int
    replica: int
    name: str | None  # its Ray name (None: no actor ran as it)
    group: str | None  # its placement group's id (hex)


class Roster(TypedDict):
    """The width's actors as a next driver finds them (JSON; see :mod:`elastic_llm.runtime.handover`)."""

    width: int
    stages: int
    actors: list[RosterRow]


RUN_ID = re.compile(r"^[0-9a-f]{6}$")


def is_run_id(text: str) -> bool:
    """Whether ``--resume`` names a run (six hex digits, as ``elastic-llm status`` shows it)
    rather than a durable checkpoint's path."""
    return bool(RUN_ID.match(text))


class SpareRef(Protocol):
    """A spare as the controller holds it (opaque but for the key it is for; None: a whole replica)."""

    @property
    def key(self) -> ShardKey | None: ...


class Spares(Protocol):
    """Stage actors started in the background ahead of a need: whole replicas (a grow, a drain's
    whole-replica move) and single actors for a key (a drain's per-stage move). Queries are pure;
    :meth:`start` reserves what a plan asks for and :meth:`tend` is the one call that starts
    processes on what was placed since (and starts over, off ``avoid``, a spare whose node went).
    Installing a started one changes the membership: :class:`StageActors` ``adopt``, ``swap_in``,
    ``take_stage_spares``."""

    def start(self, key: ShardKey | None = None, avoid: frozenset[str] = frozenset()) -> SpareRef: ...
    def tend(self, avoid: frozenset[str] = frozenset()) -> None: ...
    def replicas(self) -> Sequence[SpareRef]: ...
    def of(self) -> Mapping[ShardKey, SpareRef]: ...  # the stage spares by key
    def ready(self, spare: SpareRef) -> bool: ...  # every process of it has started
    def nodes(self, spare: SpareRef) -> frozenset[str]: ...  # where it is placed (empty while waiting for room)
    def age(self, spare: SpareRef) -> float: ...
    def cancel(self, spare: SpareRef) -> None: ...


class Placement(Protocol):
    """The actor slots of the fleet: where the run's actors (and their replacements) go."""

    def place(self, at_once: bool = False, avoid: frozenset[str] = frozenset()) -> None: ...  # raises CapacityUnavailable
    def placed(self) -> bool: ...
    def capacity(self, replicas: int | None = None) -> Capacity: ...
    def free_slots(self, avoid: frozenset[str] = frozenset()) -> int: ...
    def free_per_node(self, avoid: frozenset[str] = frozenset()) -> dict[str, int]: ...  # the free slots by node
    def bundle_nodes(self, keys: list[ShardKey]) -> dict[ShardKey, str | None]: ...  # where a replacement of each would start
    def renew(self, keys: list[ShardKey], avoid: frozenset[str] = frozenset()) -> list[ShardKey]: ...  # lost actors whose slot went with its node get a new one


class Resizes(Protocol):
    """Changes of the width and of who runs as a key (the membership table's changes, with the
    processes and slots behind them)."""

    def borrow(self, pairs: list[tuple[ShardKey, ShardKey]]) -> None: ...  # (giver, taker): the giver's actor, slot and state become the taker's (the giver's replica is dropped next)
    def drop_replicas(self, replicas: Iterable[int]) -> dict[int, int]: ...  # old replica -> new, for the kept
    def adopt(self, spare: SpareRef) -> int: ...  # a started spare replica joins as the last; its index
    def swap_in(self, spares: list[SpareRef]) -> None: ...  # started stage spares take their keys' state from the old actors (all copies at once) and their places
    def take_stage_spares(self, keys: list[ShardKey]) -> list[ShardKey]: ...  # lost keys whose placed stage spare becomes their (empty) actor
    def set_width(self) -> None: ...  # every actor learns its replica and the width


class StateMoves(Protocol):
    """The calls that move stage state between actors, the snapshot managers' pieces, the durable
    tier and the checkpointing baseline's files; each waits with a deadline."""

    def copy_stages(self, pairs: list[tuple[ShardKey, ShardKey]]) -> dict[ShardKey, tuple[int, float]]: ...  # per target: bytes, seconds
    def load_parts(self, sources: Mapping[ShardKey, StageSource]) -> dict[ShardKey, tuple[int, float]]: ...  # per actor that rebuilt from parity: bytes, seconds
    def holds_own_copy(self, keys: list[ShardKey], version: int) -> set[ShardKey]: ...
    def restore_own_copies(self, keys: list[ShardKey], version: int, pieces: Mapping[ShardKey, tuple[Piece, ...]]) -> list[ShardKey]: ...
    def load_durable(self, keys: list[ShardKey], uri: str, name: str) -> None: ...  # raises DurableError for a refused checkpoint
    def grad_norms(self, keys: list[ShardKey]) -> dict[ShardKey, float]: ...
    def rebuild(self, key: ShardKey, step: int, lr_scale: float, a: float, b: float, donors: tuple[ShardKey, ...], mirror: ShardKey | None) -> int: ...
    def promote(self, key: ShardKey, holder: ShardKey, successor: ShardKey) -> None: ...
    def mirror(self, pairs: list[tuple[ShardKey, ShardKey]], step: int) -> None: ...
    def save_checkpoints(self, root: str, step: int) -> int: ...
    def load_checkpoints(self, root: str, step: int) -> None: ...


class Handover(Protocol):
    """Driver failover (see :mod:`elastic_llm.runtime.handover`): the width's actors as a next
    driver finds them, and taking them over."""

    def roster(self) -> Roster: ...  # the width's actors as a next driver finds them
    def take_over(self, roster: Roster) -> set[ShardKey]: ...  # a dead driver's actors that answer become this group's, state in place; the keys adopted
    def leased(self) -> list[tuple[ActorRef, str | None]]: ...  # the actors a keepalive must reach (detached ones end without it), with the thread group of the call


class StageActors(Protocol):
    """The run's stage actors, ``actors[replica][stage]`` (opaque handles: the step executor's
    business), on actor slots of the fleet, and the small ports for what else the controller asks
    of them: :attr:`placement`, :attr:`spares`, :attr:`resize`, :attr:`state`, :attr:`handover`,
    :attr:`hits` (fault injection). The membership (width, nodes, readiness) is one
    :class:`~elastic_llm.controller.membership.Membership` table in both runtimes, read-only here.
    Every call that waits has a deadline; a call whose actor or node died raises one of
    :attr:`Runtime.errors`. A primitive that takes time succeeds only if the actors it involves
    are alive when it ends."""

    @property
    def cfg(self) -> RunConfig: ...
    @property
    def stages(self) -> int: ...
    @property
    def spans(self) -> Spans: ...  # "actor" (starting or adopting), "state" (copies between actors and stores)
    @property
    def width(self) -> int: ...
    @property
    def actors(self) -> list[list[ActorRef]]: ...  # [replica][stage] (empty until spawned)
    @property
    def nodes(self) -> dict[ShardKey, str]: ...
    @property
    def ready(self) -> set[ShardKey]: ...  # actors that answered since they were started
    @property
    def pids(self) -> Mapping[ShardKey, int]: ...
    @property
    def placement(self) -> Placement: ...
    @property
    def spares(self) -> Spares: ...  # started in the background, not yet in the width
    @property
    def resize(self) -> Resizes: ...
    @property
    def state(self) -> StateMoves: ...
    @property
    def handover(self) -> Handover: ...
    @property
    def hits(self) -> StageHits: ...

    def keys(self) -> list[ShardKey]: ...
    def replicas_on(self, nodes: frozenset[str]) -> list[int]: ...
    def members(self) -> list[StageMember]: ...
    def spawn_all(self) -> None: ...
    def replace(self, keys: list[ShardKey], adopt: dict[ShardKey, str] | None = None, meanwhile: Callable[[], None] | None = None) -> None: ...  # meanwhile: called about every second until they start
    def kill(self, key: ShardKey) -> None: ...
    def reset_survivors(self, alive_nodes: set[str]) -> dict[ShardKey, int | None]: ...
    def shutdown(self) -> None: ...


class Nodes(Protocol):
    """The fleet's nodes as the controller sees them."""

    def alive(self) -> set[str]: ...
    def with_slots(self) -> list[str]: ...  # live nodes that can host stage actors, by id
    def draining(self) -> dict[str, Drain]: ...  # nodes that announced their end
    def reclaimed(self) -> set[str]: ...  # nodes whose end was a reclaim (announced, or known as one): their failures are not charged to the failure budget
    def suspects(self) -> set[str]: ...  # nodes that stopped answering the driver's probes (nothing new is placed there)
    def sweep(self) -> None: ...  # look once more now (before a recovery observes)
    def cut_pairs(self, nodes: frozenset[str]) -> frozenset[tuple[str, str]]: ...  # pairs of these live nodes that cannot reach each other now (each probe bounded; smaller id first)
    def link_rates(self, nodes: frozenset[str]) -> dict[tuple[str, str], float]: ...  # bytes per second of each pair of these live nodes, measured now (bounded; a pair not measured is left out)
    def declare_gone(self, nodes: frozenset[str], why: str) -> None: ...  # nodes found gone another way (Ray's scheduler refused them): dead in this run's view from now on
    def deaths(self) -> list[NodeDeath]: ...  # deaths declared since the last call
    def stop(self) -> None: ...


class Standby(Protocol):
    """A warm standby taken from the pool: the process a key's actor becomes."""

    @property
    def actor(self) -> ActorRef: ...
    @property
    def name(self) -> str: ...


class Standbys(Protocol):
    """Warm stage processes per node, adopted in place of new processes."""

    @property
    def enabled(self) -> bool: ...
    @property
    def per_node(self) -> int: ...
    @property
    def starts_take_step_cpu(self) -> bool: ...  # a standby's start takes CPU from the steps (stages on CPUs): a used one is replaced after a step
    @property
    def adopted(self) -> int: ...

    def check(self) -> int: ...  # standbys found dead since the last check
    def resize(self, failures: int, elapsed_s: float) -> None: ...
    def ensure(self, nodes: Iterable[str]) -> int: ...  # started now
    def ready(self) -> dict[str, int]: ...
    def count(self) -> tuple[int, int]: ...  # (ready, starting)
    def pids(self, node: str) -> list[int]: ...
    def take(self, node: str) -> Standby | None: ...  # a ready standby on ``node`` (its ``actor`` to adopt), removed from the pool; None if there is none
    def take_over(self) -> int: ...  # a dead driver's standbys of the run join the pool; how many
    def actors(self) -> list[ActorRef]: ...  # every standby's actor (a keepalive reaches them)
    def shutdown(self) -> None: ...


class Keepalive(Protocol):
    def stop(self) -> None: ...


class RunRegistry(Protocol):
    """What outlives a driver: the run's config, its committed record and its managers, for
    ``--resume RUN_ID`` (driver failover)."""

    def check_same_model(self, run_id: str, config: Json) -> None: ...  # raises ResumeError
    def retire_old_driver(self, run_id: str, keep: frozenset[str] = frozenset(), keep_standbys: bool = False) -> None: ...  # ends what is not taken over
    def publish_roster(self, run_id: str, roster: Roster) -> None: ...
    def roster(self, run_id: str) -> Roster | None: ...  # the dead driver's stage actors (None: none published)
    def find(self, run_id: str) -> tuple[dict[str, ActorRef], VersionRecord | None]: ...  # managers by node, committed record
    def epoch(self, run_id: str) -> int: ...  # drivers the run had so far (0: none known)
    def publish_run(self, run_id: str, config: Json, epoch: int) -> None: ...
    def publish_committed(self, run_id: str, record: VersionRecord) -> None: ...
    def keepalive(self, handles: Callable[[], list[tuple[ActorRef, str | None]]], period_s: float) -> Keepalive: ...
    def forget(self, run_id: str) -> None: ...


class Faults(Protocol):
    """Fault injection (``chaos``): at fixed points, at a rate, and inside steps."""

    def fire(self, point: str, step: int, targets: FaultTargets) -> None: ...
    def observe_step(self, step: int, seconds: float, width: int) -> float | None: ...
    def wrap(self, executor: StepExecutor, targets: Callable[[], FaultTargets]) -> StepExecutor: ...


class DurableTier(Protocol):
    """The durable tier as the controller drives it (:class:`elastic_llm.durable.tier.DurableTier`
    on Ray; a simulated one in :mod:`elastic_llm.sim`)."""

    @property
    def every(self) -> int: ...
    @property
    def inflight(self) -> Flush | None: ...  # the flush in flight, or None

    def wants(self, record: VersionRecord) -> bool: ...  # at a commit: flush this version? (the coordinator asks)
    def start(self, record: VersionRecord) -> None: ...
    def observe(self, step_s: float, elapsed_s: float, failures: int) -> None: ...
    def poll(self, block: bool = False) -> None: ...
    def latest(self) -> tuple[int, str] | None: ...
    def reset(self) -> None: ...
    def finish(self) -> None: ...
    def checkpoint(self, name: str) -> tuple[str, StreamPosition | None]: ...  # (run URI, data position) of committed checkpoint ``name``


class Runtime(Protocol):
    """What a controller runs on: Ray (:class:`elastic_llm.runtime.RayRuntime`) or a simulated
    fleet (:class:`elastic_llm.sim.runtime.SimRuntime`). ``errors``: the exceptions its calls
    raise when an actor or a node they involve died (the controller observes and recovers)."""

    @property
    def clock(self) -> Clock: ...
    @property
    def rng(self) -> random.Random: ...
    @property
    def errors(self) -> tuple[type[BaseException], ...]: ...
    @property
    def nodes(self) -> Nodes: ...
    @property
    def fleet(self) -> ManagerFleet | None: ...  # the snapshot managers (None: this runtime keeps none)
    @property
    def registry(self) -> RunRegistry: ...
    @property
    def faults(self) -> Faults: ...

    def start(self, cfg: RunConfig, run_id: str, spans: Spans) -> list[tuple[str, str]]: ...  # what a run needs first (Ray: start or join it); warnings for the user: (what, message)
    def standbys(self, cfg: RunConfig, run_id: str) -> Standbys | None: ...
    def group(self, cfg: RunConfig, run_id: str, standbys: Standbys | None) -> StageActors: ...
    def monitor(self, status: RunStatus) -> ActorRef: ...  # the run's monitor, holding its first status (see elastic_llm.monitor.Publisher)
    def durable(self, cfg: RunConfig, snapshots: SnapshotCoordinator, data_dir: str, metrics: MetricsWriter) -> DurableTier | None: ...  # None: no durable tier
    def executor(self, actors: list[list[ActorRef]], cfg: RunConfig, node_of: Callable[[ShardKey], str | None] | None = None,
                 set_aside: Callable[[], frozenset[str]] = frozenset) -> StepExecutor: ...  # node_of: where each actor runs; set_aside: nodes whose actors a step counts lost (a cut link's side)
    def cpu(self) -> float: ...  # the controller's own CPU seconds so far (a simulation leaves out its own bookkeeping)
    def shutdown(self) -> None: ...
