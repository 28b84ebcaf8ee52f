"""Warm standby stage processes and instant shrink decisions, on a real loopback Ray cluster with
real kills (SIGKILL of stage and standby processes, node removal). A drain that moves one stage
is the contract suite's (``tests/test_contract.py``, on both runtimes). Lossless recoveries are checked bit for bit against an undisturbed run.

One ``ray.cluster_utils.Cluster`` (a head without CPUs + 3 worker nodes of 2 CPUs) is shared by
the module; nodes removed or drained by a test are replaced before the next one.
"""

import os
import signal
import time

import pytest
import ray

from elastic_llm.config import load_config
from elastic_llm.runtime.placement import PLACE_S
from elastic_llm.runtime.ray_runtime import ray_trainer
from elastic_llm.runtime.session import NODE_STORE_BYTES
from elastic_llm.runtime.standby import CHECK_S
from elastic_llm.snapshot.records import ShardKey

from .conftest import FOUR_SMALL_STAGES, REPO, events, live_workers, loopback_cluster_fixture, top_up, undisturbed_losses, wait_until

pytestmark = pytest.mark.timeout(300)
WORKERS = 3
STEPS = 12
KILL_AT = 8
# 4 stages of one CPU each, spread over 3 nodes of 2 CPUs: two free CPUs, not room for a replica
BASE = [*FOUR_SMALL_STAGES, "snapshot.group_size=3", "recovery.standby=1"]

cluster = loopback_cluster_fixture(WORKERS, 2)


@pytest.fixture
def nodes(cluster):
    return top_up(cluster, WORKERS, 2, exact=True)


def make_trainer(cluster, corpus_dir, tmp_path, *extra):
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}", *extra])
    return ray_trainer(cfg, cluster=cluster, metrics_out=tmp_path / "metrics.jsonl")


def losses(history):
    return {h["step"]: h["loss"] for h in history}


@pytest.fixture(scope="module")
def clean(cluster, corpus_dir):
    top_up(cluster, WORKERS, 2, exact=True)
    return undisturbed_losses(cluster, load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}"]), STEPS)


def standby_pids(trainer, node):
    return set(trainer.parts.standbys.pids(node))


def wait_for_standby(trainer, node, seconds=120):
    wait_until(lambda: trainer.parts.standbys.ready().get(node, 0) >= 1, seconds, f"a warm standby on node {node[:12]}")


def test_killed_stage_adopts_the_standby_on_its_node(nodes, clean, corpus_dir, tmp_path):
    victim = ShardKey(1, 0)
    t = make_trainer(nodes, corpus_dir, tmp_path, f"chaos.events=[{{step: {KILL_AT}, kill: stage, stage: 1, how: sigkill}}]")
    seen = {}

    def on_step(rec):
        # the standby of the victim's node has started before the kill; the first pass only (a
        # rollback to before KILL_AT - 1, when the killed stage's snapshot of it had not arrived,
        # replays that step with the adopted standby already a stage)
        if rec["step"] == KILL_AT - 1 and not seen:
            node = t.group.nodes[victim]
            wait_for_standby(t, node)
            seen.update(node=node, standbys=standby_pids(t, node), actors=set(t.group.pids.values()))

    try:
        got = losses(t.fit(STEPS, on_step=on_step))
        rec = [r for r in t.recoveries if r["stage"] == 1]
        assert [r["source"] for r in rec] == ["local_smp"], t.recoveries
        # adopted: the new stage 1 is the standby's process; no other process was started
        assert t.group.pids[victim] in seen["standbys"], (t.group.pids[victim], seen)
        assert set(t.group.pids.values()) <= seen["actors"] | seen["standbys"]
        assert t.group.nodes[victim] == seen["node"]
        assert rec[0]["actor_s"] > 0 and rec[0]["state_s"] > 0 and rec[0]["plan_s"] > 0
        assert got == clean  # bit for bit
        # a new standby takes the adopted one's place on that node
        wait_until(lambda: bool(standby_pids(t, seen["node"]) - seen["standbys"]), 120, "a new standby after the adoption")
    finally:
        t.shutdown()


def test_idle_standby_killed_is_replaced_and_training_goes_on(nodes, clean, corpus_dir, tmp_path):
    t = make_trainer(nodes, corpus_dir, tmp_path)
    seen = {}

    def on_step(rec):
        if rec["step"] == 3:
            node = t.group.nodes[ShardKey(2, 0)]
            wait_for_standby(t, node)
            (pid,) = standby_pids(t, node)
            os.kill(pid, signal.SIGKILL)
            seen.update(node=node, pid=pid)
        if rec["step"] == 4:  # idle standbys are pinged every CHECK_S at a step boundary: steps can be faster than that
            time.sleep(CHECK_S + 0.5)
        if rec["step"] == 9:  # the pool noticed and started another one
            wait_until(lambda: bool(standby_pids(t, seen["node"]) - {seen["pid"]}), 120, "a replacement standby")

    try:
        got = losses(t.fit(STEPS, on_step=on_step))
        assert not t.recoveries  # the run never noticed
        assert got == clean
        assert any(e.get("lost") for e in events(tmp_path, "standby")), "the dead standby was not noticed"
    finally:
        t.shutdown()


def test_standby_killed_while_being_adopted_replans(nodes, clean, corpus_dir, tmp_path):
    chaos = (
        f"chaos.events=[{{step: {KILL_AT}, kill: stage, stage: 1, how: sigkill}}, "
        f"{{step: {KILL_AT}, kill: standby, stage: 1, during: recovery}}]"
    )
    t = make_trainer(nodes, corpus_dir, tmp_path, chaos)
    seen = {}

    def on_step(rec):
        if rec["step"] == KILL_AT - 1 and not seen:  # the first pass (a rollback may replay it)
            node = t.group.nodes[ShardKey(1, 0)]
            wait_for_standby(t, node)
            seen["standbys"] = standby_pids(t, node)

    try:
        got = losses(t.fit(STEPS, on_step=on_step))
        states = [(e["old"], e["new"]) for e in events(tmp_path, "state")]
        assert ("recovering", "recovering") in states, states  # the adoption failed: observed and planned again
        assert [r["source"] for r in t.recoveries if r["stage"] == 1] == ["local_smp"]
        assert t.group.pids[ShardKey(1, 0)] not in seen["standbys"]  # the dead standby did not become it
        assert got == clean
    finally:
        t.shutdown()


def test_a_removed_node_is_declared_dead_by_the_run_itself(nodes, clean, corpus_dir, tmp_path):
    # the run's node watch (recovery.node_probe_s, default 0.25 s) finds the raylet gone and tells
    # Ray, before Ray's own health checks (here 4 x 0.5 s) would: the death carries its reason

    t = make_trainer(nodes, corpus_dir, tmp_path, f"chaos.events=[{{step: {KILL_AT}, kill: node, stage: 1}}]")
    try:
        got = losses(t.fit(STEPS))
        (start,) = events(tmp_path, "start")
        victim = next(a["node_id"] for a in start["actors"] if (a["stage"], a["replica"]) == (1, 0))
        dead = events(tmp_path, "node_dead")
        assert [(d["node"], d["outcome"]) for d in dead] == [(victim, "refused")], dead
        info = ray._private.worker.global_worker.gcs_client.get_all_node_info()[ray.NodeID.from_hex(victim)]
        assert info.death_info.reason_message.startswith("elastic-llm node watch: the raylet at"), info.death_info
        assert {r["source"] for r in t.recoveries if r["stage"] is not None} <= {"local_smp", "parity"}, t.recoveries
        assert got == clean  # the recovery is lossless: bit for bit
        # loopback nodes are sized for every-step snapshots: the run found none too small
        stores = {n["Resources"]["object_store_memory"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")}
        assert stores == {NODE_STORE_BYTES} and events(tmp_path, "warning") == []
    finally:
        t.shutdown()


def test_shrink_without_free_cpu_is_decided_at_once(nodes, corpus_dir, tmp_path):
    # 3 replicas of 2 one-CPU stages fill the 3 nodes (PACK): a lost node's stages fit nowhere
    t = make_trainer(
        nodes, corpus_dir, tmp_path, "parallel.stages=2", "parallel.dp=3", "parallel.microbatches=1", "train.batch_size=6",
        "parallel.placement_strategy=PACK", "elastic.min_replicas=1", "elastic.max_replicas=3", "snapshot.enabled=false",
        "recovery.standby=0", "chaos.events=[{step: 4, kill: node, stage: 0, replica: 2}]",
    )
    try:
        t.fit(8)
        (resize,) = t.resizes
        assert (resize["from_dp"], resize["to_dp"]) == (3, 2)
        rec = t.recoveries[0]
        assert rec["rollback_steps"] == 0
        assert rec["plan_s"] < PLACE_S, rec  # no placement wait (PLACE_S): Ray's view shows no free CPU at once
        assert t.group.width == 2 and live_workers() == WORKERS - 1
    finally:
        t.shutdown()


def test_a_standby_or_manager_that_rays_scheduler_refuses_declares_its_node_lost(nodes):
    """Ray's scheduler refuses an actor pinned to a node it no longer has. A run whose view still
    held the node (Ray's table, or the run's, lagging) starts a warm standby and a snapshot
    manager there: the standby's refusal declares the node lost in the run's view (a ``node_dead``
    line with outcome ``unschedulable``, no standby started there again), the manager's raises
    :class:`NodeGone` for the coordinator to plan around."""
    from elastic_llm.controller.drains import Outcome
    from elastic_llm.runtime.managers import RayManagers
    from elastic_llm.runtime.ray_runtime import RayNodes
    from elastic_llm.runtime.session import NAMESPACE
    from elastic_llm.runtime.standby import StandbyPool
    from elastic_llm.sources import NodeGone

    node = max(nodes.worker_nodes, key=lambda n: n.node_id)
    victim = node.node_id
    nodes.remove_node(node, allow_graceful=False)
    wait_until(lambda: live_workers() == WORKERS - 1, 60, "Ray seeing the node dead")
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), BASE)
    view = RayNodes()  # no node watch: nothing else tells it of the node
    pool = StandbyPool(cfg, "5e1f00", NAMESPACE, on_gone=view.declare_gone)
    try:
        assert pool.ensure([victim]) == 1
        wait_until(lambda: pool.ready() == {} and victim in view.dead(), 60, "the scheduler's refusal of the standby")
        assert pool.count() == (0, 0) and victim not in view.with_slots() and victim not in view.alive()
        [death] = view.deaths()
        assert (death.node, death.outcome) == (victim, Outcome.UNSCHEDULABLE) and view.deaths() == []
        assert pool.ensure(view.with_slots()) == WORKERS - 1  # the live nodes only
    finally:
        pool.shutdown()
    fleet = RayManagers(NAMESPACE, cfg.snapshot.codec)
    smp = fleet.start(victim, "smp-5e1f00-refused", "5e1f00", 0.0)
    with pytest.raises(NodeGone, match="refused a snapshot manager"):
        fleet.calls.get(smp.held.remote(), timeout=60)
