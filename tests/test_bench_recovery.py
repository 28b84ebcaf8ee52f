"""Pure helpers of ``benchmarks/recovery.py``: metrics lines -> seconds per path, ratios, cluster
shapes. No Ray."""

import pytest

from benchmarks.recovery import (
    cluster_plan,
    path_overrides,
    span_totals,
    speedups,
    target_check,
    timeline,
)
from elastic_llm.config import load_config

from .conftest import REPO


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
    assert t["lost_vs_steady_s"] == 2.0  # 3 s for one step of 1 s
    assert t["states"] == ["running->recovering", "recovering->running"]
    assert t["window"] == (10.0, 13.0)


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


def test_span_totals_sum_per_name_inside_the_window():
    spans = [("group.replace", 0.5, 2.0), ("group.replace", 3.0, 4.5), ("recovery.observe", 2.5, 2.75), ("group.replace", 9.0, 9.5)]
    assert span_totals(spans, 1.0, 5.0) == {"group.replace": 1.5, "recovery.observe": 0.25}


def test_speedups_and_target():
    sp = speedups(10.0, {"a": 0.5, "b": 2.0, "c": None})
    assert sp == {"a": 20.0, "b": 5.0, "c": None}
    assert target_check(sp) == {"target_speedup": 10.0, "met": False, "not_met_by": ["b", "c"]}
    assert target_check({"a": 20.0})["met"]


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
