"""The field and matrix layer: reedsolo's GF(2^8), small matrices over it, and the parity matrix.

What this module owns
---------------------
* The field: reedsolo's GF(2^8) (primitive polynomial 0x11d, generator 2), taken from
  reedsolo itself -- the exp/log tables are the ones ``reedsolo.init_tables`` returns,
  and the read-only numpy tables the kernels index (``_MUL``: 256 x 256 products,
  ``_INV``: inverses) are derived from them with numpy, not computed by hand.
* Small dense matrices over the field: :func:`gf_matmul` and :func:`gf_invert_matrix`
  (Gauss-Jordan; reedsolo has no matrix routines).
* :func:`parity_matrix`, the m x k matrix P of the systematic RS(k, m) code:
  ``parity = P . data``.  It is built with reedsolo's own ``rs_generator_poly`` (the
  generator ``g(x) = prod_{i<m} (x - 2^i)``, fcr 0) and ``gf_poly_div`` (the synthetic
  division ``RSCodec.encode`` performs): by linearity column i is the parity of the
  unit message e_i, i.e. ``x^(m+k-1-i) mod g(x)``, so the columns are the successive
  remainders ``x^m, x^(m+1), ... mod g``, one one-step division each.  P therefore
  reproduces ``reedsolo.RSCodec(nsym=m, nsize=k+m).encode`` byte for byte.
  ``[I; P]`` is MDS (any k of the k + m shards determine the data): the BCH bound for RS
  codes of length <= 255; the test-suite also checks it exhaustively for small (k, m).

reedsolo keeps its tables in module globals that ``init_tables`` (and every
``RSCodec(...)``) overwrites; the field is therefore captured once, as numpy copies, and
every later call into reedsolo runs under :func:`_reedsolo_field`, which reinstalls our
field first if some other reedsolo user switched it.

What this module must never do
------------------------------
* Touch shard data: no per-byte work over buffers (that is the kernels' job), no
  native libraries, threads or I/O.
* Re-implement what reedsolo provides (table generation, generator polynomial,
  polynomial division), or hand out writable views of its tables or matrices.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import numpy as np
import reedsolo

from elastic_llm.snapshot.erasure.base import CodeParametersError

PRIM_POLY = 0x11D
GENERATOR = 2
C_EXP = 8
FCR = 0  # first consecutive root of the generator polynomial (reedsolo's default)
MAX_SHARDS = 255  # = reedsolo's field_charac: symbols per codeword

_reedsolo_lock = threading.Lock()


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _build_field() -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    with _reedsolo_lock:
        log_t, exp_t, charac = reedsolo.init_tables(prim=PRIM_POLY, generator=GENERATOR, c_exp=C_EXP)
    if charac != MAX_SHARDS:
        raise RuntimeError(f"reedsolo.init_tables gave a field of {charac + 1} elements, expected 256")
    exp_bytes = bytes(exp_t)  # 510 entries, exp[i] = 2^i, doubled so exp[log a + log b] needs no mod
    exp = np.frombuffer(exp_bytes, dtype=np.uint8)
    log = np.frombuffer(bytes(log_t), dtype=np.uint8).astype(np.intp)  # log[0] is unused
    nz = np.arange(1, 256)
    mul = np.zeros((256, 256), dtype=np.uint8)
    mul[1:, 1:] = exp[log[nz][:, None] + log[nz][None, :]]
    inv = np.zeros(256, dtype=np.uint8)
    inv[1:] = exp[MAX_SHARDS - log[nz]]
    return exp_bytes, _frozen(exp), _frozen(log), _frozen(mul), _frozen(inv)


_EXP_BYTES, _EXP, _LOG, _MUL, _INV = _build_field()


@contextlib.contextmanager
def _reedsolo_field() -> Iterator[None]:
    """Run reedsolo's module-level functions on our field, one caller at a time."""
    with _reedsolo_lock:
        if reedsolo.field_charac != MAX_SHARDS or bytes(reedsolo.gf_exp) != _EXP_BYTES:
            reedsolo.init_tables(prim=PRIM_POLY, generator=GENERATOR, c_exp=C_EXP)
        yield


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


def generator_poly(m: int) -> np.ndarray:
    """reedsolo's generator polynomial of m parity symbols, highest degree first (read-only)."""
    with _reedsolo_field():
        g = reedsolo.rs_generator_poly(m, fcr=FCR, generator=GENERATOR)
    return _frozen(np.frombuffer(bytes(g), dtype=np.uint8).copy())


def parity_matrix(k: int, m: int) -> np.ndarray:
    """The m x k parity matrix P of RS(k, m): parity = P . data (GF(2^8)); read-only.

    Column i is the parity reedsolo appends to the unit message e_i (see the module doc).
    """
    check_params(k, m)
    return _parity_matrix(int(k), int(m))


@functools.lru_cache(maxsize=64)
def _parity_matrix(k: int, m: int) -> np.ndarray:
    gen = bytes(generator_poly(m))
    p = np.empty((m, k), dtype=np.uint8)
    power = bytearray(m + 1)
    power[0] = 1  # x^m
    with _reedsolo_field():
        for i in range(k - 1, -1, -1):  # e_{k-1} is the degree-0 message symbol
            _quotient, rem = reedsolo.gf_poly_div(power, gen)
            p[:, i] = np.frombuffer(bytes(rem), dtype=np.uint8)
            power = bytearray(rem) + bytearray(1)  # times x: the next power's remainder
    return _frozen(p)


def check_params(k: Any, m: Any) -> None:
    """Raise :class:`CodeParametersError` unless 1 <= k, 1 <= m and k + m <= 255."""
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
