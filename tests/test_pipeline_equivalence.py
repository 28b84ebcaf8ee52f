"""The pipelined model (stage actors on Ray, each running its own step from a plan) computes the
same loss and gradients as the unsplit model: the loss, and every stage's gradient norm (reported
before clipping, after the replicas' all-reduce), and replicas hold identical bits afterwards."""

from dataclasses import replace

import numpy as np
import pytest
import ray
import torch

from elastic_llm.config import config_from_dict
from elastic_llm.model import build_full_model, lm_loss
from elastic_llm.pipeline.executor import RayStepExecutor
from elastic_llm.pipeline.stage import StageWorker
from elastic_llm.pipeline.stage_actor import CONCURRENCY_GROUPS
from elastic_llm.snapshot.records import ShardKey

from .numerics import assert_loss_close, assert_within_envelope, reference_steps

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


def stage_actors(cfg, stages, dp, replicas=None):
    Actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(StageWorker).options(num_cpus=0.25)
    return [[Actor.remote(cfg.to_dict(), s, r, dp) for s in range(stages)] for r in (replicas if replicas is not None else range(dp))]


def token_batches(cfg, seed):
    """A function giving a new random (inputs, targets) batch of ``cfg``'s size at each call."""
    rng = np.random.default_rng(seed)

    def batch():
        tokens = rng.integers(0, 256, size=(cfg.train.batch_size, cfg.model.seq_len + 1))
        return tokens[:, :-1].copy(), tokens[:, 1:].copy()

    return batch


def kill_all(actors):
    for row in actors:
        for a in row:
            ray.kill(a)


def global_name(stage_name, layer_ids):
    parts = stage_name.split(".")
    if parts[0] == "layers":
        parts[1] = str(layer_ids[int(parts[1])])
    return ".".join(parts)


@pytest.mark.parametrize("stages,dp,schedule", [
    (4, 1, "1f1b"), (2, 2, "gpipe"), (2, 3, "1f1b"),  # each shape and each schedule once in the suite; the other three pairs are slow
    pytest.param(4, 1, "gpipe", marks=pytest.mark.slow), pytest.param(2, 2, "1f1b", marks=pytest.mark.slow), pytest.param(2, 3, "gpipe", marks=pytest.mark.slow),
])
def test_pipeline_matches_unsplit_model(ray_local, schedule, stages, dp):
    cfg = small_config(stages, dp, schedule, batch=4 * dp)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, size=(cfg.train.batch_size, cfg.model.seq_len + 1))
    x, y = tokens[:, :-1].copy(), tokens[:, 1:].copy()
    ref_loss, ref_grads, ref_params = full_model_reference(cfg, x, y)

    actors = stage_actors(cfg, stages, dp)
    try:
        ex = RayStepExecutor(actors, schedule, cfg.parallel.microbatches)
        for s in range(stages):  # same initial weights as the unsplit model, on every replica
            info = ray.get(actors[0][s].info.remote())
            for r in range(dp):
                for name, value in ray.get(actors[r][s].parameters.remote()).items():
                    np.testing.assert_array_equal(value, ref_params[global_name(name, info.layers)])
        result = ex.finish(ex.start(1, x, y))
        heads = [result.reports[k].losses for k in result.reports if k.stage == stages - 1]
        assert sorted(len(h) for h in heads) == [cfg.parallel.microbatches] * dp
        np.testing.assert_allclose(result.loss, ref_loss, rtol=1e-5)
        seen = set()
        for s in range(stages):
            info = ray.get(actors[0][s].info.remote())
            names = {global_name(n, info.layers) for n in ray.get(actors[0][s].parameters.remote())}
            seen |= names
            ref_norm = float(np.sqrt(sum(float((ref_grads[n].astype(np.float64) ** 2).sum()) for n in names)))
            norms = [result.reports[k].grad_norm for k in result.reports if k.stage == s]
            assert len(norms) == dp
            np.testing.assert_allclose(norms, ref_norm, rtol=2e-4, err_msg=f"stage {s}: gradient (summed over {dp} replicas) differs")
            assert len(set(norms)) == 1, f"stage {s}: replicas summed to different gradients: {norms}"
            params = [ray.get(actors[r][s].parameters.remote()) for r in range(dp)]
            for other in params[1:]:  # the all-reduce left every replica with identical bits
                for name in params[0]:
                    np.testing.assert_array_equal(other[name], params[0][name])
        assert seen == set(ref_grads), "every parameter of the unsplit model lives on exactly one stage"
    finally:
        kill_all(actors)


def test_optimizer_step_keeps_replicas_identical_and_reports_clipped_norm(ray_local):
    cfg = small_config(2, 2, "1f1b")
    rng = np.random.default_rng(2)
    actors = stage_actors(cfg, 2, 2)
    try:
        ex = RayStepExecutor(actors, "1f1b", cfg.parallel.microbatches)
        before = ray.get(actors[0][1].parameters.remote())
        for step in (1, 2, 3):
            tokens = rng.integers(0, 256, size=(cfg.train.batch_size, cfg.model.seq_len + 1))
            result = ex.finish(ex.start(step, tokens[:, :-1].copy(), tokens[:, 1:].copy()))
            assert np.isfinite(result.loss) and len(result.grad_norms) == 2
        for s in range(2):
            p0, p1 = ray.get([actors[0][s].parameters.remote(), actors[1][s].parameters.remote()])
            for name in p0:
                np.testing.assert_array_equal(p0[name], p1[name])
            norm = ray.get(actors[0][s].grad_norm.remote())
            assert 0 < norm <= cfg.train.grad_clip
        after = ray.get(actors[0][1].parameters.remote())
        assert any(not np.array_equal(before[n], after[n]) for n in before), "the step changed nothing"
        # gradients cross replicas as O(gradient) bytes: 2 (dp - 1) / dp of it per replica
        grad_bytes = 4 * sum(v.size for v in ray.get(actors[0][0].parameters.remote()).values())
        sent = result.reports[ShardKey(0, 0)].sent_bytes
        assert sent["chunk"] + sent["gather"] == pytest.approx(grad_bytes, rel=0.01)
    finally:
        kill_all(actors)


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
    actors = stage_actors(cfg, n, 1)
    try:
        result = (ex := RayStepExecutor(actors, schedule, micro, swapped=True)).finish(ex.start(1, x, y))
        np.testing.assert_allclose(result.reports[ShardKey(n - 1, 0)].losses, ref_losses, rtol=1e-5)
        for s in range(n):
            ref_norm = float(np.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in stages[s].parameters())))
            np.testing.assert_allclose(result.reports[ShardKey(s, 0)].grad_norm, ref_norm, rtol=2e-4, err_msg=f"stage {s}")
    finally:
        kill_all(actors)


def test_redundant_mode_on_the_step_executor_matches_the_unsplit_model(ray_local):
    """Every stage also trains a copy of its successor from the gradients the successor received
    (passed on stage to stage); the pipeline itself still computes the unsplit model's loss and
    gradients. (That each copy equals its successor bit for bit is checked where it is promoted,
    tests/test_checkfree_cluster.py.)"""
    d = small_config(4, 1, "1f1b").to_dict()
    d["recovery"]["mode"] = "redundant"
    cfg = config_from_dict(d)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 256, size=(cfg.train.batch_size, cfg.model.seq_len + 1))
    x, y = tokens[:, :-1].copy(), tokens[:, 1:].copy()
    ref_loss, ref_grads, _ = full_model_reference(cfg, x, y)
    actors = stage_actors(cfg, 4, 1)
    try:
        ex = RayStepExecutor(actors, "1f1b", cfg.parallel.microbatches, redundant=True)
        result = ex.finish(ex.start(1, x, y))
        np.testing.assert_allclose(result.loss, ref_loss, rtol=1e-5)
        assert "shadow" in result.reports[ShardKey(0, 0)].sent_bytes  # stage 0 passes on what stage 1 sent it
        for s in range(4):
            info = ray.get(actors[0][s].info.remote())
            names = {global_name(n, info.layers) for n in ray.get(actors[0][s].parameters.remote())}
            ref_norm = float(np.sqrt(sum(float((ref_grads[n].astype(np.float64) ** 2).sum()) for n in names)))
            np.testing.assert_allclose(result.reports[ShardKey(s, 0)].grad_norm, ref_norm, rtol=2e-4)
    finally:
        kill_all(actors)


def test_in_bf16_each_redundant_copy_holds_its_successors_state_bit_for_bit(ray_local):
    """Redundant mode with ``train.precision: bf16``: each stage's copy of its successor runs in
    the successor's precision on what the successor got (its bf16 input, its bf16 gradient), so
    after two steps it holds the successor's fp32 state bit for bit (the promotion's premise)."""
    d = small_config(4, 1, "1f1b").to_dict()
    d["recovery"]["mode"], d["train"]["precision"] = "redundant", "bf16"
    cfg = config_from_dict(d)
    actors = stage_actors(cfg, 4, 1)
    try:
        ex = RayStepExecutor(actors, "1f1b", cfg.parallel.microbatches, redundant=True)
        for step, seed in ((1, 5), (2, 6)):
            ex.finish(ex.start(step, *token_batch(cfg, seed)))
        for s in range(4):
            copy = ray.get(actors[0][s].shadow_state.options(num_returns=2).remote()[0])  # (buffer, manifest): the bytes
            real = ray.get(actors[0][(s + 1) % 4].capture_state.options(num_returns=2).remote()[0])
            np.testing.assert_array_equal(copy, real, err_msg=f"stage {s}'s copy of stage {(s + 1) % 4}")
    finally:
        kill_all(actors)


def test_a_width_change_rebuilds_the_links_and_the_all_reduce_group(ray_local):
    """Three replicas train a step; replica 1 is dropped and the others become replicas 0 and 1
    of two: the next executor sets up a new generation of links among them only, and their
    all-reduce keeps them bit-identical."""
    cfg = small_config(2, 3, "1f1b", batch=12)
    rng = np.random.default_rng(6)
    actors = stage_actors(cfg, 2, 3)
    try:
        ex = RayStepExecutor(actors, "1f1b", cfg.parallel.microbatches)
        tokens = rng.integers(0, 256, size=(12, cfg.model.seq_len + 1))
        assert len(ex.finish(ex.start(1, tokens[:, :-1].copy(), tokens[:, 1:].copy())).reports) == 6
        kept = [actors[0], actors[2]]
        ray.get([kept[r][s].set_width.remote(r, 2) for r in range(2) for s in range(2)])
        ex2 = RayStepExecutor(kept, "1f1b", cfg.parallel.microbatches)
        tokens = rng.integers(0, 256, size=(8, cfg.model.seq_len + 1))
        result = ex2.finish(ex2.start(2, tokens[:, :-1].copy(), tokens[:, 1:].copy()))
        assert ex2.generation > ex.generation
        assert set(result.reports) == {ShardKey(s, r) for r in range(2) for s in range(2)}
        for s in range(2):
            p0, p1 = ray.get([kept[0][s].parameters.remote(), kept[1][s].parameters.remote()])
            for name in p0:
                np.testing.assert_array_equal(p0[name], p1[name])
        assert [ray.get(a.info.remote()).step for a in actors[1]] == [1, 1]  # the dropped replica took no part
    finally:
        kill_all(actors)


# --------------------------------------------------------------------------- any width


def token_batch(cfg, seed):
    tokens = np.random.default_rng(seed).integers(0, 256, size=(cfg.train.batch_size, cfg.model.seq_len + 1))
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def train_steps(cfg, width, batches):
    """Run ``batches`` as steps 1, 2, ... on fresh actors of ``width`` replicas (2 stages); returns
    the step results and every replica's parameters afterwards, ``params[replica][stage]``."""
    actors = stage_actors(cfg, 2, width)
    try:
        ex = RayStepExecutor(actors, cfg.parallel.schedule, cfg.parallel.microbatches)
        results = [ex.finish(ex.start(i + 1, x, y)) for i, (x, y) in enumerate(batches)]
        params = [ray.get([a.parameters.remote() for a in row]) for row in actors]
        return results, params
    finally:
        kill_all(actors)


_RUNS = {}


def cached_steps(batch, micro, width, seeds):
    """:func:`train_steps` on the batches of ``seeds`` (each run once per module)."""
    key = (batch, micro, width, seeds)
    if key not in _RUNS:
        cfg = small_config(2, width, "1f1b", micro=micro, batch=batch)
        _RUNS[key] = train_steps(cfg, width, [token_batch(cfg, seed) for seed in seeds])
    return _RUNS[key]


def assert_is_the_float64_step(cfg, batches, results, params):
    """Loss and per-stage gradient norm of every step are the float64 steps' within 1e-5, and the
    parameters after the last update lie within the rounding envelope of the float64 run
    (tests/numerics.py: any float32 order of the same steps lands there, on any CPU; a wrong
    gradient, learning rate or update does not); every replica holds the same bits."""
    ref = reference_steps(cfg, batches)
    for t, got in enumerate(results):
        assert_loss_close(got.loss, ref.losses[t], f"step {t + 1} loss")
        for s, norm in enumerate(ref.grad_norms[t]):
            assert_loss_close(got.grad_norms[s], norm, f"step {t + 1} stage {s} gradient norm")
        norms = {k: rep.grad_norm for k, rep in got.reports.items()}
        assert all(norms[k] == norms[ShardKey(k.stage, 0)] for k in norms), f"replicas' gradient norms differ: {norms}"
    for s, st in enumerate(ref.stages):
        moved = max(float(np.abs(st.final[n] - st.initial[n]).max()) for n in st.final)
        assert moved > 1e-5, "the update moved nothing: the comparison would be empty"
        assert_within_envelope(params[0][s], ref, s, "replica 0")
        for r in range(1, len(params)):
            for name in params[0][s]:
                np.testing.assert_array_equal(params[r][s][name], params[0][s][name], err_msg=f"replica {r} stage {s} {name}")


@pytest.mark.parametrize(
    "batch,micro,width",
    [
        (16, 4, 3),  # shares 6, 5, 5: microbatches (2, 2, 1, 1), (2, 1, 1, 1), (2, 1, 1, 1)
        pytest.param(16, 4, 5, marks=pytest.mark.slow),  # shares 4, 3, 3, 3, 3: four replicas run 3 microbatches (slow: widths 3 stay)
        (8, 4, 3),  # shares 3, 3, 2: every replica has fewer sequences than microbatches
    ],
)
def test_a_step_at_any_width_is_the_float64_step(ray_local, batch, micro, width):
    """Widths that do not split the batch into whole microbatches train the step of one replica
    (the float64 step, within rounding): uneven shares, fewer microbatches where a share is small, weighted losses, and the
    replicas' gradients summed in replica order."""
    from elastic_llm.pipeline.shares import replica_microbatches

    results, params = cached_steps(batch, micro, width, (11,))
    heads = [results[0].reports[ShardKey(1, r)].losses for r in range(width)]
    assert [len(h) for h in heads] == [len(m) for m in replica_microbatches(batch, width, micro)]
    cfg = small_config(2, width, "1f1b", micro=micro, batch=batch)
    assert_is_the_float64_step(cfg, [token_batch(cfg, 11)], results, params)


def test_the_width_one_step_is_the_float64_step_too(ray_local):
    """One replica (8 sequences in 4 microbatches) lands in the same envelope as the widths."""
    cfg = small_config(2, 1, "1f1b", micro=4, batch=8)
    assert_is_the_float64_step(cfg, [token_batch(cfg, 11)], *cached_steps(8, 4, 1, (11,)))


@pytest.mark.slow  # 16 s; on Ray the bf16 pipeline test runs its steps twice for the same bits, and every bit-identical recovery compares two runs
def test_the_same_config_and_seed_give_the_same_bits_twice(ray_local):
    """A second run on fresh actors of the step at width 3 (8 sequences, 4 microbatches)."""
    cfg = small_config(2, 3, "1f1b", micro=4, batch=8)
    first, p_first = cached_steps(8, 4, 3, (11,))
    second, p_second = train_steps(cfg, 3, [token_batch(cfg, 11)])
    assert first[0].loss == second[0].loss
    assert first[0].grad_norms == second[0].grad_norms
    for r in range(3):
        for s in range(2):
            for name in p_first[r][s]:
                np.testing.assert_array_equal(p_first[r][s][name], p_second[r][s][name])


def test_a_bf16_pipeline_on_ray_is_near_the_fp32_step_and_its_replicas_hold_the_same_fp32_bits(ray_local):
    """``train.precision: bf16`` through the stage actors and their links (bf16 on the wire): two
    steps at width 2 (2 stages, 4 microbatches) land within bf16's rounding of the same steps in
    fp32, replicas hold identical fp32 parameters afterwards, and a second run gives the same bits."""
    cfg = small_config(2, 2, "1f1b", micro=4, batch=8)
    bf16 = replace(cfg, train=replace(cfg.train, precision="bf16"))
    data = [token_batch(cfg, 11), token_batch(cfg, 12)]
    fp32_results, _ = cached_steps(8, 4, 2, (11, 12))
    results, params = train_steps(bf16, 2, data)
    np.testing.assert_allclose([r.loss for r in results], [r.loss for r in fp32_results], rtol=2e-2)
    assert [r.loss for r in results] != [r.loss for r in fp32_results]
    for s in range(2):
        for name, value in params[0][s].items():
            assert value.dtype == np.float32
            np.testing.assert_array_equal(params[1][s][name], value)
    again, _ = train_steps(bf16, 2, data)
    assert [r.loss for r in again] == [r.loss for r in results]


@pytest.mark.slow  # 17 s; a grow on Ray stays bit-identical in test_elastic_cluster, width 3 against float64 in the any-width step here
def test_a_width_change_from_two_to_three_replicas_keeps_the_width_one_math(ray_local):
    """Two replicas train a step; a third joins with replica 0's state (as a grow does) and the
    three train the next step on the same global batch of 8 sequences (shares 3, 3, 2 in
    microbatches of one): a new generation of links, replicas bit-identical, and both steps
    are the float64 steps within rounding (tests/numerics.py)."""
    cfg = small_config(2, 2, "1f1b", micro=4, batch=8)
    batches = [token_batch(cfg, seed) for seed in (12, 13)]
    actors, joined = stage_actors(cfg, 2, 2), []
    try:
        ex = RayStepExecutor(actors, "1f1b", cfg.parallel.microbatches)
        first = ex.finish(ex.start(1, *batches[0]))
        joined = stage_actors(cfg, 2, 3, replicas=[2])[0]
        ray.get([joined[s].load_state.remote(*actors[0][s].capture_state.options(num_returns=2).remote()) for s in range(2)])
        grown = actors + [joined]
        ray.get([grown[r][s].set_width.remote(r, 3) for r in range(3) for s in range(2)])
        ex3 = RayStepExecutor(grown, "1f1b", cfg.parallel.microbatches)
        second = ex3.finish(ex3.start(2, *batches[1]))
        assert ex3.generation > ex.generation
        assert set(second.reports) == {ShardKey(s, r) for r in range(3) for s in range(2)}
        assert [len(second.reports[ShardKey(1, r)].losses) for r in range(3)] == [3, 3, 2]
        params = [ray.get([a.parameters.remote() for a in row]) for row in grown]
        assert_is_the_float64_step(cfg, batches, [first, second], params)
        x, y = batches[0]  # evaluation of replica 0's share at width 3: 3 sequences in 3 microbatches; 5 in (2, 1, 1, 1)
        per_sequence = [ex3.eval_loss(x[i : i + 1], y[i : i + 1]) for i in range(5)]
        assert abs(ex3.eval_loss(x[:3], y[:3]) - np.mean(per_sequence[:3])) <= 1e-6
        assert abs(ex3.eval_loss(x[:5], y[:5]) - np.mean(per_sequence)) <= 1e-6
    finally:
        kill_all(actors)
        kill_all([joined])


def test_the_driver_makes_one_call_per_replica_and_a_killed_relay_is_named_while_its_stages_live_on(ray_local):
    """Each replica's stage 0 relays the step to its stages: the driver makes one call per
    replica per step. SIGKILL of a relaying stage 0 mid-step: the step fails naming it, its
    replica's other stages (whose reports went with it) are alive, reset to the step before, and
    the run goes on at width 1."""
    import os
    import signal

    from elastic_llm.pipeline.executor import StepFailed
    from elastic_llm.pipeline.plan import Fault, FaultAction, Phase

    cfg = small_config(2, 2, "1f1b")
    batch = token_batches(cfg, 4)
    actors = stage_actors(cfg, 2, 2)

    try:
        ex = RayStepExecutor(actors, "1f1b", cfg.parallel.microbatches)
        ex.finish(ex.start(1, *batch()))  # links up
        before = ex.calls
        result = ex.finish(ex.start(2, *batch()))
        assert ex.calls - before == 2, f"{ex.calls - before} driver calls for a step of 2 replicas x 2 stages"
        assert set(result.reports) == {ShardKey(s, r) for s in range(2) for r in range(2)} and np.isfinite(result.loss)

        head = ShardKey(0, 1)
        pid = ray.get(actors[1][0].info.remote()).pid
        pending = ex.start(3, *batch(), faults={head: Fault(Phase.BACKWARD, FaultAction.HOLD)})
        assert not ex.wait(pending, 1.0), "the step ended while its stage 0 was held"
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(StepFailed) as err:
            ex.finish(pending)
        assert (err.value.stage, err.value.replica) == (0, 1)
        assert pending.orphaned <= {ShardKey(1, 1)}
        steps = ray.get([a.reset_step.remote() for a in actors[0] + actors[1][1:]], timeout=60)  # as the controller does after a failed step
        assert steps == [2] * 3, f"completed steps after the aborted step 3: {steps}"

        # the run goes on without the lost replica: one call for its one replica
        ray.get([a.set_width.remote(0, 1) for a in actors[0]], timeout=60)
        ex2 = RayStepExecutor(actors[:1], "1f1b", cfg.parallel.microbatches)
        assert np.isfinite(ex2.finish(ex2.start(3, *batch())).loss)
    finally:
        kill_all(actors)


@pytest.mark.slow  # 55 s, and a bound in wall-clock time (half an op); a death reaching every stage of a step stays in the suite (the tests below)
def test_a_stage_killed_mid_step_stops_the_others_inside_their_ops_not_after(ray_local):
    """4 stages x 2 replicas of a model whose ops take a good part of a second. Replica 0's stage
    2 is held at its first forward and SIGKILLed one op's time into the step, while replica 1
    (which does not wait for it before the all-reduce) computes: every other stage is stopped
    where it is (a peer's lost link, or the driver's abort checked at each layer boundary), not
    when its op would have ended: each reports its failure within half an op's time of the kill
    (with the whole suite beside it the slowest came at a third: the driver hears of the death
    first)."""
    import os
    import signal
    import time

    from elastic_llm.pipeline.executor import StepFailed
    from elastic_llm.pipeline.plan import FailureKind, Fault, FaultAction, Phase

    cfg = config_from_dict({
        "model": {"dim": 768, "n_heads": 8, "n_layers": 8, "seq_len": 256},
        "parallel": {"stages": 4, "dp": 2, "schedule": "1f1b", "microbatches": 2, "cpus_per_actor": 0.25, "threads_per_actor": 1},
        "train": {"batch_size": 8, "seed": 3},
    })
    batch = token_batches(cfg, 5)
    actors = stage_actors(cfg, 4, 2)

    try:
        ex = RayStepExecutor(actors, "1f1b", cfg.parallel.microbatches)
        ex.finish(ex.start(1, *batch()))  # links up, first ops warm
        ops = np.concatenate([r.op_seconds for r in ex.finish(ex.start(2, *batch())).reports.values()])
        op_s = float(np.median(ops))
        victim = ShardKey(2, 0)
        pid = ray.get(actors[0][2].info.remote()).pid
        pending = ex.start(3, *batch(), faults={victim: Fault(Phase.FORWARD, FaultAction.HOLD)})
        assert not ex.wait(pending, op_s), "the step ended while a stage was held"
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(StepFailed) as err:
            ex.finish(pending)
        assert (err.value.stage, err.value.replica) == (2, 0)
        stopped = {k: r.failure for k, r in pending.reports.items() if r.failure is not None}
        assert set(stopped) == {ShardKey(s, r) for s in range(4) for r in range(2)} - {victim}, sorted(pending.reports)
        late = {k: round(f.at - killed, 3) for k, f in stopped.items() if f.at - killed > 0.5 * op_s}
        assert not late, f"stopped after half an op ({op_s:.2f} s) past the kill: {late}"
        assert FailureKind.ERROR not in {f.kind for f in stopped.values()}  # the victim is the one root cause
    finally:
        kill_all(actors)


def step_held_on_a_node(actors, cfg, victim, seed, dead):
    """An executor over ``actors`` whose ``victim`` runs on node "gone" (judged dead once ``dead``
    holds it), one clean step, then step 2 submitted with the victim held in its first forward
    (alive: Ray would not fail its call). Returns (executor, the pending step)."""
    from elastic_llm.pipeline.plan import Fault, FaultAction, Phase

    batch = token_batches(cfg, seed)
    ex = RayStepExecutor(actors, "1f1b", cfg.parallel.microbatches, dead_nodes=lambda: set(dead),
                         node_of=lambda k: "gone" if k == victim else f"node-{k.stage}-{k.replica}")
    ex.finish(ex.start(1, *batch()))
    return ex, ex.start(2, *batch(), faults={victim: Fault(Phase.FORWARD, FaultAction.HOLD)})


@pytest.mark.parametrize("victim", [ShardKey(1, 0), ShardKey(0, 1)])  # a stage the relay waits on; a relay itself
def test_a_stage_whose_node_the_run_judged_dead_is_lost_at_once_not_when_ray_fails_its_call(ray_local, victim):
    """The victim is held in its first forward (alive: Ray would not fail its call) when the run's
    node watch judges its node dead: the step fails at the driver's next look, naming the victim
    (NodeLost), the others aborted, without waiting for the victim's call (its relay skips it; a
    victim that is a replica's relay loses that replica's reports)."""
    import time

    from elastic_llm.pipeline.executor import NodeLost, StepFailed

    cfg = small_config(2, 2, "1f1b", micro=2)
    actors = stage_actors(cfg, 2, 2)
    dead: set[str] = set()
    try:
        ex, pending = step_held_on_a_node(actors, cfg, victim, 6, dead)
        assert not ex.wait(pending, 1.0), "the step ended while a stage was held"
        dead.add("gone")
        t0 = time.monotonic()
        with pytest.raises(StepFailed) as err:
            ex.finish(pending)
        took = time.monotonic() - t0
        assert (err.value.stage, err.value.replica) == (victim.stage, victim.replica) and isinstance(err.value.cause, NodeLost), err.value
        assert took < 10, took  # not the victim's hold (120 s): its call was not waited for
        answered = {k for k, r in pending.reports.items() if r.failure is not None}
        others = {ShardKey(s, r) for s in range(2) for r in range(2)} - {victim}
        assert others - answered <= pending.orphaned and (victim.stage != 0 or pending.orphaned), (sorted(answered), pending.orphaned)
        # the survivors are out of the step: each answers a reset at once (an orphaned stage too)
        assert all(ray.get(actors[k.replica][k.stage].reset_step.remote(), timeout=5) == 1 for k in others)
    finally:
        kill_all(actors)


def test_a_node_judged_dead_wakes_the_steps_other_actors_at_the_verdict_not_at_the_drivers_next_look(ray_local, monkeypatch):
    """The node watch hands its verdict to the executor on the watch's own thread
    (``nodes_died``): the step's other actors are aborted then, so their reports come back while
    the driver has not looked at the dead nodes (its look is set beyond this test), and its look
    afterwards names the victim. A death of a node that hosts no actor of the step aborts nothing."""
    import threading

    from elastic_llm.pipeline import executor as executor_module
    from elastic_llm.pipeline.executor import NodeLost, StepFailed
    from elastic_llm.pipeline.plan import FailureKind

    monkeypatch.setattr(executor_module, "LOOK_S", 3600.0)
    victim = ShardKey(1, 0)
    cfg = small_config(2, 2, "1f1b", micro=2)
    actors = stage_actors(cfg, 2, 2)
    dead: set[str] = set()
    try:
        ex, pending = step_held_on_a_node(actors, cfg, victim, 7, dead)
        ex.nodes_died({"elsewhere"})  # no actor of the step there
        assert not ex.wait(pending, 1.0), "a death elsewhere ended the step"
        dead.add("gone")
        verdict = threading.Thread(target=ex.nodes_died, args=({"gone"},))
        verdict.start()
        verdict.join()
        assert ex.wait(pending, 30.0)
        aborted = {k for k, r in pending.reports.items() if r.failure is not None and r.failure.kind is FailureKind.ABORTED}
        assert aborted and victim not in aborted, sorted(pending.reports)  # woken by the verdict: the driver itself aborted nothing yet
        with pytest.raises(StepFailed) as err:
            ex.finish(pending)
        assert (err.value.stage, err.value.replica) == (victim.stage, victim.replica) and isinstance(err.value.cause, NodeLost), err.value
        others = {ShardKey(s, r) for s in range(2) for r in range(2)} - {victim}
        assert all(ray.get(actors[k.replica][k.stage].reset_step.remote(), timeout=5) == 1 for k in others)
    finally:
        kill_all(actors)


def test_waiting_on_a_step_ends_when_one_replica_failed_not_when_the_others_answered(ray_local):
    """The controller waits on a step in looks of a second (new drain notices between): a look
    must end as soon as one replica's relay reports the failure, with the other replica still
    computing (before, it waited for every relay or the whole look: a killed relay of replica 1
    was detected a second late on llama-25m)."""
    import time

    from elastic_llm.pipeline.executor import PendingStep
    from elastic_llm.pipeline.relay import ReplicaReports

    @ray.remote
    def relay_died():
        raise RuntimeError("replica 1's stage 0 died")

    @ray.remote
    def relay_answers(seconds):
        time.sleep(seconds)
        return ReplicaReports()

    ex = RayStepExecutor([[None, None], [None, None]], "1f1b", 2)
    slow = relay_answers.remote(3.0)
    pending = PendingStep(1, 1, 2, 2, {relay_died.remote(): 1, slow: 0}, ((1, 1), (1, 1)))
    assert ex.wait(pending, 20.0)  # the step has ended: it failed
    assert ShardKey(0, 1) in pending.lost and list(pending.relays) == [slow]  # replica 0 was not waited for
    ray.get(slow, timeout=30)
