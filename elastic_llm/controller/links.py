"""The run's view of its nodes with the nodes it set aside for a cut link: the one
:class:`~elastic_llm.controller.ports.Nodes` every part of the controller asks.

Owns: :class:`LinkGuard`, which wraps the runtime's nodes and keeps the run's
:class:`~elastic_llm.recovery.links.SetAside` table: a node set aside counts as a suspect (nothing
is placed there; its actors and snapshot parts are lost to a recovery that observes now) and is
no node with slots, until its time is over. :meth:`LinkGuard.check` is asked by a recovery that
found nothing lost (every actor answered and no node is dead or suspect: the failed step's own
links broke): it asks the runtime which pairs of the run's nodes cannot reach each other and sets
one side aside by :func:`~elastic_llm.recovery.links.pick_side`'s rule (one ``link_cut`` line).
:meth:`LinkGuard.observe`, after every step, follows how much the links cost the step; by the
straggler rule it has the link rates measured and drains the node on the slow link: it counts as
a draining node with no deadline (its stages move off it at the next look, as for a preemption
notice) until its time is over (one ``straggler`` line). Written once for both runtimes; the
probes themselves are the runtime's (:meth:`Nodes.cut_pairs`, :meth:`Nodes.link_rates`). Never
moves an actor (a recovery does for a node set aside, as for a suspect; the elastic executor
for a straggler, as for a drain).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from elastic_llm import events
from elastic_llm.clock import Clock
from elastic_llm.controller.drains import Drain, NodeDeath
from elastic_llm.controller.metrics import MetricsWriter
from elastic_llm.controller.ports import Nodes
from elastic_llm.config.schema import RecoveryConfig
from elastic_llm.recovery.links import Pair, SetAside, pick_side, slow_pairs


class LinkGuard:
    """``inner``: the runtime's nodes; ``rc``: the run's ``recovery`` settings
    (``link_set_aside_s``: the first period a node is set aside, doubled at each repeat; the
    straggler rule's ``straggler_share`` and ``straggler_steps``)."""

    def __init__(self, inner: Nodes, clock: Clock, rc: RecoveryConfig, metrics: MetricsWriter) -> None:
        self.inner, self.clock, self.metrics = inner, clock, metrics
        self.base_s, self.share, self.steps = rc.link_set_aside_s, rc.straggler_share, rc.straggler_steps
        self.table = SetAside()  # set aside for a cut link: suspects of the run
        self.slow = SetAside()  # stragglers: drained (their stages move off), nothing placed there
        self.streak = 0  # steps in a row whose links cost more than ``share``

    def set_aside(self) -> frozenset[str]:
        return self.table.active(self.clock.monotonic())

    def check(self, step: int, hosting: Mapping[str, int]) -> str | None:
        """After step ``step`` failed with nothing lost: the pairs of ``hosting``'s nodes (the
        run's actors per node) that cannot reach each other; one side set aside (returned), or
        None when every pair answered."""
        cut = self.inner.cut_pairs(frozenset(hosting) - self.suspects())
        if not cut:
            return None
        self.table, node, for_s = self._add(self.table, cut, hosting)
        self.metrics.emit(events.LinkCut(step=step, pairs=[list(p) for p in sorted(cut)], set_aside=node, for_s=for_s, times=self.table.count(node)))
        return node

    def _add(self, table: SetAside, pairs: Iterable[Pair], hosting: Mapping[str, int]) -> tuple[SetAside, str, float]:
        """``table`` with the side :func:`pick_side` names among ``pairs`` added from now; that
        node and its seconds."""
        node = pick_side(pairs, hosting, dict(table.times))
        now = self.clock.monotonic()
        table = table.add(node, now, self.base_s)
        return table, node, round((table.ends(node) or now) - now, 3)

    def observe(self, step: int, share: float, hosting: Mapping[str, int]) -> str | None:
        """After step ``step``, whose links cost its slowest actor ``share`` of its time
        (:func:`~elastic_llm.recovery.links.link_share`): after ``straggler_steps`` such steps in a
        row over ``straggler_share``, the link rates of the run's nodes (and of the free ones) are
        measured and the straggler among the slow pairs, if any, is drained (returned; one
        ``straggler`` line)."""
        if self.steps <= 0:
            return None
        self.streak = self.streak + 1 if share > self.share else 0
        if self.streak < self.steps:
            return None
        self.streak = 0
        rates = self.inner.link_rates((frozenset(hosting) | frozenset(self.inner.with_slots())) - self.suspects() - frozenset(self.draining()))
        slow = slow_pairs(rates)
        if not slow:
            return None
        self.slow, node, for_s = self._add(self.slow, slow, hosting)
        mine = sorted(r for p, r in rates.items() if node in p)
        self.metrics.emit(events.Straggler(step=step, node=node, share=round(share, 4), node_mb_s=round(mine[len(mine) // 2] / 1e6, 2),
                                           fastest_mb_s=round(max(rates.values()) / 1e6, 2), for_s=for_s, times=self.slow.count(node)))
        return node

    # ------------------------------------------------------------------ Nodes
    def alive(self) -> set[str]:
        return self.inner.alive()

    def with_slots(self) -> list[str]:
        aside = self.set_aside()
        return [n for n in self.inner.with_slots() if n not in aside]

    def draining(self) -> dict[str, Drain]:
        """The runtime's draining nodes and the stragglers (no deadline: they move at the next look)."""
        out = self.inner.draining()
        for n in sorted(self.slow.active(self.clock.monotonic()) - set(out)):
            out[n] = Drain(n, None)
        return out

    def reclaimed(self) -> set[str]:
        return self.inner.reclaimed()

    def suspects(self) -> set[str]:
        return self.inner.suspects() | self.set_aside()

    def sweep(self) -> None:
        self.inner.sweep()

    def cut_pairs(self, nodes: frozenset[str]) -> frozenset[tuple[str, str]]:
        return self.inner.cut_pairs(nodes)

    def link_rates(self, nodes: frozenset[str]) -> dict[tuple[str, str], float]:
        return self.inner.link_rates(nodes)

    def declare_gone(self, nodes: frozenset[str], why: str) -> None:
        self.inner.declare_gone(nodes, why)

    def deaths(self) -> list[NodeDeath]:
        return self.inner.deaths()

    def stop(self) -> None:
        self.inner.stop()
