"""The Intel ISA-L binding: loading libisal through ctypes, its RS kernel, and CRC-32.

What this module owns
---------------------
* Finding and loading ``libisal.so.2`` once per process (:func:`isal_available`), with
  the ctypes signatures of the three functions used: ``ec_init_tables``,
  ``ec_encode_data`` and ``crc32_gzip_refl``.  The library is loaded with ``CDLL`` (not
  ``PyDLL``), so every call releases the GIL.
* :class:`IsalCodec`, the :class:`ErasureCodec` that runs ``ec_encode_data`` on the
  caller's buffers in chunks.
* :func:`checksum`, CRC-32 of a buffer (ISA-L when loaded, ``zlib.crc32`` otherwise).

What this module must never do
------------------------------
* Know the code: it multiplies by whatever matrix it is given (the matrices come from
  :mod:`.gf` through the codec) and never validates shards -- :class:`ReedSolomon`
  checks every argument before a pointer reaches C.
* Fail at import when libisal is missing: only asking for the ISA-L backend raises
  (:class:`BackendUnavailableError`, saying how to install it); checksums fall back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import zlib
from typing import Any, Optional, Sequence

import numpy as np

from elastic_llm.snapshot.erasure.base import (
    BackendUnavailableError,
    CodeParametersError,
    ErasureCodec,
    ShardDtypeError,
    addr,
)

INSTALL_HINT = "Debian/Ubuntu: apt-get install -y libisal2"

_isal_lock = threading.Lock()
_isal_lib: Optional[ctypes.CDLL] = None
_isal_error: Optional[str] = None
_isal_tried = False


def _bind(lib: ctypes.CDLL) -> None:
    vp = ctypes.c_void_p
    lib.ec_init_tables.argtypes = [ctypes.c_int, ctypes.c_int, vp, vp]
    lib.ec_init_tables.restype = None
    lib.ec_encode_data.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, vp,
                                   ctypes.POINTER(vp), ctypes.POINTER(vp)]
    lib.ec_encode_data.restype = None
    lib.crc32_gzip_refl.argtypes = [ctypes.c_uint32, vp, ctypes.c_uint64]
    lib.crc32_gzip_refl.restype = ctypes.c_uint32


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
                _bind(lib)
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


def isal_error() -> Optional[str]:
    """Why libisal could not be loaded (None if it loaded or was not tried yet)."""
    return _isal_error


def checksum_impl() -> str:
    """Which implementation :func:`checksum` uses here: "isal" or "zlib"."""
    return "isal" if isal_available() else "zlib"


def checksum(arr: Any, start: int = 0) -> int:
    """CRC-32 (the zlib/gzip polynomial) of a C-contiguous buffer, as an int.

    ``start``: the CRC of the bytes before ``arr`` (chaining: ``checksum(b, checksum(a))`` is
    the CRC of a + b), as with ``zlib.crc32(data, value)``.

    The value is always ``zlib.crc32(bytes(arr))``; it is computed by ISA-L's
    ``crc32_gzip_refl`` (tens of GB/s, releases the GIL) when libisal is present
    and by ``zlib.crc32`` (C, a few GB/s) otherwise.  CRC-32 rather than CRC-32C
    was chosen so that the value does not depend on which machine computed it:
    the zlib fallback has no CRC-32C, and a checksum recorded on one host must
    verify on another.
    """
    if isinstance(arr, np.ndarray):
        if not arr.flags.c_contiguous:
            raise ShardDtypeError(
                f"checksum needs a C-contiguous array, got strides {arr.strides}: pass np.ascontiguousarray(a)")
        nbytes = arr.nbytes
        lib = _load_isal()
        if lib is not None:
            if nbytes == 0:
                return start
            return int(lib.crc32_gzip_refl(start, addr(arr), nbytes))
        return zlib.crc32(arr.reshape(-1).view(np.uint8).data, start) & 0xFFFFFFFF
    return zlib.crc32(arr, start) & 0xFFFFFFFF


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
                f"ISA-L backend requested but libisal could not be loaded ({_isal_error}); "
                f"install it ({INSTALL_HINT}) or use backend='numpy'/'auto'"
            )
        self._lib = lib
        if not 64 <= chunk <= 1 << 30:  # ISA-L's length argument is a C int
            raise CodeParametersError(f"chunk must be between 64 bytes and 1 GiB, got {chunk}")
        self.chunk = int(chunk)

    def prepare(self, matrix: np.ndarray) -> _IsalPlan:
        mat = np.ascontiguousarray(matrix, dtype=np.uint8)
        rows, cols = mat.shape
        tables = np.zeros(max(1, 32 * rows * cols), dtype=np.uint8)
        if rows:
            self._lib.ec_init_tables(cols, rows, addr(mat), addr(tables))
        return _IsalPlan(rows, cols, tables, mat)

    def apply(self, prepared: _IsalPlan, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        rows, cols = prepared.rows, prepared.cols
        if rows == 0:
            return
        length = outputs[0].shape[0]
        if length == 0:
            return
        in_addrs = [addr(a) for a in inputs]
        out_addrs = [addr(a) for a in outputs]
        in_ptrs = (ctypes.c_void_p * cols)()
        out_ptrs = (ctypes.c_void_p * rows)()
        tables = addr(prepared.tables)
        enc = self._lib.ec_encode_data
        chunk = self.chunk
        for off in range(0, length, chunk):
            n = min(chunk, length - off)
            in_ptrs[:] = [a + off for a in in_addrs]
            out_ptrs[:] = [a + off for a in out_addrs]
            enc(n, cols, rows, tables, in_ptrs, out_ptrs)
