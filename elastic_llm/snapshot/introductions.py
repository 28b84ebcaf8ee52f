"""Actor handles in a version's plans, sent to each receiver once instead of in every plan.

Owns: :class:`Known` (an actor as a plan names it: its id, and its handle unless the receiver has
it), the sender's side (:class:`Introductions`: which handles each receiver acknowledged, and
when) and the receiver's (:class:`Acquaintances`: the handles it was sent, by id). Pure: no Ray;
the coordinator and the snapshot managers use it, and the simulation's managers unchanged.

Why: a Ray actor handle costs its receiver ~0.4 ms of CPU to deserialize on a quiet core (Ray
builds a descriptor for each of the class's methods: 37 for a manager, 46 for a stage) and up to
~2 ms beside training. Every version's plans named ~25 of them (a group's lead gets every
member's plan, each naming the group's managers and its stages, and forwards each), each step:
measured on the 3-node loopback cluster with py-spy, 33% of the lead manager's GIL time.

The rule that keeps it safe: a sender leaves a handle out only for a receiver that answered a
call naming that actor at an attempt at most :data:`TRUST` attempts older; a receiver keeps a
handle while a plan named it within the last :data:`KEEP` attempts (> ``TRUST``), so an actor
the run dropped is not kept alive by a manager's memory for long. A receiver asked for an actor
it does not know raises :class:`Unknown` (the version fails, as for any manager's error); the sender
forgets what that receiver knew on any failure, so the next version sends the handles again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

TRUST = 32  # a receiver's acknowledgement of an actor counts for plans up to this many attempts newer (a node leads its group only now and then)
KEEP = 128  # a receiver forgets a handle no plan named in this many attempts (more than 2 x TRUST: two versions may be in flight)


def actor_id(handle: object) -> str:
    """A stable id of ``handle``'s actor: Ray's actor id (the same in every process), or, for an
    in-process object (a simulation's manager), its class and identity."""
    ray_id = getattr(handle, "_actor_id", None)
    if ray_id is not None and hasattr(ray_id, "hex"):
        return str(ray_id.hex())
    return f"{type(handle).__name__}@{id(handle):x}"


@dataclass(frozen=True)
class Known:
    """An actor as a plan names it: ``id`` (:func:`actor_id`) and its handle, or ``None`` where
    the receiver acknowledged it recently (:class:`Introductions`)."""

    id: str
    handle: Any = None  # a Ray actor handle or a simulation's manager: whatever the plan's actors are

    @staticmethod
    def of(handle: object) -> "Known":
        """``handle`` named with its handle (a plan to a receiver that may not hold it)."""
        return Known(actor_id(handle), handle)


class Unknown(LookupError):
    """A plan named an actor by id only, and this receiver does not hold its handle."""


class Introductions:
    """The sender's side: for each receiver (by :func:`actor_id`), the attempt at which it last
    answered a call naming each actor."""

    def __init__(self) -> None:
        self._acked: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()  # a manager relays two versions at once, on two threads

    def name(self, receiver: str, handle: object, attempt: int) -> Known:
        """``handle`` as a plan of ``attempt`` to ``receiver`` names it."""
        ident = actor_id(handle)
        with self._lock:
            seen = self._acked.get(receiver, {}).get(ident)
        return Known(ident, None if seen is not None and attempt - seen <= TRUST else handle)

    def forwarding(self, receiver: str, held: Acquaintances, attempt: int) -> Callable[[Known], Known]:
        """How a plan this process was sent names each actor when passed on to ``receiver``
        (resolved through ``held``, then by id only where ``receiver`` holds it)."""
        return lambda known: self.name(receiver, held.handle(known, attempt), attempt)

    def answered(self, receiver: str, named: Iterable[Known], attempt: int) -> None:
        """``receiver`` answered a call of ``attempt`` that named ``named``: it holds them now."""
        with self._lock:
            acked = self._acked.setdefault(receiver, {})
            for k in named:
                acked[k.id] = max(attempt, acked.get(k.id, attempt))
            for ident in [i for i, a in acked.items() if attempt - a > TRUST]:  # what it may have forgotten
                del acked[ident]

    def known_to(self, receiver: str) -> frozenset[str]:
        """The actors ``receiver`` acknowledged recently (the plans to it name these by id only)."""
        with self._lock:
            return frozenset(self._acked.get(receiver, ()))

    def failed(self, receiver: str) -> None:
        """A call to ``receiver`` failed: assume it knows nothing (the next plan sends every handle)."""
        with self._lock:
            self._acked.pop(receiver, None)


class Acquaintances:
    """The receiver's side: the handles it was sent, by actor id, and the newest attempt that named each."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[object, int]] = {}
        self._newest = 0  # the newest attempt a plan named anything at
        self._lock = threading.Lock()  # versions' plans arrive on several threads

    def handle(self, known: Known, attempt: int) -> Any:
        """The handle ``known`` names (kept if it came with one); :class:`Unknown` if it came
        without one and none is held. A newer attempt first drops the handles no plan named
        within :data:`KEEP` attempts of it."""
        with self._lock:
            if attempt > self._newest:
                self._newest = attempt
                for ident in [i for i, (_, a) in self._held.items() if attempt - a > KEEP]:
                    del self._held[ident]
            held = self._held.get(known.id)
            if known.handle is not None:
                self._held[known.id] = (known.handle, max(attempt, held[1]) if held else attempt)
                return known.handle
            if held is None:
                raise Unknown(f"a plan of attempt {attempt} named actor {known.id} by id only, and this manager holds no handle of it (the sender sends it with the next plan)")
            self._held[known.id] = (held[0], max(attempt, held[1]))
            return held[0]

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
