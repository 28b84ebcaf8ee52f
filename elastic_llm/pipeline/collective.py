"""Gradient summing among the replicas of one stage, over the step's links.

Owns: the all-reduce (sum) of a flat float32 gradient: a direct reduce-scatter (replica j owns
chunk j; every other replica sends it that chunk) and an all-gather (each owner sends its summed
chunk to every other replica). The owner adds the contributions in replica order 0, 1, ..., DP-1,
exactly the element-wise operations of summing whole gradients in replica order, so every replica
ends with identical bits and the result does not depend on timing. A sum, not a mean: each
replica's gradient is already weighted by its share of the global batch
(:mod:`elastic_llm.pipeline.shares`), which may differ between replicas. Each replica sends
2 (DP - 1) / DP of its gradient (1.5x at DP = 4), like a ring, in two rounds instead of
2 (DP - 1). Never decides who the replicas are: the plan's peers say.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from elastic_llm.pipeline.shares import even_sizes
from elastic_llm.tensors import host
from elastic_llm.pipeline.transport import Msg
from elastic_llm.snapshot.records import ShardKey


class Links(Protocol):
    """What the all-reduce needs of the step's links: send to and receive from a peer."""

    def send(self, peer: ShardKey, kind: Msg, mb: int, hop: int, array: Any) -> None: ...

    def recv(self, peer: ShardKey, kind: Msg, mb: int, hop: int) -> np.ndarray | torch.Tensor: ...  # gradient chunks are float32: numpy


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(n)``, sizes differing by at most one."""
    bounds, lo = [], 0
    for size in even_sizes(n, parts):
        bounds.append((lo, lo + size))
        lo += size
    return bounds


def allreduce_sum(transport: Links, flat: np.ndarray, replicas: list[ShardKey], me: int) -> np.ndarray:
    """The sum of ``flat`` over ``replicas`` (this stage's actors in replica order; this actor is
    ``replicas[me]``), added in that order. Returns a new array; ``flat`` is not modified."""
    dp = len(replicas)
    if dp == 1:
        return flat
    bounds = chunk_bounds(flat.size, dp)
    for j, (lo, hi) in enumerate(bounds):  # reduce-scatter: my contribution to every owner
        if j != me:
            transport.send(replicas[j], Msg.CHUNK, 0, j, flat[lo:hi])
    lo, hi = bounds[me]
    parts = [flat[lo:hi] if r == me else np.asarray(transport.recv(replicas[r], Msg.CHUNK, 0, me)) for r in range(dp)]  # fp32 in every precision
    total = torch.from_numpy(np.array(parts[0]))  # torch's in-place adds
    for part in parts[1:]:  # fixed replica order: identical bits on every replica
        total += torch.from_numpy(part)
    out = np.empty_like(flat)
    out[lo:hi] = host(total)
    for j in range(dp):  # all-gather: my summed chunk to every other replica
        if j != me:
            transport.send(replicas[j], Msg.GATHER, 0, me, total)
    for r, (a, b) in enumerate(bounds):
        if r != me:
            out[a:b] = np.asarray(transport.recv(replicas[r], Msg.GATHER, 0, r))
    return out
