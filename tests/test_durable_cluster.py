"""The durable tier on a real loopback Ray cluster: flushes by the snapshot managers, resume with
another data-parallel width, SIGKILL of a flushing manager, rollback to a durable checkpoint when
more nodes are lost than parity covers, and ``snapshot.every: auto``.

One ``ray.cluster_utils.Cluster`` (a head without CPUs + 4 worker nodes) is shared by the module;
nodes removed by a test are replaced before the next one.
"""

import json
import math
import os
import signal

import numpy as np
import pytest
import ray

from elastic_llm import cadence
from elastic_llm.config import load_config
from elastic_llm.runtime.ray_runtime import ray_trainer
from elastic_llm.durable import format as fmt
from elastic_llm.durable.storage import Storage

from .conftest import REPO, loopback_cluster_fixture, top_up, wait_until

pytestmark = pytest.mark.timeout(300)
WORKERS = 4
BASE = [
    "model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4",
    "parallel.stages=4", "parallel.microbatches=2", "parallel.cpus_per_actor=0.5",
    "parallel.placement_strategy=SPREAD", "train.batch_size=4", "train.eval_every=0",
    "snapshot.group_size=4", "snapshot.parity=1",
    "recovery.standby=0",  # new processes replace lost stages here; warm standbys: test_standby_cluster.py
]


cluster = loopback_cluster_fixture(WORKERS, 2)


@pytest.fixture
def nodes(cluster):
    return top_up(cluster, WORKERS, 2)


def make_trainer(cluster, corpus_dir, *extra, **kwargs):
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}", *extra])
    return ray_trainer(cfg, cluster=cluster, **kwargs)


def stage_states(trainer):
    """Replica 0's parameters + optimizer state of every stage, as the bytes of its arena."""
    calls = [trainer.actors[0][s].capture_state.remote() for s in range(4)]
    return [np.array(buf, copy=True) for buf, _ in ray.get(calls, timeout=60)]


def _flushed_run(nodes, corpus_dir, store):
    """A width-2 run of 5 steps flushing every commit: its losses, its final stage states, its run directory."""
    a = make_trainer(nodes, corpus_dir, "parallel.dp=2", f"durable.storage_path={store}", "durable.every=1", "durable.keep_last=20")
    try:
        losses_a = {h["step"]: h["loss"] for h in a.fit(5)}
        final = stage_states(a)
        assert a.durable.stats.flushed >= 2 and a.durable.stats.failed == 0
    finally:
        a.shutdown()
    return losses_a, final, Storage(store).child("tiny")


def test_flush_then_resume_with_another_width_is_bit_identical(nodes, corpus_dir, tmp_path):
    _, final, run = _flushed_run(nodes, corpus_dir, str(tmp_path / "ckpts"))
    committed = [e.step for e in fmt.list_checkpoints(run) if e.committed]
    assert committed[-1] == 5  # the run's end is flushed
    ck = fmt.open_checkpoint(run.uri)
    assert ck.manifest["width"] == 2 and len(ck.manifest["files"]) == 8  # 4 stages x 2 data-parallel parts
    assert ck.verify()["ok"]

    b = make_trainer(nodes, corpus_dir, "parallel.dp=1", resume=run.uri)  # narrower: one pipeline
    try:
        b.setup()
        assert b.step == 5
        for mine, theirs in zip(stage_states(b), final):
            np.testing.assert_array_equal(mine, theirs)
        assert b.fit(6)[-1]["step"] == 6
    finally:
        b.shutdown()


@pytest.mark.slow  # a third run; the suite's rollback to the durable checkpoint is checked bit for bit below
def test_a_resume_at_the_same_width_from_an_earlier_checkpoint_repeats_the_losses(nodes, corpus_dir, tmp_path):
    losses_a, _, run = _flushed_run(nodes, corpus_dir, str(tmp_path / "ckpts"))
    committed = [e.step for e in fmt.list_checkpoints(run) if e.committed]
    earlier = max(s for s in committed if s < 5)  # same width from an earlier checkpoint: the same losses
    c = make_trainer(nodes, corpus_dir, "parallel.dp=2", resume=run.uri + "/" + fmt.checkpoint_dir(earlier))
    try:
        losses_c = {h["step"]: h["loss"] for h in c.fit(5)}
    finally:
        c.shutdown()
    assert sorted(losses_c) == list(range(earlier + 1, 6))
    assert all(losses_c[s] == losses_a[s] for s in losses_c)


def test_sigkill_of_a_flushing_manager_keeps_the_previous_checkpoint(nodes, corpus_dir, tmp_path):
    store = str(tmp_path / "ckpts")
    t = make_trainer(nodes, corpus_dir, f"durable.storage_path={store}", "durable.every=1", "durable.max_write_mb_s=0.4", metrics_out=tmp_path / "m.jsonl")
    run = Storage(store).child("tiny")
    try:
        t.setup()
        for _ in range(200):  # until one checkpoint is committed and the next flush is writing
            t.run_step()
            if t.durable.latest() is not None and t.durable.inflight is not None:
                break
        previous = t.durable.latest()
        assert previous is not None
        partial = fmt.checkpoint_dir(t.durable.inflight.record.version)
        wait_until(lambda: any(run.size(f"{partial}/{f}") > 0 for f in run.list_files(partial)), 30, "the flush writing its first file")
        node, _ = next(iter(t.durable.inflight.refs.values()))
        pid = ray.get(t.snapshots.managers[node].__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGKILL)
        entries = {e.name: e.committed for e in fmt.list_checkpoints(run)}
        assert entries[partial] is False and entries[previous[1]] is True
        assert fmt.open_checkpoint(run.uri).name == previous[1]
        assert fmt.open_checkpoint(run.uri).verify()["ok"]
        failed = t.durable.stats.failed
        for _ in range(300):  # training goes on; a later flush commits and prunes the partial one
            t.run_step()
            if t.durable.stats.failed > failed and t.durable.latest()[0] > previous[0]:
                break
        assert t.durable.stats.failed > failed and t.durable.latest()[0] > previous[0]
        assert partial not in {e.name for e in fmt.list_checkpoints(run)}
    finally:
        t.shutdown()
    events = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert any(e.get("event") == "durable_failed" and e["step"] == int(partial.split("_")[1]) for e in events)


@pytest.mark.slow  # 40-50 s; its simulated twin stays (test_sim: beyond parity the durable tier is the rung that saves the run), and the flush-then-resume test here
def test_more_nodes_lost_than_parity_rolls_back_to_the_durable_checkpoint(nodes, corpus_dir, tmp_path):
    """Stages 1 and 3 go with their nodes at step 10: parity 1 cannot rebuild two shards, there
    is no data-parallel peer, but a durable checkpoint exists (made sure of at step 7): everyone
    rolls back to it; lossless, so the losses are those of an uninterrupted run."""
    clean = make_trainer(nodes, corpus_dir)
    try:
        clean_losses = {h["step"]: h["loss"] for h in clean.fit(12)}
    finally:
        clean.shutdown()
    store = str(tmp_path / "ckpts")
    t = make_trainer(nodes, corpus_dir, f"durable.storage_path={store}", "durable.every=1",
                     "chaos.events=[{step: 10, kill: node, stage: 1}, {step: 10, kill: node, stage: 3}]")

    def settle(record):
        if record["step"] == 7:  # the snapshots in flight commit and one of them is flushed
            t.snapshots.poll(block=True, timeout=60)
            t.durable.poll(block=True, timeout=60)
            assert t.durable.latest() is not None

    try:
        losses = {h["step"]: h["loss"] for h in t.fit(12, on_step=settle)}
        recs = t.recoveries
    finally:
        t.shutdown()
    assert sorted((r["stage"], r["source"]) for r in recs) == [(1, "durable"), (3, "durable")]
    assert all(r["lossless"] and "durable checkpoint of step" in r["reason"] and "parity covers 1" in r["reason"] for r in recs)
    assert 0 < recs[0]["rollback_steps"] <= 9
    assert losses == clean_losses


def test_snapshot_every_auto_settles_where_the_overhead_budget_says(nodes, corpus_dir, tmp_path):
    """Each stage's snapshot copy is made 0.2 s slower (a snapshot of known cost): the interval
    chosen is the smallest keeping that cost under 2% of the measured step time. (auto begins
    at every 8: the version of step 8 is not a sample, step 16's is, once it committed and the 2
    steps after it and a clean one ran: by step 21 on a quiet machine; 40 leaves room for a
    loaded one.)"""
    delay = 0.2
    t = make_trainer(nodes, corpus_dir, "snapshot.every=auto", "snapshot.max_overhead_pct=2", f"chaos.snapshot_delay_s={delay}", metrics_out=tmp_path / "m.jsonl")
    try:
        history = t.fit(40)
        every = t.snapshots.every
    finally:
        t.shutdown()
    changes = [json.loads(line) for line in open(tmp_path / "m.jsonl") if '"snapshot_every"' in line and '"event"' in line]
    assert changes and changes[-1]["every"] == every == history[-1]["snapshot_every"]
    last = changes[-1]  # the decision in force: its measured inputs
    cost, step_s = last["cost_s"], last["step_s"]
    assert delay <= last["parts_s"] < delay + 0.3  # one stage per node (SPREAD): the delay + the manager's CPU
    assert cost >= delay  # the known cost is a floor of what was charged (the run may feel more)
    assert every == cadence.snapshot_every(cost, step_s, 2.0) and "budget 2%" in last["why"]
    assert every >= math.ceil(delay / (step_s * 0.02)) > 1


def test_durable_every_auto_follows_young_daly(nodes, corpus_dir, tmp_path):
    """durable.every: auto flushes the first committed snapshot to measure the cost, then flushes
    every sqrt(2 x cost x MTBF) seconds' worth of snapshots (MTBF: durable.mtbf_h until a failure)."""
    store = str(tmp_path / "ckpts")
    t = make_trainer(nodes, corpus_dir, f"durable.storage_path={store}", "durable.every=auto", "durable.mtbf_h=0.001", metrics_out=tmp_path / "m.jsonl")
    try:
        history = t.fit(10)
    finally:
        t.shutdown()
    events = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    chosen = [e for e in events if e.get("event") == "durable_every"]
    assert chosen, "no interval was chosen after the first flush"
    c = chosen[-1]
    assert c["mtbf_s"] == pytest.approx(3.6) and c["interval_s"] == pytest.approx(cadence.young_daly_s(c["flush_cost_s"], 3.6))
    assert c["every"] == cadence.flush_every(c["interval_s"], c["snapshot_every"], c["step_s"])
    assert "sqrt(2 x" in c["why"] and "no failure yet" in c["why"]
    assert [e for e in events if e.get("event") == "durable"] and all(h["durable_every"] >= 1 for h in history)
