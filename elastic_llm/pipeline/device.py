"""Which device a stage trains on, in which precision, and the GPU ids Ray gives it.

Owns: the choice of a stage process's device from ``parallel.gpus_per_actor`` and what the
process sees (:func:`stage_device`: a stage that asked for a GPU and sees none refuses to start,
never a silent CPU run), the GPU ids as strings in whatever form Ray gives them (indices or
UUIDs: :func:`gpu_ids`), ``train.deterministic`` (:func:`make_deterministic`: torch's
deterministic algorithms and the cuBLAS workspace they need), and ``train.precision``
(:func:`compute`, :func:`on_wire`): in ``bf16`` a stage's forward (and so its backward) runs
under bf16 autocast, its parameters, their gradients and AdamW's moments stay fp32 (autocast
casts the weights per op; the gradients accumulate into the fp32 parameters' ``.grad``), so the
data-parallel sum, the clipping and every snapshot, checkpoint and export are fp32 as in an fp32
run (the sum in fp32: a bf16 sum would round each replica's share to 8 bits of mantissa and its
result would depend on the width); activations leave a stage in bf16 and their gradients come
back in bf16 (half the bytes on the wire); the loss is computed in fp32. Pure except
:func:`make_deterministic`, which sets torch's global flags for the process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from elastic_llm.config import RunConfig

CUBLAS_WORKSPACE = ":4096:8"  # what torch's deterministic algorithms need of cuBLAS (CUDA >= 10.2)


class NoDevice(RuntimeError):
    """A stage asked for a GPU (``parallel.gpus_per_actor`` > 0) and its process sees none."""


def stage_device(gpus_per_actor: float, cuda_available: bool, visible: str | None = None) -> torch.device:
    """``cuda`` when the stage asked for a GPU and the process sees one, ``cpu`` when it asked
    for none; raises :class:`NoDevice` naming the field and the fix when it asked for one and sees
    none (``visible``: the process's ``CUDA_VISIBLE_DEVICES``, for the message). Pure."""
    if gpus_per_actor <= 0:
        return torch.device("cpu")
    if not cuda_available:
        seen = "unset" if visible is None else repr(visible)
        raise NoDevice(
            f"parallel.gpus_per_actor={gpus_per_actor:g} but this stage process sees no CUDA device "
            f"(torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES {seen}; torch {torch.__version__} "
            f"built with CUDA {torch.version.cuda or 'none'}): install a CUDA build of torch on GPU nodes, "
            "or set parallel.gpus_per_actor=0 to train on CPUs")
    return torch.device("cuda")


def check_fits(cfg: "RunConfig", device: torch.device) -> None:
    """A CUDA stage's check of the run's memory plan against the device it sees (its share of it
    with a fractional ``gpus_per_actor``): :class:`~elastic_llm.pipeline.memory.DoesNotFit`, naming what
    would make it fit, before a step runs. Nothing to check on a CPU."""
    if device.type != "cuda":
        return
    from elastic_llm.pipeline.memory import check, share

    props = torch.cuda.get_device_properties(device)
    check(cfg, share(cfg, props.total_memory), f"this stage's GPU ({props.name})")


def compute(precision: str, device: torch.device) -> torch.autocast:
    """The context a stage's forward runs in: bf16 autocast on ``device`` for ``bf16``, a no-op for ``fp32``."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def on_wire(activation: torch.Tensor, precision: str) -> torch.Tensor:
    """An activation as it leaves a stage: bf16 in a bf16 run (whatever dtype the last op left
    it in), else as it is. Autograd goes through the cast: the gradient that comes back in bf16
    reaches the stage's fp32 residual stream as fp32."""
    return activation.to(torch.bfloat16) if precision == "bf16" else activation


def forward(precision: str, device: torch.device, run: Callable[[], torch.Tensor], to_next: bool) -> torch.Tensor:
    """``run()`` (a stage's forward) in the precision's context; its output as it leaves the
    stage when ``to_next`` (:func:`on_wire`), else as computed (the logits, for the loss)."""
    with compute(precision, device):
        out = run()
    return on_wire(out, precision) if to_next else out


def gpu_ids(ids: Iterable[object]) -> tuple[str, ...]:
    """The GPU ids Ray gave a process, as strings: indices (``0``, ``"1"``) and UUIDs
    (``"GPU-5e2c..."``) alike, in Ray's order (what ``CUDA_VISIBLE_DEVICES`` takes). Pure."""
    return tuple(str(i) for i in ids)


def make_deterministic(on: bool) -> None:
    """``train.deterministic``: torch's deterministic algorithms (an op without one raises
    instead of running a non-deterministic kernel) and the cuBLAS workspace they need, set before
    the process's first CUDA call. Off: torch's defaults (left alone when already so: the call
    imports torch's compiler configuration, about 1.3 s of CPU in a process that needs none)."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if on or torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(on)
