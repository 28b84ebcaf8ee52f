"""How a step's global batch is cut at any data-parallel width: replica shares, then microbatches.

Owns: the pure arithmetic of the cut. Replica ``r`` of width ``w`` takes
``B // w + (1 if r < B % w else 0)`` whole sequences of the global batch of ``B``, in replica
order (contiguous rows: the replicas' shares concatenated are the global batch in order); it runs
``min(M, share)`` microbatches (``M``: ``parallel.microbatches``), their sizes as equal as possible
(``np.array_split``'s). A microbatch's loss (the mean over its tokens) enters the optimizer step
with weight ``size / B``, so the replicas' gradients summed in replica order are the gradient of
the mean loss over the global batch at every width. Never touches Ray or torch: the executor cuts
with these on the driver, the stage actor weights its losses with them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def even_sizes(n: int, parts: int) -> tuple[int, ...]:
    """``parts`` sizes summing to ``n`` that differ by at most one, the larger ones first
    (``np.array_split``'s sizes)."""
    if parts < 1 or n < 0:
        raise ValueError(f"cannot cut {n} into {parts} parts")
    base, extra = divmod(n, parts)
    return tuple(base + (1 if j < extra else 0) for j in range(parts))


def replica_shares(batch: int, width: int) -> tuple[int, ...]:
    """Sequences of a global batch of ``batch`` that each of ``width`` replicas takes, in replica
    order; every replica needs at least one (``width <= batch``)."""
    if not 1 <= width <= batch:
        raise ValueError(f"a global batch of {batch} sequences cannot feed {width} replicas: every replica needs at least one sequence")
    return even_sizes(batch, width)


def microbatch_sizes(share: int, microbatches: int) -> tuple[int, ...]:
    """The microbatch sizes of a replica taking ``share`` sequences: ``min(microbatches, share)``
    microbatches as equal as possible."""
    if share < 1 or microbatches < 1:
        raise ValueError(f"{share} sequences in {microbatches} microbatches: need at least one of each")
    return even_sizes(share, min(microbatches, share))


def replica_microbatches(batch: int, width: int, microbatches: int) -> tuple[tuple[int, ...], ...]:
    """Every replica's microbatch sizes, in replica order (their sum over all is ``batch``)."""
    return tuple(microbatch_sizes(share, microbatches) for share in replica_shares(batch, width))


def cut(rows: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """``rows`` cut along its first axis into consecutive pieces of ``sizes`` (views, in order)."""
    if sum(sizes) != len(rows):
        raise ValueError(f"pieces of {list(sizes)} rows do not cover {len(rows)} rows")
    return np.split(rows, np.cumsum(sizes)[:-1])


def weighted_mean(losses: Sequence[float], sizes: Sequence[int]) -> float:
    """The mean over all sequences of per-piece mean ``losses`` of pieces of ``sizes`` sequences."""
    if len(losses) != len(sizes) or not sizes:
        raise ValueError(f"{len(losses)} losses for {len(sizes)} pieces")
    return float(np.dot(np.asarray(losses, np.float64), np.asarray(sizes, np.float64)) / sum(sizes))
