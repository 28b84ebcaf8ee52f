"""The controller's states, transitions and failure budget are pure: no Ray, no clock."""

import pytest

from elastic_llm.controller.states import (
    ALLOWED,
    EXIT_FAILED,
    EXIT_UNRECOVERABLE,
    Capacity,
    Draining,
    Failed,
    Finished,
    Recovering,
    Resizing,
    Running,
    Starting,
    TransitionError,
    WaitingForCapacity,
    after_failure,
    after_step,
    after_unrecoverable,
    check_transition,
    is_terminal,
    start_waiting,
    while_waiting,
)
from elastic_llm.controller.drains import Drain
from elastic_llm.recovery.failure import FailureBudget, FailurePolicy, StepFailure

CAP = Capacity("2 x {CPU: 1}", "0 CPUs free on 1 node")


def failure(step=5, stage=1, during="step"):
    return StepFailure(step, stage, 0, "RuntimeError: boom", "Traceback\n  File x\nRuntimeError: boom", during)


def budget_after(*steps):
    b = FailureBudget()
    for s in steps:
        b = b.record(s)
    return b


# ---------------------------------------------------------------------- steps


def test_a_step_before_the_end_keeps_running_and_the_last_one_finishes():
    assert after_step(3, 10) == Running(3)
    assert after_step(10, 10) == Finished(10)
    assert after_step(0, 0) == Finished(0)


def test_after_a_step_a_stop_finishes_drains_come_before_growing():
    d = (Drain("n1", 100.0),)
    assert after_step(3, 10, stop=True, drains=d, width=1, grow_to=2) == Finished(3)
    assert after_step(3, 10, drains=d, width=1, grow_to=2) == Draining(3, d)
    assert after_step(3, 10, width=1, grow_to=2) == Resizing(3, 1, 2, "capacity")
    assert after_step(3, 10, width=2, grow_to=2) == Running(3)  # not wider than now: nothing to do
    assert after_step(10, 10, drains=d) == Finished(10)


# ---------------------------------------------------------------------- failure budget


def test_budget_counts_in_total_and_per_step_and_is_immutable():
    b0 = FailureBudget()
    b1 = b0.record(5)
    b2 = b1.record(5).record(7)
    assert (b0.total, b0.of_step(5)) == (0, 0)
    assert (b1.total, b1.of_step(5)) == (1, 1)
    assert (b2.total, b2.of_step(5), b2.of_step(7), b2.of_step(6)) == (3, 2, 1, 0)


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_the_same_step_is_retried_max_retries_per_step_times_then_the_run_fails(retries):
    policy = FailurePolicy(max_failures=100, max_retries_per_step=retries)
    b = FailureBudget()
    for attempt in range(1, retries + 2):
        b = b.record(5)
        state = after_failure(failure(), b, policy)
        if attempt <= retries:
            assert state == Recovering(failure(), 1), attempt
        else:
            assert isinstance(state, Failed) and state.exit_code == EXIT_FAILED
            assert f"step 5 failed {retries + 1} times" in state.reason
            assert f"recovery.max_retries_per_step={retries}" in state.reason
            assert "stage 1 replica 0" in state.reason and "RuntimeError: boom" in state.reason
            assert state.failure == failure()


def test_failures_of_different_steps_spend_the_total_budget():
    policy = FailurePolicy(max_failures=3, max_retries_per_step=10)
    b = budget_after(1, 2, 3)
    assert isinstance(after_failure(failure(3), b, policy), Recovering)
    state = after_failure(failure(4), b.record(4), policy)
    assert isinstance(state, Failed) and "4 failures in this run and recovery.max_failures=3" in state.reason


def test_zero_max_failures_stops_at_the_first_failure():
    state = after_failure(failure(), budget_after(5), FailurePolicy(0, 3))
    assert isinstance(state, Failed) and state.exit_code == EXIT_FAILED


def test_a_failure_during_recovery_re_plans_with_the_next_attempt():
    policy = FailurePolicy(100, 3)
    again = failure(during="recovery")
    assert after_failure(again, budget_after(5, 5), policy, attempt=2) == Recovering(again, 2)
    assert str(again).startswith("recovery of step 5, stage 1 replica 0 failed")


def test_step_failure_from_an_exception_keeps_the_cause_and_the_first_lines():
    class Wrapped(Exception):  # like RayTaskError: ANSI header in str(), the actor's exception in .cause
        def __init__(self):
            self.cause = ValueError("bad shard\nsecond line")
            super().__init__("\x1b[36mray::StageWorker.forward()\x1b[39m (pid=1)\n" + "\n".join(f"  line {i}" for i in range(20)))

    f = StepFailure.from_exception(7, Wrapped(), 2, 1)
    assert f.error == "ValueError: bad shard"
    assert f.trace.splitlines()[0] == "ray::StageWorker.forward() (pid=1)"  # colour codes stripped
    assert len(f.trace.splitlines()) == 8
    assert f.where == "step 7, stage 2 replica 1"
    assert StepFailure.from_exception(7, TimeoutError("slow")).where == "step 7"


def test_unrecoverable_is_its_own_exit_code():
    state = after_unrecoverable(failure(), "2 nodes of an erasure group lost")
    assert state.exit_code == EXIT_UNRECOVERABLE and "2 nodes of an erasure group lost" in state.reason


# ---------------------------------------------------------------------- waiting for capacity


@pytest.mark.parametrize("resume", [Starting(), Recovering(failure())])
def test_capacity_wait_resumes_what_it_interrupted_once_placed(resume):
    waiting = start_waiting(resume, CAP, now=100.0, timeout_s=600.0)
    assert (waiting.since, waiting.deadline, waiting.resume) == (100.0, 700.0, resume)
    assert while_waiting(waiting, placed=True, capacity=CAP, now=150.0) == resume


def test_capacity_wait_keeps_waiting_with_what_is_missing_now():
    waiting = start_waiting(Starting(), CAP, now=0.0, timeout_s=60.0)
    later = Capacity("1 x {CPU: 1}", "0 CPUs free on 2 nodes")
    state = while_waiting(waiting, placed=False, capacity=later, now=59.9)
    assert isinstance(state, WaitingForCapacity) and state.capacity == later and state.deadline == 60.0


@pytest.mark.parametrize("resume", [Starting(), Recovering(failure())])
def test_capacity_wait_fails_at_its_deadline_naming_what_was_missing(resume):
    waiting = start_waiting(resume, CAP, now=10.0, timeout_s=30.0)
    state = while_waiting(waiting, placed=False, capacity=CAP, now=40.0)
    assert isinstance(state, Failed) and state.exit_code == EXIT_FAILED
    assert "need 2 x {CPU: 1}; the cluster has 0 CPUs free on 1 node" in state.reason
    assert "recovery.capacity_timeout_s=30" in state.reason
    assert state.failure == (resume.failure if isinstance(resume, Recovering) else None)
    if isinstance(resume, Recovering):
        assert "while recovering from: step 5, stage 1 replica 0 failed: RuntimeError: boom" in state.reason
    else:
        assert "to start the run" in state.reason


def test_placed_at_the_deadline_still_resumes():
    waiting = start_waiting(Starting(), CAP, now=0.0, timeout_s=5.0)
    assert while_waiting(waiting, placed=True, capacity=CAP, now=99.0) == Starting()


# ---------------------------------------------------------------------- the transition table


STATES = [
    Starting(), Running(1), Recovering(failure()), start_waiting(Starting(), CAP, 0.0, 1.0),
    Resizing(1, 1, 2, "capacity"), Draining(1, (Drain("n", None),)), Failed("x", 4), Finished(1),
]


@pytest.mark.parametrize("old", STATES, ids=lambda s: s.name)
@pytest.mark.parametrize("new", STATES, ids=lambda s: s.name)
def test_only_the_designed_transitions_are_allowed(old, new):
    after_a_step = {"running", "resizing", "draining", "finished"}
    designed = {(a, b) for a in ("starting", "running", "recovering", "resizing", "draining") for b in after_a_step} | {
        ("starting", "waiting_for_capacity"), ("starting", "failed"),
        ("running", "recovering"), ("running", "failed"),
        ("resizing", "recovering"), ("resizing", "failed"), ("draining", "recovering"), ("draining", "failed"),
        ("recovering", "recovering"), ("recovering", "waiting_for_capacity"), ("recovering", "failed"),
        ("waiting_for_capacity", "waiting_for_capacity"), ("waiting_for_capacity", "starting"),
        ("waiting_for_capacity", "recovering"), ("waiting_for_capacity", "failed"),
    }
    if (old.name, new.name) in designed:
        check_transition(old, new)
    else:
        with pytest.raises(TransitionError, match=f"{old.name} -> {new.name}"):
            check_transition(old, new)


def test_every_state_has_a_row_and_only_failed_and_finished_are_terminal():
    assert set(ALLOWED) == {type(s) for s in STATES}
    assert [s.name for s in STATES if is_terminal(s)] == ["failed", "finished"]
    assert all(ALLOWED[type(s)] == () for s in STATES if is_terminal(s))


# ---------------------------------------------------------------------- elastic decisions


def test_a_drain_waits_for_its_spares_unless_there_is_no_room_or_the_deadline_is_near():
    from elastic_llm.controller.elastic import drain_due

    assert not drain_due(0, 1, started_any=True, seconds_left=15.0, margin_s=5.0)  # spare starting: train on
    assert drain_due(1, 1, started_any=True, seconds_left=15.0, margin_s=5.0)  # spare ready: move now
    assert drain_due(0, 1, started_any=False, seconds_left=15.0, margin_s=5.0)  # no room: act now (the replicas stay in place)
    assert drain_due(0, 1, started_any=True, seconds_left=4.0, margin_s=5.0)  # deadline near: act with what there is
    assert not drain_due(1, 2, started_any=True, seconds_left=None, margin_s=5.0)  # no deadline: wait for both


def test_a_recovering_state_carries_the_policys_reason_so_it_is_decided_once():
    policy = FailurePolicy(100, 3)
    budget = budget_after(5)
    state = after_failure(failure(), budget, policy)
    assert isinstance(state, Recovering) and state.reason == policy.decide(failure(), budget).reason != ""


def test_progress_is_replaced_by_pure_steps_never_changed_in_place():
    from elastic_llm.controller.states import Progress

    p0 = Progress()
    p = p0.stepped(1).committed(1).stepped(2).step_failed(3).charged(3)
    assert p0 == Progress()  # the record it came from is unchanged
    assert (p.step, p.committed_high, p.failures, p.budget.total, p.budget.of_step(3)) == (2, 1, 1, 2, 2)
    back = p.rolled_back(1)
    assert back.step == 1 and back.committed_high == 1 and back.budget == p.budget
    assert p.committed(0).committed_high == 1  # never lower
    assert p.resumed(7).step == 7 and p.resumed(7).committed_high == 7
    assert p.drained(frozenset({"a"})).drained(frozenset({"b"})).drains_seen == {"a", "b"}
