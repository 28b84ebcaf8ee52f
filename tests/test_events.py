"""The typed metrics events: every kind writes the line it reads back, reads as that line, and a
reader takes lines of other writers (older, newer, hand-made) without refusing them. Pure."""

import json
from dataclasses import MISSING, fields

import pytest

from elastic_llm import events
from elastic_llm.controller.metrics import MetricsWriter

def sample(cls):
    """An event of ``cls`` with every field that has no default set to a value of its type
    (the annotations are strings: the module uses postponed evaluation)."""
    out = {}
    for f in fields(cls):
        if f.name == "time" or f.default is not MISSING or f.default_factory is not MISSING:
            continue
        out[f.name] = {"int": 3, "float": 1.5, "bool": True}.get(str(f.type).split(" ")[0], "x")
    return cls(time=10.0, **out)


@pytest.mark.parametrize("kind", sorted(events.KINDS))
def test_every_kind_reads_back_the_line_it_writes(kind, tmp_path):
    ev = sample(events.KINDS[kind])
    line = ev.record()
    assert line["event"] == kind and line["time"] == 10.0
    assert events.parse(json.loads(json.dumps(line))) == ev
    assert dict(ev) == line and ev["event"] == kind  # the event reads as its line
    writer = MetricsWriter(tmp_path / "m.jsonl")
    assert writer.emit(ev) is ev
    writer.close()
    assert events.read_events(tmp_path / "m.jsonl") == [ev]


def test_spans_and_details_are_keys_of_the_line_and_come_back_in_place():
    ev = events.Recovery(step=5, stage=1, replica=0, source="checkfree", lossless=False, rollback_steps=0, seconds=2.0,
                         reason="r", failure="f", weights=[0.6, 0.4], donors=[2, 0], spans={"plan_s": 0.1, "state_s": 0.3})
    line = ev.record()
    assert line["plan_s"] == 0.1 and line["weights"] == [0.6, 0.4] and "spans" not in line
    assert "survivors_restored_from_own_copy" not in line and "params_crc32" not in line  # optional fields left at None
    back = events.parse(line)
    assert back.spans == {"plan_s": 0.1, "state_s": 0.3} and back.weights == [0.6, 0.4] and back == ev


def test_lines_of_other_writers_are_read_not_refused():
    old = events.parse({"event": "recovery", "step": 4, "stage": 2, "source": "parity", "seconds": 1.0})  # no time, fewer keys
    assert isinstance(old, events.Recovery) and old.source == "parity" and old.time is None and old.lossless is None
    assert events.parse({"event": "a_kind_from_a_newer_version", "step": 1}) is None
    assert events.parse({"step": 3, "loss": 2.0}) is None  # a step line
    extra = events.parse({"event": "state", "step": 1, "old": "running", "new": "recovering", "reason": "", "time": 1.0, "new_key": 7})
    assert isinstance(extra, events.StateChange) and "new_key" not in extra  # a key the kind does not know is dropped
