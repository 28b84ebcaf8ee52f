"""The failure-rate convergence experiment: pure planning, the runner with a fake cell, the CLI's
refusals, and one small real run (two cells, a few steps) that a rerun does not repeat."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from elastic_llm.cli import main
from elastic_llm.config import load_config
from elastic_llm.experiment.convergence import (
    BASELINE,
    PAPER_RATES,
    STRATEGIES,
    Cell,
    ExperimentError,
    ExperimentMismatch,
    Rate,
    ReportContext,
    Settings,
    cell_overrides,
    cell_row,
    check_overrides,
    choose_target,
    grid,
    parse_failure_probs,
    parse_failure_rates,
    parse_strategies,
    render_markdown,
    with_target,
)
from elastic_llm.experiment.runner import CellResult, Convergence, ConvergenceSpec

from .conftest import REPO

TINY = os.path.join(REPO, "jobs", "tiny.yaml")
SETTINGS = Settings(TINY, "sha", (), steps=100, eval_every=10, checkpoint_every=25, seed=7)
PAPER = parse_failure_rates("5,10,16")


def record(step, elapsed, val=None):
    r = {"step": step, "loss": 6.0 - step / 100, "elapsed_s": elapsed, "tokens_per_s": 1000.0, "tokens": step * 2048}
    if val is not None:
        r["val_loss"] = val
    return r


def row(strategy, rate, curve, **kw):
    """A row of a run whose validation points are ``(step, val_loss, elapsed_s)`` in time order."""
    history = [record(s, t, v) for s, v, t in curve]
    return cell_row(Cell(strategy, rate), history, kw.pop("recoveries", []), kw.pop("failures", 0), total_s=1.0, finished_at="t", **kw)


# --- the command's values --------------------------------------------------------------------


def test_paper_rates_map_to_the_per_step_probabilities_of_the_paper_runs():
    assert PAPER == (Rate(0.0009, 5), Rate(0.002, 10), Rate(0.004, 16))
    assert PAPER_RATES == {5: 0.0009, 10: 0.002, 16: 0.004}
    assert parse_failure_rates(" 16, 5.0") == (Rate(0.004, 16), Rate(0.0009, 5))
    assert [r.label for r in PAPER] == ["5% (p=0.0009)", "10% (p=0.002)", "16% (p=0.004)"]
    assert parse_failure_probs("0.02,0") == (Rate(0.02), Rate(0.0))
    assert all(r.percent is None for r in parse_failure_probs("0.0009"))


@pytest.mark.parametrize(
    ("parse", "text", "words"),
    [
        (parse_failure_rates, "7", ["--failure-rates", "7", "--failure-probs"]),
        (parse_failure_rates, "5,ten", ["--failure-rates", "'ten'", "not a number"]),
        (parse_failure_rates, "5,5", ["--failure-rates", "twice"]),
        (parse_failure_rates, "", ["--failure-rates", "empty"]),
        (parse_failure_probs, "0.1,1", ["--failure-probs", "[0, 1)"]),
        (parse_failure_probs, "-0.1", ["--failure-probs", "[0, 1)"]),
        (parse_failure_probs, "nan", ["--failure-probs", "finite"]),
        (parse_failure_probs, "0.1,,0.2", ["--failure-probs", "empty item"]),
        (parse_strategies, "none,fast", ["--strategies", "'fast'", "checkfree_plus"]),
        (parse_strategies, "none,none", ["--strategies", "twice"]),
    ],
)
def test_bad_values_are_refused_naming_the_option_and_the_fix(parse, text, words):
    with pytest.raises(ExperimentError) as err:
        parse(text)
    for w in words:
        assert w in str(err.value)


def test_set_overrides_of_what_the_experiment_sets_are_refused():
    assert check_overrides(["model.dim=64", "train.lr=1e-3"]) == ("model.dim=64", "train.lr=1e-3")
    for key, option in [("train.max_steps", "--steps"), ("recovery.mode", "--strategies"), ("chaos.failure_seed", "--seed")]:
        with pytest.raises(ExperimentError, match=f"--set {key} .* use {option}"):
            check_overrides([f"{key}=1"])


# --- strategies and the grid -----------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_is_a_valid_config(strategy, tmp_path):
    cell = Cell(strategy, PAPER[1])
    cfg = load_config(TINY, cell_overrides(cell, SETTINGS, str(tmp_path / "a path: with colon")))
    mode = {"none": "checkfree", "snapshot": "lossless"}.get(strategy, strategy)
    assert cfg.recovery.mode == mode
    assert cfg.snapshots_on == (strategy == "snapshot")
    assert (cfg.train.max_steps, cfg.train.eval_every) == (100, 10)
    if strategy == BASELINE:
        assert cfg.chaos.failure_prob_per_step == 0
    else:
        assert (cfg.chaos.failure_prob_per_step, cfg.chaos.failure_seed) == (0.002, 7)
    if strategy == "checkpoint":
        assert cfg.recovery.checkpoint_every == 25
        assert cfg.recovery.checkpoint_dir == str(tmp_path / "a path: with colon")


def test_the_user_overrides_reach_every_cell():
    settings = Settings(TINY, "sha", ("model.dim=64",), 10, 2, 5, 0)
    for cell in grid(STRATEGIES, PAPER):
        assert load_config(TINY, cell_overrides(cell, settings)).model.dim == 64


def test_grid_runs_the_baseline_once_then_every_strategy_at_every_rate():
    cells = grid(STRATEGIES, PAPER)
    assert cells[0] == Cell(BASELINE, Rate(0.0))
    assert [c.strategy for c in cells].count(BASELINE) == 1
    assert len(cells) == 1 + 5 * 3
    assert len({c.key for c in cells}) == len(cells)
    assert [c.rate for c in cells[1:6]] == [PAPER[0]] * 5  # rate by rate: a rate's panel fills first
    assert grid(["snapshot", "checkfree"], PAPER[:1]) == (Cell("snapshot", PAPER[0]), Cell("checkfree", PAPER[0]))


# --- target and rows -------------------------------------------------------------------------


def test_default_target_is_the_baseline_val_loss_at_the_eval_step_nearest_80_percent():
    base = row(BASELINE, Rate(0.0), [(30, 5.0, 3.0), (60, 4.0, 6.0), (90, 3.0, 9.0), (100, 2.9, 10.0)])
    target = choose_target(None, base, 100)
    assert target.loss == 3.0 and "step 90" in target.how
    tie = row(BASELINE, Rate(0.0), [(7, 5.0, 1.0), (9, 4.0, 2.0), (10, 3.9, 3.0)])
    assert choose_target(None, tie, 10).loss == 5.0  # steps 7 and 9 are both 1 from 8: the earlier one
    assert choose_target(2.5, base, 100).loss == 2.5
    assert choose_target(None, None, 100).loss is None


def test_steps_to_target_follows_time_order_through_a_rollback():
    # val at 2 and 4, then a failure rolls back to 2: step 4 is trained (and validated) again
    recoveries = [{"step": 5, "seconds": 1.5, "source": "parity"}, {"step": 5, "seconds": 1.5, "source": "peer"}]
    r = row("snapshot", PAPER[0], [(2, 5.0, 1.0), (4, 4.6, 2.0), (4, 4.5, 4.5), (6, 4.2, 6.0)], recoveries=recoveries, failures=1)
    assert (r["recoveries"], r["recovery_s"], r["failures"], r["failure_steps"]) == (1, 1.5, 1, [5])
    assert (r["wall_s"], r["final_val_loss"], r["steps"]) == (6.0, 4.2, 6)
    for target, want in [(4.55, (4, 4.5)), (4.6, (4, 2.0)), (4.2, (6, 6.0)), (4.0, (None, None))]:
        (got,) = with_target([r], choose_target(target, None, 6))
        assert (got["steps_to_target"], got["wall_to_target_s"]) == want, target


def test_markdown_has_one_table_per_rate_with_the_baseline_as_reference():
    rows = [row(BASELINE, Rate(0.0), [(5, 4.0, 5.0), (10, 3.0, 10.0)])]
    rows += [row("snapshot", r, [(5, 4.0, 6.0), (10, 3.0, 20.0)]) for r in PAPER]
    rows.append(row("checkfree", PAPER[2], [(5, 4.5, 6.0)], error="stopped", exit_code=4))
    target = choose_target(None, rows[0], 10)
    rows = with_target(rows, target)
    ctx = ReportContext(SETTINGS, ("none", "snapshot", "checkfree"), PAPER, target, "2 CPUs", "today", "elastic-llm ...")
    md = render_markdown(ctx, rows)
    assert md.count("## failure rate") == 3
    assert md.count("| none (reference) | 0 |") == 3
    assert md.count("| strategy | failure_prob | wall_s | steps_to_target | wall_to_target_s |") == 3
    assert "| snapshot | 0.002 |" in md and "| 2.00x |" in md  # 20 s to the target against none's 10 s
    assert "checkfree (failed, exit 4)" in md
    assert "target validation loss: 3.0000 (the `none` run's validation loss at step 10" in md
    assert "5% -> 0.0009" in md and "machine: 2 CPUs" in md and "command: `elastic-llm ...`" in md
    direct = render_markdown(ReportContext(SETTINGS, ("none",), (Rate(0.02),), target, "m", "d", "c"), rows)
    assert "given directly with --failure-probs" in direct and direct.count("## failure rate") == 1


# --- the runner: resumable, parameters checked -----------------------------------------------


class FakeCells:
    """A cell runner without Ray: the val loss falls by 0.5 per eval, time passes 1 s per step
    (2 s with failures on)."""

    def __init__(self):
        self.calls = []

    def __call__(self, cfg, cell_dir, progress):
        self.calls.append((cell_dir.name, cfg.recovery.mode, cfg.chaos.failure_prob_per_step))
        slow = 2.0 if cfg.chaos.failure_prob_per_step else 1.0
        n, ev = cfg.train.max_steps, cfg.train.eval_every
        history = [record(s, s * slow, 6.0 - 0.5 * s / ev if s % ev == 0 else None) for s in range(1, n + 1)]
        return CellResult(history, [], 0, n * slow)


BASE_SPEC = ConvergenceSpec(TINY, ("model.dim=64",), ("none", "snapshot"), (Rate(0.05), Rate(0.1)), steps=6, eval_every=2, progress=False)


def spec(**kw):
    return dataclasses.replace(BASE_SPEC, **kw)


def test_runner_skips_finished_cells_and_writes_the_three_files(tmp_path):
    fake = FakeCells()
    summary = Convergence(spec(), tmp_path, fake).run()
    assert fake.calls == [("none", "checkfree", 0.0), ("snapshot-p0.05", "lossless", 0.05), ("snapshot-p0.1", "lossless", 0.1)]
    assert (summary["cells"], summary["ran"], summary["failed"]) == (3, 3, 0)
    assert summary["target_loss"] == 5.0  # none's val loss at step 4 (nearest 4.8)
    for name in ("results.json", "results.md", "loss_vs_time.png"):
        assert (tmp_path / name).stat().st_size > 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["experiment"]["steps"] == 6 and isinstance(doc["rows"], list)
    assert {(r["strategy"], r["failure_prob"], r["steps_to_target"], r["wall_to_target_s"]) for r in doc["rows"]} == {
        ("none", 0.0, 4, 4.0), ("snapshot", 0.05, 4, 8.0), ("snapshot", 0.1, 4, 8.0)
    }

    again = Convergence(spec(), tmp_path, fake).run()
    assert len(fake.calls) == 3 and again["ran"] == 0
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == doc["rows"]

    doc["rows"] = [r for r in doc["rows"] if r["cell"] != "snapshot-p0.1"]  # as if stopped before the last cell
    (tmp_path / "results.json").write_text(json.dumps(doc))
    Convergence(spec(), tmp_path, fake).run()
    assert fake.calls[3:] == [("snapshot-p0.1", "lossless", 0.1)]
    # a new target is only arithmetic: nothing runs again
    assert Convergence(spec(target_loss=5.5), tmp_path, fake).run()["rows"][1]["steps_to_target"] == 2
    assert len(fake.calls) == 4


def test_a_failed_cell_is_a_row_and_is_not_run_again(tmp_path):
    calls = []

    def failing(cfg, cell_dir, progress):
        calls.append(cell_dir.name)
        return CellResult([record(1, 1.0), record(2, 2.0, 5.5)], [], 3, 5.0, error="recovery budget exhausted", exit_code=4)

    summary = Convergence(spec(strategies=("checkfree",), rates=(Rate(0.1),), target_loss=5.0), tmp_path, failing).run()
    assert summary["failed"] == 1
    (r,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert (r["failed"], r["error"], r["exit_code"], r["failures"], r["final_val_loss"]) == (True, "recovery budget exhausted", 4, 3, 5.5)
    Convergence(spec(strategies=("checkfree",), rates=(Rate(0.1),), target_loss=5.0), tmp_path, failing).run()
    assert calls == ["checkfree-p0.1"]


def test_results_of_other_parameters_are_refused(tmp_path):
    Convergence(spec(), tmp_path, FakeCells()).run()
    for other in (spec(steps=8), spec(overrides=("model.dim=32",)), spec(eval_every=3)):
        with pytest.raises(ExperimentMismatch, match="other parameters"):
            Convergence(other, tmp_path, FakeCells())
    Convergence(spec(strategies=("snapshot", "checkfree")), tmp_path, FakeCells())  # more cells of the same experiment: fine


# --- the command line ------------------------------------------------------------------------

CLI = ["experiment", "convergence", "--config", TINY, "--steps", "6"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--failure-rates", "7"], ["--failure-rates", "--failure-probs"]),
        (["--failure-rates", "5", "--failure-probs", "0.1"], ["both"]),
        (["--failure-probs", "1.0"], ["--failure-probs", "[0, 1)"]),
        (["--failure-probs", "x"], ["--failure-probs", "not a number"]),
        (["--strategies", "none,oops"], ["--strategies", "'oops'"]),
        (["--eval-every", "0"], ["--eval-every"]),
        (["--set", "train.max_steps=3"], ["--set train.max_steps", "--steps"]),
    ],
)
def test_cli_refuses_bad_input_before_ray_with_exit_2(args, words, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*CLI, "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    for w in words:
        assert w in err
    assert not out.exists()


def test_cli_refuses_a_directory_of_another_experiment(tmp_path, capsys):
    Convergence(spec(), tmp_path, FakeCells()).run()
    before = (tmp_path / "results.json").read_text()
    args = ["--strategies", "none,snapshot", "--failure-probs", "0.05,0.1", "--eval-every", "2", "--set", "model.dim=64"]
    assert main([*CLI[:-1], "7", "--out", str(tmp_path), *args]) == 2
    assert "steps: 6 there, 7 now" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == before


@pytest.mark.slow  # two training cells through the CLI: 80 s
@pytest.mark.timeout(600)
def test_cli_end_to_end_two_small_cells_then_a_rerun_that_runs_nothing(tmp_path, capsys):
    args = [
        "experiment", "convergence", "--config", TINY, "--strategies", "none,snapshot", "--failure-probs", "0.05",
        "--steps", "6", "--eval-every", "2", "--out", str(tmp_path), "--no-progress",
        "--set", "model.dim=64", "--set", "model.seq_len=32", "--set", "train.batch_size=8", "--set", "train.eval_batches=1",
    ]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["cells"], summary["ran"], summary["failed"]) == (2, 2, 0)
    for name in ("results.json", "results.md", "loss_vs_time.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["strategy"], r["failure_prob"]) for r in rows] == [("none", 0.0), ("snapshot", 0.05)]
    fields = ("wall_s", "steps_to_target", "wall_to_target_s", "final_val_loss", "failures", "recoveries", "recovery_s", "tokens_per_s")
    for r in rows:
        assert all(r[f] is not None for f in fields), r
        assert r["steps"] == 6 and [p["step"] for p in r["val_curve"]][-1] == 6
    assert rows[0]["steps_to_target"] == 4  # the target is none's own val loss at step 4
    metrics = [tmp_path / "cells" / c / "metrics.jsonl" for c in ("none", "snapshot-p0.05")]
    stamps = [m.stat().st_mtime_ns for m in metrics]

    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ran"] == 0
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == rows
    assert [m.stat().st_mtime_ns for m in metrics] == stamps


def test_time_breakdown_splits_steps_replays_recovery_checkpoints():
    from elastic_llm.experiment.convergence import time_breakdown

    step = lambda n, dur: {"step": n, "tokens": 100 * n, "tokens_per_s": 100 / dur}  # noqa: E731
    lines = [
        {"event": "checkpoint", "step": 0, "seconds": 5.0},  # the one at start-up is not training time
        step(1, 1.0), step(2, 1.0), {"event": "checkpoint", "step": 2, "seconds": 0.5}, step(3, 2.0),
        {"event": "recovery", "step": 4, "seconds": 3.0}, step(3, 1.5), step(4, 1.0),
        {"event": "end", "elapsed_s": 12.0, "seconds_by_state": {"running": 8.5, "recovering": 3.0}},
    ]
    t = time_breakdown(lines)
    assert t["steps_s"] == pytest.approx(1.0 + 1.0 + 1.5 + 1.0) and t["replayed_s"] == pytest.approx(2.0)
    assert (t["recovery_s"], t["checkpoint_s"], t["total_s"]) == (3.0, 0.5, 12.0)
    assert t["other_s"] == pytest.approx(12.0 - 4.5 - 2.0 - 3.0 - 0.5)
    assert time_breakdown(lines[:-1]) is None
