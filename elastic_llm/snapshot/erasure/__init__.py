"""Systematic Reed-Solomon erasure coding of snapshot shards over GF(2^8), reedsolo-compatible.

RS(k data, m parity), ``k + m <= 255``, over reedsolo's field (0x11d, generator 2,
fcr 0): the m parity symbols of every codeword are exactly what
``reedsolo.RSCodec(nsym=m, nsize=k+m)`` appends.  Two interchangeable kernels produce
identical bytes: Intel ISA-L (the default; GIL released) and a numpy fallback.

Quick use::

    rs = ReedSolomon(8, 2)                      # backend "auto" | "isal" | "numpy"
    parity = rs.encode(data)                    # k equal-length 1-D uint8 arrays -> m
    sums = rs.checksums(data + parity)
    data = rs.decode(shards, checksums=sums)    # shards: k+m arrays, None = lost

A package, one module per layer, each importing only the layers below it:

* :mod:`.base`          errors and the :class:`ErasureCodec` kernel interface (shared by all);
* :mod:`.gf`            the field (from reedsolo's tables), matrices, the parity matrix;
* :mod:`.isal`          the ISA-L ctypes binding (:class:`IsalCodec`) and :func:`checksum`;
* :mod:`.numpy_kernel`  the vectorised fallback (:class:`NumpyCodec`);
* :mod:`.codec`         :class:`ReedSolomon`: validation, backend choice, encode / decode.

A package rather than sibling modules of ``elastic_llm.snapshot`` so that the layers stay
one unit under the name callers already import (``from elastic_llm.snapshot.erasure
import X`` is unchanged) and ``elastic_llm/snapshot/`` keeps one entry per concern.

This module only re-exports the public names; it must never define behaviour of its own.
"""

from elastic_llm.snapshot.erasure.base import (
    BackendUnavailableError,
    BufferOverlapError,
    ChecksumFormatError,
    CodeParametersError,
    ErasureCodec,
    ErasureError,
    ShardCountError,
    ShardDtypeError,
    ShardLengthError,
    TooManyErasuresError,
)
from elastic_llm.snapshot.erasure.codec import ReedSolomon
from elastic_llm.snapshot.erasure.gf import (
    GENERATOR,
    MAX_SHARDS,
    PRIM_POLY,
    gf_inv,
    gf_invert_matrix,
    gf_matmul,
    gf_mul,
    parity_matrix,
)
from elastic_llm.snapshot.erasure.isal import IsalCodec, checksum, checksum_impl, isal_available
from elastic_llm.snapshot.erasure.numpy_kernel import NumpyCodec

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
