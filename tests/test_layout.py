"""The rotating parity layout is pure: every property checked exhaustively for small groups."""

import itertools

import pytest

from elastic_llm.snapshot.layout import LayoutError, ParityLayout

SIZES = [(n, m) for n in range(2, 9) for m in range(1, n)]


@pytest.mark.parametrize("n,m", SIZES)
def test_every_codeword_spans_distinct_nodes_and_every_chunk_is_in_one_codeword(n, m):
    lay = ParityLayout(n, m)
    seen_chunks = set()
    for r in range(n):
        word = lay.codeword(r)
        assert len(word) == n and len({s.node for s in word}) == n
        assert [s.parity for s in word[lay.k:]] == list(range(m))
        for s in word[: lay.k]:
            assert not lay.is_holder(s.node, r) and lay.region_of(s.node, s.chunk) == r
            seen_chunks.add((s.node, s.chunk))
    assert seen_chunks == {(j, c) for j in range(n) for c in range(lay.k)}


@pytest.mark.parametrize("n,m", SIZES)
def test_parity_load_is_balanced_and_overhead_is_m_over_k(n, m):
    lay = ParityLayout(n, m)
    for j in range(n):
        regions = lay.parity_regions(j)
        assert len(regions) == m
        for r, p in regions:
            assert lay.holders(r)[p] == j
    # per node: k data chunks and m parity chunks of equal size
    assert lay.chunk_size(1000) * lay.k >= 1000


@pytest.mark.parametrize("n,m", [(4, 1), (5, 2), (6, 3), (8, 2)])
def test_any_m_lost_nodes_lose_at_most_m_symbols_per_codeword(n, m):
    lay = ParityLayout(n, m)
    for lost in itertools.combinations(range(n), m):
        assert lay.recoverable(set(lost))
        for r in range(n):
            assert sum(s.node in lost for s in lay.codeword(r)) <= m
    assert not lay.recoverable(set(range(m + 1)))


def test_bad_sizes_are_explained():
    with pytest.raises(LayoutError, match="at least parity \\+ 1 = 3 nodes"):
        ParityLayout(2, 2)
    with pytest.raises(LayoutError, match="must be >= 1"):
        ParityLayout(4, 0)
    with pytest.raises(LayoutError, match="255"):
        ParityLayout(300, 2)
    with pytest.raises(ValueError, match="holds parity"):
        ParityLayout(4, 1).chunk_of(2, 2)
