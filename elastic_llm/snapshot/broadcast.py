"""Commits and discards to every snapshot manager, about 16 managers per driver call.

Owns: the relayed calls in flight (one manager of each :data:`RELAY_FANOUT` passes the driver's
``commit`` or ``discard`` on to the others: ``SnapshotManager.relay``, which answers once every
member ran it) and delivery past a relay that died: its answer is read, at the next send without
waiting and on the recovery path waiting (:meth:`Broadcast.settle`), and a relay that failed has
its members sent the call by the driver itself. Both calls are idempotent, so a member that got
it twice is unharmed; a member whose own actor died is left to the failure that names it.

Driver-side only; it talks to managers through the coordinator's ``Calls`` (Ray's or a
simulation's), so ``elastic-llm simulate`` runs it unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("elastic_llm.snapshot")
RELAY_FANOUT = 16  # managers per driver call for a commit or discard (the first passes it on: relay)


@dataclass(frozen=True)
class Relayed:
    """A ``method(*args)`` sent through the manager on ``nodes[0]`` to all of ``nodes``."""

    ref: Any
    nodes: tuple[str, ...]
    method: str
    args: tuple[Any, ...]


class Broadcast:
    def __init__(self, calls: Any, wait_s: float) -> None:
        """``calls``: ``wait``/``get`` over the managers' answers; ``wait_s``: how long a blocking
        :meth:`settle` waits for a relay before it counts as dead."""
        self.calls = calls
        self.wait_s = wait_s
        self.pending: list[Relayed] = []  # sent, answer not read yet

    def send(self, managers: dict[str, Any], method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every manager in ``managers`` (node -> handle), fire and forget;
        returns the refs of calls :meth:`settle` sent past relays that failed since."""
        resent = self.settle(managers, block=False)
        nodes = sorted(managers)
        for i in range(0, len(nodes), RELAY_FANOUT):
            chunk = tuple(nodes[i:i + RELAY_FANOUT])
            ref = managers[chunk[0]].relay.remote(method, args, [managers[n] for n in chunk])
            self.pending.append(Relayed(ref, chunk, method, args))
        return resent

    def settle(self, managers: dict[str, Any], block: bool = True, gone: frozenset[str] = frozenset()) -> list[Any]:
        """Read the relays' answers; where one failed (its manager died, or with ``block`` did not
        answer within ``wait_s``), send its other members the call directly. ``block`` also
        waits for those calls, so every live manager holds what was sent when it returns; a
        relay with a member on a node in ``gone`` (known dead: the relay would answer only once
        Ray fails the call to it) is not waited for, its live members get the call directly,
        also without ``block`` (else a commit relayed through a dead node's manager would reach
        the live members only at the next blocking settle, which a run that fails never has).
        Returns the refs of the calls sent directly and of the relays passed over (the caller
        reads them, so Ray reports no unhandled error for a member that died too)."""
        if not self.pending:
            return []
        stuck = [r.ref for r in self.pending if gone.intersection(r.nodes)]
        by_ref = {r.ref: r for r in self.pending}
        live = [ref for ref in by_ref if ref not in stuck]
        done, rest = self.calls.wait(live, len(live), self.wait_s if block else 0) if live else ([], [])
        self.pending = [] if block else [by_ref[ref] for ref in rest]
        direct: list[Any] = []
        for ref in stuck:
            r = by_ref[ref]
            direct += [getattr(managers[n], r.method).remote(*r.args) for n in r.nodes if n in managers and n not in gone]
        for ref in done + (rest if block else []):
            r = by_ref[ref]
            try:
                self.calls.get(ref, timeout=0)  # it answered: every live member ran the call
                continue
            except Exception as e:  # noqa: BLE001 - however the relay failed (died, no answer), its members get the call directly
                why = type(e).__name__
            others = [n for n in r.nodes[1:] if n in managers and n not in gone]
            log.info("relayed %s of step %s through %s failed (%s): sent directly to its %d other managers",
                     r.method, r.args[0] if r.args else "?", r.nodes[0][:12], why, len(others))
            direct += [getattr(managers[n], r.method).remote(*r.args) for n in others]
        if block and direct:
            self.calls.wait(direct, len(direct), self.wait_s)
        return stuck + direct

    def clear(self) -> None:
        self.pending.clear()
