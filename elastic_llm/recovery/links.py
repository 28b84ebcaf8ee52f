"""Cut links between live nodes: which side of a cut the run gives up, and for how long. Pure.

Owns: the rule that turns the pairs of the run's nodes that cannot reach each other (while each
still reaches the driver, so neither is a suspect of the node watch) into one node to set aside
(:func:`pick_side`), and the table of nodes set aside (:class:`SetAside`), each until a time.

The rule:

- **Which side.** The node in the most cut pairs goes: a node cut from several peers is the one
  whose link is broken. At a tie (a single pair), the node that hosts fewer of the run's actors
  goes (its stages are the cheaper move). Then the node set aside more often before; then the
  greater node id, so the choice is the same in every run that sees the same cut.
- **No flapping.** A node set aside gets nothing placed on it (it counts as a suspect of the run)
  until its time is over: ``base_s`` the first time, doubled each time the same node is set aside
  again in the run. A pair whose link stays cut can then cause at most one recovery per period,
  and the periods grow: never one at every step.

A **slow link** is told apart the same way: a step whose slowest actor spent more than
``recovery.straggler_share`` of the step's time reading message bodies from other nodes
(:func:`link_share`: the time the links themselves cost it, not the wait for a peer's compute)
for ``recovery.straggler_steps`` steps in a row has its nodes' link rates measured; the pairs
below :data:`SLOW_RATE` of the fastest pair's rate are slow (:func:`slow_pairs`), and
:func:`pick_side` names the straggler among them (a node whose own link is slow is in every
slow pair). At least three nodes are needed: one pair alone cannot say which end is slow.

Never probes a link and never moves an actor (:class:`~elastic_llm.controller.links.LinkGuard`
asks the runtime and the recovery moves the actors).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Pair = tuple[str, str]  # two node ids, the smaller first


def pair(a: str, b: str) -> Pair:
    return (a, b) if a <= b else (b, a)


SLOW_RATE = 0.5  # a pair whose measured rate is below this share of the fastest pair's is slow


def link_share(received: Mapping[tuple[int, int], Mapping[tuple[int, int], tuple[int, float]]], node_of: Mapping[tuple[int, int], str],
               step_s: float) -> float:
    """The share of a step's ``step_s`` seconds that its slowest actor spent reading message
    bodies from actors on other nodes (``received[actor][peer]``: bytes, seconds)."""
    if step_s <= 0:
        return 0.0
    per = [sum(s for peer, (_, s) in got.items() if node_of.get(peer) != node_of.get(me)) for me, got in received.items()]
    return max(per, default=0.0) / step_s


def slow_pairs(rates: Mapping[Pair, float], factor: float = SLOW_RATE) -> list[Pair]:
    """The pairs whose rate is below ``factor`` times the fastest pair's (none with fewer than
    two pairs measured: nothing to compare with)."""
    if len(rates) < 2:
        return []
    top = max(rates.values())
    return sorted(p for p, r in rates.items() if r < factor * top)


def pick_side(cut: Iterable[Pair], hosting: Mapping[str, int], times: Mapping[str, int]) -> str:
    """The node to set aside for the ``cut`` pairs (not empty): see the module's rule.
    ``hosting``: the run's actors per node; ``times``: how often each node was set aside before."""
    degree: dict[str, int] = {}
    for a, b in cut:
        degree[a] = degree.get(a, 0) + 1
        degree[b] = degree.get(b, 0) + 1
    if not degree:
        raise ValueError("pick_side needs at least one cut pair")
    return max(degree, key=lambda n: (degree[n], -hosting.get(n, 0), times.get(n, 0), n))


@dataclass(frozen=True)
class SetAside:
    """Nodes set aside until a time (the run's monotonic clock), and how often each was."""

    until: tuple[tuple[str, float], ...] = ()
    times: tuple[tuple[str, int], ...] = field(default=())

    def add(self, node: str, now: float, base_s: float) -> SetAside:
        """``node`` set aside from ``now`` for ``base_s`` x 2^(times it was before)."""
        times = dict(self.times)
        n = times.get(node, 0)
        until = dict(self.until)
        until[node] = now + base_s * 2**n
        times[node] = n + 1
        return SetAside(tuple(sorted(until.items())), tuple(sorted(times.items())))

    def active(self, now: float) -> frozenset[str]:
        return frozenset(n for n, t in self.until if t > now)

    def count(self, node: str) -> int:
        return dict(self.times).get(node, 0)

    def ends(self, node: str) -> float | None:
        return dict(self.until).get(node)
