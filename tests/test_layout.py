"""The rotating parity layout is pure: every property checked exhaustively for small groups."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@st.composite
def group_and_blob(draw):
    n = draw(st.integers(2, 255))
    m = draw(st.integers(1, n - 1))
    return n, m, draw(st.integers(0, 1 << 40))


@settings(max_examples=60, deadline=None)
@given(nmb=group_and_blob(), data=st.data())
def test_every_blob_byte_is_in_exactly_one_codeword_of_n_distinct_nodes(nmb, data):
    """A node's blob (padded to the group's largest, ``blob`` bytes) is cut into k chunks of
    ``chunk_size(blob)`` bytes: byte b is in chunk b // size. Every byte must land in a real
    chunk (< k) with less than one chunk of padding in all, and that chunk must be a data
    symbol of exactly one codeword, whose n symbols sit on n distinct nodes."""
    n, m, blob = nmb
    lay = ParityLayout(n, m)
    size = lay.chunk_size(blob)
    assert size * lay.k >= blob and size * lay.k - blob < lay.k  # ceil(blob / k): no chunk is all padding
    if blob == 0:
        return
    node = data.draw(st.integers(0, n - 1), label="node")
    edges = [0, blob - 1, min(size, blob - 1), (lay.k - 1) * size if (lay.k - 1) * size < blob else blob - 1]
    offsets = edges + data.draw(st.lists(st.integers(0, blob - 1), max_size=8), label="offsets")
    for b in offsets:
        chunk = b // size
        assert 0 <= chunk < lay.k
        region = lay.region_of(node, chunk)
        word = lay.codeword(region)
        assert len({s.node for s in word}) == n
        assert sum(s.node == node for s in word) == 1  # one symbol per node: this byte's chunk
        assert [s.chunk for s in word if s.node == node] == [chunk]
        assert lay.chunk_of(node, region) == chunk and not lay.is_holder(node, region)
    # the node's k chunks go to k different codewords: exactly those it holds no parity for
    regions = [lay.region_of(node, c) for c in range(lay.k)]
    assert sorted(regions) == [r for r in range(n) if not lay.is_holder(node, r)]


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
