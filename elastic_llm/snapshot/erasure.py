"""Systematic Reed-Solomon erasure coding of snapshot shards over GF(2^8).

What this module owns
---------------------
* The code itself: a systematic RS(k data, m parity) code over GF(2^8) with
  reedsolo's field (primitive polynomial 0x11d, generator 2, fcr 0),
  ``k + m <= 255``.  Byte ``j`` of data shard ``i`` is symbol ``i`` of codeword
  ``j``; the m parity symbols of each codeword are exactly what
  ``reedsolo.RSCodec(nsym=m, nsize=k+m).encode(bytes(column))`` appends, so
  reedsolo can decode our shards and we can decode reedsolo's codewords.  The
  parity matrix is derived from the same generator polynomial reedsolo uses,
  ``g(x) = prod_{i<m} (x - 2^i)``, by running reedsolo's synthetic division on
  the k unit vectors (by linearity, the parity of ``e_i`` is column ``i``).
  The resulting ``[I; P]`` is MDS (any k of the k+m shards determine the data):
  this is the BCH bound for RS codes of length <= 255, and the test-suite checks
  every k x k submatrix exhaustively for all small (k, m); no (k, m) needed a
  Cauchy fallback, so none is implemented.
* Two interchangeable GF(2^8) matrix-times-shards kernels behind the small
  :class:`ErasureCodec` interface, producing identical bytes:
  :class:`IsalCodec` (Intel ISA-L's ``ec_encode_data`` through ctypes, which
  releases the GIL) and :class:`NumpyCodec` (table lookups + XOR in cache-sized
  blocks, no full-size temporaries).
* Shard integrity: :func:`checksum` (CRC-32), and decoding that treats a shard
  whose checksum does not match as an erasure.

What this module must never do
------------------------------
* Return or write wrong data: every shard that contributes to a decode is
  verified first when checksums are given; more than m lost or corrupted
  shards raise :class:`TooManyErasuresError` instead of guessing.
* Write to caller buffers (``out=``) before every argument has been validated:
  on any error the out buffers are untouched.
* Allocate full-size temporaries, start threads, do I/O, or know anything about
  snapshots, ranks or transport -- callers own placement and movement of the
  shards; this module only turns k buffers into m and back.

Quick use::

    rs = ReedSolomon(8, 2)                      # backend "auto" | "isal" | "numpy"
    parity = rs.encode(data)                    # k equal-length 1-D uint8 arrays -> m
    sums = rs.checksums(data + parity)
    data = rs.decode(shards, checksums=sums)    # shards: k+m arrays, None = lost

Thread-safety: a :class:`ReedSolomon` instance may be used from several threads
at once (per-thread scratch for the numpy kernel, a lock around the decode
cache); the ISA-L kernel and the ISA-L checksum release the GIL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, ClassVar, Optional, Sequence

import numpy as np

__all__ = [
    "ReedSolomon",
    "ErasureCodec",
    "IsalCodec",
    "NumpyCodec",
    "ErasureError",
    "CodeParametersError",
    "ShardCountError",
    "ShardLengthError",
    "ShardDtypeError",
    "BufferOverlapError",
    "ChecksumFormatError",
    "TooManyErasuresError",
    "BackendUnavailableError",
    "checksum",
    "checksum_impl",
    "isal_available",
    "parity_matrix",
    "gf_mul",
    "gf_inv",
    "gf_matmul",
    "gf_invert_matrix",
    "PRIM_POLY",
    "GENERATOR",
    "MAX_SHARDS",
]

PRIM_POLY = 0x11D
GENERATOR = 2
MAX_SHARDS = 255

# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------


class ErasureError(ValueError):
    """Base class of every error raised by this module."""


class CodeParametersError(ErasureError):
    """k < 1, m < 1, k + m > 255, or an unknown backend name."""


class ShardCountError(ErasureError):
    """Wrong number of shards, out buffers or checksums."""


class ShardLengthError(ErasureError):
    """Shards (or out buffers) of unequal length."""


class ShardDtypeError(ErasureError):
    """A shard or out buffer is not a 1-D C-contiguous uint8 numpy array
    (or an out buffer is read-only)."""


class BufferOverlapError(ErasureError):
    """An out buffer overlaps an input shard or another out buffer."""


class ChecksumFormatError(ErasureError):
    """A checksum value is not an unsigned 32-bit integer."""


class BackendUnavailableError(ErasureError):
    """The requested backend (ISA-L) cannot be loaded on this machine."""


class TooManyErasuresError(ErasureError):
    """More shards are lost or corrupted than the parity can repair."""

    def __init__(self, k: int, m: int, missing: Sequence[int], corrupted: Sequence[int]):
        self.k = k
        self.m = m
        self.missing = tuple(missing)
        self.corrupted = tuple(corrupted)
        self.lost = len(self.missing) + len(self.corrupted)
        msg = (
            f"RS({k},{m}): {self.lost} of {k + m} shards lost "
            f"({len(self.missing)} missing {list(self.missing)}, "
            f"{len(self.corrupted)} failed checksum {list(self.corrupted)}); "
            f"the {m} parity shard(s) can repair at most {m} lost shard(s), so the "
            f"data cannot be reconstructed from these shards and must come from "
            f"another source (e.g. a persistent checkpoint)"
        )
        super().__init__(msg)


# --------------------------------------------------------------------------
# GF(2^8) arithmetic (reedsolo's field: x^8+x^4+x^3+x^2+1, generator 2)
# --------------------------------------------------------------------------


def _build_field() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int64)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= PRIM_POLY
    exp[255:510] = exp[0:255]
    a = np.arange(256)
    s = log[a][:, None] + log[a][None, :]
    mul = exp[s].astype(np.uint8)
    mul[0, :] = 0
    mul[:, 0] = 0
    inv = np.zeros(256, dtype=np.uint8)
    inv[1:] = exp[255 - log[1:]]
    for t in (exp, log, mul, inv):
        t.setflags(write=False)
    return exp, log, mul, inv


_EXP, _LOG, _MUL, _INV = _build_field()


def gf_mul(a: int, b: int) -> int:
    """Product of two field elements."""
    return int(_MUL[a, b])


def gf_inv(a: int) -> int:
    """Multiplicative inverse of a non-zero field element."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(_INV[a])


def gf_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product over GF(2^8) (small matrices only)."""
    a = np.asarray(a, dtype=np.uint8)
    b = np.asarray(b, dtype=np.uint8)
    prod = _MUL[a[:, :, None], b[None, :, :]]
    return np.bitwise_xor.reduce(prod, axis=1).astype(np.uint8)


def gf_invert_matrix(a: np.ndarray) -> np.ndarray:
    """Inverse of a square matrix over GF(2^8); raises ZeroDivisionError if singular."""
    a = np.asarray(a, dtype=np.uint8)
    n = a.shape[0]
    if a.shape != (n, n):
        raise ValueError("matrix must be square")
    w = np.zeros((n, 2 * n), dtype=np.uint8)
    w[:, :n] = a
    w[np.arange(n), n + np.arange(n)] = 1
    for col in range(n):
        nz = np.flatnonzero(w[col:, col])
        if nz.size == 0:
            raise ZeroDivisionError("matrix is singular over GF(2^8)")
        piv = col + int(nz[0])
        if piv != col:
            w[[col, piv]] = w[[piv, col]]
        w[col] = _MUL[_INV[w[col, col]], w[col]]
        f = w[:, col].copy()
        f[col] = 0
        rows = np.flatnonzero(f)
        if rows.size:
            w[rows] ^= _MUL[f[rows][:, None], w[col][None, :]]
    return w[:, n:].copy()


def _generator_poly(m: int) -> np.ndarray:
    """reedsolo's generator polynomial prod_{i<m} (x - 2^i), highest degree first."""
    g = np.array([1], dtype=np.uint8)
    for i in range(m):
        root = _EXP[(i * _LOG[GENERATOR]) % 255]
        # (g * (x + root)): shift for x, plus root * g
        ng = np.zeros(g.size + 1, dtype=np.uint8)
        ng[:-1] = g
        ng[1:] ^= _MUL[root, g]
        g = ng
    return g


def parity_matrix(k: int, m: int) -> np.ndarray:
    """The m x k parity matrix P of RS(k, m): parity = P . data (GF(2^8)).

    Column i is the parity reedsolo appends to the unit message e_i, computed by
    the same synthetic division reedsolo's ``rs_encode_msg`` performs, run on all
    k unit vectors at once.
    """
    _check_params(k, m)
    gen = _generator_poly(m)
    w = np.zeros((k, k + m), dtype=np.uint8)
    w[np.arange(k), np.arange(k)] = 1
    for i in range(k):
        coef = w[:, i]
        w[:, i + 1 : i + 1 + m] ^= _MUL[coef[:, None], gen[None, 1:]]
    p = np.ascontiguousarray(w[:, k:].T)
    p.setflags(write=False)
    return p


def _check_params(k: Any, m: Any) -> None:
    for name, v in (("k", k), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise CodeParametersError(f"{name} must be an int, got {v!r}")
    if k < 1 or m < 1:
        raise CodeParametersError(f"need k >= 1 data and m >= 1 parity shards, got k={k}, m={m}")
    if k + m > MAX_SHARDS:
        raise CodeParametersError(
            f"k + m = {k + m} > {MAX_SHARDS}: GF(2^8) Reed-Solomon supports at most "
            f"{MAX_SHARDS} shards per codeword"
        )


# --------------------------------------------------------------------------
# ISA-L loading and checksums
# --------------------------------------------------------------------------

_isal_lock = threading.Lock()
_isal_lib: Optional[ctypes.CDLL] = None
_isal_error: Optional[str] = None
_isal_tried = False


def _load_isal() -> Optional[ctypes.CDLL]:
    global _isal_lib, _isal_error, _isal_tried
    with _isal_lock:
        if _isal_tried:
            return _isal_lib
        _isal_tried = True
        names = []
        found = ctypes.util.find_library("isal")
        if found:
            names.append(found)
        names.append("libisal.so.2")
        errors = []
        for name in names:
            try:
                lib = ctypes.CDLL(name)  # CDLL (not PyDLL): calls release the GIL
                lib.ec_init_tables.argtypes = [
                    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                lib.ec_init_tables.restype = None
                lib.ec_encode_data.argtypes = [
                    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                    ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
                lib.ec_encode_data.restype = None
                lib.crc32_gzip_refl.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
                lib.crc32_gzip_refl.restype = ctypes.c_uint32
            except (OSError, AttributeError) as e:
                errors.append(f"{name}: {e}")
                continue
            _isal_lib = lib
            return lib
        _isal_error = "; ".join(errors) or "libisal not found"
        return None


def isal_available() -> bool:
    """True if Intel ISA-L (libisal.so.2) can be loaded."""
    return _load_isal() is not None


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def checksum_impl() -> str:
    """Which implementation :func:`checksum` uses here: "isal" or "zlib"."""
    return "isal" if isal_available() else "zlib"


def checksum(arr: Any) -> int:
    """CRC-32 (the zlib/gzip polynomial) of a C-contiguous buffer, as an int.

    The value is always ``zlib.crc32(bytes(arr))``; it is computed by ISA-L's
    ``crc32_gzip_refl`` (tens of GB/s, releases the GIL) when libisal is present
    and by ``zlib.crc32`` (C, a few GB/s) otherwise.  CRC-32 rather than CRC-32C
    was chosen so that the value does not depend on which machine computed it:
    the zlib fallback has no CRC-32C, and a checksum recorded on one host must
    verify on another.
    """
    if isinstance(arr, np.ndarray):
        if not arr.flags.c_contiguous:
            raise ShardDtypeError("checksum needs a C-contiguous array")
        nbytes = arr.nbytes
        lib = _load_isal()
        if lib is not None:
            if nbytes == 0:
                return 0
            return int(lib.crc32_gzip_refl(0, _addr(arr), nbytes))
        return zlib.crc32(arr.reshape(-1).view(np.uint8)) & 0xFFFFFFFF
    return zlib.crc32(arr) & 0xFFFFFFFF


# --------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------


class ErasureCodec(ABC):
    """A GF(2^8) kernel: ``outputs[r] = XOR_c matrix[r, c] * inputs[c]`` bytewise.

    ``prepare`` turns a coefficient matrix into whatever the kernel needs
    (tables); ``apply`` runs it.  ``apply`` may assume validated arguments:
    len(inputs) == matrix columns, len(outputs) == matrix rows, every array 1-D
    C-contiguous uint8 of one common length, outputs writable and overlapping
    neither the inputs nor each other.
    """

    name: ClassVar[str]

    @abstractmethod
    def prepare(self, matrix: np.ndarray) -> Any:
        """Precompute tables for an (rows x n_inputs) uint8 coefficient matrix."""

    @abstractmethod
    def apply(self, prepared: Any, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        """Compute the outputs for the prepared matrix."""


class _IsalPlan:
    __slots__ = ("rows", "cols", "tables", "matrix")

    def __init__(self, rows: int, cols: int, tables: np.ndarray, matrix: np.ndarray):
        self.rows = rows
        self.cols = cols
        self.tables = tables
        self.matrix = matrix

    @property
    def nbytes(self) -> int:
        return self.tables.nbytes + self.matrix.nbytes


class IsalCodec(ErasureCodec):
    """Intel ISA-L ``ec_encode_data`` on the caller's buffers (GIL released).

    Runs in chunks of ``chunk`` bytes per shard (ISA-L takes an ``int`` length;
    chunking also keeps multi-pass work -- more than 6 output rows -- in cache).
    """

    name = "isal"

    def __init__(self, chunk: int = 1 << 20):
        lib = _load_isal()
        if lib is None:
            raise BackendUnavailableError(
                "ISA-L backend requested but libisal could not be loaded "
                f"({_isal_error}); install it (Debian/Ubuntu: apt-get install -y libisal2) "
                "or use backend='numpy'/'auto'"
            )
        self._lib = lib
        if not 64 <= chunk <= 1 << 30:  # ISA-L's length argument is a C int
            raise CodeParametersError("chunk must be between 64 bytes and 1 GiB")
        self.chunk = int(chunk)

    def prepare(self, matrix: np.ndarray) -> _IsalPlan:
        mat = np.ascontiguousarray(matrix, dtype=np.uint8)
        rows, cols = mat.shape
        tables = np.zeros(max(1, 32 * rows * cols), dtype=np.uint8)
        if rows:
            self._lib.ec_init_tables(cols, rows, _addr(mat), _addr(tables))
        return _IsalPlan(rows, cols, tables, mat)

    def apply(self, prepared: _IsalPlan, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        rows, cols = prepared.rows, prepared.cols
        if rows == 0:
            return
        length = outputs[0].shape[0]
        if length == 0:
            return
        in_addrs = [_addr(a) for a in inputs]
        out_addrs = [_addr(a) for a in outputs]
        in_ptrs = (ctypes.c_void_p * cols)()
        out_ptrs = (ctypes.c_void_p * rows)()
        tables = _addr(prepared.tables)
        enc = self._lib.ec_encode_data
        chunk = self.chunk
        for off in range(0, length, chunk):
            n = min(chunk, length - off)
            in_ptrs[:] = [a + off for a in in_addrs]
            out_ptrs[:] = [a + off for a in out_addrs]
            enc(n, cols, rows, tables, in_ptrs, out_ptrs)


# numpy kernel ---------------------------------------------------------------

_LANE_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def _lane_bytes(nlanes: int, lane_size: int) -> int:
    b = nlanes * lane_size
    for w in (1, 2, 4, 8):
        if b <= w:
            return w
    raise AssertionError(b)


class _Group:
    """Up to ``lanes`` outputs computed together with one packed lookup per input."""

    __slots__ = ("outs", "dtype", "nlanes", "terms")

    def __init__(self, outs: list[int], dtype: np.dtype, terms: list[tuple[int, Optional[np.ndarray]]]):
        self.outs = outs          # output row indices
        self.dtype = dtype        # accumulator entry type
        self.nlanes = len(outs)
        self.terms = terms        # (input index, table or None meaning plain XOR)


def _build_groups(matrix: np.ndarray, wide: bool) -> list[_Group]:
    """Packed lookup tables for a coefficient matrix.

    narrow: 256-entry tables indexed by one data byte; entry = the products of
            that byte with the coefficients of up to 8 outputs, output t in byte t.
    wide:   65536-entry tables indexed by two adjacent data bytes (little-endian
            uint16); entry = up to 4 outputs, output t in uint16 lane t, whose low
            byte is coef*byte0 and high byte is coef*byte1.
    """
    rows, cols = matrix.shape
    per = 4 if wide else 8
    lane = 2 if wide else 1
    groups = []
    for g0 in range(0, rows, per):
        outs = list(range(g0, min(rows, g0 + per)))
        dtype = _LANE_DTYPES[_lane_bytes(len(outs), lane)]
        terms: list[tuple[int, Optional[np.ndarray]]] = []
        for c in range(cols):
            coefs = matrix[outs, c]
            if not coefs.any():
                continue
            if len(outs) == 1 and coefs[0] == 1:
                terms.append((c, None))
                continue
            if wide:
                # index = byte0 | byte1 << 8  ->  2-D [byte1, byte0] flattened
                t = np.zeros((256, 256), dtype=np.uint64)
                for lane_i, cf in enumerate(coefs):
                    if cf:
                        row = _MUL[cf].astype(np.uint64)
                        sh = np.uint64(16 * lane_i)
                        t |= ((row << np.uint64(8)) << sh)[:, None] | (row << sh)[None, :]
                t = t.reshape(-1)
            else:
                t = np.zeros(256, dtype=np.uint64)
                for lane_i, cf in enumerate(coefs):
                    if cf:
                        t |= _MUL[cf].astype(np.uint64) << np.uint64(8 * lane_i)
            terms.append((c, t.astype(dtype)))
        groups.append(_Group(outs, dtype, terms))
    return groups


class _NumpyPlan:
    __slots__ = ("matrix", "narrow", "_wide", "wide_ok", "_lock")

    def __init__(self, matrix: np.ndarray, wide_budget: int):
        self.matrix = matrix
        self.narrow = _build_groups(matrix, wide=False)
        rows, cols = matrix.shape
        wide_bytes = 0
        for g0 in range(0, rows, 4):
            wide_bytes += 65536 * _lane_bytes(min(4, rows - g0), 2) * cols
        # 16-bit lookups cost ceil(rows/4)/2 lookups per data byte, 8-bit ones
        # ceil(rows/8); use them only where that is fewer and the tables fit.
        fewer = rows > 0 and (-(-rows // 4)) < 2 * (-(-rows // 8))
        self.wide_ok = fewer and wide_bytes <= wide_budget
        self._wide: Optional[list[_Group]] = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        n = self.matrix.nbytes
        for groups in (self.narrow, self._wide or []):
            n += sum(t.nbytes for g in groups for _c, t in g.terms if t is not None)
        return n

    def wide(self) -> list[_Group]:
        if self._wide is None:
            with self._lock:
                if self._wide is None:
                    self._wide = _build_groups(self.matrix, wide=True)
        return self._wide


class NumpyCodec(ErasureCodec):
    """Pure-numpy kernel: packed table lookups (``np.take``) and XOR.

    For each block of ``block_elems`` lookups per shard and each input shard the
    block is widened once to intp indices (``np.copyto`` into scratch), looked up
    in a packed table that yields the products for several outputs at once, and
    XOR-accumulated; the packed accumulator is finally de-interleaved into the
    outputs.  Long shards (>= ``wide_min_len`` bytes) use 16-bit indices (two
    data bytes per lookup, 64Ki-entry tables, at most ``wide_table_budget``
    bytes of tables per matrix); short shards, the odd last byte and codes whose
    tables would exceed the budget use 8-bit indices (256-entry tables).
    Scratch is per thread and reused, so there are no full-size temporaries.
    """

    name = "numpy"

    def __init__(self, block_elems: int = 131072, wide_min_len: int = 256 << 10,
                 wide_table_budget: int = 16 << 20):
        if block_elems < 1:
            raise CodeParametersError("block_elems must be >= 1")
        self.block_elems = int(block_elems)
        self.wide_min_len = int(wide_min_len)
        self.wide_table_budget = int(wide_table_budget)
        self._tls = threading.local()

    def prepare(self, matrix: np.ndarray) -> _NumpyPlan:
        return _NumpyPlan(np.ascontiguousarray(matrix, dtype=np.uint8), self.wide_table_budget)

    def _scratch(self, ngroups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tls = self._tls
        e = self.block_elems
        if getattr(tls, "idx", None) is None or tls.acc.shape[0] < ngroups:
            tls.idx = np.empty(e, dtype=np.intp)
            tls.tmp = np.empty(e, dtype=np.uint64)
            tls.acc = np.empty((max(ngroups, 1), e), dtype=np.uint64)
        return tls.idx, tls.tmp, tls.acc

    def apply(self, prepared: _NumpyPlan, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        if not outputs:
            return
        length = outputs[0].shape[0]
        if length == 0:
            return
        start = 0
        if prepared.wide_ok and length >= self.wide_min_len:
            body = length & ~1
            self._run(prepared.wide(), inputs, outputs, 0, body, 2)
            start = body
        if start < length:
            self._run(prepared.narrow, inputs, outputs, start, length, 1)

    def _run(self, groups: list[_Group], inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
             start: int, stop: int, elem: int) -> None:
        idx_buf, tmp_buf, acc_buf = self._scratch(len(groups))
        lane_dt = _LANE_DTYPES[elem]
        step = self.block_elems * elem
        take = np.take
        xor = np.bitwise_xor
        copyto = np.copyto
        # Which inputs are used by which group (input-major loop so each input
        # block is widened to intp once for all groups).
        users: dict[int, list[tuple[int, Optional[np.ndarray]]]] = {}
        for gi, g in enumerate(groups):
            for c, t in g.terms:
                users.setdefault(c, []).append((gi, t))
        order = sorted(users)
        for off in range(start, stop, step):
            nb = min(step, stop - off)
            ne = nb // elem
            idx = idx_buf[:ne]
            accs = []
            for gi, g in enumerate(groups):
                if g.nlanes == 1:
                    # single output: accumulate straight into the output block
                    accs.append(outputs[g.outs[0]][off:off + nb].view(g.dtype))
                else:
                    accs.append(acc_buf[gi].view(g.dtype)[:ne])
            first = [True] * len(groups)
            for c in order:
                src = inputs[c][off:off + nb]
                if elem != 1:
                    src = src.view(lane_dt)
                widened = False
                for gi, t in users[c]:
                    acc = accs[gi]
                    if t is None:  # coefficient 1 on a single output: plain XOR
                        if first[gi]:
                            copyto(acc, src)
                        else:
                            xor(acc, src, out=acc)
                    else:
                        if not widened:
                            copyto(idx, src, casting="unsafe")
                            widened = True
                        if first[gi]:
                            take(t, idx, out=acc, mode="clip")
                        else:
                            tmp = tmp_buf.view(t.dtype)[:ne]
                            take(t, idx, out=tmp, mode="clip")
                            xor(acc, tmp, out=acc)
                    first[gi] = False
            for gi, g in enumerate(groups):
                if first[gi]:  # no non-zero coefficient: outputs are zero
                    for o in g.outs:
                        outputs[o][off:off + nb].fill(0)
                    continue
                if g.nlanes == 1:
                    continue
                lanes = accs[gi].view(lane_dt).reshape(ne, -1)
                for lane_i, o in enumerate(g.outs):
                    dst = outputs[o][off:off + nb]
                    if elem != 1:
                        dst = dst.view(lane_dt)
                    copyto(dst, lanes[:, lane_i])


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
        raise ShardDtypeError(f"{what} must have dtype uint8, got {a.dtype}")
    if a.ndim != 1:
        raise ShardDtypeError(f"{what} must be 1-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ShardDtypeError(f"{what} must be contiguous")
    if writable and not a.flags.writeable:
        raise ShardDtypeError(f"{what} is read-only")
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
                lo = _addr(a)
                spans.append((lo, lo + a.nbytes, role, what))
    spans.sort()
    # sweep: any interval overlapping an earlier one whose end exceeds its start
    active: list[tuple[int, int, str]] = []  # (end, role, what)
    for lo, hi, role, what in spans:
        active = [x for x in active if x[0] > lo]
        for _end, role2, what2 in active:
            if role == 0 or role2 == 0:
                raise BufferOverlapError(f"{what} overlaps {what2}")
        active.append((hi, role, what))


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.shape == b.shape and _addr(a) == _addr(b))


# --------------------------------------------------------------------------
# the code
# --------------------------------------------------------------------------


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
        _check_params(k, m)
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

    def _decode_plan(self, chosen: tuple[int, ...]) -> Any:
        with self._cache_lock:
            plan = self._cache.get(chosen)
            if plan is not None:
                self._cache.move_to_end(chosen)
                return plan
        plan = self._codec.prepare(self.decode_matrix(chosen))
        if self._cache_size:
            with self._cache_lock:
                self._cache[chosen] = plan
                self._cache.move_to_end(chosen)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                # tables are built lazily, so re-measure; always keep the newest
                while len(self._cache) > 1 and sum(
                        getattr(p, "nbytes", 0) for p in self._cache.values()) > self._cache_bytes:
                    self._cache.popitem(last=False)
        return plan
