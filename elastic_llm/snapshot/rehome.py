"""Re-homing the committed version's parts off draining nodes, at the notice.

Owns: where each part of the committed version held on a draining node goes
(:func:`choose_homes`, pure: a live node outside the draining set that holds no other member of
its erasure group and keeps its failure domain within parity, then the one with the fewest copies
already queued on its link, so a burst's copies run side by side, not one after another), the
copies in flight (one
``adopt`` call to the new node's manager per part: it pulls the part's pieces and parity from
the draining node's manager and checks every CRC-32) and the record they make once they answer
(the part's *role* moves in :attr:`VersionRecord.homes`; nothing is re-encoded and no version is
taken), and what each took (seconds from the notice, bytes). A part whose node goes before its
copy answers stays where it was: its loss is one more erasure, as without re-homing. Never begins
a version and never waits: :meth:`Rehomer.poll` reads what has answered.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic_llm.clock import Clock
from elastic_llm.snapshot.records import VersionRecord

log = logging.getLogger("elastic_llm.snapshot")


def choose_homes(record: VersionRecord, draining: frozenset[str], live: Iterable[str], domains: Mapping[str, str], parity: int = 1,
                 queued: Mapping[str, int] | None = None) -> tuple[dict[str, str], tuple[str, ...]]:
    """For every role of ``record``'s groups whose pieces are on a ``draining`` node, a ``live``
    node to hold them, by these in turn: the fewest members of that group on it; a failure domain
    that still holds at most ``parity`` of the group with it (a zone lost then costs the group no
    more than its parity); the fewest copies queued on its link (``queued``: those in flight,
    plus the ones chosen here: a node's link carries one copy at a time, so a burst spread over
    links ends in the time of one copy, not of all); then the fewest of the group in its domain,
    the fewest roles of any group, and the name. The moves come in the order their copies should
    start (:func:`_critical_first`). Returns them and the roles that have nowhere to go (no live
    node). Pure."""
    placed = {role: record.home(role) for g in record.groups for role in g}
    load = Counter(placed.values())
    busy = Counter(queued or {})
    up = set(live)
    targets = sorted(up - draining)
    moves: dict[str, str] = {}
    stranded: list[str] = []
    for g, role in _critical_first(record.groups, placed, draining, up, parity):
        if not targets:
            stranded.append(role)
            continue
        others = [placed[m] for m in g if m != role]

        def cost(n: str, others: list[str] = others) -> tuple[int, bool, int, int, int, str]:
            dom = domains.get(n)
            near = sum(1 for o in others if dom is not None and o != n and domains.get(o) == dom)
            return (others.count(n), near + 1 > parity, busy[n], near, load[n], n)

        target = min(targets, key=cost)
        load[placed[role]] -= 1
        load[target] += 1
        busy[target] += 1
        placed[role] = moves[role] = target
    return moves, tuple(stranded)


def _critical_first(groups: tuple[tuple[str, ...], ...], placed: Mapping[str, str], draining: frozenset[str], up: set[str],
                    parity: int) -> list[tuple[tuple[str, ...], str]]:
    """The (group, role) pairs on ``draining`` nodes, in the order their copies start: first, in
    each group, the members beyond what its parity covers with the draining and already lost
    (not ``up``) ones gone (once those are copied, the version outlives the draining nodes),
    then the rest. Pure."""
    first: list[tuple[tuple[str, ...], str]] = []
    rest: list[tuple[tuple[str, ...], str]] = []
    for g in groups:
        going = [m for m in g if placed[m] in draining]
        lost = sum(1 for m in g if placed[m] not in up and placed[m] not in draining)
        need = max(0, len(going) + lost - parity)
        first += [(g, m) for m in going[:need]]
        rest += [(g, m) for m in going[need:]]
    return first + rest


@dataclass(frozen=True)
class Move:
    role: str
    source: str
    target: str
    ref: Any  # the target manager's ``adopt`` call
    since: float  # when the source node's notice was first seen (clock.perf_counter)
    started: float
    version: int


class Rehomer:
    """The re-homes in flight (see the module's docstring); :attr:`done` lists each that
    answered, for the run's metrics (the caller clears it)."""

    def __init__(self, calls: Any, clock: Clock, parity: int = 1) -> None:
        self.calls, self.clock, self.parity = calls, clock, parity
        self.moves: dict[tuple[int, str], Move] = {}  # (version, role) -> its copy in flight (an older version's too, read once it answers)
        self.noticed: dict[str, float] = {}  # draining node -> when first seen
        self.done: list[dict[str, Any]] = []

    def planned(self, record: VersionRecord) -> VersionRecord:
        """``record`` with the copies of its roles in flight counted as done."""
        return record.rehomed({r: m.target for (v, r), m in self.moves.items() if v == record.version})

    def start(self, record: VersionRecord, managers: Mapping[str, Any], draining: frozenset[str], gone: Iterable[str],
              domains: Mapping[str, str]) -> tuple[str, ...]:
        """Start a copy for every role of ``record`` held on a ``draining`` node and not moving
        yet. Returns the roles with nowhere to go."""
        now = self.clock.perf_counter()
        self.noticed = {n: self.noticed.get(n, now) for n in draining}
        planned = self.planned(record)
        live = [n for n in managers if n not in set(gone)]
        moves, stranded = choose_homes(planned, draining, live, domains, self.parity, Counter(m.target for m in self.moves.values()))
        for role, target in moves.items():
            source = planned.home(role)
            if source not in managers:
                continue
            ref = managers[target].adopt.remote(record.version, role, managers[source])
            self.moves[(record.version, role)] = Move(role, source, target, ref, self.noticed.get(source, now), now, record.version)
        if moves:
            log.info("re-homing %d parts of snapshot %d off draining nodes %s", len(moves), record.version, sorted({planned.home(r)[:12] for r in moves}))
        return stranded

    def poll(self, record: VersionRecord | None) -> VersionRecord | None:
        """``record`` with the roles whose copy answered moved to their new nodes (None: none
        did). A copy that failed (its source went first) or is of an older version is dropped."""
        if not self.moves:
            return None
        refs = {m.ref: m for m in self.moves.values()}
        ready, _ = self.calls.wait(list(refs), len(refs), 0)
        moved: dict[str, str] = {}
        now = self.clock.perf_counter()
        for ref in ready:
            m = refs[ref]
            del self.moves[(m.version, m.role)]
            try:
                nbytes = self.calls.get(ref, timeout=0)
            except Exception as e:  # noqa: BLE001 - the source went first (or the target): the role stays, one more erasure if its node goes
                if record is not None and m.version < record.version:
                    continue  # an older version's copy, superseded meanwhile
                log.warning("re-homing %s's part of snapshot %d to %s failed (%s): it stays on its draining node", m.role[:12], m.version, m.target[:12], type(e).__name__)
                continue
            if record is None or m.version != record.version:
                continue
            moved[m.role] = m.target
            self.done.append({"version": m.version, "role": m.role, "source": m.source, "target": m.target, "bytes": int(nbytes),
                              "seconds": now - m.since, "copy_s": now - m.started})
        return record.rehomed(moved) if moved and record is not None else None
