"""Rebuilding a lost shard from its erasure group's survivors, straight into the caller's buffer.

Owns: :func:`rebuild_into` (what the stage being restored runs for each :class:`ParityRebuild` of its
plan: it asks every surviving member for its piece server (:mod:`.exchange`) at once, reads every
surviving symbol over those links in parallel, each straight into one buffer, checks them, decodes
each codeword as soon as its symbols are in and checks every decoded piece against its recorded
checksum; a member that dies meanwhile, refuses, is cut off mid-symbol, or serves a piece that
fails its checksum, is one more erasure) and :func:`decode_range`, the arithmetic of a parity
rebuild (and :class:`SnapshotMissingError`, a piece not held or not intact). A codeword's symbols
are ragged: a data symbol is a member's pieces laid end to end (its chunk), zero-padded to the
longest chunk of the codeword; a parity symbol is one array of that length. Instead of padding
every symbol into a zero-filled buffer of the full length, the wanted byte range is cut where any
symbol's piece starts or ends, and each segment is decoded from views of the received bytes, with
a shared all-zero view standing in for the padding. Only the lost bytes are written, into the
caller's buffer. :func:`recipe` (which survivors a restored stage reads) and :func:`decode_range` are pure (no Ray, no I/O); :func:`rebuild_into` asks the
managers for their addresses through Ray and reads the bytes over sockets.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from elastic_llm.snapshot import exchange
from elastic_llm.snapshot.erasure import ReedSolomon, TooManyErasuresError, checksum
from elastic_llm.snapshot.layout import ParityLayout
from elastic_llm.snapshot.records import ParityRebuild, ShardInfo, VersionRecord, chunk_pieces
from elastic_llm.sources import UnrecoverableError

Runs = Sequence[tuple[int, np.ndarray]]  # (offset within the symbol, bytes), ascending, not overlapping
WAIT_S = 600.0  # longest a rebuild waits for its members' answers and pieces, all told (the driver's RESTORE_S)


class SnapshotMissingError(LookupError):
    """The requested snapshot version, shard or parity is not held here (or fails its checksum)."""


def rebuild_into(rs: ReedSolomon, r: ParityRebuild, out: np.ndarray) -> np.ndarray:
    """Shard ``r.key`` of version ``r.version`` decoded into ``out`` (``r.shard.nbytes`` long), every
    decoded piece checked against its recorded checksum. ``rs``: the codec of the group's
    ``(n - parity, parity)``. Raises :class:`TooManyErasuresError` when more members are lost
    (or die, or hold corrupted pieces) than ``r.parity`` covers, :class:`SnapshotMissingError`
    when a decoded piece fails its checksum."""
    layout = ParityLayout(r.n, r.parity)
    lost = set(r.lost)
    if not layout.recoverable(lost):
        raise TooManyErasuresError(layout.k, r.parity, sorted(lost), [])
    mine = r.shard
    if len(out) != mine.nbytes:
        raise ValueError(f"{r.key}'s shard is {mine.nbytes} bytes, the buffer given for it {len(out)}")
    mine_infos = sorted(r.infos[r.target], key=lambda s: s.key)
    words = [layout.codeword(layout.region_of(r.target, c)) for c in range(layout.k)]
    survivors = sorted({sym.node for word in words for sym in word if sym.node not in lost})
    deadline = time.monotonic() + WAIT_S  # the whole rebuild's: the members' answers and their pieces
    asked = {j: r.peers[j].endpoint.remote() for j in survivors}
    where = {j: a for j, a in ((j, _endpoint(ref, deadline)) for j, ref in asked.items()) if a is not None}  # a dead member: an erasure
    # every surviving symbol of every codeword is read at once, each straight into one buffer
    # over its member's piece server (the bytes travel in parallel); each codeword is decoded as
    # soon as its own symbols are in, from those buffers in place, straight into ``out``
    with ThreadPoolExecutor(max_workers=min(16, sum(len(w) for w in words))) as pool:
        reads = [
            [pool.submit(_read, where[sym.node], r, layout.region_of(r.target, c), sym, deadline) if sym.node in where else None for sym in word]
            for c, word in enumerate(words)
        ]
        base = 0
        for c, word in enumerate(words):
            want = mine.pieces[c]
            lo = sum(i.pieces[c].length for i in mine_infos if i.key < r.key)  # where key's piece starts in the chunk
            symbols = [None if f is None else _runs(f.result(), sym, r.infos) for f, sym in zip(reads[c], word)]
            got = decode_range(rs, symbols, next(i for i, s in enumerate(word) if s.node == r.target), lo, out[base : base + want.length])
            if checksum(got) != want.crc:
                raise SnapshotMissingError(f"piece {c} of shard {r.key}, version {r.version} fails its checksum after decoding")
            base += want.length
    return out


def _endpoint(ref: Any, deadline: float) -> tuple[str, int] | None:
    """A member's piece server; None if it died meanwhile or did not answer by ``deadline`` (one
    more erasure)."""
    import ray

    try:
        return tuple(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))  # type: ignore[return-value]
    except ray.exceptions.RayError:  # its actor died, or GetTimeoutError
        return None


def _read(address: tuple[str, int], r: ParityRebuild, region: int, sym: Any, deadline: float) -> tuple[np.ndarray, exchange.Answer] | None:
    """One symbol's bytes from its member's piece server; None if refused or cut short."""
    kind, index = (exchange.PARITY, region) if sym.chunk is None else (exchange.CHUNK, sym.chunk)
    try:
        return exchange.fetch(address, r.version, exchange.ANY_ATTEMPT, kind, index, r.role(sym.node), deadline)
    except exchange.ExchangeError:
        return None


def _runs(got: tuple[np.ndarray, exchange.Answer] | None, sym: Any, infos: Sequence[tuple[ShardInfo, ...]]) -> list[tuple[int, np.ndarray]] | None:
    """One symbol of a codeword as runs of bytes: a parity region whose CRC-32 as its holder
    sent it is the one it recorded, or a data chunk whose pieces' are theirs, laid end to end
    (the server computes them as it reads the bytes: :mod:`.exchange`); None for an erasure (a
    lost or dead member, a refusal, a piece that fails its checksum)."""
    if got is None:
        return None
    buf, answer = got
    if sym.chunk is None:
        return [(0, buf)] if answer.sent == [answer.crc] else None
    pieces = chunk_pieces(infos[sym.node], sym.chunk)
    if not answer.carries(pieces):
        return None  # a corrupted piece: one more erasure
    starts = np.cumsum([0] + [p.length for p in pieces]).tolist()
    return [(pos, buf[pos : pos + piece.length]) for pos, piece in zip(starts, pieces)]


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


def recipe(rec: VersionRecord, info: ShardInfo, lost_nodes: set[str], managers: Mapping[str, Any], parity: int) -> ParityRebuild:
    """The recipe for rebuilding shard ``info`` of committed version ``rec`` from its erasure
    group's survivors (their ``managers``, the shards each holds); :class:`UnrecoverableError` if
    more of the group is lost than ``parity`` covers (found here, before any process starts). Pure."""
    group = rec.group_of(info.node_id)
    if group is not None:
        homes = [rec.home(n) for n in group]
        lost = tuple(i for i, n in enumerate(homes) if n in lost_nodes or n not in managers)
        if len(lost) < len(group) and len(lost) <= parity:
            peers = tuple(None if i in lost else managers[n] for i, n in enumerate(homes))
            return ParityRebuild(rec.version, info.key, len(group), parity, lost, group.index(info.node_id), peers, tuple(rec.infos_on(n) for n in group), group)
    raise UnrecoverableError(f"{info.key}, step {rec.version}: its snapshot cannot be rebuilt: more nodes of its erasure group are lost than snapshot.parity={parity} covers")
