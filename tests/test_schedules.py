"""Schedules are pure: checked without Ray or torch."""

import pytest

from elastic_llm.pipeline.schedules import Op, build_schedule, gpipe, one_f_one_b, submission_order


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (1, 4), (2, 1), (4, 4), (4, 8), (6, 3), (3, 7)])
def test_every_stage_runs_each_forward_and_backward_once(name, stages, micro):
    schedule = build_schedule(name, stages, micro)
    assert len(schedule) == stages
    for ops in schedule:
        assert sorted(ops, key=lambda o: (o.kind, o.mb)) == [Op("B", i) for i in range(micro)] + [Op("F", i) for i in range(micro)]
        for i in range(micro):  # backward of a microbatch after its forward
            assert ops.index(Op("F", i)) < ops.index(Op("B", i))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 3), (4, 4), (4, 8), (8, 2)])
def test_submission_order_respects_dependencies(name, stages, micro):
    order = submission_order(build_schedule(name, stages, micro))
    pos = {item: i for i, item in enumerate(order)}
    assert len(order) == 2 * stages * micro
    for s in range(stages):
        for m in range(micro):
            if s > 0:
                assert pos[(s - 1, Op("F", m))] < pos[(s, Op("F", m))]
            if s < stages - 1:
                assert pos[(s + 1, Op("B", m))] < pos[(s, Op("B", m))]
    # per-stage order is the schedule's order
    schedule = build_schedule(name, stages, micro)
    for s in range(stages):
        assert [op for st, op in order if st == s] == schedule[s]


def _peak_in_flight(ops):
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak


def test_1f1b_bounds_activation_memory_gpipe_does_not():
    stages, micro = 4, 8
    for s, ops in enumerate(one_f_one_b(stages, micro)):
        assert _peak_in_flight(ops) == stages - s
    for ops in gpipe(stages, micro):
        assert _peak_in_flight(ops) == micro


def test_last_stage_of_1f1b_alternates():
    assert one_f_one_b(3, 3)[-1] == [Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1), Op("F", 2), Op("B", 2)]
    assert one_f_one_b(3, 3)[0] == [Op("F", 0), Op("F", 1), Op("F", 2), Op("B", 0), Op("B", 1), Op("B", 2)]


def test_deadlocking_schedule_is_rejected():
    bad = [[Op("F", 0), Op("B", 0)], [Op("B", 0), Op("F", 0)]]  # stage 1 wants a backward before its forward
    with pytest.raises(ValueError, match="deadlock"):
        submission_order(bad)


def test_unknown_schedule_and_bad_sizes():
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError):
        gpipe(0, 4)
