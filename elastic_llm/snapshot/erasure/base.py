"""The contract every layer of the erasure package shares: its errors and the kernel interface.

What this module owns
---------------------
* The exception hierarchy: every error the package raises is an :class:`ErasureError`
  (itself a ``ValueError``), one subclass per kind of bad input, so callers can catch
  exactly what they can handle (the snapshot manager catches :class:`TooManyErasuresError`).
* :class:`ErasureCodec`, the interface of a GF(2^8) matrix-times-shards kernel, which
  the ISA-L binding and the numpy kernel implement and :class:`ReedSolomon` drives.
* :func:`addr`, the address of a numpy buffer (for ctypes and for overlap checks).

It sits below the other layers (they all import it, it imports none of them), which is
why the errors and the ABC live here rather than with the codec that mostly raises them.

What this module must never do
------------------------------
* Import another module of the package, numpy kernels, ctypes libraries or reedsolo:
  anything here must be importable and meaningful on its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

import numpy as np


class ErasureError(ValueError):
    """Base class of every error raised by this package."""


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

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # rebuilt from its own fields when it crosses a process (a manager raises it, the driver
        # reads it): the default would call it with the message alone and fail to deserialize
        return (type(self), (self.k, self.m, self.missing, self.corrupted))


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


def addr(a: np.ndarray) -> int:
    """Address of the first byte of ``a``'s data."""
    return a.__array_interface__["data"][0]
