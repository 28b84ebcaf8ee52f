"""Rotating (RAID-6 style) parity layout of one erasure group: a pure function of (N, m).

Owns: which node holds which chunk of which codeword. Never touches data, Ray or the codec.

Group of N nodes, m parity. For region r in 0..N-1 the parity holders are nodes r, r+1, ...,
r+m-1 (mod N). Every node's blob is cut into k = N - m equal chunks, one for each region it does
not hold parity for. Codeword r = the k data chunks of region r (from nodes r+m, ..., r+N-1, in
that order) followed by m parity chunks (parity p on node r+p). Each codeword has its N symbols
on N distinct nodes, so losing any m nodes loses at most m symbols of every codeword. Memory
overhead per node: m chunks of parity against k chunks of data, i.e. m / (N - m).
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """Impossible group/parity sizes; the message says what to choose instead."""


@dataclass(frozen=True)
class Symbol:
    """One symbol of a codeword: data chunk ``chunk`` of ``node``'s blob, or parity ``parity``."""

    node: int
    chunk: int | None = None  # data symbol: index of the chunk within the node's blob
    parity: int | None = None  # parity symbol: row of the parity matrix


@dataclass(frozen=True)
class ParityLayout:
    n: int  # nodes in the group
    m: int  # parity symbols per codeword (nodes that may be lost)

    def __post_init__(self) -> None:
        if self.m < 1:
            raise LayoutError(f"snapshot.parity={self.m} must be >= 1")
        if self.n < self.m + 1:
            raise LayoutError(
                f"snapshot.group_size={self.n} is too small for snapshot.parity={self.m}: a group needs at least parity + 1 = {self.m + 1} nodes"
            )
        if self.n > 255:
            raise LayoutError(f"snapshot.group_size={self.n} exceeds 255, the most a GF(2^8) Reed-Solomon code spans")

    @property
    def k(self) -> int:
        """Data chunks per blob (= data symbols per codeword)."""
        return self.n - self.m

    def is_holder(self, node: int, region: int) -> bool:
        return (node - region) % self.n < self.m

    def holders(self, region: int) -> list[int]:
        """Nodes storing the parity of ``region``, parity row p on holders[p]."""
        return [(region + p) % self.n for p in range(self.m)]

    def data_nodes(self, region: int) -> list[int]:
        """Nodes contributing a data chunk to ``region``, in codeword order."""
        return [(region + self.m + i) % self.n for i in range(self.k)]

    def chunk_of(self, node: int, region: int) -> int:
        """Index of ``node``'s blob chunk that belongs to ``region`` (node must not hold it)."""
        offset = (node - region) % self.n
        if offset < self.m:
            raise ValueError(f"node {node} holds parity of region {region}, not data")
        return offset - self.m

    def region_of(self, node: int, chunk: int) -> int:
        return (node - self.m - chunk) % self.n

    def codeword(self, region: int) -> list[Symbol]:
        """The N symbols of ``region``: k data symbols then m parity symbols."""
        data = [Symbol(node=j, chunk=self.chunk_of(j, region)) for j in self.data_nodes(region)]
        return data + [Symbol(node=h, parity=p) for p, h in enumerate(self.holders(region))]

    def parity_regions(self, node: int) -> list[tuple[int, int]]:
        """(region, parity row) pairs whose parity ``node`` stores: exactly m of them."""
        return [((node - p) % self.n, p) for p in range(self.m)]

    def recoverable(self, lost: set[int] | frozenset[int]) -> bool:
        return len({x for x in lost if 0 <= x < self.n}) <= self.m

    def chunk_size(self, largest_blob: int) -> int:
        """Bytes per chunk when every blob is padded to ``largest_blob``."""
        return -(-largest_blob // self.k) if largest_blob else 0
