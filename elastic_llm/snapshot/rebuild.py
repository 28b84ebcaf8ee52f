"""Rebuilding a lost shard from its erasure group's survivors, straight into the caller's buffer.

Owns: :func:`rebuild_into` (what the stage being restored runs for each :class:`ParityRebuild` of its
plan: it asks every surviving member for its symbols at once, pulls their pieces to its own node
in parallel, checks them, decodes each codeword as soon as its symbols are in and checks every
decoded piece against its recorded checksum; a member that dies meanwhile, or a piece that fails
its checksum, is one more erasure) and :func:`decode_range`, the arithmetic of a parity rebuild
without staging copies (and :class:`SnapshotMissingError`, a piece not held or not intact). A
codeword's symbols are ragged: a data symbol is a member's pieces laid end to end (its chunk),
zero-padded to the longest chunk of the codeword; a parity symbol is one array of that length.
Instead of gathering every symbol into a zero-filled buffer of the full length (a copy of every
surviving byte into fresh memory), the wanted byte range is cut where any symbol's piece starts or
ends, and each segment is decoded from views of the pieces themselves (read in place from the
object store), with a shared all-zero view standing in for the padding. Only the lost bytes are
written, into the caller's buffer. :func:`decode_range` is pure (no Ray, no I/O);
:func:`rebuild_into` talks to the managers through Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from elastic_llm.snapshot.erasure import ReedSolomon, TooManyErasuresError, checksum
from elastic_llm.snapshot.layout import ParityLayout
from elastic_llm.snapshot.records import ParityRebuild, ShardInfo, chunk_pieces

Runs = Sequence[tuple[int, np.ndarray]]  # (offset within the symbol, bytes), ascending, not overlapping
WAIT_S = 600.0  # longest a member's answer or pieces are waited for


class SnapshotMissingError(LookupError):
    """The requested snapshot version, shard or parity is not held here (or fails its checksum)."""


def rebuild_into(rs: ReedSolomon, r: ParityRebuild, out: np.ndarray) -> np.ndarray:
    """Shard ``r.key`` of version ``r.version`` decoded into ``out`` (``r.shard.nbytes`` long), every
    decoded piece checked against its recorded checksum. ``rs``: the codec of the group's
    ``(n - parity, parity)``. Raises :class:`TooManyErasuresError` when more members are lost
    (or die, or hold corrupted pieces) than ``r.parity`` covers, :class:`SnapshotMissingError`
    when a decoded piece fails its checksum."""
    import ray

    layout = ParityLayout(r.n, r.parity)
    lost = set(r.lost)
    if not layout.recoverable(lost):
        raise TooManyErasuresError(layout.k, r.parity, sorted(lost), [])
    mine = r.shard
    if len(out) != mine.nbytes:
        raise ValueError(f"{r.key}'s shard is {mine.nbytes} bytes, the buffer given for it {len(out)}")
    mine_infos = sorted(r.infos[r.target], key=lambda s: s.key)
    # every surviving symbol of every codeword is asked for at once and its pieces' transfer
    # started (the members answer, and the bytes travel, in parallel); each codeword is then
    # decoded as soon as its own symbols are in, while the later ones still arrive, from the
    # pieces in place (no staging copy) straight into ``out``
    words = [layout.codeword(layout.region_of(r.target, c)) for c in range(layout.k)]
    asks: list[list[Any]] = []
    for c, word in enumerate(words):
        region = layout.region_of(r.target, c)
        row: list[Any] = []
        for sym in word:
            peer = None if sym.node in lost else r.peers[sym.node]
            role = r.role(sym.node)
            row.append(None if peer is None else peer.get_parity.remote(r.version, region, role) if sym.chunk is None
                       else peer.chunk_parts.remote(r.version, sym.chunk, role))
        asks.append(row)
    parts = [[_piece_refs(ref) if ref is not None and sym.chunk is not None else ref for ref, sym in zip(row, word)] for row, word in zip(asks, words)]
    flat = [ref for row in parts for got in row if isinstance(got, list) for ref in got]
    if flat:  # start every piece's transfer to this node now (returns at once)
        ray.wait(flat, num_returns=len(flat), timeout=0, fetch_local=True)
    base = 0
    for c, word in enumerate(words):
        want = mine.pieces[c]
        lo = sum(i.pieces[c].length for i in mine_infos if i.key < r.key)  # where key's piece starts in the chunk
        symbols = [_symbol(got, sym, r.infos) for got, sym in zip(parts[c], word)]
        got = decode_range(rs, symbols, next(i for i, s in enumerate(word) if s.node == r.target), lo, out[base : base + want.length])
        if checksum(got) != want.crc:
            raise SnapshotMissingError(f"piece {c} of shard {r.key}, version {r.version} fails its checksum after decoding")
        base += want.length
    return out


def _piece_refs(call: Any) -> list[Any] | None:
    """A member's answer to ``chunk_parts`` (its pieces' refs); None if it died meanwhile."""
    import ray

    try:
        return list(ray.get(call, timeout=WAIT_S))
    except ray.exceptions.RayError:  # the member died (or does not answer): one more erasure
        return None


def _symbol(got: Any, sym: Any, infos: Sequence[tuple[ShardInfo, ...]]) -> list[tuple[int, np.ndarray]] | None:
    """One symbol of a codeword as runs of bytes, read in place: a parity region (``got`` its
    call), or a data chunk (``got`` its pieces' refs) whose pieces are checked and laid end to
    end; None for an erasure (a lost or dead member, a piece that fails its checksum)."""
    import ray

    if got is None:
        return None
    try:
        if sym.chunk is None:
            return [(0, np.asarray(ray.get(got, timeout=WAIT_S)))]
        runs, pos = [], 0
        for piece, arr in zip(chunk_pieces(infos[sym.node], sym.chunk), ray.get(got, timeout=WAIT_S)):
            arr = np.asarray(arr)
            if len(arr) != piece.length or checksum(arr) != piece.crc:
                return None  # a corrupted piece: one more erasure
            runs.append((pos, arr))
            pos += piece.length
        return runs
    except ray.exceptions.RayError:  # the member died, or its parity failed its checksum there: one more erasure
        return None


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
