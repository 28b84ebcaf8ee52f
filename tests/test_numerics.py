"""The rounding envelope the cross-width tests use (tests/numerics.py) holds what it should and
only that: float32 steps computed in other orders land in it, wrong steps do not. No Ray."""

import numpy as np
import pytest
import torch

from elastic_llm.config import config_from_dict
from elastic_llm.model import build_stage, lm_loss
from elastic_llm.pipeline.optim import build_optimizer
from elastic_llm.pipeline.schedules import routes

from .numerics import assert_within_envelope, reference_steps

CFG = config_from_dict({
    "model": {"dim": 64, "n_heads": 4, "n_layers": 4, "seq_len": 32},
    "parallel": {"stages": 2, "dp": 1},
    "train": {"batch_size": 8, "seed": 0},
})
BATCHES = [(t[:, :-1].copy(), t[:, 1:].copy()) for t in (np.random.default_rng(s).integers(0, 256, size=(8, 33)) for s in (1, 2))]


def float32_steps(splits, steps, weights=None, skip_update=False):
    """``steps`` float32 steps over microbatches ``splits`` (sequence indices), each loss weighted
    by its share (or ``weights``); the stages' parameters afterwards."""
    mods = [build_stage(CFG.model.shape(), 2, s, CFG.train.seed) for s in range(2)]
    optims = [build_optimizer(m, CFG.train) for m in mods]
    for x, y in BATCHES[:steps]:
        for j, part in enumerate(splits):
            act = torch.from_numpy(x[part])
            for hop in routes(2, 1)[0]:
                act = mods[hop.stage].run(act, hop.embed, hop.layers, hop.head)
            (lm_loss(act, torch.from_numpy(y[part])) * (weights[j] if weights else len(part) / len(x))).backward()
        for m, (opt, sched) in zip(mods, optims):
            torch.nn.utils.clip_grad_norm_(m.parameters(), CFG.train.grad_clip)
            if not skip_update:
                opt.step()
            opt.zero_grad()
            sched.step()
    return [{k: p.detach().numpy() for k, p in m.named_parameters()} for m in mods]


ALL = list(range(8))
ORDERS = {"one microbatch": [ALL], "two": [ALL[:4], ALL[4:]], "eight": [[i] for i in ALL], "uneven": [ALL[:3], ALL[3:]]}


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_float32_steps_in_any_order_lie_in_the_envelope(order, steps):
    ref = reference_steps(CFG, BATCHES[:steps])
    for s, params in enumerate(float32_steps(ORDERS[order], steps)):
        assert_within_envelope(params, ref, s, order)


@pytest.mark.parametrize("wrong", ["a microbatch weighted 0.55 instead of 0.5", "no update"])
def test_a_wrong_step_falls_outside_it(wrong):
    ref = reference_steps(CFG, BATCHES[:1])
    got = float32_steps(ORDERS["two"], 1, weights=[0.55, 0.45]) if wrong.startswith("a micro") else float32_steps(ORDERS["two"], 1, skip_update=True)
    with pytest.raises(AssertionError, match="outside its rounding envelope"):
        for s, params in enumerate(got):
            assert_within_envelope(params, ref, s, wrong)
