"""The pipelined model (stage actors on Ray) computes the same loss and gradients as the unsplit model."""

import numpy as np
import pytest
import ray
import torch

from elastic_llm.config import config_from_dict
from elastic_llm.model import build_full_model, lm_loss
from elastic_llm.pipeline.runner import PipelineRunner
from elastic_llm.pipeline.stage import StageWorker

pytestmark = pytest.mark.timeout(180)


def small_config(stages, dp, schedule, micro=4, batch=8):
    return config_from_dict(
        {
            "model": {"dim": 64, "n_heads": 4, "n_layers": 4, "seq_len": 16},
            "parallel": {"stages": stages, "dp": dp, "schedule": schedule, "microbatches": micro, "cpus_per_actor": 0.25},
            "train": {"batch_size": batch, "seed": 3},
        }
    )


def full_model_reference(cfg, x, y):
    torch.manual_seed(0)
    model = build_full_model(cfg.model.shape(), cfg.train.seed)
    loss = lm_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy() for n, p in model.named_parameters()}, {n: p.detach().numpy() for n, p in model.named_parameters()}


def global_name(stage_name, layer_ids):
    parts = stage_name.split(".")
    if parts[0] == "layers":
        parts[1] = str(layer_ids[int(parts[1])])
    return ".".join(parts)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,dp", [(4, 1), (2, 2)])
def test_pipeline_matches_unsplit_model(ray_local, schedule, stages, dp):
    cfg = small_config(stages, dp, schedule)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, size=(cfg.train.batch_size, cfg.model.seq_len + 1))
    x, y = tokens[:, :-1].copy(), tokens[:, 1:].copy()
    ref_loss, ref_grads, ref_params = full_model_reference(cfg, x, y)

    Actor = ray.remote(StageWorker).options(num_cpus=0.25)
    actors = [[Actor.remote(cfg.to_dict(), s, r) for s in range(stages)] for r in range(dp)]
    try:
        runner = PipelineRunner(actors, schedule, cfg.parallel.microbatches)
        losses = ray.get(runner.submit_microbatches(x, y))
        assert len(losses) == dp * cfg.parallel.microbatches
        np.testing.assert_allclose(np.mean(losses), ref_loss, rtol=1e-5)
        if dp > 1:
            for s in range(stages):
                flat = [actors[r][s].flat_grad.remote() for r in range(dp)]
                ray.get([actors[r][s].average_grads.remote(*flat) for r in range(dp)])
        seen = set()
        for s in range(stages):
            info = ray.get(actors[0][s].info.remote())
            replica_grads = [ray.get(actors[r][s].grads.remote()) for r in range(dp)]
            params = ray.get(actors[0][s].parameters.remote())
            for name, g in replica_grads[0].items():
                gname = global_name(name, info.layers)
                seen.add(gname)
                np.testing.assert_array_equal(params[name], ref_params[gname])  # same init as unsplit
                np.testing.assert_allclose(g, ref_grads[gname], rtol=2e-4, atol=2e-6, err_msg=gname)
                for other in replica_grads[1:]:  # replicas hold identical averaged gradients
                    np.testing.assert_array_equal(other[name], g)
        assert seen == set(ref_grads), "every parameter of the unsplit model lives on exactly one stage"
    finally:
        for row in actors:
            for a in row:
                ray.kill(a)


def test_optimizer_step_keeps_replicas_identical_and_reports_clipped_norm(ray_local):
    cfg = small_config(2, 2, "1f1b")
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 256, size=(cfg.train.batch_size, cfg.model.seq_len + 1))
    Actor = ray.remote(StageWorker).options(num_cpus=0.25)
    actors = [[Actor.remote(cfg.to_dict(), s, r) for s in range(2)] for r in range(2)]
    try:
        runner = PipelineRunner(actors, "1f1b", cfg.parallel.microbatches)
        before = ray.get(actors[0][1].parameters.remote())
        result = runner.train_step(tokens[:, :-1].copy(), tokens[:, 1:].copy())
        assert np.isfinite(result.loss) and len(result.grad_norms) == 2
        for s in range(2):
            p0, p1 = ray.get([actors[0][s].parameters.remote(), actors[1][s].parameters.remote()])
            for name in p0:
                np.testing.assert_array_equal(p0[name], p1[name])
            norm = ray.get(actors[0][s].grad_norm.remote())
            assert 0 < norm <= cfg.train.grad_clip
        after = ray.get(actors[0][1].parameters.remote())
        assert any(not np.array_equal(before[n], after[n]) for n in before), "the step changed nothing"
    finally:
        for row in actors:
            for a in row:
                ray.kill(a)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_swapped_checkfree_plus_pipeline_matches_the_routes_run_in_one_process(ray_local, schedule):
    """Stage actors running CheckFree+'s order (odd microbatches through stages 1,0,..,n-1,n-2)
    give the loss and gradients of the same routes run through the stage modules in one process."""
    from elastic_llm.model import build_stage
    from elastic_llm.pipeline.schedules import routes

    d = small_config(4, 1, schedule).to_dict()
    d["recovery"]["mode"] = "checkfree_plus"
    cfg = config_from_dict(d)
    n, micro = 4, cfg.parallel.microbatches
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 256, size=(cfg.train.batch_size, cfg.model.seq_len + 1))
    x, y = tokens[:, :-1].copy(), tokens[:, 1:].copy()
    stages = [build_stage(cfg.model.shape(), n, s, cfg.train.seed) for s in range(n)]
    ref_losses = []
    for mb, (xm, ym) in enumerate(zip(np.split(x, micro), np.split(y, micro))):
        act = torch.from_numpy(xm)
        for hop in routes(n, micro, swapped=True)[mb]:
            act = stages[hop.stage].run(act, hop.embed, hop.layers, hop.head)
        loss = lm_loss(act, torch.from_numpy(ym))
        (loss / micro).backward()
        ref_losses.append(float(loss.detach()))
    Actor = ray.remote(StageWorker).options(num_cpus=0.25)
    actors = [[Actor.remote(cfg.to_dict(), s, 0) for s in range(n)]]
    try:
        runner = PipelineRunner(actors, schedule, micro, swapped=True)
        np.testing.assert_allclose(ray.get(runner.submit_microbatches(x, y)), ref_losses, rtol=1e-5)
        for s in range(n):
            got = ray.get(actors[0][s].grads.remote())
            for name, p in stages[s].named_parameters():
                np.testing.assert_allclose(got[name], p.grad.numpy(), rtol=2e-4, atol=2e-6, err_msg=f"stage {s} {name}")
    finally:
        for a in actors[0]:
            ray.kill(a)
