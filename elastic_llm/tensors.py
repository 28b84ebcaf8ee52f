"""Tensors to numpy, from any device: the one place a stage's tensors leave torch.

Owns: :func:`host` (a tensor's values as a numpy array in host memory, wherever the tensor lives:
a view of a contiguous CPU tensor, a copy from a GPU) and :func:`host_bytes` (the same, as bytes).
``tensor.numpy()`` fails on a CUDA tensor, so the stage, its snapshot copies, its transport and
its restores convert through here (a test walks the code for any other ``.numpy()`` call).
Never moves data to a device.
"""

from __future__ import annotations

import numpy as np
import torch


def host(t: torch.Tensor) -> np.ndarray:
    """``t``'s values in host memory (detached; a view when ``t`` is a CPU tensor)."""
    return t.detach().cpu().numpy()


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes in host memory, as a flat uint8 array (contiguous)."""
    return host(t.detach().contiguous().reshape(-1).view(torch.uint8))
