"""Pure tests of the replay trace parser, the replay planner and the replay report (no Ray)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from elastic_llm.replay.report import seconds_with_room, useful_fraction, write_report
from elastic_llm.replay.trace import (
    TraceError,
    TraceEvent,
    load_trace,
    parse_trace,
    parse_window,
    plan_replay,
)

SPOT_TRACE = Path(__file__).parent / "data" / "spot_trace.csv"


def adds(n: int, at_ms: int = 0, prefix: str = "n") -> str:
    return "".join(f"{at_ms},add,{prefix}{i}\n" for i in range(n))


def alive_before(plan, action) -> set[str]:
    """Replay nodes alive when ``action`` runs (every action listed before it applied)."""
    alive = set(plan.initial_nodes)
    for a in plan.actions[: plan.actions.index(action)]:
        if a.kind == "add":
            alive.add(a.node)
        elif a.kind == "remove":
            alive.remove(a.node)
    return alive


def alive_at(plan, t: float) -> set[str]:
    """Replay nodes alive just after every action at or before ``t`` (drains keep a node alive)."""
    alive = set(plan.initial_nodes)
    for a in plan.actions:
        if a.at_s <= t:
            if a.kind == "add":
                alive.add(a.node)
            elif a.kind == "remove":
                alive.remove(a.node)
    return alive


# --- parsing ---------------------------------------------------------------------------------


def test_parse_skips_comments_blank_lines_and_header():
    text = "# synthetic\n\ntime_ms,event,node\n0,add,a\n 5 , add , b \n\n# gap\n5,remove,a\n"
    assert parse_trace(text) == (
        TraceEvent(0, "add", "a"),
        TraceEvent(5, "add", "b"),
        TraceEvent(5, "remove", "a"),
    )


@pytest.mark.parametrize(
    ("text", "line", "bad", "fix"),
    [
        ("0,add,a\n1,add,b\n# c\n2,rem,a\n", 4, "'rem'", "write add or remove"),
        ("0,add,a\nsoon,add,b\n", 2, "'soon'", "whole milliseconds"),
        ("0,add,a\n-3,add,b\n", 2, "-3", "time_ms >= 0"),
        ("0,add,a\n1,add\n", 2, "'1,add'", "time_ms,add|remove,node_name"),
        ("0,add,a\n1,add,b,c,d\n", 2, "5 fields", "time_ms,add|remove,node_name[,zone]"),
        ("0,add,a\n1,add,b, \n", 2, "zone is empty", "leave the fourth column out"),
        ("0,add,a\n1,add, \n", 2, "empty", "write a node name"),
        ("0,add,a\n1,remove,b\n", 2, "'b'", "add it earlier"),
        ("0,add,a\n1,remove,a\n2,remove,a\n", 3, "'a'", "add it earlier"),
        ("0,add,a\n1,add,a\n", 2, "'a'", "remove it first"),
        ("0,add,a\n10,add,b\n9,add,c\n", 3, "time 9", "sort the trace by time_ms"),
        ("time_ms,event,node,price\n0,add,a,1.5\n1,add,b,-2\n", 3, "price '-2'", "dollars per node-hour >= 0"),
        ("time_ms,event,node,price\n0,add,a,cheap\n", 2, "price 'cheap'", "leave the cell empty to keep the last price"),
        ("time_ms,event,node,zone,price\n0,add,a,z1\n", 2, "4 fields, not 5", "time_ms,event,node,zone,price"),
    ],
)
def test_parse_errors_name_file_line_value_and_fix(text, line, bad, fix):
    with pytest.raises(TraceError) as err:
        parse_trace(text, name="trace.csv")
    message = str(err.value)
    assert f"trace.csv line {line}:" in message
    assert bad in message
    assert fix in message


def test_a_price_column_is_the_spot_price_from_its_event_on_and_an_empty_cell_keeps_it():
    text = "time_ms,event,node,zone,price\n0,add,a,z1,1.5\n0,add,b,z2,\n4000,remove,a,z1,3\n8000,add,c,z1,\n12000,remove,b,z2,0.5\n"
    events = parse_trace(text)
    assert [e.price for e in events] == [1.5, None, 3.0, None, 0.5] and events[0].zone == "z1"
    plan = plan_replay(events, window=(2.0, 12.0), time_scale=2.0)
    assert plan.spot_prices == ((0.0, 1.5), (1.0, 3.0))  # the price set before the window holds at its start; the one at its end is out
    assert plan_replay(parse_trace("0,add,a\n5,remove,a\n")).spot_prices == ()  # no price column: the table's price


def test_a_header_after_the_first_event_is_an_error():
    with pytest.raises(TraceError, match="trace line 2: time 'time_ms' is not an integer"):
        parse_trace("0,add,a\ntime_ms,event,node\n")


def test_trace_error_is_a_value_error():
    assert issubclass(TraceError, ValueError)


def test_a_trace_without_events_is_an_error():
    with pytest.raises(TraceError, match=r"trace\.csv: the trace has no events: add lines"):
        parse_trace("# only a comment\ntime_ms,event,node\n\n", name="trace.csv")


def test_load_trace_reads_a_file_and_names_a_missing_one(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("0,add,a\n0,add,b\n1000,remove,b\n")
    assert len(load_trace(path)) == 3
    missing = tmp_path / "nope.csv"
    with pytest.raises(TraceError, match="nope.csv: cannot read the trace"):
        load_trace(missing)
    path.write_text("0,add,a\n2,sub,a\n")
    with pytest.raises(TraceError, match=r"t\.csv line 2: 'sub'"):
        load_trace(path)


def test_spot_trace_file_parses_and_is_shaped_like_a_spot_trace():
    events = load_trace(SPOT_TRACE)
    assert SPOT_TRACE.read_text().startswith("#")
    at_zero = [e for e in events if e.time_ms == 0]
    later = [e for e in events if e.time_ms > 0]
    assert len(at_zero) == 16 and all(e.kind == "add" for e in at_zero)
    assert 25 <= len(later) <= 40
    assert events[-1].time_ms <= 7_200_000
    removal_bursts = Counter(e.time_ms for e in later if e.kind == "remove")
    assert sum(1 for n in removal_bursts.values() if n >= 2) >= 2
    counts = [p[1] for p in plan_replay(events).trace_alive]
    assert 5 <= min(counts) <= 7 and max(counts[len(counts) // 2 :]) >= 13


# --- windows, time and node scaling ----------------------------------------------------------


def test_window_initial_fleet_is_alive_at_start_and_only_events_inside_are_replayed():
    text = adds(4) + "1000,remove,n0\n2000,add,x\n3000,remove,n1\n4000,add,y\n5000,remove,x\n"
    plan = plan_replay(parse_trace(text), window=(2.0, 4.5))
    # at trace second 2: n0 gone, x added (the event at start is part of the initial fleet)
    assert len(plan.initial_nodes) == 4
    assert [(a.at_s, a.kind) for a in plan.actions] == [(1.0, "remove"), (2.0, "add")]
    assert plan.duration_s == 2.5
    assert plan.trace_alive == ((0.0, 4), (1.0, 3), (2.0, 4), (2.5, 4))


def test_whole_trace_by_default_and_time_scale_divides_times():
    text = adds(2) + "60000,add,c\n120000,remove,n0\n180000,add,d\n"
    plan = plan_replay(parse_trace(text), time_scale=60)
    assert plan.duration_s == 3.0  # trace 0..180 s at 60x
    # the last event (trace second 180) is the end of the replay, not an action
    assert [(a.at_s, a.kind) for a in plan.actions] == [(1.0, "add"), (2.0, "remove")]
    assert plan.initial_nodes == ("r0", "r1")


def test_node_scale_quarter_of_32_is_8_and_never_zero_while_alive():
    text = adds(32) + "".join(f"{1000 * (i + 1)},remove,n{i}\n" for i in range(31))
    plan = plan_replay(parse_trace(text) + (TraceEvent(99_000, "add", "z"),), node_scale=0.25)
    assert plan.initial_nodes == tuple(f"r{k}" for k in range(8))
    assert min(n for _, n in plan.replay_alive) == 1
    assert plan.replay_alive[-1] == (plan.duration_s, 1)


def test_a_burst_of_four_removals_at_half_scale_removes_two_at_once():
    text = adds(8) + "".join(f"5000,remove,n{i}\n" for i in range(4)) + "9000,add,q\n"
    plan = plan_replay(parse_trace(text), node_scale=0.5)
    removes = [a for a in plan.actions if a.kind == "remove"]
    assert len(removes) == 2 and {a.at_s for a in removes} == {5.0}
    assert len({a.node for a in removes}) == 2
    assert plan.replay_alive == ((0.0, 4), (5.0, 2), (9.0, 2))


def test_added_nodes_get_fresh_labels_never_reused():
    text = adds(2) + "1000,remove,n0\n2000,add,a\n3000,remove,a\n4000,add,b\n5000,add,c\n"
    plan = plan_replay(parse_trace(text + "6000,add,d\n"))  # the last event ends the replay
    added = [a.node for a in plan.actions if a.kind == "add"]
    assert added == ["r2", "r3", "r4"]


# --- seeded victims and notice ---------------------------------------------------------------


def test_victims_are_seeded_and_alive_when_removed():
    events = load_trace(SPOT_TRACE)
    plans = [plan_replay(events, node_scale=0.75, seed=7) for _ in range(2)]
    assert plans[0] == plans[1]
    for a in plans[0].actions:
        if a.kind == "remove":
            assert a.node in alive_before(plans[0], a)


def test_notice_turns_each_remove_into_a_prior_drain_of_the_same_node():
    text = adds(6) + "5000,remove,n0\n20000,remove,n1\n20000,remove,n2\n30000,add,m\n"
    plan = plan_replay(parse_trace(text), notice_s=8.0, seed=3)
    drains = [a for a in plan.actions if a.kind == "drain"]
    removes = [a for a in plan.actions if a.kind == "remove"]
    assert len(drains) == len(removes) == 3
    assert len({a.node for a in drains}) == 3  # no node drained twice
    by_node = {a.node: a for a in drains}
    for r in removes:
        d = by_node[r.node]
        assert d.at_s == max(0.0, r.at_s - 8.0)
        assert d.at_s + d.deadline_s == r.at_s
        assert r.node in alive_before(plan, d)  # drained while alive
    early = next(a for a in removes if a.at_s == 5.0)
    assert by_node[early.node].at_s == 0.0 and by_node[early.node].deadline_s == 5.0  # clamped
    keys = [(a.at_s, ["drain", "remove", "add"].index(a.kind)) for a in plan.actions]
    assert keys == sorted(keys)
    assert [a for a in plan.actions if a.kind != "drain"] == [
        a for a in plan_replay(parse_trace(text), seed=3).actions
    ]


def test_no_notice_means_no_drains():
    plan = plan_replay(load_trace(SPOT_TRACE))
    assert not [a for a in plan.actions if a.kind == "drain"]


def test_drains_never_precede_the_node_being_added():
    text = adds(1) + adds(5, at_ms=10_000, prefix="b") + "12000,remove,b0\n12000,remove,b1\n"
    text += "12000,remove,b2\n12000,remove,n0\n15000,add,z\n"
    plan = plan_replay(parse_trace(text), notice_s=30.0, seed=0)
    drains = [a for a in plan.actions if a.kind == "drain"]
    assert len(drains) == 4
    for d in drains:
        assert d.node in alive_before(plan, d)
        assert d.deadline_s >= 0
    # only r0 was alive at the notice time (0): it gets the full notice, the rest get none
    assert sorted((d.at_s, d.deadline_s) for d in drains) == [(0.0, 12.0)] + [(12.0, 0.0)] * 3


def test_at_equal_times_drains_come_before_removes_and_adds():
    text = adds(4) + "10000,add,x\n20000,remove,n0\n20000,remove,n1\n30000,add,y\n"
    plan = plan_replay(parse_trace(text), notice_s=10.0, seed=1)
    assert [(a.at_s, a.kind) for a in plan.actions] == [
        (10.0, "drain"),
        (10.0, "drain"),
        (10.0, "add"),
        (20.0, "remove"),
        (20.0, "remove"),
    ]
    for seed in range(10):  # r4 is added at the drain time, after the drains: never a victim
        plan = plan_replay(parse_trace(text), notice_s=10.0, seed=seed)
        assert "r4" not in {a.node for a in plan.actions if a.kind == "remove"}


def test_replay_alive_is_consistent_with_actions():
    plan = plan_replay(load_trace(SPOT_TRACE), time_scale=30, node_scale=0.5, notice_s=20, seed=5)
    assert plan.replay_alive[0] == (0.0, len(plan.initial_nodes))
    assert plan.replay_alive[-1][0] == plan.duration_s == 240.0
    for t, n in plan.replay_alive:
        assert len(alive_at(plan, t)) == n
    change_times = {a.at_s for a in plan.actions if a.kind != "drain"}
    assert {t for t, _ in plan.replay_alive[1:-1]} <= change_times
    for t, n in plan.trace_alive:
        assert len(alive_at(plan, t)) == max(round(n * 0.5), 1)


@pytest.mark.parametrize(
    ("kwargs", "option", "fix"),
    [
        ({"time_scale": 0}, "time_scale", "e.g. 60"),
        ({"time_scale": -2.0}, "time_scale", "e.g. 60"),
        ({"node_scale": 0.0}, "node_scale", "e.g. 0.25"),
        ({"notice_s": -1}, "notice_s", "pass 0"),
        ({"window": (5.0, 2.0)}, "window", "--window"),
        ({"window": (0.0, 99.0)}, "window", "--window"),
        ({"window": ("0", "2")}, "window", "--window"),
        ({"window": (1.0,)}, "window", "--window"),
    ],
)
def test_plan_arguments_are_validated(kwargs, option, fix):
    events = parse_trace(adds(2) + "3000,remove,n0\n")
    with pytest.raises(ValueError) as err:
        plan_replay(events, **kwargs)
    assert str(err.value).startswith(option) and fix in str(err.value)


def test_parse_window():
    assert parse_window("600:4200") == (600.0, 4200.0)
    assert parse_window("0:1.5") == (0.0, 1.5)
    for bad in ("600", "a:b", "1:2:3", "5:2", "-1:3", "nan:4"):
        with pytest.raises(ValueError, match="--window .*e.g. --window 600:4200"):
            parse_window(bad)


# --- report ----------------------------------------------------------------------------------


def test_seconds_with_room():
    alive = ((0.0, 4), (10.0, 2), (25.0, 5), (40.0, 5))
    assert seconds_with_room(alive, 40.0, 4) == 25.0  # 0-10 and 25-40
    assert seconds_with_room(alive, 40.0, 2) == 40.0
    assert seconds_with_room(alive, 40.0, 6) == 0.0
    assert seconds_with_room(alive, 30.0, 5) == 5.0  # clipped at duration
    assert seconds_with_room(((0.0, 3),), 12.5, 3) == 12.5  # last count holds to the end


def test_useful_fraction():
    assert useful_fraction(5.0, 0.0) is None
    assert useful_fraction(5.0, 20.0) == 0.25
    assert useful_fraction(30.0, 20.0) == 1.0
    assert useful_fraction(-1.0, 20.0) == 0.0


def test_write_report_round_trips_json_and_draws_a_png(tmp_path):
    out = tmp_path / "new" / "dir"
    report = {"title": "spot replay", "useful_fraction": 0.5, "nodes_needed": 2}
    timeline = [(0.0, 4, 0), (10.0, 3, 12), (20.5, 5, 30)]
    json_path, png_path = write_report(out, report, timeline)
    assert (json_path, png_path) == (out / "replay.json", out / "replay.png")
    data = json.loads(json_path.read_text())
    assert data == {
        **report,
        "timeline": [
            {"t_s": 0.0, "nodes_alive": 4, "steps_committed": 0},
            {"t_s": 10.0, "nodes_alive": 3, "steps_committed": 12},
            {"t_s": 20.5, "nodes_alive": 5, "steps_committed": 30},
        ],
    }
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir()) == ["replay.json", "replay.png"]  # no temp left
    assert report == {"title": "spot replay", "useful_fraction": 0.5, "nodes_needed": 2}


def test_liveput_counts_against_an_oracle_at_the_widest_width_the_live_nodes_hold():
    from elastic_llm.replay.report import full_width_rate, liveput, oracle_steps, oracle_widths, rate_at, width_rates

    alive = ((0.0, 8), (10.0, 4), (20.0, 8))  # 2 slots per node, 4 stages: 4 replicas, then 2, then 4 (max 3)
    assert oracle_widths(alive, 2, 4, 3) == [(0.0, 3), (10.0, 2), (20.0, 3)]
    history = [{"step": s, "dp": 2, "elapsed_s": 0.5 * s} for s in range(1, 6)]  # width 2: 0.5 s a step
    history += [{"step": 6, "dp": 1, "elapsed_s": 9.0}, {"step": 7, "dp": 1, "elapsed_s": 10.0}, {"step": 8, "dp": 1, "elapsed_s": 11.0}]
    rates = width_rates(history)
    assert rates == {1: 1.0, 2: 2.0}  # the gap into the first width-1 step holds the resize: not counted
    assert rate_at(rates, 3) == 3.0 and rate_at(rates, 1) == 1.0  # unmeasured widths scale from the widest measured
    assert full_width_rate(history, 3) == 3.0 and full_width_rate(history[:2], 3) is None
    assert oracle_steps(alive, 30.0, 2, 4, 3, rates) == 3.0 * 10 + 2.0 * 10 + 3.0 * 10
    shared = {1: 1.0, 2: 1.0}  # shared cores: a width-1 step as fast as a width-2 one
    assert oracle_steps(((0.0, 8),), 10.0, 2, 4, 2, shared) == 10.0  # the oracle is held to what was measured
    assert liveput(30, 40.0) == 0.75 and liveput(3, 0.0) is None


def test_the_report_has_the_width_beside_the_oracles(tmp_path):
    json_path, _ = write_report(tmp_path, {"title": "t"}, [(0.0, 4, 0, 2), (5.0, 4, 9, 2)], oracle=[(0.0, 2), (4.0, 1)])
    data = json.loads(json_path.read_text())
    assert [r["width"] for r in data["timeline"]] == [2, 2]
    assert data["oracle_width"] == [{"t_s": 0.0, "width": 2}, {"t_s": 4.0, "width": 1}]


def test_a_run_that_does_not_stop_after_the_replay_is_named_with_where_it_waits(caplog, capfd):
    """The replay asks the run to stop at its next step boundary; a run whose thread waits
    somewhere instead is reported (not a traceback from the CLI), with the place it waits in."""
    import threading
    import types

    from elastic_llm.replay.runner import Replay

    gate = threading.Event()

    def stuck_in_a_step():
        gate.wait(60)

    thread = threading.Thread(target=stuck_in_a_step, daemon=True)
    thread.start()
    replay = Replay.__new__(Replay)
    replay.trainer = types.SimpleNamespace(state=types.SimpleNamespace(name="running"))
    try:
        with caplog.at_level("WARNING", logger="elastic_llm.replay"):
            err = replay._hung(thread)
    finally:
        gate.set()
    assert "did not stop" in str(err) and "(state running)" in str(err) and "it waits in" in str(err)
    assert "stuck_in_a_step" in caplog.text or "stuck_in_a_step" in capfd.readouterr().err  # the whole stack is logged (to stderr once a run set the log up)
