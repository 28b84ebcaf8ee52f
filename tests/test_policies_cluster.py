"""The named recovery policies on a real loopback Ray cluster: ``restart`` restarts every stage
process from the durable checkpoint and goes on bit for bit, ``replica-group`` takes a replica
out whole and grows it back by a peer copy, and ``ray-train-elastic`` restarts everyone after a
grow.

One ``ray.cluster_utils.Cluster`` (a head without CPUs + 4 worker nodes of 2 CPUs) is shared by
the module. Faults are real ``ray.kill``s of stage actors (``chaos.events``). The same policies
on the simulated runtime are in tests/test_policies.py.
"""

import os
import threading
from dataclasses import replace

import numpy as np
import pytest
import ray

from elastic_llm.config import load_config
from elastic_llm.controller.trainer import UNTIL_STOPPED
from elastic_llm.policies import POLICIES
from elastic_llm.runtime.ray_runtime import ray_trainer

from .conftest import REPO, events, loopback_cluster_fixture, top_up, undisturbed_losses, wait_until

pytestmark = pytest.mark.timeout(300)
WORKERS = 4
CLEAN_STEPS = 45  # the steps the others are compared on (the restart test restarts within them: 20-30 steps under load)
BASE = [
    "model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4",
    "parallel.stages=4", "parallel.microbatches=2", "parallel.cpus_per_actor=0.5", "parallel.dp=2",
    "parallel.placement_strategy=SPREAD", "train.batch_size=4", "train.eval_every=0",
    "snapshot.group_size=4", "snapshot.parity=1", "durable.every=1", "durable.keep_last=20",
]

cluster = loopback_cluster_fixture(WORKERS, 2)


@pytest.fixture
def nodes(cluster):
    return top_up(cluster, WORKERS, 2)


def trainer(cluster, corpus_dir, tmp_path, *extra):
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"),
                      [*BASE, f"data.dir={corpus_dir}", f"durable.storage_path={tmp_path / 'store'}", *extra])
    return ray_trainer(cfg, cluster=cluster, metrics_out=tmp_path / "metrics.jsonl")


def fit_until(t, tmp_path, seen, what, strike=None):
    """``t.fit`` in a thread until ``seen(tmp_path)`` holds (``strike(t)`` first, from this thread,
    once a durable checkpoint committed), then two more steps: the last loss of every step, and
    the stage actors' ids before the strike and at the end."""
    losses: dict[int, float] = {}
    run = threading.Thread(target=lambda: losses.update({h["step"]: h["loss"] for h in t.fit(UNTIL_STOPPED)}), daemon=True)
    try:
        run.start()
        wait_until(lambda: t.step >= 2 and (strike is None or t.durable is not None and t.durable.stats.flushed >= 1), 120, "a durable checkpoint")
        before = ids(t)
        if strike is not None:
            strike(t)
        wait_until(lambda: (tmp_path / "metrics.jsonl").exists() and seen(tmp_path), 180, what)
        mark = t.step
        wait_until(lambda: t.step >= mark + 2, 120, f"two steps after {what}")
        t.request_stop()
        run.join(120)
        return losses, before, ids(t)
    finally:
        t.shutdown()


def ids(t):
    return {a._actor_id.hex() for row in t.actors for a in row}


def in_clean(losses, clean):
    """The steps of ``losses`` the undisturbed run trained too, in order (a fast machine trains
    more after a restart, or before a replica is back, than the clean run's steps)."""
    return [s for s in sorted(losses) if s in clean]


@pytest.fixture(scope="module")
def clean(cluster, corpus_dir):
    """The undisturbed run's losses (shared by the module's tests): more steps than any of them
    trains; without the fault-tolerance machinery, which changes no loss."""
    top_up(cluster, WORKERS, 2)
    return undisturbed_losses(cluster, load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}"]), CLEAN_STEPS)


def test_restart_restarts_every_stage_process_from_the_durable_checkpoint_and_goes_on_bit_for_bit(nodes, corpus_dir, tmp_path, clean):
    """Stage 1 of replica 0 is killed once a durable checkpoint committed; every process starts again."""
    t = trainer(nodes, corpus_dir, tmp_path, "recovery.policy=restart")
    losses, before, after = fit_until(t, tmp_path, lambda p: events(p, "recovery"), "the restart", strike=lambda t: ray.kill(t.actors[0][1]))
    recs = events(tmp_path, "recovery")
    assert {r["source"] for r in recs} == {"durable"} and len(recs) == 8, recs  # all 8 processes, not only the killed one
    assert all("every process restarts" in r["reason"] for r in recs)
    assert not before & after  # every stage process is new
    common = in_clean(losses, clean)
    assert common and common == sorted(losses), f"the run trained {max(losses)} steps, the clean one {CLEAN_STEPS}"  # it stops 2 steps after its restart
    assert all(losses[s] == clean[s] for s in common)  # restored with its data position: the same losses, bit for bit
    assert events(tmp_path, "resize") == []


def test_replica_group_takes_the_replica_out_whole_and_grows_it_back_by_a_peer_copy(nodes, corpus_dir, tmp_path, clean):
    kill = "chaos.events=[{step: 3, kill: stage, stage: 0, replica: 1}]"
    t = trainer(nodes, corpus_dir, tmp_path, "recovery.policy=replica-group", "elastic.min_replicas=1", kill)
    losses, _, _ = fit_until(t, tmp_path, lambda p: len(events(p, "resize")) >= 2, "the replica's return")
    resizes = [(e["from_dp"], e["to_dp"], e["reason"]) for e in events(tmp_path, "resize")]
    assert resizes[:2] == [(2, 1, "a lost stage takes its replica out (recovery.policy=replica-group)"), (1, 2, "capacity")], resizes  # the node had room: out whole all the same
    recs = events(tmp_path, "recovery")
    assert recs and all(r["rollback_steps"] == 0 and r["source"] != "durable" for r in recs)
    common = in_clean(losses, clean)
    assert len(common) >= 10 and np.allclose([losses[s] for s in common], [clean[s] for s in common], rtol=1e-4)  # other widths: the same math in other sums


@pytest.mark.slow  # the restart is the restart test's; the grow that leads to it: tests/test_policies.py on the simulated runtime
def test_ray_train_elastic_restarts_every_process_after_a_grow(nodes, corpus_dir, tmp_path, clean, monkeypatch):
    policy = POLICIES["ray-train-elastic"]
    quick = tuple(("elastic.grow_check_s", 1.0) if k == "elastic.grow_check_s" else (k, v) for k, v in policy.settings)
    monkeypatch.setitem(POLICIES, "ray-train-elastic", replace(policy, settings=quick))  # look for room every second, not every minute
    t = trainer(nodes, corpus_dir, tmp_path, "recovery.policy=ray-train-elastic", "parallel.dp=1", "elastic.min_replicas=1", "elastic.max_replicas=2")
    regrown = lambda p: any("resize 1 -> 2" in r["failure"] for r in events(p, "recovery"))  # noqa: E731
    losses, _, _ = fit_until(t, tmp_path, regrown, "the restart after the grow")
    assert [(e["from_dp"], e["to_dp"]) for e in events(tmp_path, "resize")][:1] == [(1, 2)]
    after = [r for r in events(tmp_path, "recovery") if "resize 1 -> 2" in r["failure"]]
    assert len(after) == 8 and {r["source"] for r in after} <= {"durable", "initial"}, after  # every process of the new width
    common = in_clean(losses, clean)
    assert len(common) >= 10 and np.allclose([losses[s] for s in common], [clean[s] for s in common], rtol=1e-4)
