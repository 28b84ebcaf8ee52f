"""Re-protection of the committed snapshot against draining nodes (a burst of notices) and after
members of its groups were lost.

Owns: the draining nodes the snapshots avoid, the committed version's members already gone,
whether the committed version would lose more members of one erasure group with the draining
ones than its parity covers, or has lost some already (then the coordinator begins a version at
once, at the next step boundary, whose groups spread the draining nodes and leave the gone ones out), and what came of it: each re-protection with its
time since the notice, the draining nodes' shard bytes it covers and whether it committed before
they went (``in_time``; nodes that went first are recorded ``in_time: False`` with the bytes they
took from the committed version). Pure bookkeeping over the coordinator's records and clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from elastic_llm.clock import Clock
from elastic_llm.snapshot.groups import exposed
from elastic_llm.snapshot.records import VersionRecord

log = logging.getLogger("elastic_llm.snapshot")


@dataclass(frozen=True)
class Pending:
    since: float  # when the first notice of this exposure was seen (clock.perf_counter)
    nodes: frozenset[str]  # draining members of groups beyond parity in the committed version
    after: int  # the begin order (the coordinator's attempt counter) of the last version begun when it was seen: only one begun later can cover it
    cause: str = "notice"  # "notice": draining nodes; "loss": members gone without one (also "loss+notice")
    noticed: float | None = None  # when the first draining node of it was seen (None: none, a loss only)


class Exposure:
    def __init__(self, parity: int, clock: Clock) -> None:
        self.parity, self.clock = parity, clock
        self.draining: frozenset[str] = frozenset()
        self.lost: frozenset[str] = frozenset()  # members of the committed version's groups already gone (its parity partly spent)
        self.pending: Pending | None = None
        self.at_risk: frozenset[str] = frozenset()  # parts with nowhere to go, said once (:meth:`stranded`)
        self.done: list[dict[str, Any]] = []  # re-protections (and nodes that went first), for the run's metrics: the caller clears it

    def notice(self, nodes: frozenset[str], committed: VersionRecord | None, last_begin: int) -> None:
        """The nodes draining now. Draining members that left the set before a version without
        them committed are recorded as late; new ones that put the committed version beyond a
        group's parity make the exposure pending."""
        nodes = frozenset(nodes)
        new, left = nodes - self.draining, self.draining - nodes
        self.draining = nodes
        now = self.clock.perf_counter()
        p = self.pending
        if p is not None and left & p.nodes:
            late = frozenset(n for n in left & p.nodes if committed is None or committed.roles_on(n))  # (not those whose parts were all re-homed)
            nbytes = sum(s.nbytes for n in late for r in committed.roles_on(n) for s in committed.infos_on(r)) if committed is not None else 0
            version = committed.version if committed is not None else 0
            if late:
                self.done.append({"version": version, "nodes": sorted(late), "seconds": now - p.since, "bytes": nbytes, "in_time": False,
                                  "cause": p.cause})
                log.warning("draining nodes %s went %.1f s after their notice, before a snapshot without them committed (%.1f MB of "
                            "their shards in step %d's)", [n[:12] for n in sorted(late)], now - p.since, nbytes / 1e6, version)
            p = self.pending = replace(p, nodes=p.nodes - left) if p.nodes - left else None
        at_risk = nodes | self.lost  # a group that already lost a member has that much less parity for the draining ones
        if new and committed is not None and exposed(committed.placed, at_risk, self.parity):
            held = frozenset(n for g in committed.placed if sum(1 for m in g if m in at_risk) > self.parity for n in g if n in nodes)
            self.pending = Pending(p.since if p is not None else now, held | (p.nodes if p is not None else frozenset()), last_begin,
                                   "notice" if p is None or p.cause == "notice" else "loss+notice", p.noticed if p is not None and p.noticed is not None else now)
            log.info("draining nodes %s are more of their erasure groups in snapshot %d than parity covers: re-protecting it at the next step boundary",
                     [n[:12] for n in sorted(held)], committed.version)

    def degraded(self, gone: frozenset[str], committed: VersionRecord | None, last_begin: int) -> None:
        """Members of the committed version's groups are gone (a recovery rebuilt or will rebuild
        their parts from parity): until a version without them commits, one more loss in such a
        group may be beyond parity, so one is taken at the next step boundary (between steps: the
        coordinator's ``reprotect_due``), whatever the cadence."""
        if committed is None:
            return
        new = frozenset(n for g in committed.placed for n in g if n in gone) - self.lost
        if not new:
            return
        self.lost |= new
        p = self.pending
        self.pending = Pending(p.since if p is not None else self.clock.perf_counter(), (p.nodes if p is not None else frozenset()) | new, last_begin,
                               "loss" if p is None or p.cause == "loss" else "loss+notice", p.noticed if p is not None else None)
        log.info("nodes %s of snapshot %d's erasure groups are gone: re-protecting it at the next step boundary", [n[:12] for n in sorted(new)], committed.version)

    def committed(self, record: VersionRecord, avoided: frozenset[str], order: int | None = None) -> None:
        """``record`` committed, its groups made avoiding ``avoided``, ``order``: when it was begun
        (the order :meth:`notice` and :meth:`degraded` were given; its version when None): if it no
        longer depends on the draining nodes beyond parity, the re-protection is done; if it does
        only through nodes noticed after it began, the next version tries again."""
        order = record.version if order is None else order
        self.lost = frozenset(n for g in record.placed for n in g if n in self.lost)  # a version made without them no longer depends on them
        p = self.pending
        if p is None or order <= p.after:
            return
        if exposed(record.placed, self.draining | self.lost, self.parity):
            if not exposed(record.placed, self.draining & avoided, self.parity):
                self.pending = replace(p, after=order)
                return
            self.pending = None
            log.warning("snapshot %d could not spread %d draining nodes so that each group keeps parity %d: too few groups; the "
                        "next recovery may need the durable tier (add nodes or raise snapshot.parity)", record.version, len(p.nodes), self.parity)
            return
        self.pending = None
        nbytes = sum(s.nbytes for n in p.nodes for s in record.infos_on(n))
        seconds = self.clock.perf_counter() - p.since
        self.done.append({"version": record.version, "nodes": sorted(p.nodes), "seconds": seconds, "bytes": nbytes, "in_time": True, "how": "version",
                          "cause": p.cause})
        log.info("snapshot %d re-protected against %d draining or lost nodes in %.2f s (%.1f MB of their shards)",
                 record.version, len(p.nodes), seconds, nbytes / 1e6)

    def critical(self, record: VersionRecord | None) -> bool:
        """Whether one more loss in some group of ``record`` could be beyond its parity: a group
        has already lost (or is losing to drains) as many members as parity covers. Pure."""
        at_risk = self.lost | self.draining
        return record is not None and any(sum(1 for n in g if n in at_risk) >= self.parity for g in record.placed)

    def rehomed(self, record: VersionRecord) -> None:
        """Parts of the committed version were re-homed off draining nodes (:mod:`rehome`): once
        no group of it loses more members with the draining (and lost) nodes than parity covers,
        the draining nodes' share of the exposure is over without a new version. Members already
        lost keep it pending: their parity is spent, and only a new version mends that."""
        p = self.pending
        if p is None:
            return
        covered = (p.nodes & self.draining) - self.lost
        if not covered or exposed(record.placed, self.draining | self.lost, self.parity):
            return
        rest = p.nodes - covered
        self.pending = replace(p, nodes=rest, cause="loss", noticed=None) if rest else None
        seconds = self.clock.perf_counter() - (p.noticed if p.noticed is not None else p.since)
        nbytes = sum(s.nbytes for r, n in record.homes if r in covered for s in record.infos_on(r))
        self.done.append({"version": record.version, "nodes": sorted(covered), "seconds": seconds, "bytes": nbytes, "in_time": True, "how": "rehome",
                          "cause": "notice"})
        log.info("snapshot %d re-protected against %d draining nodes in %.2f s by re-homing their parts", record.version, len(covered), seconds)

    def stranded(self, roles: tuple[str, ...], record: VersionRecord, then: str) -> bool:
        """Parts of the committed version on draining nodes with no live node to go to (a
        collapse), beyond a group's parity: said once per set, in the run's metrics and its log,
        before the nodes go, with ``then``: what the run does about it. Returns whether they are
        beyond parity."""
        if not roles or not exposed(record.placed, frozenset(map(record.home, roles)) | self.lost, self.parity):
            return False
        if frozenset(roles) <= self.at_risk:
            return True
        self.at_risk |= frozenset(roles)
        self.done.append({"version": record.version, "nodes": sorted(roles), "seconds": 0.0, "bytes": 0, "in_time": False, "how": "stranded"})
        log.warning("snapshot %d: %d parts on draining nodes have no live node to go to, beyond their groups' parity: %s",
                    record.version, len(roles), then)
        return True
