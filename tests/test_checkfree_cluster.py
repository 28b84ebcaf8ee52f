"""CheckFree+, redundant copies and checkpoints on real stage actors (embedded Ray), with real
kills (``ray.kill`` and SIGKILL of the worker process).

CheckFree is lossy, so its check is that every rebuilt stage holds exactly the expected average
or copy of its neighbours as they were when it died; the lossless modes (redundant, checkpoint)
are checked bit for bit against an uninterrupted run.
"""

import os
import zlib

import numpy as np
import pytest
import ray

from elastic_llm.config import load_config
from elastic_llm.runtime.ray_runtime import ray_trainer
from elastic_llm.snapshot.records import ShardKey

from .conftest import REPO

pytestmark = pytest.mark.timeout(300)
N = 4
BASE = [
    "model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4", "parallel.stages=4",
    "parallel.microbatches=2", "parallel.cpus_per_actor=0.5", "train.batch_size=4", "train.eval_every=0",
    "train.lr=3e-3", "train.warmup_steps=2",
    "recovery.standby=0",  # new processes replace lost stages here; warm standbys: test_standby_cluster.py
]


def make(corpus_dir, *extra, metrics=None):
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}", *extra])
    return ray_trainer(cfg, metrics_out=metrics)


def params(t):
    return [ray.get(t.group.actor(ShardKey(s, 0)).parameters.remote()) for s in range(N)]


def fit(t, steps):
    """``steps`` steps of trainer ``t``: its history and replica 0's final parameters; shut down after."""
    try:
        return t.fit(steps), params(t)
    finally:
        t.shutdown()


def assert_same(got, final):
    for s in range(N):
        for name, value in final[s].items():
            np.testing.assert_array_equal(got[s][name], value, err_msg=f"stage {s} {name}")


@pytest.fixture(scope="module")
def clean(ray_local, corpus_dir):
    """Losses and final parameters of an uninterrupted run without fault-tolerance overhead."""
    t = make(corpus_dir, "recovery.mode=checkfree")
    try:
        history = t.fit(10)
        return {h["step"]: h["loss"] for h in history}, params(t)
    finally:
        t.shutdown()


def test_checkfree_plus_rebuilds_every_stage_first_and_last_included(ray_local, corpus_dir, tmp_path):
    kills = {3: 0, 6: 1, 9: 2, 12: 3}  # step -> stage killed in it
    events = ", ".join(f"{{step: {k}, kill: stage, stage: {s}, how: {'sigkill' if s % 2 else 'ray_kill'}}}" for k, s in kills.items())
    t = make(corpus_dir, "recovery.mode=checkfree_plus", f"chaos.events=[{events}]", "checkfree.lr_scale=1.2")
    expected = {}

    def before_kill(record):  # the neighbours as the stage will find them when it dies in the next step
        victim = kills.get(record["step"] + 1)
        if victim is None:
            return
        get = lambda s, m: ray.get(getattr(t.group.actor(ShardKey(s, 0)), m).remote())  # noqa: E731
        if 0 < victim < N - 1:
            a, b = get(victim + 1, "grad_norm") + 1e-4, get(victim - 1, "grad_norm") + 1e-4
            a32, b32 = np.float32(a), np.float32(b)
            flat = (a32 * get(victim + 1, "layer_params") + b32 * get(victim - 1, "layer_params")) / (a32 + b32)
            expected[victim] = (zlib.crc32(flat.view(np.uint8)), [a, b])
        elif victim == 0:  # embedding (mirror on stage 1) first, then a copy of stage 1's layers
            flat = np.concatenate([get(1, "mirror_params"), get(1, "layer_params")])
            expected[victim] = (zlib.crc32(flat.view(np.uint8)), None)
        else:  # layers of stage n-2, then final norm + head from its mirror
            flat = np.concatenate([get(N - 2, "layer_params"), get(N - 2, "mirror_params")])
            expected[victim] = (zlib.crc32(flat.view(np.uint8)), None)

    try:
        history = t.fit(16, on_step=before_kill)
        lrs = {s: ray.get(t.group.actor(ShardKey(s, 0)).info.remote()) for s in range(N)}
    finally:
        t.shutdown()
    recs = {r["stage"]: r for r in t.recoveries}
    assert sorted(recs) == [0, 1, 2, 3] and t.failures == 4
    for stage, (crc, w) in expected.items():
        r = recs[stage]
        assert r["source"] == ("checkfree" if 0 < stage < N - 1 else "checkfree_plus") and r["lossless"] is False
        assert r["rollback_steps"] == 0 and r["lr_scale"] == 1.2
        assert r["params_crc32"] == crc, f"stage {stage} is not the expected {'average' if w else 'copy'} of its neighbours"
        if w is not None:
            assert r["weights"] == pytest.approx(w)
    assert all(info.step == 16 for info in lrs.values())
    losses = [h["loss"] for h in history]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5  # training went on and the loss kept falling


def test_redundant_copy_is_promoted_bit_for_bit(ray_local, corpus_dir, clean):
    losses, final = clean
    t = make(corpus_dir, "recovery.mode=redundant", "chaos.events=[{step: 3, kill: stage, stage: 0, how: sigkill}, {step: 6, kill: stage, stage: 2}]")
    history, got = fit(t, 10)
    assert [(r["stage"], r["source"], r["lossless"], r["rollback_steps"]) for r in t.recoveries] == [(0, "redundant", True, 0), (2, "redundant", True, 0)]
    assert {h["step"]: h["loss"] for h in history} == losses
    assert_same(got, final)


def test_redundant_copies_with_two_replicas_are_promoted_or_copied_from_the_other_replica_bit_for_bit(ray_local, corpus_dir):
    """Two pipelines, each stage training a copy of its successor (the copies' gradients summed
    over the replicas like the stages'). Step 3: stage 1 of replica 1 dies: promoted. Step 6:
    stage 1 of replica 0 dies, then its successor while that promotion is carried out: both
    copy replica 1's stages and their redundant copies. Step 8: stage 2 of replica 0 dies again:
    promoted from the copy that came from replica 1. Losses and parameters as an undisturbed run's."""
    dp2 = ("parallel.dp=2", "elastic.max_replicas=2")
    clean_history, final = fit(make(corpus_dir, *dp2, "recovery.mode=checkfree"), 10)
    t = make(corpus_dir, *dp2, "recovery.mode=redundant", "chaos.events=[{step: 3, kill: stage, stage: 1, replica: 1, how: sigkill}, "
             "{step: 6, kill: stage, stage: 1}, {step: 6, kill: stage, stage: 2, during: recovery}, {step: 8, kill: stage, stage: 2}]")
    history, got = fit(t, 10)
    sources = [(r["stage"], r["replica"], r["source"], r["rollback_steps"]) for r in t.recoveries]
    assert sources == [(1, 1, "redundant", 0), (1, 0, "dp_peer", 0), (2, 0, "dp_peer", 0), (2, 0, "redundant", 0)], sources
    assert {h["step"]: h["loss"] for h in history} == {h["step"]: h["loss"] for h in clean_history}
    assert_same(got, final)


def test_checkpoint_rolls_back_to_the_newest_checkpoint_bit_for_bit(ray_local, corpus_dir, clean, tmp_path):
    losses, final = clean
    t = make(corpus_dir, "recovery.mode=checkpoint", "recovery.checkpoint_every=3", f"recovery.checkpoint_dir={tmp_path}",
             "chaos.events=[{step: 5, kill: stage, stage: 1, how: sigkill}]")
    history, got = fit(t, 10)
    assert [(r["stage"], r["source"], r["rollback_steps"], r["committed_steps_lost"]) for r in t.recoveries] == [(1, "checkpoint", 1, 0)]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10]  # step 4 replayed after the rollback to 3
    assert {h["step"]: h["loss"] for h in history} == losses
    assert_same(got, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{s:08d}" for s in (0, 3, 6, 9)]


@pytest.mark.slow  # 27 s; CheckFree+ and redundant recoveries stay in the suite (tests above), this adds the failure-rate schedule under GPipe
def test_failures_at_a_rate_hit_the_same_steps_and_stages_in_every_mode(ray_local, corpus_dir):
    seen, losses = {}, {}
    for mode, schedule in (("checkfree_plus", "gpipe"), ("redundant", "1f1b")):  # the swapped order under GPipe too
        t = make(corpus_dir, f"recovery.mode={mode}", f"parallel.schedule={schedule}", "chaos.failure_prob_per_step=0.04", "chaos.failure_seed=5")
        try:
            history = t.fit(14)
        finally:
            t.shutdown()
        seen[mode] = [(r["step"], r["stage"]) for r in t.recoveries]
        losses[mode] = [h["loss"] for h in history]
    assert np.mean(losses["checkfree_plus"][-3:]) < np.mean(losses["checkfree_plus"][:3]) - 0.5
    from elastic_llm.chaos import failures_at

    expected = [(step, f[0][0]) for step in range(1, 15) for f in [failures_at(5, step, N, 1, 0.04)] if f]
    assert expected and seen["checkfree_plus"] == seen["redundant"] == expected
