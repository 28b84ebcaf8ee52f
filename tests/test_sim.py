"""``elastic-llm simulate``: the real controller on a simulated fleet (no Ray, seconds per test).

The scenarios mirror loopback cluster tests (tests/test_elastic_cluster.py,
tests/test_controller_cluster.py, tests/test_standby_cluster.py): the simulated run must reach
the same states and recover from the same sources (a drain that moves one stage is the contract
suite's, run on both runtimes: tests/test_contract.py). The simulation's fleet is scripted with a
:class:`~elastic_llm.replay.trace.ReplayPlan`, as a replay's is.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from elastic_llm.cli import main
from elastic_llm.config import load_config
from elastic_llm.replay.trace import ReplayAction, ReplayPlan
from elastic_llm.sim.costs import CostError, load_costs
from elastic_llm.sim.runner import SimOptions, Simulation

from .conftest import REPO, events

pytestmark = pytest.mark.timeout(120)
TRACE = os.path.join(REPO, "tests", "data", "spot_trace.csv")
COSTS = load_costs("cpu-2core")


def spot_tiny(corpus_dir, *sets):
    return load_config(os.path.join(REPO, "jobs", "spot-tiny.yaml"), [f"data.dir={corpus_dir}", *sets])


def scripted(nodes, actions, duration):
    """A fleet of ``nodes`` at second 0 and ``actions`` after (alive curves are not needed here)."""
    alive = ((0.0, len(nodes)),)
    return ReplayPlan(tuple(nodes), tuple(actions), duration, alive, alive)


def run(cfg, tmp_path, plan, replicas=2, slots=2, **kw):
    options = SimOptions(nodes=len(plan.initial_nodes), stages=4, replicas=replicas, slots_per_node=slots, **kw)
    sim = Simulation(cfg, options, COSTS, plan)
    report = sim.run(tmp_path)
    return sim.trainer, report


def transitions(tmp_path):
    return [(x["old"], x["new"]) for x in events(tmp_path, "state")]


def test_a_lost_node_without_room_shrinks_without_rollback_then_two_new_nodes_grow_it_back(corpus_dir, tmp_path):
    """As the loopback test of the same name: replica 1 loses stages it cannot place, is dropped
    (no rollback), and grows back once two nodes join."""
    plan = scripted(["r0", "r1", "r2", "r3"], [ReplayAction(5.0, "remove", "r2"), ReplayAction(30.0, "add", "r4"), ReplayAction(30.0, "add", "r5")], 60.0)
    t, report = run(spot_tiny(corpus_dir), tmp_path, plan)
    resizes = events(tmp_path, "resize")
    assert [(e["from_dp"], e["to_dp"]) for e in resizes] == [(2, 1), (1, 2)]
    assert [e["reason"] for e in resizes] == ["lost stages could not be placed", "capacity"]
    assert all(r["rollback_steps"] == 0 for r in events(tmp_path, "recovery"))
    assert [h["step"] for h in t.history] == list(range(1, len(t.history) + 1))  # no step replayed
    assert ("running", "recovering") in transitions(tmp_path) and ("running", "resizing") in transitions(tmp_path)
    assert report["committed_steps_lost"] == 0 and report["final_width"] == 2 and report["failed"] is None


def test_a_lost_node_without_spare_capacity_waits_then_recovers_from_parity(corpus_dir, tmp_path):
    """As tests/test_controller_cluster.py: one replica, its node with two stages goes, nothing
    can be placed until a node joins; both stages come back from parity."""
    cfg = spot_tiny(corpus_dir, "parallel.dp=1", "elastic.max_replicas=1", "recovery.capacity_report_s=1")
    plan = scripted(["r0", "r1"], [ReplayAction(5.0, "remove", "r1"), ReplayAction(20.0, "add", "r2")], 40.0)
    t, report = run(cfg, tmp_path, plan, replicas=1)
    states = transitions(tmp_path)
    assert ("recovering", "waiting_for_capacity") in states and ("waiting_for_capacity", "recovering") in states
    assert t.seconds_by_state["waiting_for_capacity"] >= 3 and len(events(tmp_path, "waiting_for_capacity")) >= 2
    assert sorted(r.source for r in t.recoveries) == ["parity", "parity"]  # two stages lived on the lost node
    assert report["committed_steps_lost"] == 0 and report["failed"] is None


def test_a_stage_process_that_dies_on_a_live_node_comes_back_from_its_manager(corpus_dir, tmp_path):
    """The fault schedule kills a stage process (its node lives): one replica, so the lost stage
    restores the committed snapshot from its node's manager and everyone rolls back to it."""
    cfg = spot_tiny(corpus_dir, "parallel.dp=1", "elastic.max_replicas=1")
    plan = scripted(["r0", "r1"], [], 120.0)
    t, report = run(cfg, tmp_path, plan, replicas=1, process_failures_per_hour=30.0, seed=3)
    assert report["events"]["process_failures"] >= 1
    assert {r.source for r in t.recoveries} == {"local_smp"}
    assert report["committed_steps_lost"] == 0 and report["failed"] is None


def test_beyond_parity_a_simulated_durable_tier_is_the_rung_that_saves_the_run(corpus_dir, tmp_path):
    """Two nodes of one erasure group (parity 1) go at once with neighbouring stages on them: with
    a durable checkpoint every 2nd commit everyone rolls back to it; without one the run stops
    (nothing lossless survives, and CheckFree cannot rebuild two neighbours)."""
    cfg = spot_tiny(corpus_dir, "parallel.dp=1", "elastic.max_replicas=1", "snapshot.group_size=6")  # one group: r0 and r1 in it
    nodes = ["r0", "r1", "r2", "r3", "r4", "r5"]  # one stage per node: r0-r3 hold the run, r4-r5 are free
    plan = scripted(nodes, [ReplayAction(20.0, "remove", "r0"), ReplayAction(20.0, "remove", "r1")], 60.0)
    t, report = run(cfg, tmp_path / "durable", plan, replicas=1, slots=1, durable_every=2)
    assert report["failed"] is None and report["events"]["durable_flushes"] > 0
    assert sorted(r.source for r in t.recoveries) == ["durable", "durable"]
    assert len({r.step - r.rollback_steps for r in t.recoveries}) == 1  # both stages restart from one durable step
    assert all(0 <= r.rollback_steps <= 2 * 2 for r in t.recoveries)  # a flush every 2nd commit, one may be in flight
    committed = [row["steps_committed"] for row in json.loads((tmp_path / "durable" / "replay.json").read_text())["timeline"]]
    first = next(i for i, c in enumerate(committed) if c > 0)
    assert min(committed[first:]) > 0  # the rollback to the durable checkpoint keeps its step committed: the line never drops to 0
    assert report["liveput"] is not None and 0 < report["liveput"] <= 1.0
    t, report = run(cfg, tmp_path / "none", plan, replicas=1, slots=1)
    assert report["exit_code"] == 3 and "parity covers 1" in report["failed"]


def test_the_same_seed_and_trace_give_the_same_replay_json(corpus_dir, tmp_path):
    cfg = spot_tiny(corpus_dir)
    reports = []
    for i in range(2):
        out = tmp_path / str(i)
        options = SimOptions(4, 4, 2, trace=TRACE, time_scale=60.0, notice_s=10.0, slots_per_node=2, process_failures_per_hour=2.0, seed=1)
        Simulation(cfg, options, COSTS).run(out)
        saved = json.loads((out / "replay.json").read_text())
        reports.append({k: v for k, v in saved.items() if k not in ("real_s", "controller_cpu")})
        saved["metrics"] = [{k: v for k, v in json.loads(x).items() if k != "cpu_by_state"} for x in (out / "metrics.jsonl").read_text().splitlines()]
        reports[-1]["metrics"] = saved["metrics"]
    assert reports[0] == reports[1]  # the metrics lines too: times, spans and every event come from the simulated clock
    assert reports[0]["steps"] > 50 and reports[0]["timeline"] and reports[0]["events"]["replay_actions"]


def test_a_1024_actor_fleet_with_losses_drains_and_grows_keeps_every_invariant(corpus_dir, tmp_path):
    """64 stages x 16 replicas over 256 nodes, the test trace scaled up with 30 s notices and
    stage processes dying too: the run ends, no committed step is lost, the width stays within
    its bounds, the committed step never goes back, and the controller's decisions stay cheap."""
    cfg = load_config(os.path.join(REPO, "jobs", "sim-fleet.yaml"), [f"data.dir={corpus_dir}"])
    options = SimOptions(256, 64, 16, trace=TRACE, window=(0.0, 3000.0), notice_s=30.0, process_failures_per_hour=0.05, seed=0)
    sim = Simulation(cfg, options, load_costs("gpu-a100"))
    report = sim.run(tmp_path)
    assert report["shape"]["actors"] == 1024 and report["failed"] is None and report["exit_code"] == 0
    assert report["committed_steps_lost"] == 0
    resizes = events(tmp_path, "resize")
    assert all(1 <= e["to_dp"] <= 16 for e in resizes)
    assert any(e["to_dp"] > e["from_dp"] for e in resizes) and any(e["to_dp"] < e["from_dp"] for e in resizes)
    assert report["events"]["drains"] > 0 and report["events"]["recoveries"] and report["events"]["process_failures"] > 0
    committed = [p["steps_committed"] for p in json.loads((tmp_path / "replay.json").read_text())["timeline"]]
    assert committed == sorted(committed) and committed[-1] > 0
    assert sim.trainer.history and [h["step"] for h in sim.trainer.history] == sorted({h["step"] for h in sim.trainer.history})


def test_at_64_x_16_the_driver_makes_one_call_per_replica_and_per_erasure_group_not_per_actor(corpus_dir, tmp_path):
    """A step is one call per replica (its stage 0 relays it to its 64 stages); a snapshot version
    is one call per erasure group to begin (32 groups of 8 over 256 nodes) and one per 16 managers
    to commit, not one per node each (512 a version before)."""
    cfg = load_config(os.path.join(REPO, "jobs", "sim-fleet.yaml"), [f"data.dir={corpus_dir}"])
    sim = Simulation(cfg, SimOptions(256, 64, 16, steps=40), load_costs("gpu-a100"))
    cpu = sim.run(tmp_path)["controller_cpu"]
    assert cpu["stage_calls_per_step"] == 16 and cpu["relayed_reports_per_step"] == 1024
    started = 2 * 256 / 40  # the managers' start and first census, spread over the run
    assert cpu["manager_calls_per_step"] <= 256 // 8 + 256 // 16 + started + 4, cpu  # 512 + started before


def test_simulated_time_never_sleeps(corpus_dir, tmp_path, monkeypatch):
    """Everything simulated reads the simulated clock: a run of 240 simulated seconds with waits,
    recoveries and drains calls no sleep and takes exactly its simulated time."""

    def no_sleep(seconds):
        raise AssertionError(f"time.sleep({seconds}) in a simulation")

    monkeypatch.setattr(time, "sleep", no_sleep)
    options = SimOptions(4, 4, 2, trace=TRACE, time_scale=30.0, notice_s=10.0, slots_per_node=2)
    report = Simulation(spot_tiny(corpus_dir), options, COSTS).run(tmp_path)
    assert report["wall_s"] == report["duration_s"] == 240.0 and report["failed"] is None


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--nodes", "4", "--stages", "4", "--replicas", "1"], "--steps: without --trace"),
        (["--nodes", "0", "--stages", "4", "--replicas", "1", "--steps", "5"], "--nodes=0 must be >= 1"),
        (["--nodes", "4", "--stages", "4", "--replicas", "1", "--steps", "5", "--notice-s", "5"], "--window and --notice-s go with --trace"),
        (["--nodes", "4", "--stages", "4", "--replicas", "1", "--steps", "5", "--cost", "tpu"], "cost model 'tpu' is neither a file nor a profile"),
        (["--nodes", "4", "--stages", "3", "--replicas", "1", "--steps", "5"], "parallel.stages=3 does not divide model.n_layers=4"),
        (["--nodes", "4", "--stages", "4", "--replicas", "1", "--trace", "/nonexistent.csv"], "/nonexistent.csv"),
        (["--nodes", "4", "--stages", "4", "--replicas", "1", "--steps", "5", "--durable-every", "-1"], "--durable-every=-1 must be >= 0"),
        (["--nodes", "4", "--stages", "4", "--replicas", "1", "--steps", "5", "--set", "durable.storage_path=/tmp/x"], "pass --durable-every N"),
    ],
)
def test_simulate_cli_refuses_bad_arguments_with_exit_2(tmp_path, capsys, args, expected):
    assert main(["simulate", "--config", os.path.join(REPO, "jobs", "spot-tiny.yaml"), "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_cost_profiles_load_and_bad_ones_name_the_field(tmp_path):
    gpu = load_costs("gpu-a100")
    assert "not measured" in gpu.provenance and "measured" in COSTS.provenance
    # 1F1B: 7 slots of 2 sequences per stage, or (shared cores) the whole step's work over the cores and the second replica's own
    slots, shared = 7 * 2 * COSTS.seq_stage_s, (16 * 4 * COSTS.seq_stage_s / COSTS.cores + COSTS.replica_s if COSTS.cores else 0.0)
    assert COSTS.step_s(4, 4, 16, 2) == pytest.approx(max(slots, shared) + COSTS.allreduce_s)
    assert COSTS.step_s(4, 4, 16, 2, snapshot=True) == pytest.approx(COSTS.step_s(4, 4, 16, 2) + COSTS.snapshot_step_s)
    assert COSTS.step_s(4, 4, 16, 1) < COSTS.step_s(4, 4, 16, 2)  # no gradient exchange at width 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nprovenance: y\nseq_stage_s: -1\n")
    with pytest.raises(CostError, match="missing field"):
        load_costs(str(bad))
    full = {k: 1.0 for k in ("seq_stage_s", "allreduce_s", "actor_start_s", "adopt_s", "detect_process_s", "detect_node_s",
                             "network_mb_s", "restore_mb_s", "parity_mb_s", "copy_mb_s", "flush_mb_s")}
    bad.write_text("name: x\nprovenance: y\n" + "".join(f"{k}: {v}\n" for k, v in {**full, "network_mb_s": 0}.items()))
    with pytest.raises(CostError, match="network_mb_s=0: a bandwidth must be > 0"):
        load_costs(str(bad))
    bad.write_text("name: x\nprovenance: y\nflops: 3\n" + "".join(f"{k}: {v}\n" for k, v in full.items()))
    with pytest.raises(CostError, match=r"unknown field\(s\) \['flops'\]"):
        load_costs(str(bad))


def test_on_shared_cores_background_process_starts_take_their_fair_share_of_a_step():
    """A loopback cluster is one machine: while k processes start (warm standbys, spares), the n
    stage processes of a step get n / (n + k) of its CPU; with an accelerator per actor
    (cores 0) a start costs a step nothing."""
    from dataclasses import replace

    from elastic_llm.sim.world import Charged, Fleet, SimClock, World

    def world(cores):
        clock = SimClock()
        return World(clock, Fleet(clock, ("a",), (), 4), replace(COSTS, cores=cores), Charged())

    w = world(2.0)
    assert w.step_end(0.0, 1.0, 4) == 1.0  # nothing starting
    w.starting(0.0, 10.0, 4)
    assert w.step_end(0.0, 1.0, 4) == pytest.approx(2.0)  # half the machine
    assert w.step_end(9.5, 1.0, 4) == pytest.approx(10.75)  # 0.25 s of work before the starts end, 0.75 after
    assert w.step_end(20.0, 1.0, 4) == 21.0  # long done
    idle = world(0.0)
    idle.starting(0.0, 10.0, 4)
    assert idle.step_end(0.0, 1.0, 4) == 1.0


def test_a_burst_that_takes_a_quarter_of_the_fleet_with_notice_keeps_the_width_and_every_committed_step(corpus_dir, tmp_path):
    """16 nodes of 2 slots, 4 stages x 4 replicas: 4 nodes (25%) get a 15 s notice at once. The
    fleet has room for every actor on them: the width never drops, nothing committed is lost."""
    nodes = [f"r{i}" for i in range(16)]
    burst = [ReplayAction(20.0, "drain", n, 15.0) for n in ("r0", "r2", "r4", "r6")] + [ReplayAction(35.0, "remove", n) for n in ("r0", "r2", "r4", "r6")]
    cfg = spot_tiny(corpus_dir, "parallel.dp=4", "elastic.min_replicas=1", "elastic.max_replicas=4", "snapshot.group_size=8", "snapshot.parity=2")
    t, report = run(cfg, tmp_path, scripted(nodes, burst, 60.0), replicas=4, slots=2)
    assert report["failed"] is None and report["committed_steps_lost"] == 0
    assert t.resizes == [] and t.group.width == 4
    assert not {"r0", "r2", "r4", "r6"} & set(t.group.nodes.values())
    assert t.recoveries == [] and sum(d["moved"] for d in t.drains) >= 2  # the actors on them moved before they went
    [done] = events(tmp_path, "reprotect")  # 3 of the 4 were in one group of 8 (parity 2): their parts were re-homed at the notice
    assert done["how"] == "rehome" and done["seconds"] < 15.0 and done["in_time"], done
    moved = [m for m in events(tmp_path, "rehome") if m["version"] == done["version"]]  # (a version in flight at the notice is re-homed once it commits)
    assert {m["source"] for m in moved} == {"r0", "r2", "r4", "r6"} and not {m["target"] for m in moved} & {"r0", "r2", "r4", "r6"}
    assert max(m["seconds"] for m in moved) == pytest.approx(done["seconds"]) and all(m["bytes"] > 0 for m in moved)


def test_the_calibration_charges_a_second_replica_what_the_widths_benchmark_measured_beyond_the_exchange():
    """On shared cores a step at width 2 costs the width-1 step, the exchange and ``replica_s``:
    spot-tiny's width-2 step less its width-1 step less the exchange (benchmarks/widths.py)."""
    import dataclasses
    import json

    from benchmarks.calibrate import profile_from

    runs = {n: json.loads(open(os.path.join(REPO, "benchmarks", "results", "calibration", f"{n}.json")).read())
            for n in ("snapshot", "recovery", "detect", "transport", "durable")}
    without, _ = profile_from(runs, 2)
    assert without["replica_s"] == 0.0  # no widths run: nothing charged
    runs["widths"] = {"width_1": {"median_step_s": 0.8}, "width_2": {"median_step_s": 1.0}, "width_2_extra_s": 0.2, "nodes": 4}
    fig, why = profile_from(runs, 2)
    assert fig["replica_s"] == round(0.2 - fig["allreduce_s"], 4) and any(w.startswith("replica_s:") for w in why)
    costs = dataclasses.replace(COSTS, **{k: fig[k] for k in ("seq_stage_s", "allreduce_s", "replica_s", "snapshot_step_s")})
    one, two = costs.step_s(4, 4, 16, 1, snapshot=True), costs.step_s(4, 4, 16, 2, snapshot=True)
    assert abs(two - one - 0.2) < 1e-3  # what the benchmark measured
    assert dataclasses.replace(costs, cores=0.0).step_s(4, 4, 16, 2) < dataclasses.replace(costs, cores=0.0).step_s(4, 4, 16, 1)  # own devices: no sharing


def test_a_burst_that_takes_90_percent_of_the_fleet_within_one_notice_loses_no_committed_step(corpus_dir, tmp_path):
    """20 nodes of 2 slots, 4 stages x 4 replicas, groups of 8 with parity 2, no durable tier:
    18 nodes get 30 s notices over 25 s (90% of the fleet within one notice window) and go at
    their deadlines. The committed version's parts on each are re-homed at its notice, onto the
    nodes not draining (by the end, the 2 that stay hold them all), so what the drains could not
    move comes back from them: no committed step lost. (Before, their erasure groups lost more
    members than parity covers: exit 3.)"""
    nodes = [f"r{i}" for i in range(20)]
    victims = [n for n in nodes if n not in ("r7", "r13")]
    burst = [a for i, v in enumerate(victims) for a in (ReplayAction(40.0 + i * 25.0 / 18, "drain", v, 30.0), ReplayAction(70.0 + i * 25.0 / 18, "remove", v))]
    cfg = spot_tiny(corpus_dir, "parallel.dp=4", "elastic.min_replicas=1", "elastic.max_replicas=4", "snapshot.group_size=8", "snapshot.parity=2")
    t, report = run(cfg, tmp_path, scripted(nodes, sorted(burst, key=lambda a: a.at_s), 200.0), replicas=4, slots=2)
    assert report["failed"] is None and report["committed_steps_lost"] == 0
    moved = events(tmp_path, "rehome")
    assert {m["source"] for m in moved} == set(victims) and {m["target"] for m in moved} <= set(nodes)
    assert all(not r["in_time"] or r["seconds"] < 30.0 for r in events(tmp_path, "reprotect"))


def test_notices_that_arrive_while_a_recovery_starts_processes_re_home_parts_at_once(corpus_dir, tmp_path):
    """A node goes without notice and its replacement takes 30 s to start (no warm standby); 5 s
    into that wait, four more nodes get 20 s notices, so they go before the recovery ends. Their
    parts of the committed version are re-homed while the recovery waits (its erasure groups
    already lost a member: one more is beyond parity 1), so the run loses no committed step.
    (Before, notices were looked at only while a step ran: the groups lost 2 of their members,
    exit 3.)"""
    from dataclasses import replace

    nodes = [f"r{i}" for i in range(10)]
    actions = [ReplayAction(40.0, "remove", "r0")] + [ReplayAction(45.0, "drain", n, 20.0) for n in ("r1", "r2", "r3", "r4")] + \
        [ReplayAction(65.0, "remove", n) for n in ("r1", "r2", "r3", "r4")]
    cfg = spot_tiny(corpus_dir, "recovery.standby=0", "snapshot.every=1")
    options = SimOptions(nodes=len(nodes), stages=4, replicas=2, slots_per_node=2)
    sim = Simulation(cfg, options, replace(COSTS, actor_start_s=30.0), scripted(nodes, actions, 150.0))
    report = sim.run(tmp_path)
    assert report["failed"] is None and report["committed_steps_lost"] == 0
    states = events(tmp_path, "state")
    began = min(x["time"] for x in states if x["new"] == "recovering")
    ended = min(x["time"] for x in states if x["old"] == "recovering" and x["new"] != "recovering")
    assert began < 1.8e9 + 30.0 + 45.0 and ended > 1.8e9 + 30.0 + 65.0  # (the run's clock starts at 30 s) one recovery spans the notices and the nodes' end
    [protected] = [r for r in events(tmp_path, "reprotect") if r["how"] == "rehome"]
    assert protected["in_time"] and protected["seconds"] < 5.0 and protected["cause"] == "notice"
    moved = events(tmp_path, "rehome")
    assert moved and {m["source"] for m in moved} <= {"r1", "r2", "r3", "r4"} and all(m["seconds"] < 5.0 for m in moved)


def test_a_collapse_with_no_node_to_re_home_to_is_said_at_the_notice_and_flushed_when_a_durable_tier_exists(corpus_dir, tmp_path):
    """Every node of the fleet gets a 30 s notice at once: the committed version's parts have
    nowhere to go. At the notice, the run says so (a ``reprotect`` line with ``how: stranded``, and
    the run's status), long before the nodes go. With a durable tier (its cadence never due on
    its own here), an emergency flush of each newer committed version runs while one can end
    before the nodes do, and the run comes back from the last on new nodes with no committed
    step lost; without one it stops
    (exit 3) as it said it would."""
    nodes = [f"r{i}" for i in range(6)]
    plan = scripted(nodes, [ReplayAction(20.0, "drain", n, 30.0) for n in nodes] + [ReplayAction(50.0, "remove", n) for n in nodes]
                    + [ReplayAction(60.0, "add", f"n{i}") for i in range(6)], 120.0)
    cfg = spot_tiny(corpus_dir, "parallel.dp=1", "elastic.max_replicas=1", "snapshot.group_size=6")
    t, report = run(cfg, tmp_path / "durable", plan, replicas=1, slots=1, durable_every=10**6)
    [said] = [r for r in events(tmp_path / "durable", "reprotect") if r["how"] == "stranded"]
    assert said["nodes"] == nodes and said["time"] - 1.8e9 < 30.0  # within seconds of the notice at 20 s, the nodes go at 50 s
    assert report["failed"] is None and report["committed_steps_lost"] == 0 and report["events"]["durable_flushes"] > 0
    assert {r.source for r in t.recoveries} == {"durable"} and all(r.rollback_steps <= 6 for r in t.recoveries)  # only the steps after the last
    # version that began while its flush could end before the nodes (twice a flush plus 2 s before their end): uncommitted work
    t, report = run(cfg, tmp_path / "none", plan, replicas=1, slots=1)
    [said] = [r for r in events(tmp_path / "none", "reprotect") if r["how"] == "stranded"]
    assert said["time"] - 1.8e9 < 30.0 and report["exit_code"] == 3


def test_in_a_collapse_no_version_begins_that_its_flush_could_not_save_before_the_nodes_go(corpus_dir, tmp_path):
    """The collapse above with a slow durable tier (a flush of seconds, steps of a fraction of
    one, a version every step): the run keeps flushing each newer committed version while the
    nodes live, but begins none within twice a flush (plus 2 s) of their end, so the newest
    committed version is on the durable tier when they go: no committed step lost."""
    from dataclasses import replace

    nodes = [f"r{i}" for i in range(6)]
    plan = scripted(nodes, [ReplayAction(20.0, "drain", n, 30.0) for n in nodes] + [ReplayAction(50.0, "remove", n) for n in nodes]
                    + [ReplayAction(60.0, "add", f"n{i}") for i in range(6)], 120.0)
    cfg = spot_tiny(corpus_dir, "parallel.dp=1", "elastic.max_replicas=1", "snapshot.group_size=6", "snapshot.every=1")
    options = SimOptions(nodes=6, stages=4, replicas=1, slots_per_node=1, durable_every=10**6)
    sim = Simulation(cfg, options, replace(COSTS, flush_mb_s=2.0), plan)
    report = sim.run(tmp_path)
    assert report["failed"] is None and report["committed_steps_lost"] == 0, report["committed_steps_lost"]  # 11 when versions began until the end
    assert report["events"]["durable_flushes"] >= 2  # the emergency flush, and newer ones while they could end in time
    assert {r.source for r in sim.trainer.recoveries} == {"durable"}


def test_a_spot_trace_without_a_durable_tier_starts_with_a_warning_and_with_one_does_not(corpus_dir, tmp_path):
    nodes = [f"r{i}" for i in range(4)]
    plan = scripted(nodes, [ReplayAction(20.0, "remove", "r0")], 30.0)
    cfg = spot_tiny(corpus_dir, "parallel.dp=1", "elastic.max_replicas=1", "snapshot.group_size=4")
    run(cfg, tmp_path / "none", plan, replicas=1, slots=1)
    [warned] = events(tmp_path / "none", "warning")
    assert warned["what"] == "spot_without_durable" and "durable.storage_path" in warned["message"]
    run(cfg, tmp_path / "durable", plan, replicas=1, slots=1, durable_every=5)
    assert events(tmp_path / "durable", "warning") == []


def test_bench_fleet_reads_notice_to_protected_per_exposure_and_evacuation_per_draining_node():
    """The fleet benchmark's re-home figures: per draining node, the slowest part of the first
    version re-homed off it (later versions' parts on it are not the notice's); per exposure a
    notice caused, the seconds until it was protected (a loss's re-protection is not a notice's);
    a collapse's ``stranded`` lines are not nodes that went first. Pure."""
    from benchmarks.fleet import rehoming, reprotection

    moves = [{"source": "a", "version": 5, "seconds": 0.4, "bytes": 10**9}, {"source": "a", "version": 5, "seconds": 1.2, "bytes": 10**9},
             {"source": "a", "version": 6, "seconds": 9.0, "bytes": 10**9}, {"source": "b", "version": 6, "seconds": 0.8, "bytes": 2 * 10**9}]
    got = rehoming(moves)
    assert got["rehomes"] == 4 and got["rehome_gb"] == 5.0 and got["rehomed_nodes"] == 2
    assert got["notice_to_evacuated_s"] == {"p50": 1.2, "p90": 1.2, "max": 1.2}
    lines = [{"in_time": True, "how": "rehome", "nodes": ["a"], "bytes": 10**6, "seconds": 1.2, "cause": "notice"},
             {"in_time": True, "how": "version", "nodes": ["f"], "bytes": 10**6, "seconds": 21.0, "cause": "loss"},
             {"in_time": False, "how": "stranded", "nodes": ["c", "d"], "bytes": 0, "seconds": 0.0},
             {"in_time": False, "how": "version", "nodes": ["e"], "bytes": 0, "seconds": 3.0, "cause": "loss+notice"}]
    r = reprotection(lines)
    assert r["notice_to_protected_s"] == {"p50": 1.2, "p90": 1.2, "max": 1.2} and r["notice_exposures"] == 2 and r["notice_went_first"] == 1
    assert (r["reprotections"], r["by_rehome"], r["went_first"], r["went_first_nodes"], r["stranded"]) == (2, 1, 1, 1, 1)
