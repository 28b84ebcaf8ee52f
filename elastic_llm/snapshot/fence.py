"""The membership generation as one snapshot manager knows it: what it refuses as a zombie's.

Owns: :class:`Fence`, the manager's floor and what it refused. A run's *generation* is an
attempt number (:data:`~elastic_llm.snapshot.records.ATTEMPT_BITS`: a driver's epoch, then one
more per version begun); the driver's *floor* is the first attempt of its current membership (it
rises with the first version begun after a node was lost, and with each ``--resume``, whose epoch
is higher). Every call of the driver that changes what a manager holds (a version's plan, commit,
discard, flush) carries the driver's floor: one at or above the manager's raises it, one below is
a zombie driver's and is refused. A parity offer or a plan carries its attempt: one below the
floor is a zombie manager's (a node cut off, its run gone on without it, then healed), refused.
Refusals are counted and named, and reported with the manager's next part of a version
(``fenced`` lines of the run). Decided by counters only, never by the wall clock.
"""

from __future__ import annotations

import threading

from elastic_llm.snapshot.records import generation


class Fence:
    def __init__(self) -> None:
        self.floor = 0
        self._refused: list[str] = []
        self._lock = threading.Lock()

    def admit(self, floor: int, what: str) -> bool:
        """A driver's call carrying its ``floor``: True (and the floor raised to it) unless it is
        below this manager's floor, when ``what`` is refused and recorded."""
        with self._lock:
            if floor < self.floor:
                self._refused.append(f"{what} from a driver at generation {generation(floor)} (membership at {generation(self.floor)})")
                return False
            self.floor = floor
            return True

    def below(self, attempt: int, what: str) -> bool:
        """Whether ``attempt`` (an offer's or a plan's) is of an older membership: then ``what``
        is refused and recorded."""
        with self._lock:
            if attempt >= self.floor:
                return False
            self._refused.append(f"{what} of attempt {generation(attempt)} (membership at {generation(self.floor)})")
            return True

    def take(self) -> tuple[str, ...]:
        """What was refused since the last call (then forgotten)."""
        with self._lock:
            taken, self._refused = tuple(self._refused), []
            return taken
