"""The controller waits for capacity visibly and with a deadline, on a real loopback cluster.

One ``ray.cluster_utils.Cluster`` with exactly the CPUs the run needs (a head without CPUs + 2
worker nodes of 2 CPUs; 4 stage actors of 1 CPU each): when a node is removed for good, the
lost stages' placement-group bundles cannot be re-placed, so the run must wait for capacity,
say what is missing, and either carry on bit for bit when a node joins or stop with exit code 4
at ``recovery.capacity_timeout_s`` with its snapshots intact.
"""

import os
import threading

import pytest
import ray
from ray.util.placement_group import placement_group_table

from elastic_llm.config import load_config
from elastic_llm.controller import RunFailed
from elastic_llm.runtime.ray_runtime import ray_trainer
from elastic_llm.runtime.session import add_loopback_node

from .conftest import REPO, events, loopback_cluster_fixture, top_up, undisturbed_losses, wait_until

pytestmark = pytest.mark.timeout(300)
WORKERS = 2
STEPS = 8
BASE = [
    "model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4",
    "parallel.stages=4", "parallel.microbatches=2", "parallel.cpus_per_actor=1",
    "parallel.placement_strategy=SPREAD", "train.batch_size=4", "train.eval_every=0",
    "snapshot.group_size=2", "snapshot.parity=1", "recovery.capacity_report_s=1",
    "recovery.standby=0",  # new processes replace lost stages here; warm standbys: test_standby_cluster.py
]
LOSE_NODE = "chaos.events=[{step: 5, kill: node, stage: 1}]"


cluster = loopback_cluster_fixture(WORKERS, 2)




@pytest.fixture
def nodes(cluster):
    """Exactly WORKERS live worker nodes: no spare capacity."""
    return top_up(cluster, WORKERS, 2, exact=True)


def make_trainer(cluster, corpus_dir, tmp_path, *extra):
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}", *extra])
    return ray_trainer(cfg, cluster=cluster, metrics_out=tmp_path / "metrics.jsonl")


@pytest.fixture(scope="module")
def clean_losses(cluster, corpus_dir):
    return undisturbed_losses(cluster, load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}"]), STEPS)


def test_lost_node_without_spare_capacity_waits_then_resumes_bit_identically(nodes, corpus_dir, tmp_path, clean_losses):
    t = make_trainer(nodes, corpus_dir, tmp_path, LOSE_NODE)
    result: dict = {}

    def train():  # the run goes on in a thread; this thread plays the autoscaler
        try:
            result["history"] = t.fit(STEPS)
        except BaseException as e:  # reported below
            result["error"] = e

    runner = threading.Thread(target=train, daemon=True)
    runner.start()
    try:
        wait_until(lambda: t.state.name == "waiting_for_capacity" or not runner.is_alive(), 120, "waiting_for_capacity")
        seen_waiting = t.state.name == "waiting_for_capacity"
        if seen_waiting:  # it keeps reporting while nothing can be placed
            wait_until(lambda: t.seconds_by_state.get("waiting_for_capacity", 0) >= 3 and len(events(tmp_path, "waiting_for_capacity")) >= 2,
                       60, "3 s of waiting for capacity, reported twice")
            # the lost stages' reservations were made afresh: none is left for Ray's GCS to re-place
            # in a loop (a group whose node died holds a GCS core at 100% while there is no room)
            states = [pg["state"] for pg in placement_group_table().values()]
            assert "RESCHEDULING" not in states, states
            assert "PENDING" in states, states
        add_loopback_node(nodes, 2)
        runner.join(timeout=180)
        assert not runner.is_alive(), "training did not resume after a node joined"
    finally:
        if runner.is_alive():
            t.shutdown()
    t.shutdown()
    assert "error" not in result, result.get("error")
    history = result["history"]
    assert seen_waiting, "the run never entered waiting_for_capacity"
    waits = events(tmp_path, "waiting_for_capacity")
    assert len(waits) >= 2
    assert all(w["need"] == "2 x {CPU: 1}" for w in waits)
    assert "CPUs free on 1 node" in waits[0]["have"]
    transitions = [(x["old"], x["new"]) for x in events(tmp_path, "state")]
    assert ("recovering", "waiting_for_capacity") in transitions and ("waiting_for_capacity", "recovering") in transitions
    assert t.seconds_by_state["waiting_for_capacity"] >= 3
    assert sorted(r["source"] for r in t.recoveries) == ["parity", "parity"]  # two stages lived on the lost node
    # back to the newest committed version: step 4's if it committed before the node died (the
    # survivors had finished no later step: nothing rolled back), else step 3's (one step)
    assert all(r["rollback_steps"] in (0, 1) and r["committed_steps_lost"] == 0 for r in t.recoveries)
    assert {h["step"]: h["loss"] for h in history} == clean_losses


def test_lost_node_and_no_capacity_within_the_timeout_stops_with_exit_4_and_snapshots_intact(nodes, corpus_dir, tmp_path):
    t = make_trainer(nodes, corpus_dir, tmp_path, LOSE_NODE, "recovery.capacity_timeout_s=4")
    try:
        with pytest.raises(RunFailed) as failed:
            t.fit(STEPS)
        assert failed.value.exit_code == 4
        assert "need 2 x {CPU: 1}" in str(failed.value) and "recovery.capacity_timeout_s=4" in str(failed.value)
        # the failure it was recovering from: the step the node went in (step 5, or 6 when step 5's
        # calls all finished before the node's processes were gone)
        assert t.step in (4, 5) and f"step {t.step + 1}," in str(failed.value)
        assert events(tmp_path, "waiting_for_capacity")
        committed = t.snapshots.committed.version
        assert committed >= 1  # (it may trail step 5 by up to snapshot.max_lag steps)
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        held = [ray.get(m.held.remote(), timeout=30) for node, m in t.snapshots.managers.items() if node in alive]
        assert held and all(h.get(committed) is True for h in held)  # the committed version is still held, committed
    finally:
        t.shutdown()
