"""The soak's kinds that need the multi-host harness: their schedule, the chaos events that strike
them, how a trial's metrics lines are judged, and the refusals (pure; the harness itself runs in
``test_soak_lab_run`` and ``elastic-llm chaos``)."""

from __future__ import annotations

import pytest

from elastic_llm.cli import main
from elastic_llm.soak.lab import HEAL_AFTER, SLOW_MBIT, harness_events, trial_run
from elastic_llm.soak.plan import HARNESS, Fault, FaultKind, Moment, TrialPlan, kinds_problem, parse_kinds, plan_soak
from elastic_llm.soak.report import build_report, judge_trial

KINDS = parse_kinds("partition,partition-heal,isolate-pair,slow-link,stage,manager,node")


def test_harness_kinds_mix_with_stage_manager_and_node_only_and_every_fault_strikes_between_steps():
    assert kinds_problem(KINDS) is None
    problem = kinds_problem(parse_kinds("partition,pause,drain"))
    assert problem is not None and "pause,drain cannot run on the multi-host harness that partition need" in problem
    plans = plan_soak(KINDS, 3, 7, seed=1, stages=4)
    assert {f.kind for p in plans for f in p.faults} == set(KINDS) and all(f.moment is Moment.STEP for p in plans for f in p.faults)


def test_each_fault_becomes_the_chaos_event_of_the_step_after_its_own_and_a_partition_heal_heals_later():
    plan = TrialPlan(0, (Fault(FaultKind.PARTITION_HEAL, 3, 1), Fault(FaultKind.SLOW_LINK, 6, 2), Fault(FaultKind.STAGE, 9, 0),
                         Fault(FaultKind.ISOLATE_PAIR, 12, 3), Fault(FaultKind.MANAGER, 15, 1)), 18)
    assert harness_events(plan) == [
        "{step: 4, kill: partition, stage: 1}", f"{{step: {4 + HEAL_AFTER}, kill: heal}}",
        f"{{step: 7, kill: slow, stage: 2, mbit: {SLOW_MBIT}}}", "{step: 10, kill: stage, stage: 0, how: sigkill}",
        "{step: 13, kill: isolate, stage: 3}", "{step: 16, kill: smp, stage: 1}",
    ]


def steps(n, loss=1.0):
    return [{"step": s, "loss": loss + s} for s in range(1, n + 1)]


def test_a_trial_on_the_harness_is_judged_from_its_lines_link_cut_straggler_and_fenced_included():
    plan = TrialPlan(0, (Fault(FaultKind.ISOLATE_PAIR, 3, 1), Fault(FaultKind.SLOW_LINK, 6, 2), Fault(FaultKind.PARTITION_HEAL, 9, 0)), 12)
    lines = steps(12) + [
        {"event": "chaos", "step": 4, "kill": "isolate"}, {"event": "link_cut", "step": 4, "set_aside": "b" * 20, "pairs": [["a", "b"]]},
        {"event": "recovery", "step": 4, "stage": 2, "replica": 0, "source": "parity", "committed_steps_lost": 0, "lossless": True, "seconds": 2.0},
        {"event": "chaos", "step": 7, "kill": "slow"}, {"event": "straggler", "step": 9, "node": "c" * 20, "share": 0.6},
        {"event": "chaos", "step": 10, "kill": "partition"}, {"event": "drain", "step": 10, "node": "c" * 20, "moved": 2, "seconds": 9.5},
        {"event": "recovery", "step": 10, "stage": 0, "replica": 0, "source": "parity", "committed_steps_lost": 0, "lossless": True, "seconds": 3.0},
        {"event": "chaos", "step": 12, "kill": "heal"}, {"event": "fenced", "step": 12, "count": 2, "what": ["x", "y"]},
    ]
    run = trial_run(plan, lines, 60.0, None)
    assert run.fenced == 2 and len(run.links) == 2 and all(i.error is None for i in run.injections)
    outcomes, failed = judge_trial(run, {s: 1.0 + s for s in range(1, 13)})
    assert failed == [] and [o.matched for o in outcomes] == [True, True, True], outcomes
    assert "set aside" in outcomes[0].what and "straggler named at step 9" in outcomes[1].what
    report = build_report({"config": "tiny", "seed": 0, "faults_per_trial": 3, "kinds": [], "aborted": None}, {s: 1.0 + s for s in range(1, 13)}, [run])
    assert report["ok"] and report["totals"]["fenced"] == 2 and report["trials"][0]["fenced"] == 2


def test_a_slow_link_never_told_apart_and_a_fault_that_never_fired_fail_their_trial():
    plan = TrialPlan(0, (Fault(FaultKind.SLOW_LINK, 3, 1), Fault(FaultKind.PARTITION, 6, 2)), 9)
    run = trial_run(plan, steps(9) + [{"event": "chaos", "step": 4, "kill": "slow"}], 30.0, None)
    outcomes, failed = judge_trial(run, {s: 1.0 + s for s in range(1, 10)})
    assert "no straggler line" in outcomes[0].what and not outcomes[0].matched
    assert run.injections[1].error == "its chaos event never fired" and {f["invariant"] for f in failed} == {"fault_outcome"}


def test_harness_kinds_where_the_harness_cannot_run_exit_2_naming_why_and_the_fix(monkeypatch, tmp_path, capsys):
    import elastic_llm.hosts.lab as lab

    monkeypatch.setattr(lab, "unavailable", lambda directional=False: "this process is not root")
    assert main(["chaos", "--faults", "partition,stage", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--faults partition need the multi-host harness" in err and "this process is not root" in err and "run it as root" in err
    assert set(HARNESS) <= set(KINDS)


@pytest.mark.slow  # about 4 minutes: a harness of four hosts, a reference run and one trial
def test_a_soak_on_the_harness_survives_a_healed_partition_and_a_cut_pair_bit_for_bit(corpus_dir, tmp_path):
    """``elastic-llm chaos`` with harness kinds: one trial whose run meets a partition healed two
    steps later and a cut between two stages' nodes, on hosts of their own; every invariant holds
    (losses bit-identical to the reference on the same harness, no committed step lost, the
    newest durable checkpoint verifies)."""
    import json

    from elastic_llm.hosts.lab import unavailable

    why = unavailable(directional=True)
    if why:
        pytest.skip(f"the multi-host harness cannot run here: {why}")
    out = tmp_path / "soak"
    code = main(["chaos", "--faults", "partition-heal,isolate-pair", "--trials", "1", "--faults-per-trial", "2", "--workers", "4",
                 "--cpus-per-node", "1", "--seed", "3", "--set", "snapshot.every=1", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert code == 0 and report["ok"], report["failures"]
    assert report["totals"]["injected"] == 2 and report["totals"]["survived"] == 2 and report["totals"]["durable_verified_trials"] == 1
    assert report["harness"] is True and {f["kind"] for f in report["trials"][0]["faults"]} == {"partition-heal", "isolate-pair"}


def test_a_fault_after_a_slow_link_waits_until_its_straggler_can_be_named():
    from elastic_llm.soak.plan import GAP, SLOW_GAP

    plans = plan_soak(KINDS, 20, 7, seed=2, stages=4)
    pairs = [(a, b) for p in plans for a, b in zip(p.faults, p.faults[1:])]
    assert any(a.kind is FaultKind.SLOW_LINK for a, _ in pairs)
    assert all(b.step - a.step >= (SLOW_GAP if a.kind is FaultKind.SLOW_LINK else GAP) for a, b in pairs)


def test_a_straggler_whose_node_the_next_fault_takes_before_the_move_counts_as_told_apart():
    plan = TrialPlan(0, (Fault(FaultKind.SLOW_LINK, 8, 0), Fault(FaultKind.NODE, 14, 0)), 17)
    lines = steps(17) + [
        {"event": "chaos", "step": 9, "kill": "slow"}, {"event": "straggler", "step": 14, "node": "c" * 20, "share": 0.76},
        {"event": "chaos", "step": 15, "kill": "node"},
        {"event": "recovery", "step": 15, "stage": 0, "replica": 0, "source": "parity", "committed_steps_lost": 0, "lossless": True, "seconds": 3.0},
    ]
    outcomes, failed = judge_trial(trial_run(plan, lines, 60.0, None), {s: 1.0 + s for s in range(1, 18)})
    assert failed == [] and "the next fault (node of stage 0) took its node before its stages moved" in outcomes[0].what
    other = TrialPlan(0, (Fault(FaultKind.SLOW_LINK, 8, 0), Fault(FaultKind.NODE, 14, 2)), 17)  # another stage's node: not an excuse
    outcomes, _ = judge_trial(trial_run(other, lines, 60.0, None), {s: 1.0 + s for s in range(1, 18)})
    assert not outcomes[0].matched and "not moved off it" in outcomes[0].what


def test_a_killed_manager_on_the_harness_counts_as_replaced_once_a_later_version_is_flushed():
    plan = TrialPlan(0, (Fault(FaultKind.MANAGER, 5, 0),), 12)
    struck = steps(12) + [{"event": "chaos", "step": 6, "kill": "smp"}, {"event": "durable_failed", "step": 2}]
    assert trial_run(plan, struck + [{"event": "durable", "step": 8}], 30.0, None).injections[0].manager_replaced is True
    run = trial_run(plan, struck + [{"event": "durable", "step": 6}], 30.0, None)  # a version from before the kill: no proof
    assert run.injections[0].manager_replaced is False and not judge_trial(run, {s: 1.0 + s for s in range(1, 13)})[0][0].matched
