"""The controller's handlers on the simulated runtime: no Ray, milliseconds per test.

The Trainer runs the same orchestration as on Ray (setup, recovery, elastic moves) on
:class:`~elastic_llm.sim.runtime.SimRuntime`'s ports over a small scripted fleet; only the step
executor is scripted here (steps fail as a test says, the failing stage's process dies), so each
test can aim a failure at one step. Everything else is the real controller: its states,
transitions, failure budget, recovery plans, data stream, metrics lines.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from elastic_llm.config import ConfigError, load_config
from elastic_llm.controller.elastic import MOVE_S
from elastic_llm.controller.trainer import UNTIL_STOPPED, RunFailed, RunUnrecoverable, Trainer
from elastic_llm.pipeline.executor import PendingStep, RayStepExecutor, StepFailed
from elastic_llm.replay.trace import ReplayAction
from elastic_llm.sim.costs import load_costs
from elastic_llm.sim.runtime import SimExecutor, SimNodes, SimPending, SimRuntime
from elastic_llm.sim.snapshots import SimManagers
from elastic_llm.sim.world import EPOCH, Charged, Fleet, SimClock, World
from elastic_llm.snapshot.records import ShardKey

from .conftest import REPO

pytestmark = pytest.mark.timeout(60)


class ScriptedExecutor(SimExecutor):
    """The simulated step, failing as scripted: ``fails`` step -> (attempts that fail, the stage
    that fails them: its process dies, as a SIGKILLed stage's would). Logs every start."""

    def __init__(self, runtime: "ScriptedRuntime", cfg) -> None:
        assert runtime.group_made is not None
        super().__init__(runtime.group_made, cfg)
        self.rt = runtime

    def start(self, step, x, y, snapshot=None, faults=None):
        self.rt.log.append(("start", step, x.copy(), self.group.width))
        return super().start(step, x, y, snapshot, faults)

    def finish(self, pending, timeout=float("inf")):
        left, key = self.rt.fails.get(pending.step, (0, None))
        if left > 0:
            self.rt.fails[pending.step] = (left - 1, key)
            self.group.ready.discard(key)
            raise StepFailed(RuntimeError(f"boom in step {pending.step}"), key.stage, key.replica, "B1")
        return super().finish(pending, timeout)


class ScriptedRuntime(SimRuntime):
    def __init__(self, world, fails) -> None:
        super().__init__(world)
        self.fails, self.log, self.executors = fails, [], []

    def executor(self, actors, cfg, node_of=None, set_aside=frozenset):
        self.executors.append(ScriptedExecutor(self, cfg))
        return self.executors[-1]


def fleet(nodes, slots=2, actions=()):
    clock = SimClock()
    fl = Fleet(clock, tuple(nodes), tuple(actions), slots)
    return World(clock, fl, load_costs("cpu-2core"), Charged())


def make(corpus_dir, tmp_path, *extra, fails=None, nodes=("n0", "n1"), actions=(), slots=2, runtime=None):
    """A 2-stage run of 2 replicas (no snapshots unless ``extra`` turns them on) on ``nodes`` of ``slots`` slots."""
    cfg = load_config(
        os.path.join(REPO, "jobs", "tiny.yaml"),
        [
            "snapshot.enabled=false", "train.eval_every=0", "parallel.stages=2", "parallel.dp=2", "train.batch_size=8",
            "model.seq_len=16", f"data.dir={corpus_dir}", "recovery.capacity_timeout_s=5", "recovery.driver_grace_s=0", *extra,
        ],
    )
    rt = (runtime or ScriptedRuntime)(fleet(nodes, slots, actions), fails if fails is not None else {})
    return Trainer(cfg, rt, metrics_out=tmp_path / "metrics.jsonl"), rt


def test_each_step_executor_takes_back_only_a_step_it_started(corpus_dir, tmp_path):
    """The submitted step the controller holds is opaque to it (``Pending``); handing an executor
    a step another kind of executor started is a bug, named at once rather than read wrongly."""
    t, rt = make(corpus_dir, tmp_path)
    t.fit(1)
    sim = rt.executors[-1]
    assert isinstance(sim, SimExecutor)
    ray_ex = RayStepExecutor([[object()]], "1f1b", 1)
    with pytest.raises(TypeError, match="its own SimPending, not PendingStep"):
        sim.finish(PendingStep(1, 0, 1, 1, {}, ((1,),)))
    with pytest.raises(TypeError, match="its own PendingStep, not SimPending"):
        ray_ex.wait(SimPending(1, 1.0, 1, 1e-3), 0.0)


def states(tmp_path):
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [(x["old"], x["new"]) for x in lines if x.get("event") == "state"]


def test_a_run_of_five_steps_sends_each_step_once_in_order(corpus_dir, tmp_path):
    t, rt = make(corpus_dir, tmp_path)
    history = t.fit(5)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert [e[1] for e in rt.log] == [1, 2, 3, 4, 5]
    assert len(rt.executors) == 1  # one executor for an unchanged membership
    assert history[2]["loss"] == pytest.approx(10.0 / np.sqrt(3))
    assert states(tmp_path) == [("starting", "running"), ("running", "finished")]


def test_a_failed_step_is_recovered_from_a_peer_and_retried_on_the_same_batch(corpus_dir, tmp_path):
    t, rt = make(corpus_dir, tmp_path, fails={3: (1, ShardKey(1, 1))})
    history = t.fit(5)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    attempts = [e for e in rt.log if e[1] == 3]
    assert len(attempts) == 2
    np.testing.assert_array_equal(attempts[0][2], attempts[1][2])  # the data stream was rewound
    assert len(rt.executors) == 2  # a new executor over the new membership
    assert ("running", "recovering") in states(tmp_path) and ("recovering", "running") in states(tmp_path)
    [rec] = t.recoveries
    assert (rec["stage"], rec["replica"], rec["source"], rec["rollback_steps"]) == (1, 1, "dp_peer", 0)
    assert rec["failure"] == "step 3, stage 1 replica 1 failed: RuntimeError: boom in step 3 (in B1)"
    assert rec["actor_s"] >= load_costs("cpu-2core").actor_start_s  # a new process started for it (simulated seconds)


def test_the_same_failure_every_time_stops_after_the_retries_with_exit_4(corpus_dir, tmp_path):
    t, rt = make(corpus_dir, tmp_path, "recovery.max_retries_per_step=2", fails={2: (99, ShardKey(1, 1))})
    with pytest.raises(RunFailed) as err:
        t.fit(5)
    assert err.value.exit_code == 4 and "boom in step 2" in str(err.value)
    assert [e[1] for e in rt.log] == [1, 2, 2, 2]  # the first attempt and two retries
    assert t.step == 1


def test_the_failure_budget_stops_the_run(corpus_dir, tmp_path):
    fails = {2: (1, ShardKey(1, 1)), 3: (1, ShardKey(1, 1)), 4: (1, ShardKey(1, 1))}
    t, _ = make(corpus_dir, tmp_path, "recovery.max_failures=2", fails=fails)
    with pytest.raises(RunFailed) as err:
        t.fit(6)
    assert err.value.exit_code == 4 and t.failures == 3 and t.step == 3


def test_a_lost_stage_with_no_copy_anywhere_fails_with_exit_3(corpus_dir, tmp_path):
    """One replica, no snapshots, no mirrors of the last stage's head: nothing holds stage 1's
    state and CheckFree+ cannot rebuild it."""
    t, _ = make(corpus_dir, tmp_path, "parallel.dp=1", "elastic.max_replicas=1", "checkfree.mirror_every=0", fails={2: (1, ShardKey(1, 0))})
    with pytest.raises(RunUnrecoverable) as err:
        t.fit(4)
    assert err.value.exit_code == 3 and "stage 1" in str(err.value)


def test_a_source_found_gone_while_a_plan_is_carried_out_re_plans_without_charging_the_budget(corpus_dir, tmp_path):
    """The executor meets a source the plan named and finds it gone (a shard that fails its
    checksums on its node): it raises instead of picking another source itself; the controller
    observes again and plans anew. The run learnt something, it did not fail again: with no
    retries allowed per step, a charge would have stopped it."""
    from elastic_llm.sources import SourceLost

    t, _ = make(corpus_dir, tmp_path, "recovery.max_retries_per_step=1", fails={3: (1, ShardKey(1, 1))})
    t.setup()
    recovery = t.parts.recovery
    carry_out, observe, met, observed = recovery.execute, recovery.observe, [], []

    def execute(plan, obs, step):
        if len(met) < 2:  # two sources found gone, one after the other
            met.append(plan)
            raise SourceLost(f"source {len(met)} failed to load on its node")
        return carry_out(plan, obs, step)

    recovery.execute = execute
    recovery.observe = lambda executor, step, **kw: observed.append(step) or observe(executor, step, **kw)
    history = t.fit(5)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert observed == [3, 3, 3]  # observed again after each
    assert t.budget.total == 1 and t.budget.of_step(3) == 1  # the step's failure alone
    assert [(r["stage"], r["replica"]) for r in t.recoveries] == [(1, 1)]


def test_no_capacity_at_start_waits_then_runs(corpus_dir, tmp_path):
    """Two nodes of two slots hold one replica of two stages ... and a third comes at second 5."""
    t, _ = make(corpus_dir, tmp_path, "parallel.dp=2", nodes=("n0",), actions=[ReplayAction(5.0, "add", "n1")])
    history = t.fit(2)
    assert [h["step"] for h in history] == [1, 2]
    assert states(tmp_path)[:2] == [("starting", "waiting_for_capacity"), ("waiting_for_capacity", "starting")]
    assert t.seconds_by_state["waiting_for_capacity"] >= 5


def test_capacity_that_never_comes_fails_at_the_deadline(corpus_dir, tmp_path):
    t, _ = make(corpus_dir, tmp_path, "recovery.capacity_timeout_s=3", nodes=("n0",))
    with pytest.raises(RunFailed) as err:
        t.fit(2)
    assert "capacity" in str(err.value) and t.step == 0


def test_room_for_another_replica_grows_the_run_and_rebuilds_the_executor(corpus_dir, tmp_path):
    t, rt = make(corpus_dir, tmp_path, "elastic.max_replicas=3", "elastic.grow_check_s=0.5", "train.batch_size=24", nodes=("n0", "n1", "n2"))
    history = t.fit(40)
    assert [(r["from_dp"], r["to_dp"]) for r in t.resizes] == [(2, 3)]
    assert [h["step"] for h in history] == list(range(1, 41))
    widths = [e[3] for e in rt.log]
    grew = widths.index(3)
    assert set(widths[:grew]) == {2} and set(widths[grew:]) == {3} and len(rt.executors) == 2


def test_a_draining_node_is_evacuated_between_steps_without_rollback(corpus_dir, tmp_path):
    """Node n1 (both stages of replica 1) gets a 30 s notice; a free node takes the replica whole."""
    t, rt = make(corpus_dir, tmp_path, nodes=("n0", "n1", "n2"), actions=[ReplayAction(3.0, "drain", "n1", 30.0), ReplayAction(33.0, "remove", "n1")])
    history = t.fit(80)
    assert [h["step"] for h in history] == list(range(1, 81))  # nothing replayed
    [drain] = t.drains
    assert drain["node"] == "n1" and drain["moved"] == 2 and drain["how"] == "replica" and drain["rollback_steps"] == 0
    assert t.recoveries == [] and ("running", "draining") in states(tmp_path)
    assert "n1" not in t.group.nodes.values() and t.group.width == 2


def test_a_move_that_ends_after_its_node_is_gone_fails_and_is_recovered(corpus_dir, tmp_path):
    """A move copies the stage's state while its node lives: with a notice shorter than the time
    the spares take to start plus the copy, the node goes first. The simulated move fails as on Ray
    (its source died mid-copy) instead of counting as done, and the run recovers the lost stages."""
    t, rt = make(corpus_dir, tmp_path, nodes=("n0", "n1", "n2"), actions=[ReplayAction(3.0, "drain", "n1", 4.0), ReplayAction(7.0, "remove", "n1")])
    history = t.fit(60)
    assert history[-1]["step"] == 60
    assert not any(d["moved"] for d in t.drains)  # no move is counted that could not finish while n1 lived
    assert {r["replica"] for r in t.recoveries} == {1} and all(r["source"] == "dp_peer" for r in t.recoveries)


def test_a_runtime_without_snapshot_managers_refuses_a_durable_tier(corpus_dir, tmp_path):
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [f"data.dir={corpus_dir}", f"durable.storage_path={tmp_path / 'ck'}"])
    rt = SimRuntime(fleet(["n0"]))
    rt.fleet = None
    with pytest.raises(ConfigError, match="durable.storage_path"):
        Trainer(cfg, rt)


def test_an_open_ended_run_shows_its_steps_without_a_total(corpus_dir, tmp_path):
    import io

    from elastic_llm.controller.progress import ProgressBar

    t, _ = make(corpus_dir, tmp_path)
    out = io.StringIO()  # not a terminal: plain lines
    t.bar = ProgressBar(True, "tiny", stream=out)
    history = t.fit(UNTIL_STOPPED, on_step=lambda r: t.request_stop() if r["step"] == 3 else None)
    assert [h["step"] for h in history] == [1, 2, 3]
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["tiny: step 1", "tiny: step 3"] and str(UNTIL_STOPPED) not in out.getvalue()


def test_a_drain_whose_stage_spare_is_late_keeps_the_replica_and_the_recovery_takes_the_spare(corpus_dir, tmp_path):
    """One slot per node: stage 1 of replica 1 on n3 gets a 4 s notice, shorter than a process
    start (4.8 s on cpu-2core). Its stage spare is late for the move, so the replica stays (the
    fleet has room: nothing is dropped) and the spare is kept; at the last step boundary before
    n3 goes its actor is given up (no step fails), takes the spare's place (only the rest of its
    start is waited for) and a peer's state."""
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [
        "snapshot.enabled=false", "train.eval_every=0", "parallel.stages=2", "parallel.dp=2", "train.batch_size=8",
        "model.seq_len=16", f"data.dir={corpus_dir}", "recovery.capacity_timeout_s=5", "recovery.driver_grace_s=0",
        "elastic.min_replicas=1"])  # it could shrink, but must not: there is room
    nodes = ("n0", "n1", "n2", "n3", "n4", "n5")
    rt = ScriptedRuntime(fleet(nodes, slots=1, actions=[ReplayAction(3.0, "drain", "n3", 4.0), ReplayAction(7.0, "remove", "n3")]), {})
    t = Trainer(cfg, rt, metrics_out=tmp_path / "metrics.jsonl")
    history = t.fit(60)
    assert history[-1]["step"] == 60 and t.group.width == 2 and t.resizes == []  # nothing dropped
    first, last = t.drains  # acted on at the notice (it stays), and again at the last look before n3 goes
    assert first["dropped"] == 0 and first["stayed"] == 1 and last["deadline_s"] < 2.0
    [rec] = t.recoveries  # given up at that look: no step failed, nothing charged
    assert (rec["stage"], rec["replica"], rec["source"]) == (1, 1, "dp_peer") and "NodeEnding" in rec["failure"] and t.failures == 0
    assert rec["actor_s"] < load_costs("cpu-2core").actor_start_s  # the spare had been starting since the notice
    assert "n3" not in t.group.nodes.values() and not t.group.spares.of()


def test_a_replica_without_room_trains_on_until_the_last_step_boundary_before_its_node_goes_and_is_given_up_there(corpus_dir, tmp_path):
    """One slot per node and no free node: n3 (stage 1 of replica 1) gets a 10 s notice, many
    steps long. Its replica stays and trains on; at the last step boundary before n3 goes
    (within a step and MOVE_S of its end) its actor is given up and the recovery drops the
    replica, so no step fails when n3 goes: nothing is charged and no step's work is lost."""
    t, _ = make(corpus_dir, tmp_path, "elastic.min_replicas=1", nodes=("n0", "n1", "n2", "n3"), slots=1,
                actions=[ReplayAction(3.0, "drain", "n3", 10.0), ReplayAction(13.0, "remove", "n3")])
    history = t.fit(60)
    assert history[-1]["step"] == 60 and t.group.width == 1 and "n3" not in t.group.nodes.values()
    first, last = t.drains
    assert first["stayed"] == 1 and 0 < last["deadline_s"] <= t.parts.elastic.timer.peek() + MOVE_S
    assert last["step"] > first["step"] + 5  # it trained on in between
    [resize] = t.resizes
    assert (resize["from_dp"], resize["to_dp"]) == (2, 1) and resize["time"] < 1_800_000_013.0  # before n3 went
    assert t.failures == 0 and all("NodeEnding" in r["failure"] and r["rollback_steps"] == 0 for r in t.recoveries)


def test_reclaimed_nodes_do_not_charge_the_failure_budget_but_a_dying_process_does(corpus_dir, tmp_path):
    """recovery.max_failures=0 stops a run at its first failure: two spot reclaims (nodes the
    trace removes, with no notice) are recovered and not charged; a stage process that dies on a
    live node afterwards is a fault, charged, and stops the run with exit 4."""
    actions = [ReplayAction(10.0, "remove", "n1"), ReplayAction(25.0, "remove", "n0")]
    t, rt = make(corpus_dir, tmp_path, "recovery.max_failures=0", nodes=("n0", "n1", "n2", "n3"), actions=actions, fails={400: (1, ShardKey(0, 0))})
    with pytest.raises(RunFailed, match="max_failures=0"):
        t.fit(450)
    assert t.progress.reclaims == 2 and t.failures == 3 and t.budget.total == 1
    assert {r["source"] for r in t.recoveries} == {"dp_peer"} and t.step == 399


def test_a_notice_that_arrives_mid_step_starts_its_spare_at_once_so_the_move_makes_the_deadline(corpus_dir, tmp_path):
    """Steps of ~30 s; n3 (stage 1 of replica 1) gets a 40 s notice during a step. Seen only at
    the step's end, its stage spare (4.8 s to start) would not be ready at that boundary and the
    next boundary comes after the node is gone: the replica stays and is recovered. Looked at
    while the step runs, the spare starts within a second of the notice and the move is made at
    the step's end: no failure, no recovery."""
    import dataclasses

    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [
        "snapshot.enabled=false", "train.eval_every=0", "parallel.stages=2", "parallel.dp=2", "train.batch_size=8",
        "model.seq_len=16", f"data.dir={corpus_dir}", "recovery.capacity_timeout_s=5", "recovery.driver_grace_s=0", "elastic.min_replicas=1"])
    clock = SimClock()
    costs = dataclasses.replace(load_costs("cpu-2core"), allreduce_s=30.0)
    actions = (ReplayAction(40.0, "drain", "n3", 40.0), ReplayAction(80.0, "remove", "n3"))
    rt = ScriptedRuntime(World(clock, Fleet(clock, ("n0", "n1", "n2", "n3", "n4", "n5"), actions, 1), costs, Charged()), {})
    t = Trainer(cfg, rt, metrics_out=tmp_path / "metrics.jsonl")
    history = t.fit(8)
    assert [h["step"] for h in history] == list(range(1, 9))
    assert [(d["moved"], d["stayed"], d["how"]) for d in t.drains] == [(1, 0, "stages")]
    assert t.recoveries == [] and "n3" not in t.group.nodes.values()


def test_a_node_cut_off_mid_step_is_suspected_the_step_fails_at_the_suspect_deadline_and_its_stage_moves(corpus_dir, tmp_path):
    """After step 3, n3 (stage 1 of replica 1; one slot per node) stops answering the driver. The
    node watch's probes time out (0.25 s apart, 0.5 s each): three in a row make it a suspect
    while step 4 runs, which gives step 4 the suspect deadline from then (30 s, not the
    executor's 900 s). The recovery does not wait for the suspect's actor (60 s on Ray) and puts
    stage 1 of replica 1 on a free node off it; the failure is charged (a silent node is not a
    reclaim), and a node_dead line comes only when the node is removed."""
    t, rt = make(corpus_dir, tmp_path, "elastic.min_replicas=1", nodes=tuple(f"n{i}" for i in range(6)), slots=1)
    cut = {}

    def on_step(rec):
        if rec["step"] == 3:
            cut.update(node=t.group.nodes[ShardKey(1, 1)], at=rt.clock.now)
            rt.world.fleet.play(ReplayAction(rt.clock.now, "cut", cut["node"]))
        if rec["step"] == 6:
            rt.world.fleet.play(ReplayAction(rt.clock.now, "remove", cut["node"]))

    history = t.fit(8, on_step=on_step)
    assert [h["step"] for h in history] == list(range(1, 9)) and cut["node"] == "n3"
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    failed = next(x["time"] - EPOCH for x in lines if x.get("event") == "state" and x["new"] == "recovering")
    suspected = 3 * (0.25 + 0.5)  # the third timed-out probe
    assert 30.0 <= failed - cut["at"] <= 30.0 + suspected + 2.0, failed - cut["at"]
    [rec] = t.recoveries
    assert rec["source"] == "dp_peer" and rec["seconds"] < 10.0  # the suspect's actor was not waited for
    assert t.group.nodes[ShardKey(1, 1)] not in {"n3"} and t.budget.total == 1
    [dead] = [x for x in lines if x.get("event") == "node_dead"]
    assert dead["node"] == "n3" and dead["outcome"] == "refused" and dead["failures"] > 3 and dead["step"] >= 6


def test_a_used_standby_is_replaced_after_the_first_step_of_the_resumed_run_not_beside_it(corpus_dir, tmp_path):
    """A recovery adopts a warm standby; the new standby that takes its place starts once the run
    has completed a step after the recovery (a process start competes with that step's CPU)."""
    t, rt = make(corpus_dir, tmp_path, "recovery.standby=1", fails={25: (1, ShardKey(1, 1))}, slots=3)  # a free slot per node: a standby each
    rt.standbys_per_node = 1
    t.fit(27)  # the standbys are ready long before step 25
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    [rec] = t.recoveries
    assert rec["source"] == "dp_peer" and rec["actor_s"] < load_costs("cpu-2core").actor_start_s  # the standby was adopted
    after = [x for x in lines if x.get("event") == "standby" and x.get("started") and x["time"] >= rec["time"]]
    assert [x["step"] for x in after[:1]] == [25]  # resumed at step 24's boundary; step 25 completed first


def test_where_a_start_takes_no_steps_cpu_a_used_standby_is_replaced_at_once(corpus_dir, tmp_path):
    """With a device per actor (no shared cores, as on GPUs) a process start competes with no
    step: the used standby's replacement starts at the recovery's own step boundary, so a burst's
    next recovery finds it ready sooner (fleet seed 1 at 30 s notices: 0.945 -> 0.951 of the oracle)."""
    from dataclasses import replace

    t, rt = make(corpus_dir, tmp_path, "recovery.standby=1", fails={250: (1, ShardKey(1, 1))}, slots=3)  # (steps are shorter without shared cores)
    rt.standbys_per_node = 1
    rt.world.costs = replace(rt.world.costs, cores=0.0)
    t.fit(252)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    [rec] = t.recoveries
    after = [x for x in lines if x.get("event") == "standby" and x.get("started") and x["time"] >= rec["time"]]
    assert rec["actor_s"] < load_costs("cpu-2core").actor_start_s and [x["step"] for x in after[:1]] == [249]  # at the resumed run's first boundary


class _RemovingFaults:
    """Fault injection's ``recovery`` point, simulated: the node ``pick()`` names goes at once
    (between the recovery's plan and its execution), while Ray's node table (``StaleManagers``)
    still lists it."""

    def __init__(self, world, pick) -> None:
        self.world, self.pick, self.removed = world, pick, None

    def fire(self, point, step, targets):
        if point == "recovery" and self.removed is None:
            fleet = self.world.fleet
            self.removed = self.pick()
            fleet.nodes[self.removed].removed_s = fleet.clock.now
            fleet.removal_of[self.removed] = fleet.clock.now
            fleet._alive = None

    def observe_step(self, step, seconds, width):
        return None

    def wrap(self, executor, targets):
        return executor


class StaleManagers(SimManagers):
    """Ray's node table as it lags: a removed node is still listed (the scheduler knows better)."""

    def nodes(self):
        return set(self.world.fleet.nodes)


class StaleNodes(SimNodes):
    """The run's view over that table: a removed node is alive until the run declares it gone."""

    def alive(self):
        return set(self.world.fleet.nodes) - self.gone


def test_a_node_that_goes_while_a_recovery_is_carried_out_is_planned_around_and_charged_to_nothing(corpus_dir, tmp_path):
    """A stage process dies (a fault: charged, and recovery.max_failures=1 allows no second one).
    Between the recovery's plan and its execution a node that holds only a snapshot manager goes;
    Ray's node table still lists it, so a new manager is started there and the scheduler refuses
    it. The refusal is the node's death: the plan is made again without it, at once, and the
    budget is not charged (before, every attempt re-placed the manager there and was charged)."""
    t, rt = make(corpus_dir, tmp_path, "snapshot.enabled=true", "snapshot.every=1", "snapshot.group_size=5", "snapshot.parity=1",
                 "recovery.max_failures=1", nodes=("n0", "n1", "n2", "n3", "n4"), slots=1, fails={5: (1, ShardKey(1, 1))})
    rt.fleet, rt.nodes = StaleManagers(rt.world, rt.fleet.calls), StaleNodes(rt.world)
    rt.faults = faults = _RemovingFaults(rt.world, lambda: min(set(rt.world.fleet.alive()) - set(t.group.nodes.values())))
    history = t.fit(8)
    assert [h["step"] for h in history][-4:] == [5, 6, 7, 8]
    gone = faults.removed
    assert gone is not None and gone not in rt.nodes.alive() and gone not in t.snapshots.managers
    assert t.budget.total == 1 and t.failures == 1  # the process death alone
    assert [r["source"] for r in t.recoveries] == ["dp_peer"]
    assert states(tmp_path).count(("recovering", "recovering")) == 1  # planned once more, without the node


def test_a_spare_on_a_node_the_run_knows_dead_does_not_join_while_the_placement_table_still_lists_it(corpus_dir, tmp_path):
    """A spare replica has started on two nodes; the run learns one of them is gone (a refusal
    declared it) while the placement table, lagging, still shows the spare placed and started.
    No grow adopts it: the run stays at its width and nothing fails (before, the grow copied state
    onto the dead node's actors, failed, and was charged)."""
    t, rt = make(corpus_dir, tmp_path, "parallel.dp=1", "elastic.min_replicas=1", "elastic.max_replicas=2", "elastic.grow_check_s=1000000",
                 "recovery.max_failures=0", nodes=("n0", "n1", "n2", "n3"), slots=1)
    t.fit(1)  # the first look saw room for one more replica: its spare starts on the two free nodes
    [spare] = t.group.spares.replicas()
    wait_steps = 0
    while not t.group.spares.ready(spare) and wait_steps < 50:
        t.fit(t.step + 1)
        wait_steps += 1
    assert t.group.spares.ready(spare) and t.group.width == 1
    gone = min(t.group.spares.nodes(spare))
    rt.nodes.declare_gone(frozenset({gone}), "test: refused")
    t.fit(t.step + 5)
    assert t.group.width == 1 and t.failures == 0 and t.recoveries == [] and gone not in t.group.nodes.values()


def test_a_stage_and_its_neighbour_lost_before_the_first_commit_go_back_to_the_initial_state(corpus_dir, tmp_path):
    """A width-1 run loses the node holding both its stages in its first steps, before its first
    snapshot commits (snapshot.every=50): no copy, no CheckFree (a neighbour is
    lost too). It began at step 0 and committed nothing since, so everyone goes back to the initial
    state, on the data's first batch again, and no committed step is lost (this was exit 3)."""
    t, rt = make(corpus_dir, tmp_path, "snapshot.enabled=true", "snapshot.every=50", "parallel.dp=1", "elastic.max_replicas=1", nodes=("n0", "n1"), slots=2,
                 actions=[ReplayAction(6.0, "remove", "n0")])
    history = t.fit(10)
    assert history[-1]["step"] == 10 and t.committed_steps_lost == 0
    assert {r["source"] for r in t.recoveries} == {"initial"} and all(r["rollback_steps"] >= 1 for r in t.recoveries)
    firsts = [e[2] for e in rt.log if e[1] == 1]
    assert len(firsts) == 2  # step 1 ran twice: at the start and again after going back
    np.testing.assert_array_equal(firsts[0], firsts[1])  # on the same batch: the data's start
    assert set(t.group.nodes.values()) == {"n1"}


def test_spare_replicas_started_to_grow_give_their_slots_to_a_recovery_that_needs_them(corpus_dir, tmp_path):
    """Replica 0 fills n0; a spare replica, started to grow into n1, holds n1's slots. n0 goes:
    its stages need two slots and only the spare's exist. The recovery releases the spare and
    restores replica 0 there (it waited for capacity until recovery.capacity_timeout_s and failed)."""
    t, rt = make(corpus_dir, tmp_path, "snapshot.enabled=true", "snapshot.every=1", "snapshot.group_size=2", "snapshot.parity=1",
                 "parallel.dp=1", "elastic.min_replicas=1", "elastic.max_replicas=2", "elastic.grow_check_s=1000000",
                 nodes=("n0", "n1"), slots=2, actions=[ReplayAction(5.5, "remove", "n0")])
    history = t.fit(12)
    assert history[-1]["step"] == 12 and t.committed_steps_lost == 0
    assert t.group.width == 1 and set(t.group.nodes.values()) == {"n1"}
    assert {r["source"] for r in t.recoveries} == {"parity"}
    assert ("recovering", "waiting_for_capacity") not in states(tmp_path)


class _Removals:
    """Fault injection simulated: at each (point, step) of ``plan`` the node its pick names goes at once."""

    def __init__(self, world, plan) -> None:
        self.world, self.plan, self.removed = world, dict(plan), []

    def fire(self, point, step, targets):
        pick = self.plan.pop((point, step), None)
        if pick is not None:
            fleet, node = self.world.fleet, pick()
            fleet.nodes[node].removed_s = fleet.removal_of[node] = fleet.clock.now
            fleet._alive = None
            self.removed.append(node)

    def observe_step(self, step, seconds, width):
        return None

    def wrap(self, executor, targets):
        return executor


def test_a_member_lost_right_after_a_parity_rebuild_is_covered_by_the_version_taken_again_between_steps(corpus_dir, tmp_path):
    """Stage 1's node goes in step 7: stage 1 is rebuilt from step 5's parity (group of all 5
    nodes, parity 1) and everyone goes back to step 5. That version has spent its parity, so it is
    taken again at once, between steps, on the 4 nodes left. Stage 0's node goes right after the
    recovery, before any step: step 5's version, re-taken, covers it (one member of a 4-node
    group), so stage 0 is rebuilt from parity too and no committed step is lost. Without the
    re-take, both nodes were of one group of the only version: nothing lossless survived (exit 3)."""
    t, rt = make(corpus_dir, tmp_path, "snapshot.enabled=true", "snapshot.every=5", "snapshot.group_size=5", "snapshot.parity=1",
                 "parallel.dp=1", "elastic.max_replicas=1", nodes=("n0", "n1", "n2", "n3", "n4"), slots=1)
    rt.faults = faults = _Removals(rt.world, {("before_step", 7): lambda: t.group.nodes[ShardKey(1, 0)],
                                              ("recovered", 7): lambda: t.group.nodes[ShardKey(0, 0)]})
    history = t.fit(10)
    assert len(faults.removed) == 2 and history[-1]["step"] == 10 and t.committed_steps_lost == 0
    assert [(r["stage"], r["source"]) for r in t.recoveries] == [(1, "parity"), (0, "parity")]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reprotects = [x for x in lines if x.get("event") == "reprotect"]
    assert [(x["version"], x["nodes"], x["in_time"]) for x in reprotects[:2]] == [(5, [faults.removed[0]], True), (5, [faults.removed[1]], True)]
    assert not set(faults.removed) & {n for g in t.snapshots.committed.groups for n in g}


def test_a_re_protection_between_steps_never_waits_into_the_margin_of_a_drain_of_the_runs_nodes():
    """The run waits up to REPROTECT_S for a re-protecting version, but a drain of a node hosting
    its stages comes first: the wait ends DRAIN_MARGIN_S before that drain's deadline (at once when
    closer), while drains of other nodes and drains without a deadline do not shorten it."""
    from elastic_llm.controller.drains import Drain
    from elastic_llm.controller.elastic import DRAIN_MARGIN_S
    from elastic_llm.controller.stepping import REPROTECT_S, reprotect_wait_s

    hosting = {"a", "b"}
    assert reprotect_wait_s([], hosting, 100.0) == REPROTECT_S
    assert reprotect_wait_s([Drain("c", 101.0), Drain("a", None)], hosting, 100.0) == REPROTECT_S
    assert reprotect_wait_s([Drain("a", 100.0 + DRAIN_MARGIN_S + 3.0)], hosting, 100.0) == pytest.approx(3.0)
    assert reprotect_wait_s([Drain("b", 102.0)], hosting, 100.0) == 0.0  # 2 s notice: the drain's moves at once


class _Publishing(ScriptedRuntime):
    """Records, at each publish of a committed record (driver failover), which managers already
    count that version committed (``committed``: the newest a manager was told to commit)."""

    def __init__(self, world, fails) -> None:
        super().__init__(world, fails)
        self.published: list[tuple[int, list[int]]] = []

    def durable(self, cfg, snapshots, data_dir, metrics):
        snapshots.on_commit = lambda rec: self.published.append((rec.version, [m.committed for m in snapshots.managers.values()]))
        return super().durable(cfg, snapshots, data_dir, metrics)


def test_a_committed_record_is_published_before_any_manager_frees_the_version_it_replaces(corpus_dir, tmp_path):
    """A manager frees every older version once told to commit a newer one. Were that sent before
    the record is published, a driver killed in between would leave a published record whose
    parts every manager had freed: `--resume` then found nothing (it failed so in CI). So at each
    publish, no manager has heard of that commit yet."""
    t, rt = make(corpus_dir, tmp_path, "snapshot.enabled=true", "snapshot.every=2", "snapshot.group_size=3", "snapshot.parity=1",
                 "parallel.dp=1", "elastic.max_replicas=1", nodes=("n0", "n1", "n2"), slots=1, runtime=_Publishing)
    t.fit(6)
    assert [v for v, _ in rt.published] == [2, 4, 6]
    assert all(max(told) < version for version, told in rt.published), rt.published


def test_a_whole_replica_drained_under_a_short_notice_never_waits_for_snapshots_past_its_nodes_end(corpus_dir, tmp_path):
    """Both nodes of replica 1 (one slot each) get a 12 s notice at once; a spare replica starts
    on the two free nodes (4.8 s on cpu-2core) and the replica moves onto it whole, with ~7 s
    left. Versions take ~25 s here (parity at 1 MB/s per node), so one is always in flight:
    letting it commit first (up to SETTLE_S = 60 s) would run past the nodes' end. The settling is
    cut to the time they have left less a move's: the version in flight is dropped, the move is
    made before they go, the drain's line says so, and nothing fails when they go."""
    import dataclasses

    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [
        "snapshot.every=1", "snapshot.max_lag=100000", "snapshot.parity=1", "snapshot.group_size=3", "train.eval_every=0",
        "parallel.stages=2", "parallel.dp=2", "train.batch_size=8", "model.seq_len=16", f"data.dir={corpus_dir}",
        "recovery.capacity_timeout_s=5", "recovery.driver_grace_s=0", "elastic.min_replicas=1", "elastic.max_replicas=2"])
    clock = SimClock()
    costs = dataclasses.replace(load_costs("cpu-2core"), parity_mb_s=1.0, cores=0.0)  # a device per actor: parity does not slow the steps
    actions = (ReplayAction(30.0, "drain", "n2", 12.0), ReplayAction(30.0, "drain", "n3", 12.0),
               ReplayAction(42.0, "remove", "n2"), ReplayAction(42.0, "remove", "n3"))
    rt = ScriptedRuntime(World(clock, Fleet(clock, ("n0", "n1", "n2", "n3", "n4", "n5"), actions, 1), costs, Charged()), {})
    t = Trainer(cfg, rt, metrics_out=tmp_path / "metrics.jsonl")
    t.fit(UNTIL_STOPPED, on_step=lambda r: t.request_stop() if clock.now > 50.0 else None)
    assert {t.group.nodes[k] for k in t.group.keys() if k.replica == 1} == {"n4", "n5"}  # the replica moved onto the spare's nodes
    [drain] = [d for d in t.drains if d["node"] == "n2"]
    assert (drain["moved"], drain["how"], drain["settle"]) == (2, "replica", "cut"), drain
    assert drain["time"] < EPOCH + 42.0, drain  # its moves were over before the nodes went (waiting for the version: at 44.2 s)
    assert t.failures == 0 and t.recoveries == [] and t.group.width == 2
