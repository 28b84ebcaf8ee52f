"""``elastic-llm chaos``: the seeded schedule, the verdict and the arguments (pure), and one
short soak end to end on a loopback cluster (a head without CPUs + 4 worker nodes of 2 CPUs,
shared by the module) with real kills and a real straggler."""

import json
import os

import pytest

from elastic_llm.cli import main
from elastic_llm.config import load_config
from elastic_llm.soak.plan import GAP, HARNESS, MOMENTS, RESIZES, Fault, FaultKind, Moment, TrialPlan, parse_kinds, plan_soak, plan_trial
from elastic_llm.soak.report import Injection, TrialRun, build_report, judge_trial, render_markdown
from elastic_llm.soak.runner import Soak, SoakOptions, hook_events

from .conftest import FOUR_SMALL_STAGES, REPO, loopback_cluster_fixture, wait_until

pytestmark = pytest.mark.timeout(300)
ALL = tuple(k for k in FaultKind if k not in HARNESS)  # the loopback cluster's kinds (the harness's: test_soak_lab)

# ---------------------------------------------------------------------------- the schedule


def test_schedule_is_reproducible_per_seed_and_trial():
    a = plan_soak(ALL, 3, 5, seed=7, stages=4)
    assert a == plan_soak(ALL, 3, 5, seed=7, stages=4)
    assert a != plan_soak(ALL, 3, 5, seed=8, stages=4)
    assert a[2] == plan_trial(ALL, 5, 7, 2, 4)  # a trial re-runs alone
    assert a[0].faults != a[1].faults


@pytest.mark.parametrize("seed", range(5))
def test_schedule_spaces_faults_and_covers_every_kind(seed):
    plan = plan_trial(ALL, 8, seed, 0, stages=3)
    steps = [f.step for f in plan.faults]
    assert all(b - a >= GAP for a, b in zip(steps, steps[1:])) and steps[0] >= 3
    assert plan.steps > steps[-1]
    assert {f.kind for f in plan.faults[: len(ALL)]} == set(ALL)  # every kind once before any twice
    assert all(0 <= f.stage < 3 for f in plan.faults)
    assert all(f.moment in MOMENTS[f.kind] for f in plan.faults)


def test_schedule_aims_faults_at_every_moment():
    faults = [f for p in plan_soak(ALL, 20, 12, seed=0, stages=4, resize=True) for f in p.faults]
    assert {f.moment for f in faults} == set(Moment) and {f.moment for f in faults if f.kind is FaultKind.DRIVER} == {Moment.STEP}
    assert {f.moment for f in faults if f.kind is FaultKind.CORRUPT} == {Moment.STEP}
    assert {f.kind for f in faults if f.moment is Moment.RESIZE} == set(RESIZES)


def test_a_run_of_fixed_width_is_never_aimed_at_a_resize():
    faults = [f for p in plan_soak(ALL, 10, 12, seed=0, stages=4) for f in p.faults]
    assert Moment.RESIZE not in {f.moment for f in faults}
    # the schedule of a fixed-width soak is the one it always was: same seed, same faults
    assert [(f.kind, f.step, f.stage) for f in plan_trial(ALL, 12, 0, 3, 4).faults] == \
        [(f.kind, f.step, f.stage) for f in plan_trial(ALL, 12, 0, 3, 4, resize=True).faults]


def test_kinds_parse_and_unknown_ones_are_named():
    assert parse_kinds("stage, pause,stage") == (FaultKind.STAGE, FaultKind.PAUSE)
    with pytest.raises(ValueError, match="unknown fault kind 'disk'.*stage, manager, node, drain, pause, corrupt, flush, driver"):
        parse_kinds("stage,disk")


def test_corrupt_faults_and_stage_kills_at_an_op_become_chaos_events_of_the_next_step():
    plan = TrialPlan(0, (Fault(FaultKind.STAGE, 3, 0), Fault(FaultKind.CORRUPT, 6, 2), Fault(FaultKind.STAGE, 9, 1, Moment.BACKWARD)), 12)
    assert hook_events(plan) == ["{step: 7, kill: smp, stage: 2, corrupt: true}", "{step: 7, kill: stage, stage: 2, how: sigkill}",
                                 "{step: 10, kill: stage, stage: 1, how: sigkill, op: backward}"]
    assert str(plan.faults[2]) == "stage of stage 1 after step 9 at its backward op"


# ---------------------------------------------------------------------------- the verdict
REF = {s: 1.0 / s for s in range(1, 13)}


def rec(step, stage, source, seconds=1.0, lost=0):
    return {"step": step, "stage": stage, "source": source, "seconds": seconds, "committed_steps_lost": lost}


def test_verdict_of_a_clean_soak():
    faults = (Fault(FaultKind.STAGE, 3, 1), Fault(FaultKind.PAUSE, 6, 0), Fault(FaultKind.MANAGER, 9, 2))
    run = TrialRun(
        TrialPlan(0, faults, 12),
        [Injection(faults[0], "stage 1"), Injection(faults[1], "stage 0"), Injection(faults[2], "manager", manager_replaced=True)],
        dict(REF), recoveries=[rec(4, 1, "local_smp", 0.5)],
    )
    report = build_report({"config": "t", "seed": 0, "faults_per_trial": 3, "kinds": ["manager", "pause", "stage"]}, REF, [run])
    assert report["ok"] and report["failures"] == []
    assert report["by_kind"]["stage"] == {"injected": 1, "survived": 1, "recovery_sources": {"local_smp": 1}, "recover_s": {"median": 0.5, "max": 0.5},
                                          "committed_steps_lost": 0, "bit_identical": True}
    assert report["by_kind"]["pause"]["recovery_sources"] == {} and report["totals"]["survived"] == 3
    assert "all invariants held" in render_markdown(report)


def test_verdict_names_each_broken_invariant():
    faults = (Fault(FaultKind.PAUSE, 3, 1), Fault(FaultKind.CORRUPT, 6, 2), Fault(FaultKind.DRAIN, 9, 0))
    got = {**REF, 8: 0.5}
    run = TrialRun(
        TrialPlan(0, faults, 12),
        [Injection(faults[0], "p"), Injection(faults[1], "c"), Injection(faults[2], "d", node="n1")],
        got, recoveries=[rec(4, 1, "local_smp"), rec(7, 2, "local_smp", lost=2)], drains=[{"step": 9, "node": "n2", "seconds": 1.0}],
    )
    outcomes, failed = judge_trial(run, REF)
    assert [o.matched for o in outcomes] == [False, False, False]
    assert [f["invariant"] for f in failed] == ["no_committed_step_lost", "bit_identical", "fault_outcome", "corrupt_detected", "fault_outcome"]
    assert "recovered as a death" in failed[2]["diagnosis"] and "corrupted local shard" in failed[3]["diagnosis"]
    assert "step 8" in failed[1]["diagnosis"]
    hung = TrialRun(TrialPlan(1, faults, 12), [], {}, hung="state recovering at step 4")
    assert [f["invariant"] for f in judge_trial(hung, REF)[1]] == ["finished"]
    bad = TrialRun(TrialPlan(2, (), 12), [], dict(REF), durable_error="checkpoint_000012 does not verify: DurableError: crc")
    assert judge_trial(bad, REF)[1] == [{"invariant": "durable_verifies", "diagnosis": "checkpoint_000012 does not verify: DurableError: crc"}]


def test_a_fault_struck_during_a_recovery_shares_the_window_of_the_stage_killed_to_start_it():
    primer, fault = Fault(FaultKind.STAGE, 3, 2), Fault(FaultKind.STAGE, 3, 1, Moment.RECOVERY)
    nxt = Fault(FaultKind.PAUSE, 6, 0)
    run = TrialRun(
        TrialPlan(0, (fault, nxt), 9),
        [Injection(primer, "stage 2", primer=True), Injection(fault, "stage 1", moment=Moment.RECOVERY), Injection(nxt, "stage 0")],
        dict(REF), recoveries=[rec(4, 2, "local_smp", 0.4), rec(4, 1, "parity", 0.9)],
    )
    outcomes, failed = judge_trial(run, REF)
    assert failed == [] and [o.matched for o in outcomes] == [True, True, True]
    assert "parity" in outcomes[1].what and "local_smp" in outcomes[0].what
    report = build_report({"config": "t", "seed": 0, "faults_per_trial": 2, "kinds": ["pause", "stage"]}, REF, [run])
    assert report["by_moment"] == {"step": {"injected": 2, "survived": 2}, "recovery": {"injected": 1, "survived": 1}}
    assert report["by_kind"]["stage"]["injected"] == 2
    missing = TrialRun(TrialPlan(0, (fault, nxt), 9), [Injection(primer, "stage 2", primer=True), Injection(fault, "stage 1")], dict(REF),
                       recoveries=[rec(4, 2, "local_smp"), rec(4, 1, "parity")])
    assert [f["diagnosis"] for f in judge_trial(missing, REF)[1]] == ["1 of 2 planned faults were never injected"]


def test_fall_backs_beyond_the_budget_are_counted_apart_and_a_drain_line_may_follow_a_rollback():
    drain, node = Fault(FaultKind.DRAIN, 6, 1), Fault(FaultKind.NODE, 6, 0, Moment.DRAIN)
    durable = {**rec(7, 0, "durable", lost=4), "reason": "no in-memory copy survives (2 nodes of an erasure group...)"}
    run = TrialRun(TrialPlan(0, (node,), 12), [Injection(drain, "d", node="n1", primer=True), Injection(node, "n", node="n2", moment=Moment.DRAIN)],
                   dict(REF), recoveries=[durable], drains=[{"step": 5, "node": "n1", "seconds": 0.1}])  # the rollback replayed step 5
    outcomes, failed = judge_trial(run, REF)
    assert failed == [] and outcomes[0].matched and outcomes[1].matched
    t = build_report({"config": "t", "seed": 0, "faults_per_trial": 1, "kinds": ["node"]}, REF, [run])
    assert t["totals"]["committed_steps_lost"] == 0 and t["totals"]["fallbacks"] == 1 and t["totals"]["fallback_committed_steps_lost"] == 4
    assert t["trials"][0]["fallbacks"][0]["source"] == "durable"


def test_losses_are_compared_up_to_the_first_lossy_recovery():
    node = Fault(FaultKind.NODE, 3, 1, Moment.SNAPSHOT)  # before any snapshot committed: CheckFree is the right fall-back
    lossy = {**rec(4, 1, "checkfree"), "lossless": False}
    run = TrialRun(TrialPlan(0, (node,), 9), [Injection(node, "n", node="n1")], {**REF, 5: 0.0, 9: 0.0}, recoveries=[lossy])
    outcomes, failed = judge_trial(run, REF)
    assert failed == [] and "(lossy)" in outcomes[0].what
    report = build_report({"config": "t", "seed": 0, "faults_per_trial": 1, "kinds": ["node"]}, REF, [run])
    assert report["totals"]["lossy_recoveries"] == 1 and report["trials"][0]["bit_identical"]
    run.losses[3] = 0.0  # a step before the lossy recovery must still match
    assert [f["invariant"] for f in judge_trial(run, REF)[1]] == ["bit_identical"]


def test_after_a_width_change_losses_match_within_a_tolerance_and_a_dropped_replica_is_an_outcome():
    # a node removed with no room left: the run drops its replica (width 2 -> 1) instead of
    # restoring the stage; from the next step the global batch is summed in another order
    node = Fault(FaultKind.NODE, 3, 1)
    shrink = {"event": "resize", "step": 3, "from_dp": 2, "to_dp": 1, "reason": "replica lost"}
    got = {**REF, **{s: REF[s] * (1 + 1e-6) for s in range(4, 13)}}
    run = TrialRun(TrialPlan(0, (node,), 12), [Injection(node, "n", node="n1")], got, recoveries=[rec(4, None, "none")], resizes=[shrink])
    outcomes, failed = judge_trial(run, REF)
    assert failed == [] and outcomes[0].matched and "dropped (width 2 -> 1)" in outcomes[0].what
    report = build_report({"config": "t", "seed": 0, "faults_per_trial": 1, "kinds": ["node"]}, REF, [run])
    assert report["trials"][0]["width_changed_at"] == 3 and 0 < report["totals"]["rel_diff_after_width_change"] < 2e-6
    assert "up to their first width change" in render_markdown(report)
    run.losses[3] = REF[3] * (1 + 1e-9)  # the step before the width changed must match bit for bit
    assert [f["invariant"] for f in judge_trial(run, REF)[1]] == ["bit_identical"]
    run.losses[3], run.losses[7] = REF[3], REF[7] * 1.01  # after it, only within the tolerance
    assert "more than 0.001 apart" in judge_trial(run, REF)[1][0]["diagnosis"]


def test_driver_faults_are_judged_by_where_the_new_driver_resumed_from():
    faults = (Fault(FaultKind.DRIVER, 3, 0), Fault(FaultKind.DRIVER, 6, 0), Fault(FaultKind.DRIVER, 9, 0))
    injections = [Injection(f, "driver") for f in faults]
    failovers = [
        {"fault_step": 3, "committed": 3, "source": "memory", "step": 3, "seconds": 9.5},
        {"fault_step": 6, "committed": 7, "source": "memory", "step": 6, "seconds": 9.0},  # one committed step not resumed from
        {"fault_step": 9, "committed": 9, "source": "durable", "step": None, "seconds": 12.0},
    ]
    run = TrialRun(TrialPlan(0, faults, 12), injections, dict(REF), failovers=failovers)
    outcomes, failed = judge_trial(run, REF)
    assert [o.matched for o in outcomes] == [True, False, False]
    assert outcomes[0].seconds == (9.5,) and "in-memory snapshot of step 3" in outcomes[0].what
    assert "step 7 was committed" in outcomes[1].what and "durable tier" in outcomes[2].what
    assert failed[0] == {"invariant": "no_committed_step_lost", "diagnosis": "recoveries undid 10 committed steps"}
    report = build_report({"config": "t", "seed": 0, "faults_per_trial": 3, "kinds": ["driver"]}, REF, [run])
    assert report["by_kind"]["driver"]["recovery_sources"] == {"durable": 1, "memory": 2} and report["totals"]["committed_steps_lost"] == 10


def test_a_soak_stopped_by_a_run_it_could_not_end_fails_with_the_reason():
    run = TrialRun(TrialPlan(4, (), 9), [], {}, hung="state finished at step 9")
    report = build_report({"config": "t", "seed": 0, "faults_per_trial": 0, "kinds": [], "aborted": "trial 4 hung"}, REF, [run])
    assert not report["ok"] and {"trial": 4, "invariant": "finished", "diagnosis": "the soak stopped: trial 4 hung"} in report["failures"]


def test_a_run_lengthened_by_a_drain_is_checked_on_every_step_it_trained():
    drain = Fault(FaultKind.DRAIN, 6, 0)
    run = TrialRun(TrialPlan(0, (drain,), 9), [Injection(drain, "d", node="n1")], {s: REF[s] for s in range(1, 12)},
                   drains=[{"step": 10, "node": "n1", "seconds": 2.0}])
    assert judge_trial(run, REF)[1] == []  # steps 10 and 11 were trained while the drain moved its stage
    run.losses[11] = 0.0
    assert [f["invariant"] for f in judge_trial(run, REF)[1]] == ["bit_identical"]


def test_a_run_waiting_on_a_harness_that_failed_is_let_go():
    """The harness stopped serving the run's asks (it failed mid-trial): the step the run waits
    on is answered at once and later steps do not wait, so its stop takes effect (trial 9 of a
    long soak waited 60 s per step on a harness that had given up, and the soak stopped)."""
    import threading
    import time
    from types import SimpleNamespace

    from elastic_llm.soak.runner import _Trial

    trial = _Trial(None, TrialPlan(0, (), 5), SimpleNamespace(observers=[]))
    waiting = threading.Thread(target=trial.on_step, args=({"step": 1},))
    waiting.start()
    wait_until(lambda: not trial.asks.empty(), 5, "the trial's ask to the harness", every=0.01)
    assert not trial.asks.empty() and waiting.is_alive()  # waits for the harness
    trial.close()
    waiting.join(5)
    assert not waiting.is_alive()
    t = time.monotonic()
    trial.on_step({"step": 2})
    assert time.monotonic() - t < 30 and trial.asks.empty()  # at once, not after a wait for the harness (60 s a step)


def test_a_fault_deferred_into_a_hooked_faults_step_waits_one_more_step():
    """A pause deferred (behind a flush that waited for its moment) to the step whose next step
    the chaos hook kills a stage in was struck in that same step in a full-suite run, and the
    verdict, which matches recoveries with faults by step, took the killed stage's recovery for
    the pause's. One fault per step: the deferred one waits; no deferred fault is dropped."""
    from types import SimpleNamespace

    from elastic_llm.snapshot.records import ShardKey
    from elastic_llm.soak.runner import _Trial

    hooked = Fault(FaultKind.STAGE, 15, 2, Moment.BACKWARD)
    pause, stage = Fault(FaultKind.PAUSE, 12, 3), Fault(FaultKind.STAGE, 13, 1)
    group = SimpleNamespace(nodes={ShardKey(s, 0): f"node{s}" for s in range(4)}, pids={ShardKey(s, 0): 100 + s for s in range(4)})
    trial = _Trial(None, TrialPlan(0, (pause, hooked), 21), SimpleNamespace(snapshots=None, group=group, drains=[], observers=[]))
    trial.later = {15: pause, 16: stage}
    trial._between_steps(15, None, hooked)
    assert [i.fault for i in trial.injections] == [hooked]
    assert trial.later == {16: stage, 17: Fault(FaultKind.PAUSE, 17, 3)}


def test_a_resize_fault_whose_shrink_grew_back_before_its_turn_shrinks_the_run_again():
    """A resize fault came due while an earlier shrink was still growing back (no primer of its
    own); the run grew back before a spare was seen. It must not strike between steps: it
    shrinks the run again (a suite run struck it at a step, and the soak missed the moment)."""
    from types import SimpleNamespace

    from elastic_llm.soak.runner import _Grow, _Trial

    fault = Fault(FaultKind.MANAGER, 7, 1, Moment.RESIZE)
    elastic = SimpleNamespace(bounds=lambda dp: (1, 2))
    t = SimpleNamespace(group=SimpleNamespace(spares=SimpleNamespace(replicas=list), width=2), cfg=SimpleNamespace(elastic=elastic, parallel=SimpleNamespace(dp=2)), state=None, observers=[])
    trial = _Trial(None, TrialPlan(0, (fault,), 14), t)
    primed = []
    trial._shrink_first = lambda f, step: primed.append((f, step))
    trial.growing = _Grow(fault, 7, 0, shrunk=True, primed=False)
    trial._resize_step(8)
    assert primed == [(fault, 8)] and trial.growing is None and trial.injections == []
    trial.growing = _Grow(fault, 7, 0, shrunk=True, primed=True)  # its own primer's shrink grew back: that was its moment, missed
    trial._settle = lambda step: None
    trial._inject = lambda f, moment: trial.injections.append((f, moment))
    trial._resize_step(8)
    assert trial.injections == [(fault, Moment.STEP)] and len(primed) == 1


@pytest.mark.parametrize("argv, message", [
    (["--faults", "stage,disk"], "unknown fault kind 'disk'"),
    (["--trials", "0"], "--trials=0 must be >= 1"),
    (["--first-trial", "-1"], "--first-trial=-1 must be >= 0"),
    (["--faults", "stage,driver"], "driver faults run in soaks of their own"),
    (["--faults-per-trial", "0"], "--faults-per-trial=0 must be >= 1"),
    (["--workers", "1"], "--workers=1 must be >= 2"),
    (["--trial-timeout-s", "0"], "--trial-timeout-s=0 must be > 0"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv, message, tmp_path, capsys):
    assert main(["chaos", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


# ---------------------------------------------------------------------------- end to end
BASE = [*FOUR_SMALL_STAGES, "snapshot.parity=1", "recovery.standby=0"]
WORKERS = 4
cluster = loopback_cluster_fixture(WORKERS, 2)


def test_soak_of_faults_at_their_worst_moments_holds_every_invariant(cluster, corpus_dir, tmp_path):
    """A stage killed while another stage's recovery runs, a manager killed while a snapshot is
    in flight, a manager killed while a durable flush is written, a straggler between steps, a
    stage killed by the chaos hook as it starts its backward op, a node removed while another
    node's drain is pending."""
    faults = (
        Fault(FaultKind.STAGE, 3, 1, Moment.RECOVERY),
        Fault(FaultKind.MANAGER, 6, 2, Moment.SNAPSHOT),
        Fault(FaultKind.FLUSH, 9, 0, Moment.FLUSH),
        Fault(FaultKind.PAUSE, 12, 3),
        Fault(FaultKind.STAGE, 15, 2, Moment.BACKWARD),
        Fault(FaultKind.NODE, 18, 0, Moment.DRAIN),
    )
    plans = [TrialPlan(0, faults, 21)]

    def load(extra):
        return load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}", *extra])

    report = Soak(load, plans, SoakOptions(WORKERS, 2.0, trial_timeout_s=150.0, seed=1), cluster=cluster).run(tmp_path)
    print((tmp_path / "report.md").read_text())
    assert report["ok"], report["failures"]
    assert json.loads((tmp_path / "report.json").read_text())["totals"] == report["totals"]
    assert {k: v["injected"] for k, v in report["by_kind"].items()} == {"stage": 3, "manager": 1, "flush": 1, "pause": 1, "drain": 1, "node": 1}
    assert all(v["survived"] == v["injected"] and v["committed_steps_lost"] == 0 and v["bit_identical"] for v in report["by_kind"].values())
    assert report["by_kind"]["pause"]["recovery_sources"] == {}
    assert report["by_moment"]["recovery"] == {"injected": 1, "survived": 1}  # struck while the primer's recovery ran
    assert sum(m["injected"] for m in report["by_moment"].values()) == 8 and report["by_moment"]["backward"] == {"injected": 1, "survived": 1}
    assert report["by_moment"]["drain"] == {"injected": 1, "survived": 1}  # a node removed while another node's drain was pending
    assert report["by_moment"]["flush"] == {"injected": 1, "survived": 1}  # every 2nd commit flushes: one comes within 5 steps
    (trial,) = report["trials"]
    # in the order struck: a fault that waits for its moment (the flush) can push the pause past the hooked kill
    assert sorted((f["kind"], f["stage"]) for f in trial["faults"]) == sorted([
        ("stage", 2), ("stage", 1), ("manager", 2), ("flush", 0), ("pause", 3), ("stage", 2), ("drain", 1), ("node", 0)])
    assert len({f["step"] for f in trial["faults"]}) == 6  # one step per fault (a primer strikes in its fault's step)
    assert trial["durable"] is not None and trial["durable_error"] is None  # the final checkpoint verified
    assert "a byte flipped in a copy of it was detected" in trial["durable"]


@pytest.mark.slow  # 2 driver processes started and killed, ~70 s; one killed driver resumed bit for bit stays in the suite (test_failover_cluster)
def test_soak_of_driver_kills_resumes_each_new_driver_from_memory_bit_for_bit(cluster, corpus_dir, tmp_path):
    """Two SIGKILLed driver processes in a row, each replaced by `elastic-llm train --resume RUN_ID`."""
    plans = [TrialPlan(0, (Fault(FaultKind.DRIVER, 3, 0), Fault(FaultKind.DRIVER, 8, 0)), 11)]
    sets = [*BASE, f"data.dir={corpus_dir}"]
    config = os.path.join(REPO, "jobs", "tiny.yaml")

    def load(extra):
        return load_config(config, [*sets, *extra])

    argv = ["--config", config, *[a for s in sets for a in ("--set", s)]]
    report = Soak(load, plans, SoakOptions(WORKERS, 2.0, trial_timeout_s=250.0, seed=1), cluster=cluster, driver_argv=argv).run(tmp_path)
    print((tmp_path / "report.md").read_text())
    assert report["ok"], report["failures"]
    k = report["by_kind"]["driver"]
    assert k["injected"] == 2 and k["survived"] == 2 and k["recovery_sources"] == {"memory": 2} and k["bit_identical"]
    (trial,) = report["trials"]
    assert len(trial["failovers"]) == 2 and all(f["source"] == "memory" and f["step"] == f["committed"] >= 1 for f in trial["failovers"])
    assert trial["durable"] is not None and trial["durable_error"] is None


@pytest.mark.slow  # ~1 min: the soak at its worst moments stays in the suite
def test_soak_of_faults_during_a_resize_holds_every_invariant(cluster, corpus_dir, tmp_path):
    """Two replicas of two stages, one stage actor per node: a removed node leaves no room, so the
    run drops a replica; a fresh node comes and the run grows back; a stage is killed and a
    manager is killed while that grow is under way."""
    sets = ["model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4", "parallel.stages=2", "parallel.dp=2",
            "parallel.microbatches=2", "parallel.cpus_per_actor=2", "parallel.placement_strategy=SPREAD", "train.batch_size=4",
            "train.eval_every=0", "snapshot.parity=1", "recovery.standby=0", "elastic.min_replicas=1", "elastic.max_replicas=2",
            "elastic.grow_check_s=0.5", f"data.dir={corpus_dir}"]
    # 14 steps: after the last fault a snapshot replaces the killed manager before the final flush
    plans = [TrialPlan(0, (Fault(FaultKind.STAGE, 3, 0, Moment.RESIZE), Fault(FaultKind.MANAGER, 7, 1, Moment.RESIZE)), 14)]

    def load(extra):
        return load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*sets, *extra])

    report = Soak(load, plans, SoakOptions(WORKERS, 2.0, trial_timeout_s=250.0, seed=1), cluster=cluster).run(tmp_path)
    print((tmp_path / "report.md").read_text())
    assert report["ok"], report["failures"]
    assert report["by_moment"]["resize"] == {"injected": 2, "survived": 2}  # struck while a spare replica started or joined
    (trial,) = report["trials"]
    assert [(f["kind"], f["moment"]) for f in trial["faults"]] == [("node", "step"), ("stage", "resize"), ("node", "step"), ("manager", "resize")]
    assert trial["resizes"] >= 3 and trial["width_changed_at"] is not None  # two shrinks, a grow (the second may come after the end)
    assert trial["rel_diff_after_width_change"] is not None  # compared within the tolerance after the width changed
    assert trial["durable"] is not None and trial["durable_error"] is None
