"""Re-protection of the committed snapshot against draining nodes (a burst of notices).

Owns: the draining nodes the snapshots avoid, whether the committed version would lose more
members of one erasure group with them than its parity covers (then the coordinator begins a
version at once, whose groups spread them), and what came of it: each re-protection with its
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
    after: int  # the last version begun when it was seen: only a later one can cover it


class Exposure:
    def __init__(self, parity: int, clock: Clock) -> None:
        self.parity, self.clock = parity, clock
        self.draining: frozenset[str] = frozenset()
        self.pending: Pending | None = None
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
            late = left & p.nodes
            nbytes = sum(s.nbytes for n in late for s in committed.infos_on(n)) if committed is not None else 0
            version = committed.version if committed is not None else 0
            self.done.append({"version": version, "nodes": sorted(late), "seconds": now - p.since, "bytes": nbytes, "in_time": False})
            log.warning("draining nodes %s went %.1f s after their notice, before a snapshot without them committed (%.1f MB of "
                        "their shards in step %d's)", [n[:12] for n in sorted(late)], now - p.since, nbytes / 1e6, version)
            p = self.pending = replace(p, nodes=p.nodes - late) if p.nodes - late else None
        if new and committed is not None and exposed(committed.groups, nodes, self.parity):
            held = frozenset(n for g in committed.groups if sum(1 for m in g if m in nodes) > self.parity for n in g if n in nodes)
            self.pending = Pending(p.since if p is not None else now, held | (p.nodes if p is not None else frozenset()), last_begin)
            log.info("draining nodes %s are more of their erasure groups in snapshot %d than parity covers: re-protecting it with the next step",
                     [n[:12] for n in sorted(held)], committed.version)

    def committed(self, record: VersionRecord, avoided: frozenset[str]) -> None:
        """``record`` committed, its groups made avoiding ``avoided``: if it no longer depends on
        the draining nodes beyond parity, the re-protection is done; if it does only through
        nodes noticed after it began, the next version tries again."""
        p = self.pending
        if p is None or record.version <= p.after:
            return
        if exposed(record.groups, self.draining, self.parity):
            if not exposed(record.groups, self.draining & avoided, self.parity):
                self.pending = replace(p, after=record.version)
                return
            self.pending = None
            log.warning("snapshot %d could not spread %d draining nodes so that each group keeps parity %d: too few groups; the "
                        "next recovery may need the durable tier (add nodes or raise snapshot.parity)", record.version, len(p.nodes), self.parity)
            return
        self.pending = None
        nbytes = sum(s.nbytes for n in p.nodes for s in record.infos_on(n))
        seconds = self.clock.perf_counter() - p.since
        self.done.append({"version": record.version, "nodes": sorted(p.nodes), "seconds": seconds, "bytes": nbytes, "in_time": True})
        log.info("snapshot %d re-protected against the end of %d draining nodes in %.2f s (%.1f MB of their shards)",
                 record.version, len(p.nodes), seconds, nbytes / 1e6)
