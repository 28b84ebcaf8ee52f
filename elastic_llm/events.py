"""Every event line of a run's metrics file, as a type: written by the controller and the tiers,
read back by the monitor, the soak, the experiments and the benchmarks through :func:`parse`.

Owns: :class:`Kind` (the ``event`` word of a line) and one frozen dataclass per kind, whose fields
are the line's keys (:meth:`Event.record` is the line; a ``flat`` field spreads its mapping into
it, as the spans of a recovery do; an ``optional`` field left at None is left out). An event also
reads as that mapping (``ev["source"]``, ``ev.get("stage")``), so code and files that knew the
lines as dicts read the same values. Step lines (no ``event`` key) stay plain dicts.
Never writes a file (the controller's ``MetricsWriter`` does), never refuses a line (a reader of
metrics must read what an older or newer writer wrote) and imports nothing of the project but the
enums: every layer may use it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from elastic_llm.sources import StrEnum


class Kind(StrEnum):
    START = "start"
    STATE = "state"
    RECOVERY = "recovery"
    DRAIN = "drain"
    RESIZE = "resize"
    WAITING_FOR_CAPACITY = "waiting_for_capacity"
    REATTACH = "reattach"
    RESUME = "resume"
    CHECKPOINT = "checkpoint"
    DURABLE = "durable"
    DURABLE_EVERY = "durable_every"
    DURABLE_FAILED = "durable_failed"
    SNAPSHOT_EVERY = "snapshot_every"
    REPROTECT = "reprotect"
    REHOME = "rehome"
    CHAOS = "chaos"
    CHAOS_RATE = "chaos_rate"
    STANDBY = "standby"
    NODE_DEAD = "node_dead"
    NODE_SUSPECT = "node_suspect"
    FENCED = "fenced"
    LINK_CUT = "link_cut"
    STRAGGLER = "straggler"
    WARNING = "warning"
    FAILED = "failed"
    END = "end"


def flat() -> Any:
    """A mapping field whose items are keys of the line itself (spans, per-kind details)."""
    return field(default_factory=dict, metadata={"flat": True})


def optional(default: Any = None) -> Any:
    """A field left out of the line while it is None."""
    return field(default=default, metadata={"optional": True})


@dataclass(frozen=True, kw_only=True)
class Event(Mapping[str, Any]):
    """One event line. Subclasses set ``kind`` and list the line's keys as fields."""

    kind: ClassVar[Kind]
    time: float = field(default_factory=time.time)

    def record(self) -> dict[str, Any]:
        """The metrics line: ``event``, ``time``, then the fields in order."""
        out: dict[str, Any] = {"event": self.kind.value, "time": self.time}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "time" or (value is None and f.metadata.get("optional")):
                continue
            if f.metadata.get("flat"):
                out.update(value)
            else:
                out[f.name] = value
        return out

    def __getitem__(self, key: str) -> Any:
        return self.record()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.record())

    def __len__(self) -> int:
        return len(self.record())


@dataclass(frozen=True, kw_only=True)
class Start(Event):
    kind = Kind.START
    run_id: str
    config: dict[str, Any]
    parameters: int
    actors: list[dict[str, Any]]  # stage, replica, node_id, pid of every stage actor
    data_dir: str
    setup_s: dict[str, float] = field(default_factory=dict)  # where the start went: ray, retire, managers, stages, ...


@dataclass(frozen=True, kw_only=True)
class StateChange(Event):
    kind = Kind.STATE
    step: int
    old: str
    new: str
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Recovery(Event):
    """One restored actor of a finished recovery (``stage`` None and source ``none``: nothing was lost)."""

    kind = Kind.RECOVERY
    step: int  # the failed step
    stage: int | None
    replica: int | None
    source: str  # a Source, or "none"
    lossless: bool
    rollback_steps: int
    committed_steps_lost: int = 0  # committed steps the rollback undid (a fall-back beyond the newest committed snapshot)
    seconds: float
    reason: str  # the plan's
    failure: str
    failed_op: str | None = None
    survivors_restored_from_own_copy: int | None = optional()
    weights: list[float] | None = optional()  # CheckFree: the neighbours' averaging weights (next, prev)
    donors: list[int] | None = optional()  # CheckFree: the donor stages
    params_crc32: int | None = optional()  # CheckFree: CRC-32 of the rebuilt parameters
    mirror: bool | None = optional()  # CheckFree+: whether the embedding / head came from a mirror
    lr_scale: float | None = optional()  # CheckFree: the rebuilt stage's learning-rate scale
    state_bytes: int | None = optional()  # dp_peer: the bytes of the state streamed from the peer; parity: the bytes rebuilt
    transfer_s: float | None = optional()  # dp_peer: the target's seconds to take them (connection, bytes, restore); parity: the rebuild's (pulls, decode)
    spans: dict[str, float] = flat()  # plan_s, actor_s, state_s, ...


@dataclass(frozen=True, kw_only=True)
class Drain(Event):
    kind = Kind.DRAIN
    step: int
    node: str
    deadline_s: float | None
    moved: int
    dropped: int  # 0: a drain drops no replica (the recovery at the node's end drops the fewest); kept for the line's readers
    stayed: int
    seconds: float
    rollback_steps: int = 0
    how: str = ""
    settle: str = ""  # snapshot versions in flight before whole replicas moved: "committed", "cut" at the nodes' time, "skipped" (none left), "" none
    spans: dict[str, float] = flat()


@dataclass(frozen=True, kw_only=True)
class Resize(Event):
    kind = Kind.RESIZE
    step: int
    from_dp: int
    to_dp: int
    reason: str
    seconds: float
    spans: dict[str, float] = flat()


@dataclass(frozen=True, kw_only=True)
class WaitingForCapacity(Event):
    kind = Kind.WAITING_FOR_CAPACITY
    step: int
    need: Any
    have: Any
    waited_s: float
    deadline_s: float


@dataclass(frozen=True, kw_only=True)
class Reattach(Event):
    """A new driver (``--resume``) took the run over from its committed in-memory snapshot."""

    kind = Kind.REATTACH
    step: int
    run_id: str
    seconds: float
    managers: int
    kept: int = 0  # stage actors taken over with the committed state in place (nothing restored)
    restored: int = 0  # stage actors that restored it from the managers (new ones, or past it)


@dataclass(frozen=True, kw_only=True)
class Resume(Event):
    """The run went on from a durable checkpoint."""

    kind = Kind.RESUME
    step: int
    path: str
    seconds: float
    width_then: int | None = None
    stages_then: int | None = None


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Event):
    kind = Kind.CHECKPOINT
    step: int
    seconds: float
    path: str


@dataclass(frozen=True, kw_only=True)
class Durable(Event):
    """A durable checkpoint committed."""

    kind = Kind.DURABLE
    step: int
    path: str
    seconds: float
    bytes: int
    gbps: float
    every: int
    why: str
    pruned: list[str]  # checkpoint directories removed (durable.keep_last)


@dataclass(frozen=True, kw_only=True)
class DurableEvery(Event):
    kind = Kind.DURABLE_EVERY
    every: int
    previous: int
    interval_s: float
    flush_cost_s: float
    mtbf_s: float
    snapshot_every: int
    step_s: float
    why: str


@dataclass(frozen=True, kw_only=True)
class DurableFailed(Event):
    kind = Kind.DURABLE_FAILED
    step: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Reprotect(Event):
    """Draining nodes held more of the committed version than its groups' parity covers: a
    version without that exposure committed ``seconds`` after the notice was seen (or, not
    ``in_time``, they went ``seconds`` after it, first)."""

    kind = Kind.REPROTECT
    step: int = 0
    version: int
    nodes: list[str]
    seconds: float
    bytes: int  # the draining nodes' shard bytes now protected by groups that outlive them (in_time: False: that they took)
    in_time: bool = True  # False: they went first, before a version without them committed
    how: str = "version"  # a version without them ("version"), their parts re-homed ("rehome"), or nowhere to go ("stranded": ``nodes`` are the parts, said at the notice)
    cause: str = "notice"  # what exposed it: draining nodes ("notice"), members gone without a notice ("loss"; ``seconds`` from the loss), or both ("loss+notice")


@dataclass(frozen=True, kw_only=True)
class Rehome(Event):
    """One member's part of the committed version (its pieces and parity) copied off a draining
    node (``source``) to ``target``, ``seconds`` after the notice (``copy_s`` of them copying)."""

    kind = Kind.REHOME
    step: int = 0
    version: int
    role: str
    source: str
    target: str
    bytes: int
    seconds: float
    copy_s: float


@dataclass(frozen=True, kw_only=True)
class SnapshotEvery(Event):
    """``snapshot.every: auto`` chose a new cadence."""

    kind = Kind.SNAPSHOT_EVERY
    step: int = 0
    every: int
    previous: int
    cost_s: float
    step_s: float
    parts_s: Any
    felt_s: float
    max_overhead_pct: float
    why: str
    version: int


@dataclass(frozen=True, kw_only=True)
class Chaos(Event):
    kind = Kind.CHAOS
    step: int
    kill: str
    stage: int
    replica: int
    how: str
    corrupt: bool
    during: str
    op: str


@dataclass(frozen=True, kw_only=True)
class ChaosRate(Event):
    kind = Kind.CHAOS_RATE
    step: int
    rate_per_hour: float
    prob_per_step: float


@dataclass(frozen=True, kw_only=True)
class Standby(Event):
    """Warm standbys lost (``lost``) or started (``started``)."""

    kind = Kind.STANDBY
    step: int
    lost: int | None = optional()
    started: int | None = optional()
    ready: int
    starting: int | None = optional()
    per_node: int | None = optional()


@dataclass(frozen=True, kw_only=True)
class NodeDead(Event):
    kind = Kind.NODE_DEAD
    step: int
    node: str
    address: str
    outcome: str
    failures: int
    suspect_s: float


@dataclass(frozen=True, kw_only=True)
class NodeSuspect(Event):
    """The node watch's probes to ``node`` timed out ``recovery.node_probe_failures`` times in a
    row: the run places nothing there and a step with an actor there gets the suspect deadline."""

    kind = Kind.NODE_SUSPECT
    step: int
    node: str


@dataclass(frozen=True, kw_only=True)
class Fenced(Event):
    """``count`` calls, links, offers or writes of an older membership generation were refused (a
    zombie's: its node was cut off and came back, or its driver was replaced by ``--resume``);
    ``what`` names each. Who refused: stage ``stage`` replica ``replica``, the snapshot manager of
    node ``node``, or (all None) the durable tier (files a zombie wrote into a checkpoint's
    directory, which its manifest does not name)."""

    kind = Kind.FENCED
    step: int
    count: int
    what: list[str]
    stage: int | None = None
    replica: int | None = None
    node: str | None = None


@dataclass(frozen=True, kw_only=True)
class LinkCut(Event):
    """The run's nodes in ``pairs`` could not reach each other (each still reached the driver)
    after step ``step`` failed: ``set_aside`` (the side :func:`~elastic_llm.recovery.links.pick_side`
    chose) gets nothing placed on it for ``for_s`` seconds (its ``times``-th time), and its stages
    are recovered elsewhere."""

    kind = Kind.LINK_CUT
    step: int
    pairs: list[list[str]]
    set_aside: str
    for_s: float
    times: int


@dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """The links cost the run's slowest actor ``share`` of each step for
    ``recovery.straggler_steps`` steps; the measured rates named ``node`` (its pairs at
    ``node_mb_s``, the fastest pair at ``fastest_mb_s``): its stages move off it like a drain,
    and nothing is placed on it for ``for_s`` seconds (its ``times``-th time)."""

    kind = Kind.STRAGGLER
    step: int
    node: str
    share: float
    node_mb_s: float
    fastest_mb_s: float
    for_s: float
    times: int


@dataclass(frozen=True, kw_only=True)
class RunWarning(Event):
    kind = Kind.WARNING
    step: int
    what: str
    message: str


@dataclass(frozen=True, kw_only=True)
class Failed(Event):
    kind = Kind.FAILED
    step: int
    reason: str
    exit_code: int


@dataclass(frozen=True, kw_only=True)
class End(Event):
    kind = Kind.END
    step: int
    tokens: int
    elapsed_s: float
    seconds_by_state: dict[str, float] = field(default_factory=dict)
    cpu_by_state: dict[str, float] = field(default_factory=dict)  # the driver's CPU seconds in each state


KINDS: dict[str, type[Event]] = {cls.kind.value: cls for cls in Event.__subclasses__()}


def parse(record: Mapping[str, Any]) -> Event | None:
    """The typed event of a metrics line; None for a step line or a kind this version does not
    know (a newer writer's). Keys the kind does not list go into its ``flat`` field, if it has
    one, else are dropped; keys it lists that the line lacks (a line of an older writer, which
    wrote no ``time`` on recovery lines, or a hand-made one) read as None."""
    if isinstance(record, Event):
        return record
    kind = record.get("event")
    cls = KINDS.get(str(kind)) if kind is not None else None
    if cls is None:
        return None
    own = {f.name: f for f in fields(cls)}
    spread = next((f.name for f in own.values() if f.metadata.get("flat")), None)
    kwargs: dict[str, Any] = {name: None for name, f in own.items() if f.default is MISSING and f.default_factory is MISSING}
    kwargs["time"] = None
    rest: dict[str, Any] = {}
    for key, value in record.items():
        if key == "event":
            continue
        if key in own and key != spread:
            kwargs[key] = value
        else:
            rest[key] = value
    if spread is not None:
        kwargs[spread] = rest
    return cls(**kwargs)


def read_lines(path: str | Path, growing: bool = False) -> list[dict[str, Any]]:
    """Every line of a metrics file as written (events and steps alike). ``growing``: a file
    another process is still writing: a missing file is empty and its last line, if cut short,
    is left out (a broken line anywhere else still raises)."""
    p = Path(path)
    if growing and not p.exists():
        return []
    lines = [line for line in p.read_text().splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if growing and i == len(lines) - 1:
                break
            raise
    return out


def read_events(path: str | Path) -> list[Event]:
    """The event lines of a metrics file, typed."""
    return [ev for ev in map(parse, read_lines(path)) if ev is not None]
