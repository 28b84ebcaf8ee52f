"""What the controller learns about nodes: a node announced its end (:class:`Drain`), or was
found dead (:class:`NodeDeath`, with the probe :class:`Outcome` that decided it).

Owns these records (pure, frozen); the runtimes produce them (:mod:`elastic_llm.runtime.drains`
reads Ray's draining nodes, :mod:`elastic_llm.runtime.liveness` probes raylets; the simulation
plays a trace). Never asks anything of a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

PROBE_TIMEOUT_S = 0.5  # a node watch's probe not answered this long timed out (a suspect's round is longer by this)


@dataclass(frozen=True)
class Drain:
    """A node marked as draining; ``deadline`` is a wall-clock (``Clock.time``) instant, None: no deadline."""

    node_id: str
    deadline: float | None

    def seconds_left(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now


class Outcome(Enum):
    """What one connection attempt to a node's raylet gave (or, for ``UNSCHEDULABLE``, what
    decided a node's death without one)."""

    OK = "ok"
    REFUSED = "refused"  # the machine answered: nothing listens there (the raylet process is gone)
    TIMEOUT = "timeout"  # no answer at all (or the network is unreachable)
    UNSCHEDULABLE = "unschedulable"  # no probe: Ray's scheduler refused to place something pinned to the node (it is gone)


@dataclass(frozen=True)
class NodeDeath:
    node: str
    address: str  # host:port of the raylet that failed to answer
    outcome: Outcome  # the probe outcome that decided it
    failures: int  # failed probes in a row, the deciding one included
    suspect_s: float  # seconds from the first of those failed probes to the decision

    def reason(self) -> str:
        if self.outcome is Outcome.UNSCHEDULABLE:
            return f"elastic-llm: Ray's scheduler refused to place on node {self.node[:12]} ({self.address})"
        what = "refused the connection" if self.outcome is Outcome.REFUSED else f"did not answer {self.failures} probes in a row"
        return f"elastic-llm node watch: the raylet at {self.address} {what}"
