"""A link cut between two live nodes: which side the run sets aside, for how long, and what the
controller's view of its nodes says meanwhile (pure rule and the guard over a fake runtime)."""

from __future__ import annotations

import os

import pytest

from elastic_llm.config import ConfigError, RecoveryConfig
from elastic_llm.config.loading import load_config
from elastic_llm.controller.links import LinkGuard
from elastic_llm.recovery.links import SetAside, pair, pick_side

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "tiny.yaml")


def test_the_node_cut_from_most_peers_goes_whatever_it_hosts():
    cut = [pair("b", "a"), pair("b", "c"), pair("b", "d")]
    assert pick_side(cut, {"a": 1, "b": 9, "c": 1, "d": 1}, {}) == "b"


def test_a_single_pair_gives_up_the_side_hosting_fewer_actors_then_the_one_set_aside_before_then_the_greater_id():
    assert pick_side([("a", "b")], {"a": 1, "b": 3}, {}) == "a"
    assert pick_side([("a", "b")], {"a": 2, "b": 2}, {"a": 1}) == "a"
    assert pick_side([("a", "b")], {"a": 2, "b": 2}, {}) == "b"
    with pytest.raises(ValueError):
        pick_side([], {}, {})


def test_a_node_set_aside_again_waits_twice_as_long_and_its_time_ends():
    t = SetAside().add("n", 100.0, 30.0)
    assert t.active(129.9) == {"n"} and t.active(130.0) == frozenset()
    t = t.add("n", 200.0, 30.0)
    assert t.count("n") == 2 and t.ends("n") == 260.0 and t.active(259.0) == {"n"}
    t = t.add("m", 200.0, 30.0)
    assert t.active(231.0) == {"n"} and t.count("m") == 1


class FakeNodes:
    """The runtime's nodes: four alive with slots, one suspect of the watch, and the pairs cut."""

    def __init__(self, cut):
        self.cut, self.asked = cut, []

    def alive(self):
        return {"a", "b", "c", "d"}

    def with_slots(self):
        return ["a", "b", "c", "d"]

    def suspects(self):
        return {"d"}

    def cut_pairs(self, nodes):
        self.asked.append(nodes)
        return frozenset(p for p in self.cut if set(p) <= nodes)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


class Lines:
    def __init__(self):
        self.lines = []

    def emit(self, event):
        self.lines.append(dict(event))
        return event


def test_the_guard_sets_one_side_aside_with_a_line_and_counts_it_a_suspect_without_slots_until_its_time_is_over():
    inner, clock, lines = FakeNodes({("a", "b")}), Clock(), Lines()
    guard = LinkGuard(inner, clock, RecoveryConfig(link_set_aside_s=60.0), lines)
    assert guard.check(5, {"a": 2, "b": 1, "c": 1, "d": 1}) == "b"
    assert inner.asked == [{"a", "b", "c"}]  # the watch's suspect is not probed
    [line] = lines.lines
    assert line["event"] == "link_cut" and line["pairs"] == [["a", "b"]] and line["set_aside"] == "b" and line["for_s"] == 60.0 and line["times"] == 1
    assert guard.suspects() == {"b", "d"} and guard.with_slots() == ["a", "c", "d"] and guard.set_aside() == {"b"}
    clock.now += 60.0
    assert guard.suspects() == {"d"} and "b" in guard.with_slots()
    assert guard.check(9, {"a": 2, "b": 1}) == "b" and lines.lines[-1]["for_s"] == 120.0 and lines.lines[-1]["times"] == 2


def test_the_guard_sets_nothing_aside_when_every_pair_answers():
    lines = Lines()
    guard = LinkGuard(FakeNodes(set()), Clock(), RecoveryConfig(link_set_aside_s=60.0), lines)
    assert guard.check(3, {"a": 1, "b": 1}) is None and guard.set_aside() == frozenset() and lines.lines == []


@pytest.mark.parametrize("override, words", [
    ("recovery.link_set_aside_s=0", "recovery.link_set_aside_s=0.0 must be > 0 seconds"),
    ("chaos.events=[{step: 2, kill: slow, stage: 3, mbit: 0}]", "mbit=0.0 must be > 0 Mbit/s"),
])
def test_bad_link_settings_name_the_field_and_the_fix(override, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("[", r"\[")):
        load_config(TINY, [override])


def test_status_shows_a_node_set_aside_and_a_straggler_as_events():
    from elastic_llm.monitor import event_of

    cut = event_of({"event": "link_cut", "time": 5.0, "step": 5, "pairs": [["a", "b"]], "set_aside": "b" * 20, "for_s": 300.0, "times": 1})
    slow = event_of({"event": "straggler", "time": 9.0, "step": 9, "node": "c" * 20, "share": 0.42, "node_mb_s": 2.4, "fastest_mb_s": 340.0,
                     "for_s": 300.0, "times": 1})
    assert cut is not None and cut.kind == "link_cut" and cut.text == "node bbbbbbbbbbbb set aside for 300 s: cut from 1 peer(s)"
    assert slow is not None and slow.kind == "straggler" and "node cccccccccccc is a straggler: its links at 2.4 MB/s (fastest 340.0) cost 42%" in slow.text
