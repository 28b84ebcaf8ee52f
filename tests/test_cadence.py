"""snapshot.every: auto's cost bookkeeping (:class:`elastic_llm.cadence.SnapshotCost`), pure: steps
and versions in, the interval out."""

from __future__ import annotations

import pytest

from elastic_llm.cadence import AUTO_PROBE, COLD, SETTLE, SnapshotCost


def cycle(c: SnapshotCost, version: int, steps: list[float], in_flight: int = 2, parts_s: float = 0.01) -> None:
    """Version ``version`` begins at the first of ``steps``, is in flight for ``in_flight`` steps
    (the first included) and commits after the last of them; the rest of ``steps`` follow."""
    c.began(version)
    for i, s in enumerate(steps):
        c.step(s, [version] if i < in_flight else [], began=i == 0)
        if i == in_flight - 1:
            c.ended(version, parts_s)


def test_what_a_version_leaves_on_the_steps_after_it_is_its_cost_not_the_baseline():
    """Clean steps take 1.0 s; a version slows its two steps in flight by 0.3 and 0.2 s and the
    two after it by 0.2 and 0.1 s (objects freed, a flush, the raylets' last moves): its cost is
    all 0.8 s, the baseline stays 1.0 s, and at a 2% budget the interval is 40 steps. (Charging
    only the steps in flight, and taking the next ones as clean, said 0.5 s on a baseline of
    1.15 s: every 22, twice the budget.)"""
    c = SnapshotCost(max_overhead_pct=2.0)
    for _ in range(COLD + 3):
        c.step(1.0, [], began=False)
    cycle(c, 10, [1.3, 1.2, 1.2, 1.1, 1.0, 1.0])  # the first version: cold buffers, not a sample
    assert c.cost.value is None and c.clean_s.value == pytest.approx(1.0)
    cycle(c, 20, [1.3, 1.2, 1.2, 1.1, 1.0])
    assert c.cost.value == pytest.approx(0.8)
    assert c.clean_s.value == pytest.approx(1.0)
    assert c.every == 40 and c.changes[-1]["every"] == 40 and c.changes[-1]["version"] == 20
    assert "0.800 s per snapshot" in c.why


def test_noise_evens_out_over_a_versions_steps_and_its_parts_are_a_floor():
    """Steps around a version as often faster as slower than clean ones: the differences cancel
    (clipping each at zero would add up the noise as cost); what the parts reported is then the
    cost."""
    c = SnapshotCost(max_overhead_pct=2.0)
    for _ in range(COLD + 3):
        c.step(1.0, [], began=False)
    cycle(c, 10, [1.1, 0.9, 1.1, 0.9, 1.0])
    cycle(c, 20, [1.1, 0.9, 1.1, 0.9, 1.0], parts_s=0.05)
    assert c.cost.value == pytest.approx(0.05)
    assert c.every == 5  # 0.05 s / (1.0 s x 2%) = 2.5 -> 3, but a version is 2 steps in flight: at least 2 + SETTLE + 1
    assert "-> every 3; at least 5" in c.why


def test_a_newer_version_begun_after_one_ended_closes_its_cost_and_two_in_flight_share_a_steps_excess():
    """At an interval shorter than a version's settling steps no step is clean: the next version's
    begin makes the previous one's cost final; a step with two versions in flight charges each
    half of its excess."""
    c = SnapshotCost(max_overhead_pct=10.0)
    for _ in range(COLD + 1):
        c.step(1.0, [], began=False)
    c.began(1)
    c.step(1.2, [1], began=True)
    c.began(2)
    c.step(1.4, [1, 2], began=True)  # 0.2 each
    c.ended(1, 0.0)  # ended while 2 is in flight, begun after it: its cost is final now (and the first: no sample)
    assert 1 not in c.open and c.finals == 1
    c.step(1.1, [2], began=False)
    c.ended(2, 0.0)
    c.step(1.1, [], began=False)  # settling: charged to 2
    c.began(3)  # 2 ended: final
    assert c.cost.value == pytest.approx(0.2 + 0.1 + 0.1)
    assert c.every == 5  # 0.4 s / (1.0 s x 10%) = 4, but 2 steps in flight + SETTLE + one clean step


def test_a_dropped_version_is_forgotten_and_a_long_stretch_without_a_clean_step_asks_for_one():
    c = SnapshotCost(max_overhead_pct=2.0)
    for _ in range(COLD + 1):
        c.step(1.0, [], began=False)
    c.began(5)
    c.step(3.0, [5], began=True)
    c.ended(5, None)  # its step failed: dropped, no sample
    assert 5 not in c.open and c.finals == 0
    for i in range(AUTO_PROBE - 1):  # the dropped version's step was not clean either
        assert not c.probing()
        c.began(6 + i)
        c.step(1.1, [6 + i], began=True)
        c.ended(6 + i, 0.01)
    assert c.probing()  # a version every step: no version until a step ran clean
    for _ in range(SETTLE):
        c.step(1.05, [], began=False)  # what the last one left behind: not clean yet
        assert c.probing()
    c.step(1.0, [], began=False)
    assert not c.probing() and c.since_clean == 0 and not c.open


def test_the_baseline_is_the_median_of_recent_clean_steps_and_the_first_steps_count_for_nothing():
    """A run's first steps are slow (compiling, first touches): they are not the baseline; a slow
    clean step later (another process's burst) moves the median, not an average, of the last ones."""
    c = SnapshotCost(max_overhead_pct=2.0)
    for s in [9.0, 3.0] + [1.0] * 4 + [5.0] + [1.0] * 2:
        c.step(s, [], began=False)
    assert COLD == 2 and c.clean_s.value == pytest.approx(1.0)
    assert c.since_clean == 0 and not c.open


def test_the_interval_covers_the_average_cost_and_its_error_not_every_single_versions():
    """Two versions cost 0.4 s and 0.8 s over 1.0 s clean steps: the moving average is 0.52 s.
    The budget is a share of the run's time, so the average cost is what must stay within it; it
    is known up to its standard error (the moving average weighs (2 - 0.3) / 0.3 samples), and
    the interval is chosen for the average plus that error (0.597 s): 30 steps, where the average
    alone says 26 and the average plus a whole deviation (0.70 s, every single version's cost
    covered) said 36."""
    c = SnapshotCost(max_overhead_pct=2.0)
    for _ in range(COLD + 3):
        c.step(1.0, [], began=False)
    cycle(c, 10, [1.1, 1.0, 1.0, 1.0, 1.0])  # the first: not a sample
    cycle(c, 20, [1.2, 1.1, 1.1, 1.0, 1.0])  # 0.4 s
    assert c.cost.value == pytest.approx(0.4) and c.every == 20
    cycle(c, 30, [1.4, 1.2, 1.1, 1.1, 1.0])  # 0.8 s
    assert c.cost.value == pytest.approx(0.52)
    assert c.cost.bound == pytest.approx(0.52 + (0.7 * 0.3 * 0.4**2 * 0.3 / 1.7) ** 0.5)
    assert c.every == 30
    assert "+ its standard error" in c.why


def test_slow_first_steps_do_not_stay_the_baseline_and_the_interval_leaves_a_clean_step():
    """Measured on the 3-node loopback cluster: the first steps of a run run beside its warm
    standbys' starts (0.87 s against 0.42 s steady); a version costs 0.12 s over its step in
    flight and the three after it. Before the floor, the slow steps stayed the baseline, every
    version's felt cost read as nothing, the interval fell to its parts' (every 3) and from then
    on no step was clean: 25% overhead against a 2% budget. Now each interval leaves a clean step,
    the baseline follows the steady steps and the interval settles where the budget says."""
    c = SnapshotCost(max_overhead_pct=2.0)
    extra = [0.04, 0.05, 0.02, 0.01]  # what one version adds to its step and the three after it
    last_begin, begun, version, overhead = -100, {}, 0, []
    for step in range(1, 301):
        base = 0.87 if step <= 10 else 0.42
        if step - last_begin >= c.every and not c.probing():
            version, last_begin = version + 1, step
            c.began(version)
            begun[version] = step
        cost = sum(extra[step - b] for b in begun.values() if 0 <= step - b < len(extra))
        c.step(base + cost, [version] if begun.get(version) == step else [], began=begun.get(version) == step)
        if begun.get(version) == step:
            c.ended(version, 0.02)
        if step > 200:
            overhead.append(cost / base)
    assert c.clean_s.value == pytest.approx(0.42)  # the steady steps, not the first ones
    assert c.every >= 12  # 0.12 s / (0.42 s x 2%) = 14.3 (less while the deviation settles)
    assert sum(overhead) / len(overhead) <= 0.0201  # the budget holds (7 versions of 0.12 s in these 100 steps of 0.42 s: 2.0%)


def test_flush_turns_flush_every_nth_commit_one_at_a_time_and_count_the_turns_a_busy_flush_took():
    from elastic_llm.cadence import FlushTurns

    turns = FlushTurns(3)
    assert [turns.wants(busy=False) for _ in range(3)] == [False, False, True]
    turns.started()
    assert [turns.wants(busy=b) for b in (False, False, True, True, False)] == [False, False, False, False, True]  # due at the third, the flush in flight
    assert turns.skipped == 2
