"""Pure helpers of ``benchmarks/rehome.py``: a single-stage drain's ``drain`` line -> seconds from
the notice to the moved stage, and the report that carries them beside the bursts. No Ray."""

from benchmarks.rehome import single_drain_row, summary


def drain_line(t, moved=1):
    return {"event": "drain", "time": t, "step": 7, "node": "n1", "deadline_s": 19.5, "moved": moved, "dropped": 0, "stayed": 0,
            "seconds": 2.5, "rollback_steps": 0, "how": "stages"}


def test_a_single_drain_is_timed_from_its_notice_to_its_drain_line_and_set_against_the_notice():
    row = single_drain_row([drain_line(1000.0 + 4.0), drain_line(1000.0 + 9.0)], asked=1000.0, notice_s=20.0)
    assert row["notice_to_moved_s"] == 4.0 and row["notice_s"] == 20.0 and row["moved_vs_notice"] == 0.2  # the first line: the move
    assert (row["moved"], row["how"], row["rollback_steps"], row["drain_s"]) == (1, "stages", 0, 2.5)
    none = single_drain_row([], asked=1000.0, notice_s=20.0)  # the run never drained: no figure, not a zero
    assert none["notice_to_moved_s"] is None and none["moved_vs_notice"] is None and none["moved"] == 0


def test_the_report_carries_the_single_drains_median_beside_the_bursts():
    rows = [{"notice_to_protected_s": s} for s in (1.2, None, 0.4)]
    singles = [single_drain_row([drain_line(100.0 + s)], 100.0, 20.0) for s in (3.0, 5.0, 4.0)] + [single_drain_row([], 100.0, 20.0)]
    got = summary(rows, singles, 20.0)
    assert got["notice_to_protected_s_median"] == 0.8 and got["protected_rounds"] == 2
    assert got["single_drain_notice_to_moved_s_median"] == 4.0 and got["single_drain_moved_vs_notice"] == 0.2
    assert got["single_drains_moved"] == 3 and got["single_drains"] == singles and got["notice_s"] == 20.0
