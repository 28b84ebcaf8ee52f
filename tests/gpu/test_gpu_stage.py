"""A stage on a CUDA device (issue 48's GPU path): run with ``pytest -m gpu tests/gpu`` on a
machine with a GPU; skipped cleanly without CUDA, and needs no Ray. Each test builds stage actors
in-process (``StageWorker``) on ``cuda``.

What they hold: a stage trains on the GPU; its pinned snapshot buffers are allocated when it
starts, at the state's exact size; a snapshot copied in the background while the next step's
kernels run equals the post-step state bit for bit (the copy is ordered after the update); a
capture outside the step (a checkpoint's or a peer's) sees the finished update; and with
``train.deterministic`` a restore into a fresh stage continues bit for bit; and a stage whose
memory plan exceeds its GPU refuses to start, naming what would make it fit."""

import numpy as np
import pytest
import torch

from elastic_llm.config import load_config
from elastic_llm.pipeline.stage import StageWorker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU tests need one")]

SETS = ["model.dim=256", "model.n_heads=4", "model.n_layers=4", "model.seq_len=64", "train.batch_size=4", "parallel.microbatches=1",
        "parallel.stages=1", "train.warmup_steps=1", "parallel.gpus_per_actor=1", "train.deterministic=true"]


def batches(n, seed=0):
    g = np.random.default_rng(seed)
    return [(g.integers(0, 256, (4, 64)), g.integers(0, 256, (4, 64))) for _ in range(n)]


def train(worker, data, snapshot_at=()):
    losses = []
    for i, (x, y) in enumerate(data):
        losses.append(float(worker.forward(0, x, y)))
        worker.backward(0, None)
        worker.step(snapshot={"epoch": 0, "index": i} if i in snapshot_at else None)
    return losses


@pytest.fixture
def cfg():
    try:
        yield load_config("jobs/tiny.yaml", SETS)
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_cuda_stage_trains_and_its_pinned_buffers_are_exact_and_allocated_at_its_start(cfg):
    worker = StageWorker(cfg, 0, 0)
    assert worker.device.type == "cuda" and next(worker.module.parameters()).is_cuda
    n = worker.arena.layout.nbytes
    assert sorted(worker.copies.buffers) == [0, 1, 2] and all(b.nbytes == n for b in worker.copies.buffers.values())
    losses = train(worker, batches(3))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] + 1.0


def test_a_snapshot_copied_while_the_next_step_runs_equals_the_post_step_state_bit_for_bit(cfg):
    worker = StageWorker(cfg, 0, 0)
    data = batches(3)
    train(worker, data[:2], snapshot_at=(1,))  # step 2 snapshots: its copy runs on a side stream
    x, y = data[2]
    worker.forward(0, x, y)  # the next step's kernels race the copy
    worker.backward(0, None)
    job, _ = worker.copies.take(2, "test")
    after, _ = worker.capture_state()  # outside the step: ordered after everything queued (no update since step 2)
    assert np.array_equal(job.buffer[job.lo:job.hi], after[job.lo:job.hi])


def test_with_deterministic_a_restore_into_a_fresh_stage_continues_bit_for_bit(cfg):
    data = batches(5)
    worker = StageWorker(cfg, 0, 0)
    train(worker, data[:2])
    buf, manifest = worker.capture_state()
    saved = (buf.copy(), manifest)
    want = train(worker, data[2:])
    fresh = StageWorker(cfg, 0, 0)
    assert fresh.load_state(*saved) == 2
    assert train(fresh, data[2:]) == want


def test_a_stage_whose_plan_exceeds_its_gpu_refuses_to_start_naming_what_would_fit():
    from elastic_llm.pipeline.memory import DoesNotFit

    huge = load_config(None, ["model.dim=8192", "model.n_heads=64", "model.n_layers=64", "model.seq_len=8192", "train.batch_size=64",
                              "parallel.microbatches=1", "parallel.stages=1", "parallel.gpus_per_actor=1"])
    with pytest.raises(DoesNotFit, match="this stage's GPU .* set any of|a change of several"):
        StageWorker(huge, 0, 0)  # the check runs before the stage allocates anything
