"""Erasure groups of a snapshot version: which nodes protect each other's shards with parity.

Owns: :func:`make_groups`, pure, and :func:`check_parity_fits` (a cluster too small for one group is refused). Nodes that fail together must not share a group beyond what its
parity covers: real fleets lose nodes by availability zone, instance type or launch batch (nodes
launched together are reclaimed together), so groups are never consecutive node names. With
failure domains known (a label per node: ``elastic-llm.io/failure-domain`` or Ray's
``ray.io/availability-zone``, set by ``cluster.yaml``; a trace's zone column in a simulation), no
group holds more than ``parity`` nodes of one domain whenever the fleet allows it (enough groups
that the largest domain spreads over them); without them, the nodes are spread by a shuffle
seeded with the version, so each version's groups differ. Never talks to a node.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from elastic_llm.snapshot.layout import LayoutError

DOMAIN_LABELS = ("elastic-llm.io/failure-domain", "ray.io/availability-zone")  # the node labels read as a failure domain, first found wins


def group_sizes(n: int, size: int, parity: int) -> list[int]:
    """Sizes of the groups of ``n`` nodes: chunks of ``size``, a tail shorter than parity + 1
    joining the last one; none when fewer than parity + 1 nodes. Pure."""
    if n < parity + 1:
        return []
    sizes = [min(size, n - i) for i in range(0, n, size)]
    if len(sizes) > 1 and sizes[-1] < parity + 1:
        tail = sizes.pop()
        sizes[-1] += tail
    return sizes


def make_groups(nodes: Sequence[str], size: int, parity: int, domains: Mapping[str, str] | None = None, seed: int = 0) -> tuple[tuple[str, ...], ...]:
    """Split ``nodes`` into erasure groups of about ``size`` (:func:`group_sizes`). When some
    failure domain holds two or more of them but not all (a node without one is a domain of its
    own: the draining nodes the coordinator spreads on a fleet without labels are one domain,
    the rest none), the nodes are dealt round robin, domain after domain
    (largest first), over enough groups that none holds more than ``parity`` of one domain
    (while each keeps parity + 1 members); otherwise they are dealt in a shuffled order seeded
    with ``seed`` (the version). Each group's members are sorted. Pure."""
    ordered = sorted(nodes)
    n = len(ordered)
    sizes = group_sizes(n, size, parity)
    if not sizes:
        return ()
    by_domain: dict[str, list[str]] = {}
    for node in ordered:  # a node without a domain is a domain of its own
        by_domain.setdefault((domains or {}).get(node) or f"node:{node}", []).append(node)
    if len(by_domain) < 2 or max(len(v) for v in by_domain.values()) < 2:  # one domain, or none shared: nothing to spread
        random.Random(seed).shuffle(ordered)
        out, i = [], 0
        for k in sizes:
            out.append(tuple(sorted(ordered[i : i + k])))
            i += k
        return tuple(out)
    largest = max(len(v) for v in by_domain.values())
    count = min(max(len(sizes), math.ceil(largest / max(parity, 1))), n // (parity + 1))
    dealt: list[list[str]] = [[] for _ in range(count)]
    i = 0
    for _, members in sorted(by_domain.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        for node in members:
            dealt[i % count].append(node)
            i += 1
    return tuple(tuple(sorted(g)) for g in dealt)


def domain_of(labels: Mapping[str, str]) -> str | None:
    """A node's failure domain from its labels (:data:`DOMAIN_LABELS`), or None. Pure."""
    return next((labels[k] for k in DOMAIN_LABELS if labels.get(k)), None)


def exposed(groups: tuple[tuple[str, ...], ...], going: frozenset[str], parity: int) -> bool:
    """Whether some group loses more members than ``parity`` when the ``going`` nodes go. Pure."""
    return any(sum(1 for n in g if n in going) > parity for g in groups)


def check_parity_fits(nodes: int, parity: int, group_size: int) -> None:
    """Raise :class:`LayoutError` when ``nodes`` nodes with CPUs (two or more) cannot form one
    erasure group of ``parity`` + 1: :func:`make_groups` would form none and every snapshot would
    go without parity, less protection than a smaller ``snapshot.parity`` gives. A single node is
    accepted: it holds no parity whatever the setting (the embedded single-node Ray). Pure."""
    if 2 <= nodes < parity + 1:
        raise LayoutError(
            f"snapshot.parity={parity} needs erasure groups of at least parity + 1 = {parity + 1} nodes with CPUs "
            f"(snapshot.group_size={group_size} per group), but the cluster has {nodes}: no group could form and the snapshots "
            f"would have no parity at all; set snapshot.parity to at most {nodes - 1}, or add nodes"
        )
