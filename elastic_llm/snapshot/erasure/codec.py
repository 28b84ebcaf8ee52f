"""The codec: :class:`ReedSolomon`, the systematic RS(k, m) erasure code that callers use.

What this module owns
---------------------
* The code: k equal-length data shards -> m parity shards (:meth:`ReedSolomon.encode`,
  one row at a time with :meth:`~ReedSolomon.encode_row`), and any k intact shards of
  the k + m -> the k data shards (:meth:`~ReedSolomon.decode`), with the decode
  coefficients derived from the parity matrix and cached per erasure pattern (LRU).
  Byte ``j`` of data shard ``i`` is symbol ``i`` of codeword ``j``; the m parity symbols
  of each codeword are exactly what ``reedsolo.RSCodec(nsym=m, nsize=k+m)`` appends, so
  reedsolo can decode our shards and we can decode reedsolo's codewords.
* Backend selection ("auto" -> ISA-L if libisal loads, else numpy; "isal"; "numpy").
* Validation of every public argument, with an error naming the shard and the fix.
* Shard integrity: :meth:`~ReedSolomon.checksums` / :meth:`~ReedSolomon.verify`, and
  decoding that treats a shard whose checksum does not match as an erasure.

What this module must never do
------------------------------
* Return or write wrong data: every shard that contributes to a decode is verified
  first when checksums are given; more than m lost or corrupted shards raise
  :class:`TooManyErasuresError` instead of guessing.
* Write to caller buffers (``out=``) before every argument has been validated: on any
  error the out buffers are untouched.
* Do field arithmetic over shard bytes itself (the kernels do), allocate full-size
  temporaries, start threads, do I/O, or know anything about snapshots, ranks or
  transport -- callers own placement and movement of the shards.

Thread-safety: an instance may be used from several threads at once (per-thread scratch
in the numpy kernel, a lock around the decode cache); the ISA-L kernel and checksum
release the GIL.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import numpy as np

from elastic_llm.snapshot.erasure.base import (
    BufferOverlapError,
    ChecksumFormatError,
    CodeParametersError,
    ErasureCodec,
    ShardCountError,
    ShardDtypeError,
    ShardLengthError,
    TooManyErasuresError,
    addr,
)
from elastic_llm.snapshot.erasure.gf import check_params, gf_invert_matrix, gf_matmul, parity_matrix
from elastic_llm.snapshot.erasure.isal import IsalCodec, checksum, isal_available
from elastic_llm.snapshot.erasure.numpy_kernel import NumpyCodec


def _make_codec(backend: str) -> ErasureCodec:
    if backend == "auto":
        return IsalCodec() if isal_available() else NumpyCodec()
    if backend == "isal":
        return IsalCodec()
    if backend == "numpy":
        return NumpyCodec()
    raise CodeParametersError(f"unknown backend {backend!r}; use 'auto', 'isal' or 'numpy'")


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------


def _check_array(a: Any, what: str, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ShardDtypeError(f"{what} must be a numpy uint8 array, got {type(a).__name__}")
    if a.dtype != np.uint8:
        raise ShardDtypeError(f"{what} must have dtype uint8, got {a.dtype} (a.view(np.uint8) gives its bytes)")
    if a.ndim != 1:
        raise ShardDtypeError(f"{what} must be 1-D, got shape {a.shape} (a.reshape(-1) flattens a contiguous array)")
    if not a.flags.c_contiguous:
        raise ShardDtypeError(f"{what} must be C-contiguous, got strides {a.strides}: pass np.ascontiguousarray(a)")
    if writable and not a.flags.writeable:
        raise ShardDtypeError(f"{what} is read-only: out buffers must be writable")
    return a


def _check_list(seq: Any, n: int, what: str) -> list:
    if isinstance(seq, np.ndarray) or not isinstance(seq, (list, tuple)):
        raise ShardCountError(f"{what} must be a list of {n} arrays, got {type(seq).__name__}")
    if len(seq) != n:
        raise ShardCountError(f"expected {n} {what}, got {len(seq)}")
    return list(seq)


def _check_no_overlap(outputs: Sequence[tuple[str, np.ndarray]], inputs: Sequence[tuple[str, np.ndarray]]) -> None:
    """Outputs may not overlap each other or any input (address-interval test)."""
    spans = []
    for role, items in ((0, outputs), (1, inputs)):
        for what, a in items:
            if a.nbytes:
                lo = addr(a)
                spans.append((lo, lo + a.nbytes, role, what))
    spans.sort()
    # sweep: any interval overlapping an earlier one whose end exceeds its start
    active: list[tuple[int, int, str]] = []  # (end, role, what)
    for lo, hi, role, what in spans:
        active = [x for x in active if x[0] > lo]
        for _end, role2, what2 in active:
            if role == 0 or role2 == 0:
                out_what, other = (what, what2) if role == 0 else (what2, what)
                raise BufferOverlapError(
                    f"{out_what} overlaps {other}: out buffers must not share memory with the input "
                    f"shards or with each other")
        active.append((hi, role, what))


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.shape == b.shape and addr(a) == addr(b))


# --------------------------------------------------------------------------
# the code
# --------------------------------------------------------------------------


def _xor_into(data: np.ndarray, out: np.ndarray) -> None:
    np.bitwise_xor(out, data, out=out)


class ReedSolomon:
    """Systematic RS(k, m) erasure code over GF(2^8), reedsolo-compatible.

    ``encode`` maps k equal-length data shards to m parity shards; ``decode``
    rebuilds the k data shards from any k intact shards of the k + m.
    ``backend``: "auto" (ISA-L if libisal loads, else numpy), "isal" (raises
    :class:`BackendUnavailableError` if missing) or "numpy".
    ``decode_cache_size`` / ``decode_cache_bytes``: at most this many erasure
    patterns, and about this many bytes of kernel tables, are kept in the LRU
    cache of decode plans.  ``codec``: a preconfigured kernel instance (tests,
    tuning); overrides ``backend``.
    """

    def __init__(self, k: int, m: int, backend: str = "auto", *, decode_cache_size: int = 32,
                 decode_cache_bytes: int = 64 << 20, codec: Optional[ErasureCodec] = None):
        check_params(k, m)
        if not isinstance(backend, str):
            raise CodeParametersError(f"backend must be a string, got {backend!r}")
        self.k = int(k)
        self.m = int(m)
        self.n = self.k + self.m
        self._codec = codec if codec is not None else _make_codec(backend)
        self.parity_matrix = parity_matrix(self.k, self.m)
        g = np.concatenate([np.eye(self.k, dtype=np.uint8), self.parity_matrix], axis=0)
        g.setflags(write=False)
        self.generator_matrix = g
        self._encode_plan = self._codec.prepare(self.parity_matrix)
        self._row_plans: dict[int, Any] = {}
        self._update_plans: dict[tuple[int, int], Any] = {}  # (row, symbol) -> its one-coefficient plan
        self._tls = threading.local()
        self._cache: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._cache_size = max(0, int(decode_cache_size))
        self._cache_bytes = max(0, int(decode_cache_bytes))
        self._cache_lock = threading.Lock()

    @property
    def backend(self) -> str:
        """The kernel in use: "isal" or "numpy"."""
        return self._codec.name

    def __repr__(self) -> str:
        return f"ReedSolomon(k={self.k}, m={self.m}, backend={self.backend!r})"

    # -- encode -----------------------------------------------------------
    def _check_data(self, data: Sequence[np.ndarray]) -> tuple[list[np.ndarray], int]:
        """k valid, equal-length data shards, and their length."""
        data = _check_list(data, self.k, "data shards")
        for i, a in enumerate(data):
            _check_array(a, f"data shard {i}")
        length = data[0].shape[0]
        for i, a in enumerate(data):
            if a.shape[0] != length:
                raise ShardLengthError(
                    f"data shard {i} has {a.shape[0]} bytes, shard 0 has {length}: shards must be equal length")
        return data, length

    def encode(self, data: Sequence[np.ndarray], out: Optional[Sequence[np.ndarray]] = None) -> list[np.ndarray]:
        """Parity of k data shards: a list of m uint8 arrays (``out`` if given)."""
        data, length = self._check_data(data)
        if out is None:
            outs = [np.empty(length, dtype=np.uint8) for _ in range(self.m)]
        else:
            outs = _check_list(out, self.m, "parity out buffers")
            for j, a in enumerate(outs):
                _check_array(a, f"parity out buffer {j}", writable=True)
                if a.shape[0] != length:
                    raise ShardLengthError(
                        f"parity out buffer {j} has {a.shape[0]} bytes, data shards have {length}")
            _check_no_overlap([(f"parity out buffer {j}", a) for j, a in enumerate(outs)],
                              [(f"data shard {i}", a) for i, a in enumerate(data)])
        self._codec.apply(self._encode_plan, data, outs)
        return outs

    def encode_row(self, data: Sequence[np.ndarray], row: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Parity row ``row`` alone (what one parity holder keeps): equals ``encode(data)[row]``
        at 1/m of the work."""
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.m:
            raise CodeParametersError(f"parity row must be an int in [0, {self.m}), got {row!r}")
        data, length = self._check_data(data)
        if out is None:
            out = np.empty(length, dtype=np.uint8)
        else:
            _check_array(out, "parity out buffer", writable=True)
            if out.shape[0] != length:
                raise ShardLengthError(f"parity out buffer has {out.shape[0]} bytes, data shards have {length}")
            _check_no_overlap([("parity out buffer", out)], [(f"data shard {i}", a) for i, a in enumerate(data)])
        plan = self._row_plans.get(int(row))
        if plan is None:
            plan = self._row_plans[int(row)] = self._codec.prepare(np.ascontiguousarray(self.parity_matrix[row : row + 1]))
        self._codec.apply(plan, data, [out])
        return out

    def encode_update(self, data: np.ndarray, symbol: int, row: int, out: np.ndarray) -> np.ndarray:
        """Add data symbol ``symbol``'s contribution to parity row ``row`` into ``out`` (a byte
        range of the parity, and the same range of the symbol): ``out ^= P[row, symbol] * data``.
        Starting from zeros and adding every symbol's bytes once, in any order and any cuts, gives
        ``encode_row``'s parity: a holder encodes as the bytes arrive, with no second pass."""
        update = self.updater(symbol, row)
        _check_array(data, "data bytes")
        _check_array(out, "parity out buffer", writable=True)
        if out.shape[0] != data.shape[0]:
            raise ShardLengthError(f"parity out buffer has {out.shape[0]} bytes, the data {data.shape[0]}")
        _check_no_overlap([("parity out buffer", out)], [("data bytes", data)])
        update(data, out)
        return out

    def updater(self, symbol: int, row: int) -> Callable[[np.ndarray, np.ndarray], None]:
        """:meth:`encode_update` for one data symbol and parity row, checked once here: the
        returned ``update(data, out)`` does ``out ^= P[row, symbol] * data`` with no checks of its
        own (a parity holder calls it for every block it reads: uint8, contiguous, of one length,
        not overlapping; about 20 us of checks a call saved, a sixth of a 128 KiB block's time)."""
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.m:
            raise CodeParametersError(f"parity row must be an int in [0, {self.m}), got {row!r}")
        if isinstance(symbol, bool) or not isinstance(symbol, (int, np.integer)) or not 0 <= symbol < self.k:
            raise CodeParametersError(f"data symbol must be an int in [0, {self.k}), got {symbol!r}")
        coef = int(self.parity_matrix[row, symbol])
        if coef == 1:  # a plain XOR (every coefficient of a single parity row is 1)
            return _xor_into
        plan = self._update_plans.get((int(row), int(symbol)))
        if plan is None:
            plan = self._update_plans[(int(row), int(symbol))] = self._codec.prepare(np.array([[coef]], dtype=np.uint8))

        def update(data: np.ndarray, out: np.ndarray) -> None:
            scratch = self._scratch(len(data))
            self._codec.apply(plan, [data], [scratch])
            np.bitwise_xor(out, scratch, out=out)

        return update

    def _scratch(self, nbytes: int) -> np.ndarray:
        """A per-thread buffer of at least ``nbytes`` (reused: a streamed chunk's products stay in cache)."""
        buf = getattr(self._tls, "scratch", None)
        if buf is None or len(buf) < nbytes:
            buf = self._tls.scratch = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes]

    # -- checksums --------------------------------------------------------
    def checksums(self, shards: Sequence[Optional[np.ndarray]]) -> list[Optional[int]]:
        """:func:`checksum` of each shard (None stays None)."""
        return [None if s is None else checksum(s) for s in shards]

    def verify(self, shards: Sequence[Optional[np.ndarray]], checksums: Sequence[Optional[int]]) -> list[bool]:
        """Per shard: True if it is present and its checksum matches."""
        shards = _check_list(shards, self.n, "shards")
        checksums = self._check_checksums(checksums)
        return [s is not None and checksum(s) == checksums[i] for i, s in enumerate(shards)]

    def _check_checksums(self, checksums: Sequence[Optional[int]]) -> list[Optional[int]]:
        sums = _check_list(checksums, self.n, "checksums")
        for i, c in enumerate(sums):
            if c is None:
                continue
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c <= 0xFFFFFFFF:
                raise ChecksumFormatError(f"checksum {i} must be an int in [0, 2**32), got {c!r}")
        return sums

    # -- decode -----------------------------------------------------------
    def decode(self, shards: Sequence[Optional[np.ndarray]], out: Optional[Sequence[np.ndarray]] = None,
               checksums: Optional[Sequence[Optional[int]]] = None) -> list[np.ndarray]:
        """Rebuild the k data shards from k + m shards (None for a lost one).

        ``checksums`` (k + m values from :func:`checksum`, taken when the shards
        were written): every shard is verified before it is used and a mismatch
        is treated as an erasure; a ``None`` checksum means the shard has no
        recorded checksum and it is treated as lost if present.  Shards are used
        data-first, so when no data shard is lost no parity is read.

        Returns a list of k arrays.  Without ``out``, surviving data shards are
        returned as the very objects passed in (no copy) and lost ones in new
        arrays.  With ``out`` (k writable buffers), everything is written there
        (an ``out[i]`` that *is* the intact ``shards[i]`` is left as is), and
        ``out`` is returned.  Raises :class:`TooManyErasuresError` if fewer than
        k intact shards remain; nothing is written to ``out`` on any error.
        """
        k, n = self.k, self.n
        shards = _check_list(shards, n, "shards")
        length = -1
        first_i = -1
        for i, s in enumerate(shards):
            if s is None:
                continue
            _check_array(s, f"shard {i}")
            if length < 0:
                length, first_i = s.shape[0], i
            elif s.shape[0] != length:
                raise ShardLengthError(
                    f"shard {i} has {s.shape[0]} bytes, shard {first_i} has {length}: shards must be equal length")
        sums = None if checksums is None else self._check_checksums(checksums)
        outs = None
        if out is not None:
            outs = _check_list(out, k, "data out buffers")
            for i, a in enumerate(outs):
                _check_array(a, f"data out buffer {i}", writable=True)
                if length >= 0 and a.shape[0] != length:
                    raise ShardLengthError(f"data out buffer {i} has {a.shape[0]} bytes, shards have {length}")
            if length < 0:
                lens = {a.shape[0] for a in outs}
                if len(lens) > 1:
                    raise ShardLengthError("data out buffers have unequal lengths")

        # choose k intact shards, data first, verifying each before use
        missing = [i for i, s in enumerate(shards) if s is None]
        corrupted: list[int] = []
        chosen: list[int] = []
        for i, s in enumerate(shards):
            if len(chosen) == k:
                break
            if s is None:
                continue
            if sums is not None and (sums[i] is None or checksum(s) != sums[i]):
                corrupted.append(i)
                continue
            chosen.append(i)
        if len(chosen) < k:
            raise TooManyErasuresError(self.k, self.m, missing, corrupted)
        chosen_set = set(chosen)
        lost = [i for i in range(k) if i not in chosen_set]

        if outs is not None:
            in_place = {i for i in range(k) if i in chosen_set and _same_buffer(outs[i], shards[i])}
            _check_no_overlap(
                [(f"data out buffer {i}", outs[i]) for i in range(k) if i not in in_place],
                [(f"shard {c}", shards[c]) for c in chosen])
            result = outs
        else:
            in_place = set()
            result = [shards[i] if i in chosen_set else np.empty(length, dtype=np.uint8) for i in range(k)]

        if lost:
            plan = self._decode_plan(tuple(chosen))
            self._codec.apply(plan, [shards[c] for c in chosen], [result[i] for i in lost])
        if outs is not None:
            for i in range(k):
                if i in chosen_set and i not in in_place:
                    np.copyto(outs[i], shards[i])
        return list(result)

    def decode_row(self, shards: Sequence[Optional[np.ndarray]], row: int, out: np.ndarray) -> np.ndarray:
        """Data shard ``row`` alone, written into ``out`` (what a rebuild of one lost member
        needs): equals ``decode(shards)[row]`` at the cost of one output row, with no other
        buffer allocated. The first k present shards are used, data first; an intact ``row``
        is copied. Raises :class:`TooManyErasuresError` if fewer than k shards are present."""
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.k:
            raise CodeParametersError(f"data row must be an int in [0, {self.k}), got {row!r}")
        shards = _check_list(shards, self.n, "shards")
        present = [i for i, s in enumerate(shards) if s is not None]
        for i in present:
            _check_array(shards[i], f"shard {i}")
            if shards[i].shape[0] != shards[present[0]].shape[0]:
                raise ShardLengthError(f"shard {i} has {shards[i].shape[0]} bytes, shard {present[0]} has {shards[present[0]].shape[0]}")
        _check_array(out, "data out buffer", writable=True)
        if present and out.shape[0] != shards[present[0]].shape[0]:
            raise ShardLengthError(f"data out buffer has {out.shape[0]} bytes, shards have {shards[present[0]].shape[0]}")
        if len(present) < self.k:
            raise TooManyErasuresError(self.k, self.m, [i for i, s in enumerate(shards) if s is None], [])
        chosen = tuple(present[: self.k])
        if row in chosen:
            np.copyto(out, shards[row])
            return out
        _check_no_overlap([("data out buffer", out)], [(f"shard {c}", shards[c]) for c in chosen])
        self._codec.apply(self._decode_plan(chosen, row), [shards[c] for c in chosen], [out])
        return out

    def decode_matrix(self, chosen: Sequence[int]) -> np.ndarray:
        """Coefficients (lost data rows x k) expressing the data shards missing
        from ``chosen`` (k distinct shard indices, sorted) in terms of the
        ``chosen`` shards."""
        k = self.k
        chosen = list(chosen)
        if len(chosen) != k or len(set(chosen)) != k or not all(0 <= c < self.n for c in chosen):
            raise ShardCountError(f"need k={k} distinct shard indices in [0, {self.n})")
        cset = set(chosen)
        lost = [i for i in range(k) if i not in cset]
        present_data = [c for c in chosen if c < k]
        par = [c - k for c in chosen if c >= k]
        r = len(lost)
        coeffs = np.zeros((r, k), dtype=np.uint8)
        if r == 0:
            return coeffs
        # Parity row p:  s_p = P[p, D] d_D  +  P[p, L] d_L   (D present, L lost data)
        # so  d_L = inv(P[Pc, L]) (s_Pc + P[Pc, D] d_D), with Pc the first r parity rows.
        pc = par[:r]
        sub = self.parity_matrix[np.ix_(pc, lost)]
        q = gf_invert_matrix(sub)  # MDS: square submatrices of P are invertible
        col = {c: j for j, c in enumerate(chosen)}
        for t, p in enumerate(pc):
            coeffs[:, col[p + k]] = q[:, t]
        if present_data:
            pd = self.parity_matrix[np.ix_(pc, present_data)]
            qd = gf_matmul(q, pd)
            for t, d in enumerate(present_data):
                coeffs[:, col[d]] = qd[:, t]
        return coeffs

    def _decode_plan(self, chosen: tuple[int, ...], row: Optional[int] = None) -> Any:
        """The prepared kernel for the data rows missing from ``chosen`` (all of them, or only
        ``row``), from the LRU cache."""
        key = chosen if row is None else (*chosen, -1 - row)  # chosen indices are >= 0: no clash
        with self._cache_lock:
            plan = self._cache.get(key)
            if plan is not None:
                self._cache.move_to_end(key)
                return plan
        matrix = self.decode_matrix(chosen)
        if row is not None:
            lost = [i for i in range(self.k) if i not in set(chosen)]
            matrix = np.ascontiguousarray(matrix[lost.index(row) : lost.index(row) + 1])
        plan = self._codec.prepare(matrix)
        if self._cache_size:
            with self._cache_lock:
                self._cache[key] = plan
                self._cache.move_to_end(key)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                # tables are built lazily, so re-measure; always keep the newest
                while len(self._cache) > 1 and sum(
                        getattr(p, "nbytes", 0) for p in self._cache.values()) > self._cache_bytes:
                    self._cache.popitem(last=False)
        return plan
