"""decode_range: a lost member's piece decoded from ragged symbols read in place equals the
piece decoded the padded way (every symbol gathered into a zero-filled buffer)."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_llm.snapshot.erasure import ReedSolomon, TooManyErasuresError
from elastic_llm.snapshot.rebuild import decode_range


def _runs(pieces: list[np.ndarray]) -> list[tuple[int, np.ndarray]]:
    out, pos = [], 0
    for p in pieces:
        out.append((pos, p))
        pos += len(p)
    return out


@pytest.mark.parametrize("backend", ["numpy", "isal"])
def test_a_lost_piece_decodes_from_ragged_pieces_in_place(backend):
    rng = np.random.default_rng(3)
    rs = ReedSolomon(3, 2, backend=backend)
    # three members' chunks: several pieces each (one empty), of different total lengths
    chunks = [[rng.integers(0, 256, n, dtype=np.uint8) for n in sizes] for sizes in ([700, 0, 301], [64, 900], [1000])]
    width = max(sum(len(p) for p in c) for c in chunks)
    padded = [np.zeros(width, dtype=np.uint8) for _ in chunks]
    for buf, c in zip(padded, chunks):
        flat = np.concatenate(c)
        buf[: len(flat)] = flat
    parity = rs.encode(padded)
    for lost in (0, 1, 2):
        symbols = [None if i == lost else _runs(c) for i, c in enumerate(chunks)] + [[(0, p)] for p in parity]
        for lo, n in ((0, 700), (700, 301), (10, 950), (650, 100)):
            n = min(n, width - lo)
            out = np.full(n, 0xEE, dtype=np.uint8)
            assert decode_range(rs, symbols, lost, lo, out) is out
            assert np.array_equal(out, padded[lost][lo : lo + n]), (lost, lo, n)
    # a second erasure in the same codeword is decoded from the other parity row
    symbols = [None, None, _runs(chunks[2])] + [[(0, p)] for p in parity]
    out = np.empty(width, dtype=np.uint8)
    assert np.array_equal(decode_range(rs, symbols, 1, 0, out), padded[1])
    with pytest.raises(TooManyErasuresError):
        decode_range(rs, [None, None, None, [(0, parity[0])], [(0, parity[1])]], 0, 0, out)
