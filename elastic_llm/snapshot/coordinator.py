"""Driver-side bookkeeping of snapshot versions: two-phase commit across snapshot managers.

Owns: one SnapshotManager actor per node (named ``smp-<run>-<node>``), when a snapshot is due
(``snapshot.every``, re-chosen after every commit from the measured cost with ``auto``
(:func:`elastic_llm.cadence.snapshot_every`), and ``snapshot.max_lag``: how far the committed version may trail training
before a step waits for it), the erasure groups of each version, the versions in flight (shards
in -> parity encoded -> committed), the record of the latest committed version, and fetching a
stage's committed state back from the managers (a lost shard as the recipe the restored stage
follows to rebuild it from parity, :class:`~elastic_llm.snapshot.records.ParityRebuild`). A cluster of
several nodes too small for one erasure group of ``snapshot.parity`` is refused when the run
starts (:func:`~elastic_llm.snapshot.groups.check_parity_fits`).

Never blocks a training step except when the committed version trails by more than ``max_lag``
(and then with a deadline); never decides recovery: it answers where state is, the controller
decides what to do with it.

Commits and discards reach the managers ~16 per driver call (:mod:`elastic_llm.snapshot.broadcast`);
its managers are started and counted by :class:`~elastic_llm.snapshot.census.ManagerCensus`.
It talks to its managers through :class:`~elastic_llm.snapshot.ports.Calls` (Ray's ``wait``/``get``, or a simulation's) and
reads time from a :class:`~elastic_llm.clock.Clock`: ``elastic-llm simulate`` runs it unchanged.

Why ~600 lines: the two-phase commit, the cadence it is driven by (the cost model and its bookkeeping are in
:mod:`elastic_llm.cadence`), the lost-part census a recovery observes and the restore that follows
a plan all read and change the same in-flight and committed records; split apart, each would need
the others' bookkeeping.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Callable
from typing import Any, cast

from elastic_llm.cadence import SnapshotCost
from elastic_llm.clock import SYSTEM, Clock
from elastic_llm.config import RunConfig
from elastic_llm.sources import Source, SourceLost, UnrecoverableError
from elastic_llm.snapshot.broadcast import Broadcast
from elastic_llm.snapshot.census import CALL_FAILED, PING_S, ManagerCensus
from elastic_llm.snapshot.exposure import Exposure
from elastic_llm.snapshot.groups import make_groups
from elastic_llm.snapshot.introductions import Introductions, Known, actor_id
from elastic_llm.snapshot.ports import Calls, Flusher, ManagerFleet, ManagerHandle
from elastic_llm.snapshot.rebuild import SnapshotMissingError, recipe
from elastic_llm.snapshot.rehome import Rehomer
from elastic_llm.snapshot.records import ATTEMPT_BITS, ManagerPart, ManagerPlan, ParityRebuild, ShardKey, SnapshotStats, StageSource, VersionRecord, generation

log = logging.getLogger("elastic_llm.snapshot")
MAX_INFLIGHT = 2  # versions in flight at once: step t+1's snapshot starts while step t's parity finishes
WAIT_S = 600.0  # longest the driver waits for versions in flight before calling it a failure
COLLAPSE_MARGIN_S = 2.0  # in a collapse, no version begins closer than this (plus twice a flush) to the nodes' end


@dataclass(frozen=True)
class StageMember:
    """A stage actor whose state goes into a version, and the node it runs on."""

    key: ShardKey
    actor: Any
    node_id: str


@dataclass
class _Inflight:
    """A version in flight (driver-side only; never sent to an actor)."""

    version: int
    refs: dict[str, Any]  # first node of a group -> ref of its relay's ManagerParts (the group's: relay_versions)
    groups: tuple[tuple[str, ...], ...]
    lost: tuple[ShardKey, ...]  # stages whose node had no manager
    attempt: int = 0  # ManagerPlan.attempt: a step re-run after a rollback is a new attempt at its version
    avoided: frozenset[str] = frozenset()  # the draining nodes its groups were made to spread
    charged: bool = True  # taken with a training step: ``auto`` charges its cost to the steps (a re-protection between steps is not)
    results: dict[str, ManagerPart] = field(default_factory=dict)  # node -> its part
    answered: set[str] = field(default_factory=set)  # the relays (by first node) that answered
    named: dict[str, tuple[str, tuple[Known, ...]]] = field(default_factory=dict)  # first node -> its manager's actor id, the actors its relay's plans named (held once it answers)

    def waiting(self) -> dict[str, Any]:
        return {lead: ref for lead, ref in self.refs.items() if lead not in self.answered}

    def group_of(self, lead: str) -> tuple[str, ...]:  # the members whose relay is lead (a node in no group relays for itself)
        return next((g for g in self.groups if g and g[0] == lead), (lead,))


class SnapshotCoordinator(ManagerCensus):
    def __init__(self, cfg: RunConfig, fleet: ManagerFleet, run_id: str, clock: Clock = SYSTEM, epoch: int = 1) -> None:
        """``fleet``: where the managers live; ``epoch``: which driver of the run this is (1, then
        one more at each ``--resume RUN_ID``): the attempts it sends exceed any earlier driver's."""
        self.cfg = cfg
        self.fleet = fleet
        self.calls: Calls = fleet.calls
        self.clock = clock
        self.run_id = run_id
        self.epoch = epoch
        self.managers: dict[str, ManagerHandle] = {}
        self.inflight: list[_Inflight] = []  # oldest first, at most MAX_INFLIGHT
        self.committed: VersionRecord | None = None
        self.stats = SnapshotStats()
        self._domain_of: dict[str, str] = {}  # node -> failure domain (fleet.domains(), asked again when a new node joins)
        self._domain_seen: set[str] = set()
        self.refresh_managers = False
        self.gone: set[str] = set()  # nodes known dead (:meth:`note_alive`): their managers get no broadcast
        self.floor = epoch << ATTEMPT_BITS  # the first attempt of this membership generation (elastic_llm.snapshot.fence), sent with every change
        self._renewed = True  # a node was lost since the last version began: the next one starts a generation
        self.fenced: list[tuple[str, str]] = []  # (node, what its manager refused as a zombie's), not reported yet (the caller clears it)
        self.exposure = Exposure(cfg.snapshot.parity, clock)  # nodes about to go (draining): no parity duties, no new shards
        self.rehomer = Rehomer(self.calls, clock, cfg.snapshot.parity)  # the committed version's parts copied off draining nodes at the notice
        self.emergency = -1  # the newest version flushed because its parts had nowhere to go (a collapse)
        self.collapse = False  # every node the run has is draining and the committed version is beyond parity on them (_time_to_flush)
        self.ends_at: float | None = None  # clock.time() the first draining node goes (its notice's deadline), told by the elastic look
        self.flush_s = 0.0  # the longest emergency flush so far (seconds)
        self._flush_t0: float | None = None  # when the emergency flush under way started
        self.broadcast = Broadcast(self.calls, PING_S)  # commits and discards to every manager
        self._dropped: list[Any] = []  # result refs of dropped versions, retrieved once done (no "unhandled error" noise)
        self._incarnations: dict[str, int] = {}  # managers created per node
        self._retired: dict[str, ManagerHandle] = {}  # the manager of each node lost, ended, and ended again if the node rejoins (_rejoin)
        self.durable: Flusher | None = None  # the durable tier: decides at each commit whether to flush it
        self.on_commit: Callable[[VersionRecord], None] | None = None  # driver failover publishes each committed record
        self.grace_s = cfg.recovery.driver_grace_s  # > 0: detached managers that outlive their driver this long
        self.name_tag = ""  # a resuming driver's managers get names of their own (the old ones may still hold theirs)
        sn = cfg.snapshot
        self.auto = sn.every == "auto"
        self.costs = SnapshotCost(sn.max_overhead_pct) if self.auto else None  # auto: what versions cost the steps, and the interval
        self._every = 0 if self.auto else int(sn.every)  # auto: costs.every
        self.last_begin = 0
        self._attempt = 0  # the newest ManagerPlan.attempt sent
        self.introduced = Introductions()  # which actor handles each group's lead holds: a plan names those by id only
        self.unloadable: dict[str, int] = {}  # node -> committed version whose shard there failed to load

    @property
    def every(self) -> int:
        """Steps between versions: ``snapshot.every``, or what ``auto`` chose last."""
        return self.costs.every if self.costs is not None else self._every

    @property
    def why(self) -> str:
        return self.costs.why if self.costs is not None else f"snapshot.every={self._every}"

    @property
    def changes(self) -> list[dict[str, Any]]:  # snapshot.every: auto decisions not reported yet (the caller clears the list)
        return self.costs.changes if self.costs is not None else []

    def shutdown(self) -> None:
        for m in self.managers.values():
            self.fleet.end(m)
        self.managers.clear()
        self.inflight.clear()
        self.broadcast.clear()

    # ------------------------------------------------------------------ draining nodes
    @property
    def avoid(self) -> frozenset[str]:
        return self.exposure.draining

    @avoid.setter
    def avoid(self, nodes: frozenset[str]) -> None:
        """Nodes about to go: the committed version's parts on them are re-homed at once
        (:mod:`rehome`); those that cannot be, or whose groups would still lose more members
        than parity covers, get a version that spreads the draining nodes at the next step
        boundary (:mod:`exposure`). Called again while a step runs, it reads the copies done."""
        self.exposure.notice(nodes, self.committed, self._attempt)
        self._rehome()

    def _rehome(self) -> None:
        rec = self.committed
        moved = self.rehomer.poll(rec)
        if moved is not None:
            self.committed = moved
            if self.on_commit is not None:
                self.on_commit(moved)
            self.exposure.rehomed(moved)
        rec, draining = self.committed, self.exposure.draining
        self.collapse = False
        if self._flush_t0 is not None and self.durable is not None and self.durable.inflight is None:  # an emergency flush ended: how long they take
            self.flush_s, self._flush_t0 = max(self.flush_s, self.clock.monotonic() - self._flush_t0), None
        if rec is not None and draining & {n for g in self.rehomer.planned(rec).placed for n in g}:
            up = self.fleet.nodes() - self.gone  # (asked only when parts on draining nodes are not moving yet)
            live = {n: h for n, h in self.managers.items() if n in up}
            stranded = self.rehomer.start(rec, live, draining, self.gone, self._domains(list(live)))
            flush = self.durable is not None and self.durable.inflight is None and rec.version > self.emergency
            then = ("the run has no durable tier (durable.storage_path): it loses its committed steps if they go" if self.durable is None else
                    "an emergency flush of it to the durable tier starts now" if flush else "a flush to the durable tier is under way")
            beyond = self.exposure.stranded(stranded, rec, then)
            self.collapse = beyond and not set(live) - draining  # every node the run has is going: a newer version sits on them too
            if beyond and flush and self.durable is not None:
                self.emergency, self._flush_t0 = rec.version, self.clock.monotonic()
                self._to_all("commit", rec.version, True, (), self.floor)  # pinned for the flush
                self.durable.start(rec)

    @property
    def reprotections(self) -> list[dict[str, Any]]:
        return self.exposure.done

    @property
    def rehomes(self) -> list[dict[str, Any]]:
        return self.rehomer.done

    # ------------------------------------------------------------------ timing
    def _time_to_flush(self) -> bool:
        """In a collapse (every node draining): whether one more version may begin. Each newer
        committed version is flushed while the nodes live (the emergency flush), one at a time; a
        version begins only when no flush is under way and the nodes' end (:attr:`ends_at`) is
        more than twice the longest emergency flush so far plus :data:`COLLAPSE_MARGIN_S` away, so
        that the newest committed version is on the durable tier when they go (a later one, cut by
        their end, would be committed steps lost)."""
        if self.durable is None:
            return True  # nothing outlives the nodes either way
        if self.durable.inflight is not None or self._flush_t0 is not None:
            return False
        return self.ends_at is None or self.ends_at - self.clock.time() > 2 * self.flush_s + COLLAPSE_MARGIN_S

    def due(self, step: int, last: bool = False) -> bool:
        """Whether step ``step`` takes a snapshot. Skips it while two versions are in flight, unless
        the committed version would then trail by more than ``max_lag`` steps: then waits (with a
        deadline) for a version to finish, so a recovery never loses more than that. The run's
        ``last`` step always takes one (waiting likewise): the run's end is what a resume or the
        durable tier's last flush starts from."""
        sn = self.cfg.snapshot
        if self.collapse and not last and not self._time_to_flush():
            self.stats.skipped += 1
            return False
        if self.exposure.pending is not None and not self.inflight and not self.rehomer.moves:  # a burst of notices: re-protect now, whatever the cadence
            return True  # (unless its parts are being re-homed: a version is taken if that fails)
        if not last and ((step - self.last_begin < self.every) if self.auto else (step % self.every)):
            return False
        lag = step - (self.committed.version if self.committed else 0)
        if self.costs is not None and not last and self.costs.probing() and lag < sn.max_lag:
            return False  # no version until a step ran clean: what snapshots cost is measured against a current baseline
        self.poll()
        if self.can_begin():
            return True
        if lag <= sn.max_lag and not last:
            self.stats.skipped += 1
            return False
        t = self.clock.perf_counter()
        while not self.can_begin():
            self.poll(block=True, timeout=WAIT_S)
        self.stats.wait_s += self.clock.perf_counter() - t
        return True

    def reprotect_due(self, step: int) -> bool:
        """Whether to take a version now, between steps, at ``step`` (the step every stage is at:
        after a recovery, the committed one's): the committed version has lost members of its
        erasure groups, or draining ones beyond their parity (:mod:`exposure`), no version in
        flight covers it, and it is not being flushed (the flush reads its pieces). Waiting for the
        next step leaves the run one more loss from losing everything for a step's time and more
        (a replay lost a second node of a 4-node group 18 s after the first, during the recovery's
        first step). A version of the committed step replaces it on each manager only once it commits."""
        rec, flushing = self.committed, self.durable.inflight if self.durable is not None else None
        if rec is None or self.collapse or self.exposure.pending is None or self.inflight or self.rehomer.moves or step < rec.version:  # a collapse: nowhere to re-protect to
            return False
        return flushing is None or flushing.record.version != step

    # ------------------------------------------------------------------ one version
    def begin(self, version: int, stages: list[StageMember], with_step: bool = True) -> None:
        """Start snapshot ``version``: one call per erasure group, to its first member's manager,
        which starts every member's part (each collects its node's stage
        copies (the stages' step ``version`` was submitted with ``snapshot=...``, or, with
        ``with_step`` False, a re-protection: their state was copied between steps), offers chunks
        to parity holders and encodes its parity. Nothing here waits."""
        if not self.can_begin():
            raise RuntimeError(f"snapshots of steps {[p.version for p in self.inflight]} are still in flight")
        if back := {m.node_id for m in stages} & self.gone:  # the run placed stages on a node it had lost: a new member
            self._rejoin(back)
        if self.refresh_managers or any(m.node_id not in self.managers for m in stages):
            self.ensure_managers()
            self.refresh_managers = False
        sn = self.cfg.snapshot
        attempt = self._attempt = max(self._attempt + 1, self.epoch << ATTEMPT_BITS)  # increasing, also across drivers (a later driver's epoch is higher)
        if self._renewed:  # the first version since a node was lost: what older attempts send from now on is a zombie's
            self.floor, self._renewed = attempt, False
        by_node: dict[str, list[tuple[ShardKey, Any]]] = {node: [] for node in self.managers}
        lost = []
        for m in stages:
            if m.node_id in by_node:
                by_node[m.node_id].append((m.key, m.actor))
            else:
                lost.append(m.key)
        # a draining node takes no parity duties unless it still hosts stages: then its shards
        # must be covered by a group until they are moved (or it goes and they are rebuilt)
        members = sorted(n for n in self.managers if n not in self.avoid or by_node[n])
        domains = dict(self._domains(members))
        domains.update({n: "\0draining" for n in members if n in self.avoid})  # spread over the groups: at most parity in any
        groups = make_groups(members, sn.group_size, sn.parity, domains, seed=version)
        group_of = {node: g for g in groups for node in g}
        by_lead: dict[str, list[tuple[Known, ManagerPlan]]] = {}
        receivers = {node: actor_id(handle) for node, handle in self.managers.items()}  # a lead's plans name what it holds by id only
        for node, handle in self.managers.items():
            if node in self.avoid and not by_node[node]:
                continue  # a draining node with nothing of this version: its end must not fail it
            group = group_of.get(node, ())
            lead = group[0] if group else node
            name = partial(self.introduced.name, receivers[lead], attempt=attempt)
            plan = ManagerPlan(
                version=version,
                stages=tuple((key, name(actor)) for key, actor in by_node[node]),
                group=group,
                me=group.index(node) if group else 0,
                peers=tuple(name(self.managers[n]) for n in group),
                parity=sn.parity,
                attempt=attempt,
                floor=self.floor,
            )
            by_lead.setdefault(lead, []).append((name(handle), plan))
        # one call per group: its first manager starts the members' parts and answers with all of them
        refs = {lead: self.managers[lead].relay_versions.remote(tuple(calls)) for lead, calls in by_lead.items()}
        named = {lead: (receivers[lead], tuple(k for member, plan in calls for k in (member, *plan.named()))) for lead, calls in by_lead.items()}
        self.inflight.append(_Inflight(version, refs, groups, tuple(lost), attempt, self.avoid, charged=with_step, named=named))
        self.last_begin = version
        if self.costs is not None and with_step:
            self.costs.began(version)

    def _domains(self, members: list[str]) -> dict[str, str]:
        """The failure domains of ``members``, asked of the fleet only when a member is new."""
        if not set(members) <= self._domain_seen:
            self._domain_of = self.fleet.domains()
            self._domain_seen = set(members)
        return self._domain_of

    def can_begin(self) -> bool:
        return len(self.inflight) < MAX_INFLIGHT

    def busy(self) -> bool:
        """Whether a version is still being worked on by a manager (a part not answered yet). No waiting."""
        refs = [r for p in self.inflight for r in p.waiting().values()]
        if not refs:
            return False
        ready, _ = self.calls.wait(refs, len(refs), 0)
        return len(ready) < len(refs)

    def poll(self, block: bool = False, timeout: float = WAIT_S, final: bool = False, drop: bool = True) -> None:
        """Commit the newest version whose parts all finished (older ones in flight are then
        superseded and dropped); drop a version as soon as one of its parts failed (which wakes
        the managers still waiting on it). ``block`` waits until nothing is in flight, at most
        ``timeout`` seconds (then the versions still in flight are dropped, with a warning).
        ``final``: the run has ended: what commits now decides no cadence (no step follows).
        ``drop`` False: what is still in flight at the deadline stays in flight."""

        deadline = self.clock.monotonic() + timeout
        self._drain_dropped()
        self._rehome()
        while self.inflight:
            waiting = {ref: (p, lead) for p in self.inflight for lead, ref in p.waiting().items()}
            ready: list[Any] = []
            if waiting:
                left = max(0.0, deadline - self.clock.monotonic()) if block else 0
                ready, _ = self.calls.wait(list(waiting), 1 if block else len(waiting), left)
            for ref in ready:
                p, lead = waiting[ref]
                if p not in self.inflight:
                    continue
                try:
                    parts = cast(tuple[ManagerPart, ...], self.calls.get(ref))
                    self.fenced += [(part.node_id, what) for part in parts for what in part.fenced]
                    if mixed := sorted({part.attempt for part in parts} - {p.attempt}):  # never commits pieces of two generations
                        raise SnapshotMissingError(f"parts of attempts {', '.join(map(generation, mixed))} in a version of attempt {generation(p.attempt)}")
                    p.results.update((part.node_id, part) for part in parts)
                    p.answered.add(lead)
                    if lead in p.named:
                        self.introduced.answered(*p.named[lead], p.attempt)
                except CALL_FAILED as e:  # a manager or a stage died mid-snapshot: drop this version
                    if lead in p.named:
                        self.introduced.failed(p.named[lead][0])
                    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                    self._discard(p, lines[-1] if lines else type(e).__name__)
            for p in list(self.inflight):
                if p in self.inflight and p.lost:
                    self._discard(p, f"{', '.join(map(str, p.lost))} had no snapshot manager")
            done = [p for p in self.inflight if len(p.answered) == len(p.refs)]
            if done:
                newest = done[-1]
                for p in [p for p in self.inflight if p.version < newest.version]:
                    self._discard(p, None)  # superseded by the newer complete one
                self._commit(newest, choose=not final)
            if not block:
                return
            if self.inflight and self.clock.monotonic() >= deadline:
                for p in list(self.inflight) if drop else ():
                    self._discard(p, f"not complete after {timeout:.0f} s")
                return

    def _commit(self, p: _Inflight, choose: bool = True) -> None:
        t0 = self.clock.perf_counter()
        shards = tuple(s for part in p.results.values() for s in part.shards)
        record = VersionRecord(p.version, p.groups, tuple(sorted(shards, key=lambda s: (s.key.stage, s.key.replica))), attempt=p.attempt)  # tuple key: ShardKey's ordering is ~5x slower
        flush = self.durable is not None and self.durable.wants(record)
        flushing = self.durable.inflight if self.durable is not None else None
        keep = (flushing.record.version,) if flushing is not None else ()
        if self.on_commit is not None:  # published before any manager frees the version it replaces: a driver
            self.on_commit(record)  # killed in between leaves a record whose parts are all still held
        self._to_all("commit", record.version, flush, keep, self.floor)  # pinned until its flush is over
        self.committed = record
        self.exposure.committed(record, p.avoided, p.attempt)
        self.inflight.remove(p)
        self.stats.add_commit(list(p.results.values()), self.clock.perf_counter() - t0)
        if self.costs is not None and p.charged:  # what its parts took: the busiest node's stage copies and manager CPU time
            self.costs.ended(p.version, max((part.cost_s() for part in p.results.values()), default=0.0) if choose else None)
        if flush and self.durable is not None:
            self.durable.start(record)

    def observe_step(self, seconds: float, began: bool = False) -> None:
        """A training step's wall time, before this step's :meth:`poll`; ``began``: the step began
        a version. ``auto`` charges what versions cost from it (:class:`~elastic_llm.cadence.SnapshotCost`)."""
        if self.costs is not None:
            self.costs.step(seconds, [p.version for p in self.inflight], began)

    def _discard(self, p: _Inflight, why: str | None, expected: bool = False) -> None:
        """Drop a version in flight: superseded by a newer complete one (``why`` None) or failed
        (``expected``: because its training step failed, which the controller reports)."""
        self._to_all("discard", p.version, p.attempt, self.floor)
        self.inflight.remove(p)
        if self.costs is not None and p.charged:
            self.costs.ended(p.version, None)
        self._dropped += list(p.waiting().values())
        if why is None:
            self.stats.superseded += 1
            return
        self.stats.discarded += 1
        self.refresh_managers = True  # a manager may have died: re-create before the next version
        (log.info if expected else log.warning)("snapshot of step %d discarded: %s", p.version, why)

    def _to_all(self, method: str, *args: Any) -> None:
        """Call ``method`` on every manager not on a node known dead, ~16 per driver call (:class:`Broadcast`)."""
        self._dropped += self.broadcast.send({n: h for n, h in self.managers.items() if n not in self.gone}, method, *args)

    def settle_relays(self, block: bool = True) -> None:
        """Every live manager holds the commits and discards sent so far (:meth:`Broadcast.settle`)."""
        self._dropped += self.broadcast.settle(self.managers, block, frozenset(self.gone))

    def note_alive(self, alive_nodes: set[str] | frozenset[str]) -> None:
        """The managers on nodes not in ``alive_nodes`` are dead (the run judged their node dead,
        perhaps before Ray did): no commit or discard goes to them, none is waited for."""
        lost = {n for n in self.managers if n not in alive_nodes} - self.gone
        self.gone |= lost
        self._renewed = self._renewed or bool(lost)
        self._drop_unreachable()
        self.exposure.degraded(frozenset(self.gone), self.committed, self._attempt)

    def _rejoin(self, nodes: set[str]) -> None:
        """``nodes``, lost before, are members again (a healed partition, the end of a set-aside):
        the manager each had (a zombie of an older generation: refused by its peers, it still
        holds memory) is stopped, and the next :meth:`ensure_managers` starts a new one there."""
        for node in sorted(nodes):
            for old in filter(None, (self.managers.pop(node, None), self._retired.pop(node, None))):
                self.fleet.end(old)
            log.info("node %s rejoins the run: its old snapshot manager is stopped, a new one starts", node[:12])
        self.gone -= nodes

    def _drop_unreachable(self) -> None:
        """Drop each version in flight waiting on a group with a member on a node known dead: its part cannot arrive (across a cut
        link the relay's pull hangs until Ray declares the node dead, ~60 s on the harness, which a recovery used to sit out).
        A group whose answer is already in keeps its version (the next :meth:`poll` commits it)."""
        for p in list(self.inflight):
            stuck = {lead: ref for lead, ref in p.waiting().items() if self.gone.intersection(p.group_of(lead))}
            if stuck and len(self.calls.wait(list(stuck.values()), len(stuck), 0)[0]) < len(stuck):
                lost = ", ".join(n[:12] for n in sorted(self.gone & {n for lead in stuck for n in p.group_of(lead)}))
                self._discard(p, f"the parts of its groups with node {lost} cannot arrive: the node is lost")

    def _drain_dropped(self) -> None:
        """Collect the answers of dropped versions' calls (their failure was already acted on:
        reading them keeps Ray from reporting them as unhandled errors)."""
        if not self._dropped:
            return
        done, self._dropped = self.calls.wait(self._dropped, len(self._dropped), 0)
        for ref in done:
            try:
                self.calls.get(ref, timeout=0)
            except CALL_FAILED:  # the version was dropped for this failure already
                continue

    def abandon_pending(self, from_version: int = 0) -> None:
        """Forget the versions in flight from ``from_version`` on (after a training failure);
        their partial data is discarded."""
        for p in [p for p in self.inflight if p.version >= from_version]:
            self._discard(p, "its training step failed", expected=True)

    def forget_all(self) -> None:
        """Everyone rolled back to a durable checkpoint older than every version held: forget
        them all (the next committed version starts the record again)."""
        self.abandon_pending()
        self.settle_relays()
        calls = [m.discard_all.remote(self.floor) for m in self.managers.values()]
        self.calls.wait(calls, len(calls), PING_S)  # before any new version starts (threaded actors do not keep call order)
        self.committed = None

    def adopt(self, record: VersionRecord) -> None:
        """``--resume``: the dead driver's published record is committed on every manager (it may
        have died after publishing it, before they heard) and what is older is freed."""
        self.committed = record
        self._to_all("commit", record.version, False, (), self.floor)

    # ------------------------------------------------------------------ restore
    def fetch_stage_state(self, stage: int, replica: int, lost_nodes: set[str] | frozenset[str]) -> StageSource:
        """Where the committed state of ``stage`` is (all its data-parallel slices, as many as
        the run had replicas when the version was taken), with the manifest of ``replica`` (its
        RNG; the last one recorded if the run was narrower then), as the plan has it: shards on
        ``lost_nodes`` (the plan's lost parts) as recipes the restored stage follows to rebuild
        them from parity into its own state (:class:`ParityRebuild`), every other shard from its node's
        manager, which checks its pieces. A shard that fails to load on its node is news to the
        plan: it is recorded (:meth:`lost_parts` counts it from then on) and :class:`SourceLost`
        raised, so the controller observes again and re-plans; this never switches source on its
        own. The refs go straight to the stage being restored: no bytes pass through the driver."""
        rec = self.committed
        if rec is None:
            raise UnrecoverableError("no snapshot has been committed yet")
        offsets: list[int] = []
        refs: list[Any] = []
        rebuilds: list[ParityRebuild] = []
        sources: list[Source] = []
        slices = [info for info in rec.shards if info.key.stage == stage]
        for info in slices:
            node = rec.home(info.node_id)
            if node in lost_nodes or node not in self.managers:
                rebuilds.append(recipe(rec, info, set(lost_nodes) | {node}, self.managers, self.cfg.snapshot.parity))
                sources.append(Source.PARITY)
                continue
            try:
                got = cast(list[object], self.calls.get(self.managers[node].shard_parts.remote(rec.version, info.key), timeout=WAIT_S))
            except CALL_FAILED as e:
                self.unloadable[node] = rec.version
                why = getattr(e, "cause", None) or e  # a task's error: the manager's own exception
                raise SourceLost(f"{info.key}'s shard of step {rec.version} failed to load on its node {node[:12]} "
                                 f"({type(why).__name__}: {(str(why).splitlines() or [''])[0][:200]}): its part counts as lost from now on") from None
            offsets += [p.offset for p in info.pieces]
            refs += got
            sources.append(Source.LOCAL_SMP)
        manifest = slices[min(replica, len(slices) - 1)].manifest
        return StageSource(tuple(offsets), tuple(refs), manifest, tuple(sources), tuple(rebuilds))
