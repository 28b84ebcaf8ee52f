"""The snapshot managers a run has: one per alive node, started where one is missing, and the
census of which nodes' parts of the committed version are gone.

Owns: starting managers (:meth:`ManagerCensus.ensure_managers`: a node whose new manager Ray's
scheduler refuses, or that dies before its first answer, is gone; one that does not answer
the census is replaced), the census a recovery observes
(:meth:`ManagerCensus.lost_parts`, each lost node with why), and what a manager's answer
raises when the run lost something (``CALL_FAILED``) rather than when the code is wrong. Mixed
into :class:`~elastic_llm.snapshot.coordinator.SnapshotCoordinator`, whose records it reads.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from typing import cast

from elastic_llm.snapshot.introductions import Unknown
from elastic_llm.snapshot.ports import Calls, ManagerFleet, ManagerHandle, ManagerLost
from elastic_llm.snapshot.rebuild import SnapshotMissingError
from elastic_llm.snapshot.records import VersionRecord
from elastic_llm.sources import NodeGone

log = logging.getLogger("elastic_llm.snapshot")

PING_S = 10.0  # a manager that does not answer within this is slow ...
SLOW_PING_S = 20.0  # ... and lost if it still has not answered this much later
START_S = 120.0  # longest new managers may take to answer (a worker process start on a loaded node)
# What a manager's answer raises when the run lost something, not when our code is wrong (that propagates): an actor or node
# gone (ManagerLost from Ray's and the simulation's calls, NodeGone; the manager's "no snapshot
# of step ..." from its stages), the version or shard not held or failing its checksum (SnapshotMissingError), an actor its plan
# named by id only that it does not hold (Unknown: the next plan carries the handle), no answer in time.
CALL_FAILED: tuple[type[Exception], ...] = (ManagerLost, NodeGone, SnapshotMissingError, Unknown, TimeoutError, RuntimeError)


class ManagerCensus:
    """Needs the coordinator's ``fleet``, ``calls``, ``managers``, ``gone``, ``committed``,
    ``unloadable`` and naming fields, and its ``note_alive`` / ``settle_relays``."""

    fleet: ManagerFleet
    calls: Calls
    managers: dict[str, ManagerHandle]
    gone: set[str]
    committed: VersionRecord | None
    unloadable: dict[str, int]
    run_id: str
    name_tag: str
    grace_s: float
    _renewed: bool
    _incarnations: dict[str, int]
    _retired: dict[str, ManagerHandle]

    def note_alive(self, alive_nodes: set[str] | frozenset[str]) -> None:
        raise NotImplementedError  # the coordinator's

    def settle_relays(self, block: bool = True) -> None:
        raise NotImplementedError  # the coordinator's

    def ensure_managers(self, alive_nodes: set[str] | frozenset[str] | None = None) -> frozenset[str]:
        """One live SnapshotManager per alive node with CPUs (re-created where one died), the
        nodes the run knows dead left out even while the fleet still lists them (those of
        :meth:`note_alive`, and those not in ``alive_nodes``: the run's view, when the caller has
        one). A node where Ray's scheduler refuses to start one is gone (the refusal is the
        declaration), and so is one whose new manager dies before its first answer (its node
        died while Ray's node table still lists it); a manager that does not answer the census
        (:meth:`lost_parts`) is replaced. Those nodes get no manager and count as dead from now
        on; they are returned (the caller re-plans without them). Each manager is asked once: the
        census asks those there are, then the new ones are asked whether they answer, within
        ``START_S`` (asking the others again was one more round of calls in every parity recovery,
        for an answer the census had just given: the census's own round takes 32-108 ms on the
        loopback cluster)."""
        alive = self.fleet.nodes() - self.gone
        if alive_nodes is not None:
            alive &= set(alive_nodes)
        for node in self.dead_managers(alive):  # every other manager answered it
            if (old := self.managers.pop(node, None)) is not None and node not in alive:  # cut off, perhaps alive: a zombie if it comes back
                self.fleet.end(old)
                self._retired[node] = old
        refused: set[str] = set()
        new = {node: self._start_manager(node) for node in sorted(alive - set(self.managers))}
        if new:
            refused |= self._ask_held(set(new), refused)  # a new manager dead at once: its node is gone
        self.gone |= refused
        self._renewed = self._renewed or bool(refused)
        return frozenset(refused)

    def _start_manager(self, node: str) -> ManagerHandle:
        n = self._incarnations[node] = self._incarnations.get(node, -1) + 1
        name = f"smp-{self.run_id}-{node[:12]}{self.name_tag}" + (f"-{n}" if n else "")  # a SIGKILLed actor's name is released late
        self.managers[node] = self.fleet.start(node, name, self.run_id, self.grace_s)
        return self.managers[node]

    def _ask_held(self, nodes: set[str], refused: set[str]) -> set[str]:
        """Ask the managers of ``nodes`` whether they answer (within ``START_S``). A node whose
        manager Ray's scheduler refused joins ``refused``; those whose manager died are returned.
        Neither keeps its manager."""
        asks = {node: self.managers[node].held.remote() for node in sorted(nodes)}
        self.calls.wait(list(asks.values()), len(asks), START_S)
        died: set[str] = set()
        for node, ref in asks.items():
            try:
                self.calls.get(ref, timeout=0)
            except NodeGone as e:
                log.warning("no snapshot manager on node %s: %s; the node counts as lost", node[:12], e.why)
                refused.add(node)
            except ManagerLost as e:
                log.warning("the snapshot manager on node %s died while asked (%s)", node[:12], type(e.cause).__name__)
                died.add(node)
        for node in refused & set(asks) | died:
            self.managers.pop(node, None)
        return died

    def dead_managers(self, alive_nodes: set[str] | frozenset[str]) -> frozenset[str]:  # nodes whose part of the committed version is gone (lost_parts)
        return frozenset(self.lost_parts(alive_nodes))

    def lost_parts(self, alive_nodes: set[str] | frozenset[str]) -> dict[str, str]:
        """Nodes whose part of the committed version is gone, each with why: the node died, its
        manager does not answer, its manager no longer holds that version (a successor of a killed
        manager), or a shard of it failed to load there (:meth:`fetch_stage_state`: missing or
        failing its checksum). Asks every manager at once; one that is alive but slow (a loaded
        node) gets a second, longer deadline before it counts as lost, since a manager counted
        lost can send the run back to the durable tier. Changes nothing, beyond reading the
        relays of commits and discards that answered (:meth:`settle_relays`, not waiting for the
        rest: none of them changes whether a manager holds the committed version, and waiting
        for them took 33-119 ms of each parity recovery's plan on the loopback cluster)."""

        self.note_alive(alive_nodes)
        self.settle_relays(block=False)
        why = {n: "its node died" for n in self.managers if n not in alive_nodes}
        pings = {n: h.held.remote() for n, h in self.managers.items() if n not in why}
        ready, slow = self.calls.wait(list(pings.values()), len(pings), PING_S)
        if slow:
            self.calls.wait(slow, len(slow), SLOW_PING_S)
        rec = self.committed
        part_of = {n for g in rec.placed for n in g} | {rec.home(s.node_id) for s in rec.shards} if rec is not None else set()
        for node, ref in pings.items():
            try:
                held = cast(Container[int], self.calls.get(ref, timeout=0))  # held(): the versions it holds
            except TimeoutError:  # Ray's GetTimeoutError is one
                why[node] = f"its manager did not answer within {PING_S + SLOW_PING_S:g} s"
                continue
            except CALL_FAILED as e:
                why[node] = f"its manager is gone ({type(getattr(e, 'cause', None) or e).__name__})"
                continue
            if rec is not None and node in part_of and rec.version not in held:
                why[node] = f"its manager no longer holds step {rec.version} (a successor of a killed manager)"
        if rec is not None:  # shards recorded on nodes that no longer have a manager, or that failed to load
            for s in rec.shards:
                if rec.home(s.node_id) not in self.managers:
                    why.setdefault(rec.home(s.node_id), "it has no manager")
            for n, v in self.unloadable.items():
                if v == rec.version:
                    why.setdefault(n, f"a shard of step {v} failed to load there")
        return why
