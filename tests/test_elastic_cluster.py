"""Elastic width on a real loopback cluster: shrink, grow, drain, and what a resize does to the math.

One ``ray.cluster_utils.Cluster`` (a head without CPUs + 4 worker nodes of 1 CPU each) shared by
the module; each test starts from 4 live worker nodes. Runs have 2 stages; with ``dp=2`` the 4
stage actors fill the cluster (SPREAD: one per node), so a lost node leaves no room and the
broken replica must be dropped; nodes added later give room to grow back. Nodes are removed
and added from the main thread while the run trains in another one (as an autoscaler would),
and a drain is asked for by the real ``elastic-llm spot-watcher`` process on a spot interruption
notice served by a fake EC2 metadata service on 127.0.0.1 (``FakeIMDS``).
"""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import ray

from elastic_llm.config import load_config
from elastic_llm.runtime.ray_runtime import ray_trainer
from elastic_llm.snapshot.erasure import checksum
from elastic_llm.snapshot.groups import exposed
from elastic_llm.runtime.session import add_loopback_node, loopback_cluster
from elastic_llm.runtime.drains import draining_nodes, request_drain
from elastic_llm.data import open_run_data
from elastic_llm.snapshot.records import ShardKey

from .conftest import REPO, events, live_workers, undisturbed_losses, wait_until
from .numerics import assert_loss_close, assert_within_envelope, reference_steps
from .test_spot_watcher import FakeIMDS

pytestmark = pytest.mark.timeout(300)
WORKERS = 4
CLEAN_STEPS = 80  # steps of the undisturbed run: more than the drained runs take (67 measured; 0.1-0.3 s each); a run past it gets its own (clean_losses)
BASE = [
    "model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4",
    "parallel.stages=2", "parallel.microbatches=2", "parallel.cpus_per_actor=1",
    "parallel.placement_strategy=SPREAD", "train.batch_size=8", "train.eval_every=0",
    "snapshot.group_size=4", "snapshot.parity=1", "recovery.capacity_report_s=1",
    "elastic.min_replicas=1", "elastic.max_replicas=2", "elastic.grow_check_s=1",
    "recovery.standby=0",  # new processes and stage spares take lost or drained places here; warm standbys: test_standby_cluster.py
]


@pytest.fixture(scope="module")
def cluster():
    c = loopback_cluster(WORKERS, 1)
    yield c
    ray.shutdown()
    c.shutdown()




@pytest.fixture
def nodes(cluster):
    """Exactly WORKERS live worker nodes of 1 CPU, none draining."""
    draining = set(draining_nodes())
    for node in list(cluster.worker_nodes):
        if node.node_id in draining:
            cluster.remove_node(node)
    while len(cluster.worker_nodes) > WORKERS:
        cluster.remove_node(list(cluster.worker_nodes)[-1])
    while len(cluster.worker_nodes) < WORKERS:
        add_loopback_node(cluster, 1)
    cluster.wait_for_nodes()
    wait_until(lambda: live_workers() == WORKERS, 60, "worker nodes coming up")
    return cluster


def make_trainer(cluster, corpus_dir, tmp_path, *extra):
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}", *extra])
    return ray_trainer(cfg, cluster=cluster, metrics_out=tmp_path / "metrics.jsonl")


def node_of(cluster, node_id):
    return next(n for n in cluster.worker_nodes if n.node_id == node_id)


class Background:
    """``trainer.fit(steps)`` in a thread, recording the data position after every step; the
    test thread plays the autoscaler (Cluster.add_node/remove_node must run on the main thread)."""

    def __init__(self, trainer, steps):
        self.t = trainer
        self.positions = []
        self.result = {}
        self.thread = threading.Thread(target=self._fit, args=(steps,), daemon=True)
        self.thread.start()

    def _fit(self, steps):
        try:
            self.result["history"] = self.t.fit(steps, on_step=lambda r: self.positions.append((r["step"], dict(self.t.stream.state_dict()))))
        except BaseException as e:  # reported by join()
            self.result["error"] = e

    def steps_after(self, started, what, steps=3):
        """Once ``started()`` holds (or the run failed), ``steps`` more steps; then stop the run
        and return its history."""
        wait_until(lambda: started() or "error" in self.result, 120, what)
        mark = self.t.step
        wait_until(lambda: self.t.step >= mark + steps or "error" in self.result, 120, f"{steps} steps after {what}")
        self.t.request_stop()
        return self.join()

    def join(self, seconds=240):
        self.thread.join(timeout=seconds)
        assert not self.thread.is_alive(), f"training did not finish within {seconds} s (state {self.t.state.name})"
        assert "error" not in self.result, self.result.get("error")
        return self.result["history"]


def assert_stream_in_order(positions, batch_size):
    """Every step took the next batch: no window skipped or read twice (epoch 0 throughout)."""
    assert positions, "no step completed"
    for step, pos in positions:
        assert pos == {"epoch": 0, "index": step * batch_size}, (step, pos)


@pytest.fixture(scope="module")
def clean_dp1(cluster, corpus_dir, tmp_path_factory):
    """An undisturbed dp=1 run: its losses, and the parameters after its first step."""
    t = make_trainer(cluster, corpus_dir, tmp_path_factory.mktemp("clean"), "parallel.dp=1", "elastic.max_replicas=1", "snapshot.enabled=false")
    try:
        first = t.fit(1)
        params = [ray.get(t.actors[0][s].parameters.remote(), timeout=60) for s in range(2)]
        history = t.fit(CLEAN_STEPS)
        return {"losses": {h["step"]: h["loss"] for h in history}, "step1_loss": first[0]["loss"], "step1_params": params}
    finally:
        t.shutdown()


def clean_losses(clean, steps, nodes, corpus_dir):
    """The undisturbed dp=1 run's losses up to ``steps``: the shared run's, or where a machine
    fast enough trained past it (within a notice or a deadline, steps are counted by the clock), a
    longer undisturbed run's, so a faster machine never fails the comparison."""
    if steps <= CLEAN_STEPS:
        return clean["losses"]
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}", "parallel.dp=1", "elastic.max_replicas=1"])
    return undisturbed_losses(nodes, cfg, steps)


def test_one_step_at_width_1_and_at_width_2_are_the_float64_step_within_rounding(nodes, corpus_dir, tmp_path, clean_dp1):
    """Width 2 splits the batch over two replicas and sums their gradients: the same step as width
    1 in another float32 order. Both must be the step computed in float64 within the rounding
    envelope of tests/numerics.py (a bound that holds on any CPU's kernels; "within 1e-6 of each
    other" held on Intel and failed on AMD EPYC, issue 35), and the two replicas hold the same bits."""
    t = make_trainer(nodes, corpus_dir, tmp_path, "parallel.dp=2")
    try:
        ref = reference_steps(t.cfg, [first_batch(t.cfg)])
        [record] = t.fit(1)
        assert record["dp"] == 2
        assert_loss_close(clean_dp1["step1_loss"], ref.losses[0], "width 1 loss")
        assert_loss_close(record["loss"], ref.losses[0], "width 2 loss")
        for s in range(2):
            assert_within_envelope(clean_dp1["step1_params"][s], ref, s, "width 1")
            got = [ray.get(t.actors[r][s].parameters.remote(), timeout=60) for r in range(2)]
            assert_within_envelope(got[0], ref, s, "width 2")
            for name in got[0]:
                np.testing.assert_array_equal(got[1][name], got[0][name], err_msg=f"replica 1 stage {s} {name}")
    finally:
        t.shutdown()


def first_batch(cfg):
    """The batch a run of ``cfg`` trains its first step on (its data stream from the start)."""
    d = cfg.data
    return open_run_data(d.dir, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size, d.val_fraction, d.tokenizer, d.tokenizer_file).train.next_batch(cfg.train.batch_size)


@pytest.mark.slow  # 60-130 s; the suite's resize soak (test_soak.py) shrinks without room and grows back too
def test_a_lost_node_without_room_shrinks_without_rollback_then_two_new_nodes_grow_it_back(nodes, corpus_dir, tmp_path):
    t = make_trainer(nodes, corpus_dir, tmp_path, "parallel.dp=2")
    run = Background(t, 1000)  # stopped below, once it has grown back
    try:
        wait_until(lambda: t.step >= 3, 120, "three steps")
        nodes.remove_node(node_of(nodes, t.group.nodes[ShardKey(1, 1)]))
        wait_until(lambda: events(tmp_path, "resize"), 120, "the shrink")
        assert t.group.width == 1
        shrunk_at = t.step
        for _ in range(2):
            add_loopback_node(nodes, 1)
        wait_until(lambda: len(events(tmp_path, "resize")) >= 2, 120, "growing back")
        grown_at = t.step
        wait_until(lambda: t.step >= grown_at + 3, 60, "three steps at width 2")
        t.request_stop()
        history = run.join()
    finally:
        t.shutdown()
    resizes = [(e["from_dp"], e["to_dp"]) for e in events(tmp_path, "resize")]
    assert resizes == [(2, 1), (1, 2)]
    assert [e["reason"] for e in events(tmp_path, "resize")] == ["lost stages could not be placed", "capacity"]
    assert all(r["rollback_steps"] == 0 for r in events(tmp_path, "recovery"))
    assert [h["step"] for h in history] == list(range(1, len(history) + 1))  # no step replayed
    assert history[shrunk_at]["dp"] == 1 and history[-1]["dp"] == 2
    assert_stream_in_order(run.positions, 8)
    losses = [h["loss"] for h in history]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])


@pytest.mark.slow  # 23 s; the policy test of the same name and the simulated fleets keep it in the suite
def test_two_nodes_lost_at_once_beyond_parity_with_a_whole_replica_left_shrinks(nodes, corpus_dir, tmp_path):
    t = make_trainer(nodes, corpus_dir, tmp_path, "parallel.dp=2")
    run = Background(t, 10)
    try:
        wait_until(lambda: t.step >= 3, 120, "three steps")
        doomed = {t.group.nodes[ShardKey(s, 1)] for s in range(2)}
        assert len(doomed) == 2  # SPREAD: replica 1 on two nodes of its own
        for node_id in doomed:  # two of the four nodes of the erasure group: more than parity 1 covers
            nodes.remove_node(node_of(nodes, node_id))
        history = run.join()
    finally:
        t.shutdown()
    assert [(e["from_dp"], e["to_dp"]) for e in events(tmp_path, "resize")] == [(2, 1)]
    assert all(r["rollback_steps"] == 0 for r in events(tmp_path, "recovery"))
    assert history[-1]["step"] == 10 and history[-1]["dp"] == 1
    assert_stream_in_order(run.positions, 8)


def test_two_replicas_broken_at_once_without_room_merge_into_one_whole_replica_with_no_new_process(nodes, corpus_dir, tmp_path, clean_dp1):
    """Borrow and merge on Ray: the nodes of stage 0 of replica 0 and stage 1 of replica 1 go
    together while the run is held between steps; no replica is whole and no slot is free. The
    survivors of the two form one whole replica: old replica 1's stage 0 takes replica 0's lost
    place (its process, state and placement group), nothing restarts, nothing rolls back, and
    the run goes on at width 1 with the losses of an undisturbed width-1 run (within float32
    rounding: the first steps summed two replicas' gradients)."""
    t = make_trainer(nodes, corpus_dir, tmp_path, "parallel.dp=2")
    held, go = threading.Event(), threading.Event()

    class Held(Background):
        def _fit(self, steps):
            def on_step(r):
                self.positions.append((r["step"], dict(self.t.stream.state_dict())))
                if r["step"] == 3:
                    held.set()
                    go.wait(120)
            try:
                self.result["history"] = self.t.fit(steps, on_step=on_step)
            except BaseException as e:  # reported by join()
                self.result["error"] = e

    run = Held(t, 8)
    try:
        assert held.wait(120), "three steps"
        g = t.group
        doomed = [g.nodes[ShardKey(0, 0)], g.nodes[ShardKey(1, 1)]]
        assert len(set(g.nodes.values())) == 4  # SPREAD: one actor per node, no room left after two go
        pid_of_giver, pid_of_kept = g.pids[ShardKey(0, 1)], g.pids[ShardKey(1, 0)]
        for node_id in doomed:
            nodes.remove_node(node_of(nodes, node_id))
        go.set()
        history = run.join()
    finally:
        go.set()
        t.shutdown()
    assert [(e["from_dp"], e["to_dp"]) for e in events(tmp_path, "resize")] == [(2, 1)]
    recoveries = events(tmp_path, "recovery")
    assert recoveries and all(r["rollback_steps"] == 0 for r in recoveries)
    assert any("borrow and merge" in r["reason"] for r in recoveries), [r["reason"] for r in recoveries]
    assert {t.group.pids[ShardKey(0, 0)], t.group.pids[ShardKey(1, 0)]} == {pid_of_giver, pid_of_kept}  # no new process
    assert [h["step"] for h in history] == list(range(1, 9)) and history[-1]["dp"] == 1
    assert_stream_in_order(run.positions, 8)
    for h in history:
        assert abs(h["loss"] - clean_dp1["losses"][h["step"]]) <= 1e-4 * abs(clean_dp1["losses"][h["step"]]), (h["step"], h["loss"])


NOTICE_S = 60  # the spot notice (EC2 gives 120 s): a stage spare must start within it, also on the loaded 2 cores of the whole suite (30 s was not always enough there)


def test_the_spot_watcher_drains_on_a_notice_so_the_stages_move_first_with_no_rollback_and_identical_losses(nodes, corpus_dir, tmp_path, clean_dp1):
    t = make_trainer(nodes, corpus_dir, tmp_path, "parallel.dp=1", "elastic.max_replicas=1")
    run = Background(t, 10**6)  # stopped below, a few steps after the move
    imds = FakeIMDS()
    watcher = None
    try:
        wait_until(lambda: t.group is not None and ShardKey(0, 0) in t.group.nodes, 120, "the stages placed")
        victim = t.group.nodes[ShardKey(0, 0)]
        with open(tmp_path / "watcher.log", "w") as log:  # started now: its start-up overlaps the first steps
            watcher = subprocess.Popen(
                [sys.executable, "-m", "elastic_llm.cli", "spot-watcher", "--address", nodes.address, "--node-id", victim,
                 "--metadata-url", imds.url, "--interval-s", "0.5"],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            )
        wait_until(lambda: t.step >= 3, 120, "three steps")
        assert t.group.nodes[ShardKey(0, 0)] == victim
        wait_until(lambda: imds.count("GET", 404) > 0 or watcher.poll() is not None, 60, "the watcher polling")
        assert watcher.poll() is None, (tmp_path / "watcher.log").read_text()
        imds.interrupt(NOTICE_S)  # EC2 schedules the interruption 2 min ahead; a shorter notice here
        asked = time.monotonic()
        seen_draining = set()

        def drained():
            seen_draining.update(draining_nodes())
            return bool(events(tmp_path, "drain"))

        # how soon the stages move after a notice is measured by `elastic-llm bench rehome` (its
        # notice_to_moved_s), not bounded here: the wait below is a hang guard on a loaded machine
        wait_until(drained, 10 * NOTICE_S, "the drain")
        try:
            watcher_rc = watcher.wait(timeout=max(1.0, asked + NOTICE_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail("the spot watcher did not exit within the notice's deadline:\n" + (tmp_path / "watcher.log").read_text())
        drains_before_removal = events(tmp_path, "drain")
        nodes.remove_node(node_of(nodes, victim))  # the deadline: the instance goes
        moved_at = t.step
        wait_until(lambda: t.step >= moved_at + 3, 60, "three steps after the move")
        t.request_stop()
        history = run.join()
        # the committed version no longer depends on the victim: no shard or parity of it there, and
        # every stage's committed state comes back from the managers alive (none is rebuilt)
        # bit for bit: every piece as recorded when it was committed (and the stages' state, when
        # the committed version is the run's last step)
        rec = t.parts.snapshots.committed
        assert victim not in {s.node_id for s in rec.shards} and not any(victim in g for g in rec.groups)
        for stage in range(2):
            src = t.parts.snapshots.fetch_stage_state(stage, 0, frozenset())
            assert src.source == "local_smp"
            parts = [np.asarray(p).view(np.uint8) for p in ray.get(list(src.refs), timeout=60)]
            crcs = [p.crc for info in rec.shards if info.key.stage == stage for p in info.pieces]
            assert [checksum(p) for p in parts] == crcs, f"stage {stage}: a piece of the committed version differs from what was committed"
            if rec.version == t.step:
                live = np.asarray(ray.get(t.group.actor(ShardKey(stage, 0)).capture_state.remote(), timeout=60)[0]).view(np.uint8)
                got = np.zeros_like(live)
                for off, part in zip(src.offsets, parts):
                    got[off:off + len(part)] = part
                assert np.array_equal(got, live), f"stage {stage}: the committed state differs from the stage's"
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
            watcher.wait(timeout=10)
        imds.close()
        t.shutdown()
    watcher_log = (tmp_path / "watcher.log").read_text()
    assert watcher_rc == 0, watcher_log
    assert f"Ray accepted the drain of node {victim}" in watcher_log
    assert victim in seen_draining, "Ray never showed the victim as draining"
    [drain] = events(tmp_path, "drain")
    assert drains_before_removal == [drain] and drain["step"] <= moved_at, "the stages were not moved before the node went"
    # the victim hosts one of the two stages and the other nodes have room for it: just that stage moves
    assert drain["node"] == victim and drain["moved"] == 1 and drain["how"] == "stages" and drain["rollback_steps"] == 0
    assert 0 < drain["deadline_s"] <= NOTICE_S
    assert events(tmp_path, "recovery") == []  # the node went after the move: nothing to recover
    assert victim not in t.group.nodes.values()
    want = clean_losses(clean_dp1, len(history), nodes, corpus_dir)
    assert {h["step"]: h["loss"] for h in history} == {k: v for k, v in want.items() if k <= len(history)}


def test_a_node_removed_while_a_recovery_is_planned_onto_it_is_planned_around_with_no_charge_and_identical_losses(nodes, corpus_dir, tmp_path, clean_dp1):
    """Stage 0's actor is killed at step 6 (a fault: charged; recovery.max_failures=1 allows no
    other). The recovery plans to restore it where it was, on its node (its slot and snapshot
    manager are there); after the plan is made and before it is carried out, that node is
    removed. The node's loss is worked around at once and charged to nothing: stage 0 comes
    back from parity on another node, the run goes on with no committed step lost and the
    losses of the undisturbed run, bit for bit."""
    events_ = "{step: 6, kill: stage, stage: 0}, {step: 6, kill: node, stage: 0, during: recovery}"
    t = make_trainer(nodes, corpus_dir, tmp_path, "parallel.dp=1", "elastic.max_replicas=1", "recovery.max_failures=1",
                     "snapshot.every=1", "snapshot.max_lag=1", f"chaos.events=[{events_}]")  # max_lag: a version of step 4 or later is committed by step 6
    try:
        t.setup()
        victim = t.group.nodes[ShardKey(0, 0)]
        history = t.fit(10)
    finally:
        t.shutdown()
    assert victim not in t.group.nodes.values()
    assert t.budget.total == 1 and t.committed_steps_lost == 0
    assert [c["during"] for c in events(tmp_path, "chaos") if c["kill"] == "node"] == ["recovery"]  # the node went after the plan was made
    # around it either way: planned again without the node (a second recovering state), or, when the plan's call into the
    # node's manager fails while it is carried out, the same recovery takes the parity path (seen once in 3 suite runs)
    [rec] = [r for r in events(tmp_path, "recovery") if r["stage"] == 0]
    assert rec["source"] == "parity" and rec["committed_steps_lost"] == 0
    losses = {h["step"]: h["loss"] for h in history}
    assert losses == {k: v for k, v in clean_dp1["losses"].items() if k <= 10}


def test_a_node_removed_while_a_resize_places_a_replica_on_it_is_charged_to_nothing_and_the_run_stays_bit_identical(nodes, corpus_dir, tmp_path, clean_dp1):
    """A dp=1 run with room for a second replica grows into it; once the spare joined the width
    and before its state is copied, the node of its stage 0 is removed. recovery.max_failures=0
    stops a run at its first charged failure: the node's loss is not one. The broken replica is
    dropped, there is no room for another, and the run goes on at width 1 with no committed step
    lost and the losses of the undisturbed width-1 run, bit for bit."""
    t = make_trainer(nodes, corpus_dir, tmp_path, "parallel.dp=1", "elastic.max_replicas=2", "recovery.max_failures=0",
                     "snapshot.every=1", "chaos.events=[{step: 1, kill: node, stage: 0, during: resize}]")
    run = Background(t, 10**6)  # stopped below, a few steps after the strike
    try:
        history = run.steps_after(lambda: events(tmp_path, "chaos"), "the grow and its strike")
    finally:
        t.shutdown()
    [chaos] = events(tmp_path, "chaos")
    assert chaos["during"] == "resize" and chaos["kill"] == "node"
    assert t.budget.total == 0 and t.failures == 0 and t.committed_steps_lost == 0 and t.group.width == 1
    assert live_workers() == WORKERS - 1
    want = clean_losses(clean_dp1, len(history), nodes, corpus_dir)
    assert {h["step"]: h["loss"] for h in history} == {k: v for k, v in want.items() if k <= len(history)}


BURST = ("snapshot.group_size=3", "snapshot.every=4")


def burst_of_two(nodes, corpus_dir, tmp_path, *extra, steps=3):
    """Six worker nodes, erasure groups of 3 (parity 1), a version every 4 steps: once one
    committed, stage 0 replica 0's node and another member of its group get a 2 s notice at once
    and go at its deadline; ``steps`` more steps, then the run stops. Returns (trainer, the two
    nodes, the run's history)."""
    for _ in range(2):
        add_loopback_node(nodes, 1)
    nodes.wait_for_nodes()
    wait_until(lambda: live_workers() == WORKERS + 2, 60, "six worker nodes")
    t = make_trainer(nodes, corpus_dir, tmp_path, *extra, *BURST)
    run = Background(t, 10**6)  # stopped below, a few steps after the nodes went
    try:
        wait_until(lambda: t.parts is not None and t.parts.snapshots.committed is not None or "error" in run.result, 120, "a commit")
        rec = t.parts.snapshots.committed
        first = t.group.nodes[ShardKey(0, 0)]
        victims = [first, next(n for n in rec.group_of(first) if n != first)]
        for v in victims:
            request_drain(v, 2, "test: a burst of two notices")
        time.sleep(2.0)
        for v in victims:
            nodes.remove_node(node_of(nodes, v))  # the deadline: the instances go
        history = run.steps_after(lambda: True, "the nodes went", steps=steps)
    finally:
        t.shutdown()
    return t, victims, history


def test_two_nodes_of_a_three_node_group_drained_at_once_with_a_2_s_notice_early_at_width_1_lose_nothing(nodes, corpus_dir, tmp_path, clean_dp1):
    """Six nodes, erasure groups of 3, parity 1, one replica of 2 stages. Early in the run (once
    step 4's version committed), stage 0's node and another member of its group get a 2 s notice at once and are removed
    at its deadline: beyond the group's parity, and too short for a stage spare to start on this
    machine. The committed version is protected within the notice (its parts on both re-homed,
    or a version without them committed first: steps are short here; the simulated tests hold
    steps longer than the notice), so whatever the drain could not move comes back: no committed
    step lost and the losses of the undisturbed run, bit for bit."""
    t, victims, history = burst_of_two(nodes, corpus_dir, tmp_path, "parallel.dp=1", "elastic.max_replicas=1")
    moved, protected = events(tmp_path, "rehome"), events(tmp_path, "reprotect")
    assert t.committed_steps_lost == 0 and not set(victims) & set(t.group.nodes.values()), (protected, moved)
    assert all(r["source"] in ("local_smp", "parity", "dp_peer") for r in events(tmp_path, "recovery"))
    got = {h["step"]: h["loss"] for h in history}  # (steps re-run after a rollback keep their last loss)
    want = clean_losses(clean_dp1, max(got), nodes, corpus_dir)
    assert got == {k: want[k] for k in got}
    # the committed version depends on the victims within its parity at most: a version taken while a stage still lived on
    # a draining node keeps that stage's own part there (its spare takes over when the node goes), a lost part parity covers
    assert not exposed(t.parts.snapshots.committed.placed, frozenset(victims), 1), t.parts.snapshots.committed.placed
    assert not {m["target"] for m in moved} & set(victims)
    # parts were re-homed at the notice; whether a re-protection was needed (or beat the 2 s deadline) is a race with the
    # versions committing every few 0.1-0.3 s steps (a newer version's copies start over; on a fast machine the moves
    # alone covered the version once, with no re-protect line): not asserted
    assert moved, (protected, moved)


@pytest.mark.slow  # 100 s with its undisturbed width-2 run; the width-1 case below stays in the suite
def test_two_nodes_of_a_three_node_group_drained_at_once_with_a_2_s_notice_at_width_2_lose_nothing(nodes, corpus_dir, tmp_path):
    """The same burst at width 2: six nodes, erasure groups of 3, parity 1, two replicas of 2
    stages (one per node). Once step 4's version committed, stage 0 replica 0's node and another
    member of its group get a 2 s notice at once and are removed at its deadline. The committed
    version's parts on them are re-homed within the notice; what the drain could not move is
    given up at the step boundary before they go and comes back (from a data-parallel peer, or
    the version), the run goes on at width 2 with no
    committed step lost, and its losses are an undisturbed width-2 run's, bit for bit."""
    extra = ("parallel.dp=2", "elastic.max_replicas=2")
    t, victims, history = burst_of_two(nodes, corpus_dir, tmp_path, *extra, steps=4)
    assert t.committed_steps_lost == 0 and not set(victims) & set(t.group.nodes.values())
    assert t.group.width == 2 and all(r["source"] in ("local_smp", "parity", "dp_peer") for r in events(tmp_path, "recovery"))
    # the drain is acted on at a step boundary within the notice (steps of 0.1-0.3 s): too late to move, so the
    # actors on the victims are given up there (every stage has a peer) and no step fails when they go
    assert any("NodeEnding" in r["failure"] for r in events(tmp_path, "recovery")) and t.failures == 0
    assert events(tmp_path, "rehome") and not {m["target"] for m in events(tmp_path, "rehome")} & set(victims)
    got = {h["step"]: h["loss"] for h in history}  # (steps re-run after a rollback keep their last loss)
    (tmp_path / "clean").mkdir()
    clean = make_trainer(nodes, corpus_dir, tmp_path / "clean", *extra, *BURST)
    try:
        want = {h["step"]: h["loss"] for h in clean.fit(max(got))}
    finally:
        clean.shutdown()
    assert got == {k: want[k] for k in got}


@pytest.mark.slow  # 100-110 s; its simulated twins stay (test_sim: a collapse said at the notice and flushed, no version begun that its flush could not save)
def test_every_node_noticed_at_once_is_said_at_the_notice_and_saved_by_an_emergency_flush(nodes, corpus_dir, tmp_path, clean_dp1):
    """A collapse: every worker node gets a 10 s notice at once, so the committed version's parts
    have no live node to go to. At the notice the run says so (a ``stranded`` re-protection line)
    and flushes the committed version to the durable tier (whose own cadence is never due here),
    and each newer one while a flush can end before the nodes do; they go at the deadline, new
    ones come, and the run resumes from the last flush: no committed step lost, the undisturbed
    run's losses bit for bit. (The simulated test holds the
    same on a fleet; this is the real managers' flush and a real restore.)"""
    t = make_trainer(nodes, corpus_dir, tmp_path, "parallel.dp=1", "elastic.max_replicas=1", "snapshot.every=4",
                     f"durable.storage_path={tmp_path / 'durable'}", "durable.every=1000000")
    run = Background(t, 10**6)  # stopped below, a few steps after the resume
    try:
        wait_until(lambda: t.parts is not None and t.parts.snapshots.committed is not None or "error" in run.result, 120, "a commit")
        victims = [n.node_id for n in nodes.worker_nodes]
        noticed = time.time()
        for v in victims:
            request_drain(v, 10, "test: every node at once")
        wait_until(lambda: t.parts.durable.flushed_version >= 0 and t.parts.durable.inflight is None or "error" in run.result, 10, "the emergency flush")
        time.sleep(max(0.0, noticed + 10 - time.time()))  # the run trains on, flushing each newer committed version, until the deadline
        flushed = t.step
        for v in victims:
            nodes.remove_node(node_of(nodes, v))  # the deadline: every instance goes
        for _ in range(WORKERS):
            add_loopback_node(nodes, 1)
        history = run.steps_after(lambda: t.step > flushed + 1 and t.recoveries, "the resume from the durable tier")
    finally:
        t.shutdown()
    said = [r for r in events(tmp_path, "reprotect") if r["how"] == "stranded"]
    assert said and not said[0]["in_time"]
    assert t.committed_steps_lost == 0, events(tmp_path, "recovery")
    assert {r["source"] for r in events(tmp_path, "recovery")} == {"durable"}
    got = {h["step"]: h["loss"] for h in history}  # (steps re-run after the rollback keep their last loss)
    want = clean_losses(clean_dp1, max(got), nodes, corpus_dir)
    assert got == {k: want[k] for k in got}


@pytest.mark.slow  # 25 s; the rung's logic is tested without Ray (test_controller_sim, test_policy)
def test_a_stage_lost_before_the_first_commit_sends_the_run_back_to_its_initial_state_bit_for_bit(nodes, corpus_dir, tmp_path, clean_dp1):
    """No snapshot committed yet (snapshot.every=50) when stage 0 of a width-1 run dies at step
    3: no copy anywhere, and a first stage cannot be rebuilt from its neighbour without mirrors.
    The run began at step 0 and committed nothing since, so every actor starts again from the
    seed's weights on the data's first batch: no committed step lost, and the losses of the
    undisturbed run, bit for bit (this was exit 3, nothing lossless survives)."""
    t = make_trainer(nodes, corpus_dir, tmp_path, "parallel.dp=1", "elastic.max_replicas=1", "snapshot.every=50",
                     "chaos.events=[{step: 3, kill: stage, stage: 0}]")
    try:
        history = t.fit(8)
    finally:
        t.shutdown()
    assert t.committed_steps_lost == 0
    assert {(r["stage"], r["source"], r["rollback_steps"]) for r in events(tmp_path, "recovery")} == {(0, "initial", 2)}
    assert [h["step"] for h in history] == [1, 2, 1, 2, 3, 4, 5, 6, 7, 8]
    assert {h["step"]: h["loss"] for h in history} == {k: v for k, v in clean_dp1["losses"].items() if k <= 8}
    assert [h["loss"] for h in history[:2]] == [h["loss"] for h in history[2:4]]


class Busy:
    def node(self):
        return ray.get_runtime_context().get_node_id()


def test_draining_nodes_reads_what_ray_drain_node_marked(nodes):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    victim = sorted(n.node_id for n in nodes.worker_nodes)[-1]
    # a busy node, as the run's nodes are (Ray may let an idle draining node go at once)
    busy = ray.remote(num_cpus=1)(Busy).options(scheduling_strategy=NodeAffinitySchedulingStrategy(victim, soft=False)).remote()
    assert ray.get(busy.node.remote(), timeout=60) == victim
    request_drain(victim, 30, "test")
    wait_until(lambda: victim in draining_nodes(), 10, "Ray showing the drain")
    seen = draining_nodes()
    assert victim in seen and 20 < seen[victim].seconds_left(time.time()) <= 30
    assert all(n == victim for n in seen)


def test_a_nodes_failure_domain_label_is_what_the_snapshot_groups_spread_over(nodes):
    """A node started with the label cluster.yaml gives it (its availability zone) is known by its
    domain to the snapshot managers' fleet, which the erasure groups are formed from."""
    from elastic_llm.runtime.managers import RayManagers
    from elastic_llm.runtime.session import add_loopback_node
    from elastic_llm.snapshot.groups import DOMAIN_LABELS

    node = add_loopback_node(nodes, 1, labels={DOMAIN_LABELS[0]: "us-east-1b"})
    try:
        nodes.wait_for_nodes()
        domains = RayManagers("elastic-llm-test", "auto").domains()
        assert domains.get(node.node_id) == "us-east-1b"
        assert all(d != "us-east-1b" for n, d in domains.items() if n != node.node_id)
    finally:
        nodes.remove_node(node)
