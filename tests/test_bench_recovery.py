"""Pure helpers of ``benchmarks/recovery.py``: metrics lines -> seconds per path, ratios, cluster
shapes. No Ray."""

import pytest

from benchmarks.recovery import (
    adopted_standby,
    cluster_plan,
    full_restart_lost,
    path_overrides,
    path_result,
    product_spans,
    reference_rates,
    target_check,
    timeline,
)
from elastic_llm.config import load_config

from .conftest import REPO, wait_until


def state(t, old, new):
    return {"event": "state", "time": t, "old": old, "new": new, "reason": ""}


def steps(*done):
    return [{"step": s, "t": t, "step_s": d} for s, t, d in done]


def test_timeline_of_a_recovery_splits_detection_handling_and_the_next_step():
    lines = [
        {"event": "start", "time": 0.0},
        {"step": 1}, {"step": 2}, {"step": 3},
        {"event": "chaos", "time": 10.0, "step": 4, "kill": "stage"},
        state(10.4, "running", "recovering"),
        {"event": "recovery", "stage": 1, "replica": 0, "source": "local_smp", "rollback_steps": 0, "seconds": 1.5},
        state(12.0, "recovering", "running"),
        {"step": 4}, {"step": 5},
    ]
    done = steps((1, 3.0, 2.0), (2, 6.0, 0.9), (3, 7.0, 1.1), (4, 13.0, 0.95), (5, 14.0, 1.0))
    t = timeline(lines, done)
    assert t["seconds"] == 3.0 and t["to_handler_s"] == 0.4 and t["handler_s"] == 1.6 and t["next_step_s"] == 1.0
    assert t["product_seconds"] == 1.5 and t["sources"] == ["local_smp"] and t["rollback_steps"] == 0
    assert t["next_step"] == 4 and t["restored"] == [(1, 0)] and t["steps_before_handler"] == 0
    assert t["steady_step_s"] == 1.0  # median of steps 2 and 3: the first step is not steady
    assert timeline(lines, done, steady_from=3)["steady_step_s"] == 1.1  # step 3 alone (step 2 ran beside the standbys' starts)
    assert t["lost_vs_steady_s"] == 2.0  # 3 s for one step of 1 s
    assert t["states"] == ["running->recovering", "recovering->running"]
    assert t["window"] == (10.0, 13.0)


def test_a_peer_copy_reports_its_bytes_and_rate_beside_memcpy_and_a_loopback_socket():
    lines = [
        {"step": 1}, {"step": 2},
        {"event": "chaos", "time": 10.0, "step": 3, "kill": "stage"},
        state(10.2, "running", "recovering"),
        {"event": "recovery", "stage": 0, "replica": 1, "source": "dp_peer", "rollback_steps": 0, "seconds": 0.5, "state_bytes": 4_000_000, "transfer_s": 0.002},
        {"event": "recovery", "stage": 1, "replica": 1, "source": "dp_peer", "rollback_steps": 0, "seconds": 0.5, "state_bytes": 8_000_000, "transfer_s": 0.008},
        state(10.8, "recovering", "running"),
        {"step": 3},
    ]
    t = timeline(lines, steps((1, 3.0, 1.0), (2, 4.0, 1.0), (3, 12.0, 1.0)))
    assert t["transfer"] == {"bytes": 8_000_000, "seconds": 0.008}  # the largest copy
    assert path_result(t, True)["transfer"] == {"bytes": 8_000_000, "seconds": 0.008, "gb_s": 1.0}
    ref = reference_rates(1 << 20, rounds=2)
    assert ref["bytes"] == 1 << 20 and ref["memcpy_gb_s"] > 0 and ref["loopback_tcp_gb_s"] > 0


def test_timeline_of_a_drain_starts_at_the_request_and_skips_the_step_in_flight():
    lines = [
        {"step": 3},
        state(20.5, "running", "draining"),
        {"event": "drain", "time": 22.0, "node": "n", "moved": 4, "dropped": 0, "stayed": 0, "deadline_s": 58.0, "rollback_steps": 0, "seconds": 1.4},
        state(22.1, "draining", "running"),
        {"step": 4},
    ]
    done = steps((2, 19.0, 1.0), (3, 20.4, 1.0), (4, 23.1, 1.0))  # step 3 finished after the request
    t = timeline(lines, done, t0=20.0)
    assert t["seconds"] == 3.1 and t["to_handler_s"] == 0.5 and t["next_step"] == 4
    assert t["steps_before_handler"] == 1  # the run trained on until the controller acted
    assert t["drain"]["moved"] == 4 and t["product_seconds"] == 1.4 and "sources" not in t


def test_timeline_of_a_shrink_reports_the_resize():
    lines = [
        {"event": "chaos", "time": 5.0},
        state(6.0, "running", "recovering"),
        {"event": "resize", "time": 12.0, "from_dp": 2, "to_dp": 1, "reason": "lost stages could not be placed", "seconds": 6.0},
        {"event": "recovery", "stage": None, "replica": None, "source": "none", "rollback_steps": 0, "seconds": 6.0},
        state(12.1, "recovering", "running"),
    ]
    t = timeline(lines, steps((3, 4.0, 1.0), (4, 13.1, 1.0)))
    assert t["seconds"] == 8.1 and t["resize"] == [(2, 1, "lost stages could not be placed")] and t["restored"] == []


def test_timeline_refuses_runs_that_did_not_recover():
    with pytest.raises(ValueError, match="no chaos line"):
        timeline([state(1.0, "running", "recovering")], [])
    with pytest.raises(ValueError, match="never came back"):
        timeline([{"event": "chaos", "time": 1.0}, state(2.0, "running", "recovering"), state(3.0, "recovering", "failed")], [])
    with pytest.raises(ValueError, match="no step completed"):
        timeline([{"event": "chaos", "time": 1.0}, state(2.0, "running", "recovering"), state(3.0, "recovering", "running")], steps((1, 0.5, 0.5)))


def test_product_spans_take_the_max_over_the_lines_of_one_recovery():
    lines = [
        {"event": "state", "plan_s": 9.0},  # not a recovery line
        {"event": "recovery", "stage": 1, "plan_s": 0.1, "managers_s": 0.02, "actor_s": 0.3, "state_s": 0.2},
        {"event": "recovery", "stage": 2, "plan_s": 0.1, "managers_s": 0.02, "actor_s": 0.5, "state_s": 0.1},
    ]
    assert product_spans(lines) == {"plan_s": 0.1, "managers_s": 0.02, "actor_s": 0.5, "state_s": 0.2}
    assert product_spans([{"event": "drain", "actor_s": 1.25}]) == {"plan_s": None, "managers_s": None, "actor_s": 1.25, "state_s": None}


def test_timeline_carries_the_product_spans_and_the_drain_move_kind():
    lines = [
        {"event": "chaos", "time": 1.0},
        state(1.5, "running", "recovering"),
        {"event": "recovery", "stage": 0, "replica": 0, "source": "local_smp", "rollback_steps": 1, "plan_s": 0.05, "actor_s": 0.2, "state_s": 0.3},
        state(2.0, "recovering", "running"),
    ]
    t = timeline(lines, steps((2, 0.5, 1.0), (3, 0.9, 1.0), (4, 3.0, 1.0)))
    assert (t["plan_s"], t["actor_s"], t["state_s"]) == (0.05, 0.2, 0.3)
    drain = [state(1.2, "running", "draining"), {"event": "drain", "moved": 4, "how": "stages", "rollback_steps": 0}, state(1.4, "draining", "running")]
    assert timeline(drain, steps((2, 0.5, 1.0), (3, 2.4, 1.0)), t0=1.0)["drain"]["how"] == "stages"


def test_path_result_of_a_recovery_is_lost_time_and_its_parts():
    lines = [
        {"event": "chaos", "time": 10.0},
        state(10.4, "running", "recovering"),
        {"event": "recovery", "stage": 1, "replica": 0, "source": "local_smp", "rollback_steps": 1, "plan_s": 0.1, "actor_s": 0.2, "state_s": 0.3},
        state(11.0, "recovering", "running"),
    ]
    t = timeline(lines, steps((2, 8.0, 1.0), (3, 9.0, 1.0), (4, 12.5, 1.5)))
    r = path_result(t, True)
    assert r["lost_s"] == 1.5 and r["detect_s"] == 0.4 and r["first_step_s"] == 1.5  # 2.5 s window, one steady step of 1 s
    assert (r["plan_s"], r["actor_s"], r["state_s"], r["adopted"], r["rollback_steps"]) == (0.1, 0.2, 0.3, True, 1)
    assert "pause_s" not in r and r["lost_incl_rollback_s"] == 2.5  # the rolled-back step is trained again


def test_path_result_of_a_drain_reports_the_training_pause():
    lines = [
        state(25.0, "running", "draining"),
        {"event": "drain", "moved": 4, "dropped": 0, "stayed": 0, "rollback_steps": 0, "how": "replica", "plan_s": 0.0, "actor_s": 0.0, "state_s": 0.4},
        state(25.5, "draining", "running"),
    ]
    # notice at 20.0; steps 4..8 trained on meanwhile (5 steps), the move, then step 9 done at 26.7
    done = steps((2, 19.0, 1.0), (3, 20.0 - 0.01, 1.0), *[(s, 20.0 + 0.9 * (s - 3), 1.0) for s in range(4, 9)], (9, 26.7, 1.2))
    r = path_result(timeline(lines, done, t0=20.0), None)
    assert r["pause_s"] == 0.7  # 0.5 s draining + 1.2 s step - 1 s steady
    assert r["how"] == "replica" and r["rollback_steps"] == 0 and r["steps_trained_before_move"] == 5
    assert r["lost_s"] == 0.7  # 6.7 s for 6 steps of 1 s


def test_adopted_standby_compares_the_new_actors_pids_with_the_standbys():
    before = {"a": 10, "b": 11}
    assert adopted_standby(before, {"a": 10, "b": 50}, {50, 51}) is True
    assert adopted_standby(before, {"a": 10, "b": 60}, {50, 51}) is False  # a new process, not a standby
    assert adopted_standby(before, {"a": 10}, {50}) is None  # a shrink only drops actors
    assert adopted_standby(before, {"a": 10, "b": 11, "c": 51}, {51}) is True  # a new key (grow, spare)


def test_full_restart_lost_is_its_total_minus_one_steady_step():
    r = full_restart_lost({"total_s": 12.0, "trainer_init_s": 0.5, "setup_s": 8.0, "load_wall_s": 0.5, "first_step_s": 3.0}, 1.0)
    assert r["lost_s"] == 11.0 and r["detect_s"] is None and r["actor_s"] == 8.0 and r["state_s"] == 0.5
    assert full_restart_lost({"total_s": 12.0}, None)["lost_s"] is None


def test_targets_per_path():
    paths = {
        "local_smp": {"lost_s": 0.5}, "dp_peer": {"lost_s": 1.0}, "parity": {"lost_s": 0.0},
        "drain": {"pause_s": 0.9, "steady_step_s": 1.0, "rollback_steps": 0},
        "shrink": {"lost_s": 3.0, "detect_s": 2.5, "steady_step_s": 1.0},
    }
    t = target_check(15.0, paths)
    assert t["local_smp"]["met"] and t["local_smp"]["speedup_lost"] == 30.0
    assert t["dp_peer"]["met"]  # exactly 15x counts
    assert t["parity"]["met"] and t["parity"]["speedup_lost"] is None  # lost 0: within noise, no ratio, under the bound
    assert not target_check(15.0, {"parity": {"lost_s": None}})["parity"]["met"]  # not measured: not met
    assert t["drain"]["met"] and t["shrink"]["met"] and t["shrink"]["bound_s"] == 3.5 and t["all_met"]
    slow = target_check(15.0, {**paths, "dp_peer": {"lost_s": 1.1}, "drain": {"pause_s": 1.2, "steady_step_s": 1.0, "rollback_steps": 0},
                               "shrink": {"lost_s": 4.0, "detect_s": 2.5, "steady_step_s": 1.0}})
    assert not slow["dp_peer"]["met"] and not slow["drain"]["met"] and not slow["shrink"]["met"] and not slow["all_met"]
    assert not target_check(15.0, {})["drain"]["met"]  # not measured: not met


def test_cluster_plan_leaves_room_where_paths_need_it_and_none_for_shrink():
    plan = cluster_plan(4, 0.5)
    assert plan["local_smp"] == plan["parity"] == plan["restart"] == 4  # one stage per node, a spare slot each
    assert plan["dp_peer"] == plan["shrink"] == 4  # 8 actors fill 4 nodes of 2 slots
    assert plan["drain"] == 5  # a whole replica (4 slots) fits away from the draining node (its spare slot does not count)
    with pytest.raises(ValueError, match="cpus_per_actor"):
        cluster_plan(4, 1.0)


@pytest.mark.parametrize("path", ["dp_peer", "local_smp", "parity", "drain", "shrink", "restart"])
def test_path_overrides_load_as_valid_configs(path):
    cfg = load_config(f"{REPO}/jobs/tiny.yaml", path_overrides(path, 4, cluster_plan(4, 0.5)))
    assert cfg.parallel.dp == (2 if path in ("dp_peer", "shrink") else 1)
    assert bool(cfg.chaos.events) == (path not in ("drain", "restart"))
    assert (cfg.recovery.standby == 0) == (path == "restart")  # the restart peer starts no warm standbys


def test_detection_is_timed_from_the_victims_death_when_a_witness_saw_it():
    lines = [
        {"event": "chaos", "time": 10.0, "step": 4, "kill": "stage"},
        state(10.5, "running", "recovering"),
        state(11.0, "recovering", "running"),
    ]
    done = steps((2, 8.0, 1.0), (3, 9.0, 1.0), (4, 12.0, 1.0))
    t = timeline(lines, done, died_at=10.3)
    assert t["strike_s"] == 0.3 and t["to_handler_s"] == 0.2  # the kill landed 0.3 s into the step
    assert t["lost_vs_steady_s"] == 1.0 and t["lost_from_death_s"] == 0.7  # the step's 0.3 s before the strike: lost whatever recovers
    r = path_result(t, True)
    assert r["detect_s"] == 0.2 and r["strike_s"] == 0.3 and r["lost_s"] == 0.7 and r["lost_from_step_start_s"] == 1.0
    untimed = timeline(lines, done)
    assert untimed["strike_s"] is None and untimed["to_handler_s"] == 0.5


def test_the_death_witness_notes_when_a_process_ends_and_nothing_for_one_that_lives():
    import signal
    import subprocess
    import time

    from benchmarks.recovery import DeathWitness

    victim = subprocess.Popen(["sleep", "30"])
    witness = DeathWitness(victim.pid)
    before = time.time()
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    wait_until(lambda: witness.at is not None, 5, "the witness noting the death", every=0.01)
    witness.close()
    assert witness.at is not None and before <= witness.at <= time.time()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        w = DeathWitness(alive.pid)
        w.close()  # returns at once: the thread is stopped, not left waiting
        assert w.at is None
    finally:
        alive.kill()
        alive.wait()


def test_the_median_shot_stands_for_a_path():
    from benchmarks.recovery import median_shot

    assert median_shot([0.9, 0.2, 0.5]) == 2  # lost 0.5 is the median
    assert median_shot([0.4, 0.1]) == 1  # an even count takes the lower middle
    assert median_shot([None, 0.3, 0.7]) == 1  # a shot without a figure does not count
    assert median_shot([-0.2, 0.1, 0.05]) == 2
    assert median_shot([None]) == 0


def test_a_benchmarks_stdout_holds_its_result_alone(capfd):
    """Ray's raylets and workers write on the driver's stdout (file descriptor 1, from C): while a
    benchmark runs that goes to stderr, so ``--json > out.json`` is one JSON line."""
    import os

    from benchmarks.common import stdout_to_stderr

    with stdout_to_stderr():
        os.write(1, b"(raylet) a worker died\n")
    os.write(1, b'{"bench": "x"}\n')
    out, err = capfd.readouterr()
    assert out == '{"bench": "x"}\n' and "(raylet) a worker died" in err
