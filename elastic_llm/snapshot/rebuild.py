"""Decoding one lost piece of a codeword straight from the surviving members' pieces.

Owns: :func:`decode_range`, the arithmetic of a parity rebuild without staging copies. A
codeword's symbols are ragged: a data symbol is a member's pieces laid end to end (its chunk),
zero-padded to the longest chunk of the codeword; a parity symbol is one array of that length.
Instead of gathering every symbol into a zero-filled buffer of the full length (a copy of every
surviving byte into fresh memory), the wanted byte range is cut where any symbol's piece starts or
ends, and each segment is decoded from views of the pieces themselves (read in place from the
object store), with a shared all-zero view standing in for the padding. Only the lost bytes are
written, into the caller's buffer. Pure: no Ray, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from elastic_llm.snapshot.erasure import ReedSolomon

Runs = Sequence[tuple[int, np.ndarray]]  # (offset within the symbol, bytes), ascending, not overlapping


def decode_range(rs: ReedSolomon, symbols: Sequence[Runs | None], row: int, lo: int, out: np.ndarray) -> np.ndarray:
    """Bytes ``lo`` .. ``lo + len(out)`` of data symbol ``row``, decoded into ``out``.

    ``symbols[i]``: symbol i of the codeword as runs of bytes (bytes no run covers are zero), or
    None for an erasure. Raises what :meth:`ReedSolomon.decode_row` raises (too many erasures)."""
    hi = lo + len(out)
    cuts = {lo, hi}
    for runs in symbols:
        for start, arr in runs or ():
            cuts.update(b for b in (start, start + len(arr)) if lo < b < hi)
    edges = sorted(cuts)
    widest = max((b - a for a, b in zip(edges, edges[1:])), default=0)
    zeros = np.zeros(widest, dtype=np.uint8)  # read only: its pages stay the kernel's zero page
    for a, b in zip(edges, edges[1:]):
        seg: list[np.ndarray | None] = []
        for runs in symbols:
            if runs is None:
                seg.append(None)
                continue
            view = next((arr[a - start : b - start] for start, arr in runs if start <= a and b <= start + len(arr)), None)
            seg.append(zeros[: b - a] if view is None else view)
        rs.decode_row(seg, row, out[a - lo : b - lo])
    return out
