"""The cut of a step's global batch at any data-parallel width, pure (no Ray, no torch)."""

import numpy as np
import pytest

from elastic_llm.pipeline.shares import cut, even_sizes, microbatch_sizes, replica_microbatches, replica_shares, weighted_mean
from elastic_llm.snapshot.records import ShardKey

CASES = [(b, w, m) for b in (1, 2, 5, 8, 12, 16, 17) for w in range(1, b + 1) for m in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("batch,width,micro", CASES)
def test_every_replica_takes_whole_sequences_and_runs_at_most_m_microbatches(batch, width, micro):
    shares = replica_shares(batch, width)
    assert len(shares) == width and sum(shares) == batch
    assert list(shares) == [batch // width + (1 if r < batch % width else 0) for r in range(width)]
    sizes = replica_microbatches(batch, width, micro)
    for share, mbs in zip(shares, sizes):
        assert len(mbs) == min(micro, share)
        assert sum(mbs) == share and min(mbs) >= 1
        assert max(mbs) - min(mbs) <= 1
        assert list(mbs) == sorted(mbs, reverse=True)  # np.array_split's order: the larger ones first
        assert list(mbs) == [len(a) for a in np.array_split(np.arange(share), len(mbs))]


def test_the_replicas_shares_are_the_global_batch_in_order():
    x = np.arange(16 * 3).reshape(16, 3)
    sizes = replica_microbatches(16, 3, 4)
    assert sizes == ((2, 2, 1, 1), (2, 1, 1, 1), (2, 1, 1, 1))
    parts = cut(x, [sum(m) for m in sizes])
    assert [len(p) for p in parts] == [6, 5, 5]
    micro = [mb for share, mbs in zip(parts, sizes) for mb in cut(share, mbs)]
    np.testing.assert_array_equal(np.concatenate(micro), x)


def test_a_replica_with_fewer_sequences_than_microbatches_runs_one_per_sequence():
    assert replica_microbatches(8, 3, 4) == ((1, 1, 1), (1, 1, 1), (1, 1))
    assert replica_microbatches(16, 5, 4) == ((1, 1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1))
    assert microbatch_sizes(5, 4) == (2, 1, 1, 1)


def test_a_width_above_the_batch_cannot_be_cut():
    with pytest.raises(ValueError, match="every replica needs at least one sequence"):
        replica_shares(4, 5)
    with pytest.raises(ValueError):
        replica_shares(4, 0)
    with pytest.raises(ValueError, match="do not cover"):
        cut(np.zeros((5, 2)), (2, 2))
    assert even_sizes(0, 3) == (0, 0, 0)


def test_the_weighted_mean_is_the_mean_over_sequences():
    per_sequence = np.random.default_rng(0).random(8)
    sizes = (3, 3, 2)
    means = [float(p.mean()) for p in cut(per_sequence, sizes)]
    assert weighted_mean(means, sizes) == pytest.approx(float(per_sequence.mean()), rel=1e-12)
    assert weighted_mean(means, sizes) != pytest.approx(float(np.mean(means)), rel=1e-9)  # not the mean of the means
    with pytest.raises(ValueError):
        weighted_mean([1.0], (1, 1))


# --------------------------------------------------------------------------- the driver's plans


@pytest.mark.parametrize("schedule,swapped", [("1f1b", False), ("gpipe", False), ("1f1b", True)])
def test_each_plan_carries_its_replicas_rows_microbatches_and_ops(schedule, swapped):
    from elastic_llm.pipeline.executor import RayStepExecutor

    stages, width, micro, batch = 4, 3, 4, 8
    ex = RayStepExecutor([[object()] * stages for _ in range(width)], schedule, micro, swapped=swapped)
    x = np.arange(batch * 5).reshape(batch, 5)
    plans = ex.plans(1, x, x + 1000, None)
    assert len(plans) == stages * width
    rows = []
    for r, sizes in enumerate(((1, 1, 1), (1, 1, 1), (1, 1))):
        for s in range(stages):
            plan = plans[ShardKey(s, r)]
            assert plan.micro_sizes == sizes and plan.batch == batch
            ops = plan.op_list()
            assert {op.mb for op in ops} == set(range(len(sizes)))  # the schedule of its own microbatch count
            assert sum(op.kind == "F" for op in ops) == sum(op.kind == "B" for op in ops)
        rows.append(plans[ShardKey(0, r)].tokens)
        np.testing.assert_array_equal(plans[ShardKey(stages - 1, r)].targets, plans[ShardKey(0, r)].tokens + 1000)
        assert plans[ShardKey(1, r)].tokens is None and plans[ShardKey(1, r)].targets is None
    np.testing.assert_array_equal(np.concatenate(rows), x)


def test_the_steps_loss_weights_every_microbatch_by_its_sequences():
    from elastic_llm.pipeline.executor import PendingStep
    from elastic_llm.pipeline.plan import StepReport

    sizes = ((2, 1), (1, 1))  # 5 sequences over 2 replicas
    losses = {0: (1.0, 4.0), 1: (2.0, 3.0)}
    reports = {ShardKey(1, r): StepReport(ShardKey(1, r), 1, losses[r], 0.5, 1e-3) for r in (0, 1)}
    pending = PendingStep(1, 1, 2, 2, {}, sizes, reports=dict(reports))
    assert pending.result().loss == pytest.approx((2 * 1.0 + 4.0 + 2.0 + 3.0) / 5)
    del pending.reports[ShardKey(1, 1)]
    assert np.isnan(pending.result().loss)  # a replica's losses are missing


# --------------------------------------------------------------------------- one stage, in process


def test_a_stage_weights_uneven_microbatches_into_the_gradient_of_the_global_mean():
    """Two one-stage replicas take 3 and 2 of 5 sequences in microbatches of (2, 1) and (1, 1),
    each loss weighted by its sequences / 5: their gradients summed are the unsplit model's
    gradient of the mean loss over the 5 sequences. A replica numbered as the width (a spare
    before it joins) builds too."""
    import torch

    from elastic_llm.config import config_from_dict
    from elastic_llm.model import build_full_model, lm_loss
    from elastic_llm.pipeline.stage import StageWorker

    from .numerics import FIRST_K, U32

    cfg = config_from_dict(
        {
            "model": {"dim": 32, "n_heads": 2, "n_layers": 2, "seq_len": 8},
            "parallel": {"stages": 1, "dp": 2, "microbatches": 2},
            "train": {"batch_size": 5},
        }
    )
    tokens = np.random.default_rng(3).integers(0, 256, size=(5, 9))
    x, y = tokens[:, :-1].copy(), tokens[:, 1:].copy()
    model = build_full_model(cfg.model.shape(), cfg.train.seed)
    lm_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    summed: dict[str, np.ndarray] = {}
    for r, sizes in enumerate(replica_microbatches(5, 2, 2)):
        worker = StageWorker(cfg, 0, r, 2)
        worker.set_microbatches(sizes, 5)
        rows = sum(map(sum, replica_microbatches(5, 2, 2)[:r]))
        for mb, (xm, ym) in enumerate(zip(cut(x[rows : rows + sum(sizes)], sizes), cut(y[rows : rows + sum(sizes)], sizes))):
            worker.forward(mb, xm, ym)
            worker.backward(mb)
        for name, g in worker.grads().items():
            summed[name] = g if name not in summed else summed[name] + g
    for name, p in model.named_parameters():
        g = p.grad.numpy()  # another summation order: within the float32 gradient bound of tests/numerics.py
        np.testing.assert_allclose(summed[name], g, rtol=0, atol=FIRST_K * U32 * float(np.abs(g).max()), err_msg=name)
    assert StageWorker(cfg, 0, 2, 2).micro_per_replica == 2  # a spare's default: the whole batch in 2 microbatches
