"""``bench anchors``: the grid it runs, the verdicts it draws, one of its simulations end to end
(the small shape on a short window of the real p3 trace), and its refusals."""

from __future__ import annotations

import pytest

from benchmarks import anchors
from elastic_llm.cli import main
from elastic_llm.replay.trace import load_trace

pytestmark = pytest.mark.timeout(120)


def test_the_grid_is_every_policy_on_every_trace_at_every_notice_on_both_shapes(tmp_path):
    traces = [(n, str(f), w) for n, f, w in anchors.TRACES]
    jobs = anchors._jobs(tmp_path, traces, None)
    assert len(jobs) == len(anchors.POLICIES) * len(traces) * len(anchors.NOTICES) * len(anchors.SHAPES)
    assert {j["policy"] for j in jobs} == {"elastic-llm", "restart", "ray-train-elastic", "replica-group", "redundant"}
    assert {j["notice"] for j in jobs} == {0.0, 30.0, 120.0} and len({j["out"] for j in jobs}) == len(jobs)
    assert "redundant" in anchors.POLICIES and {j["policy"] for j in anchors._jobs(tmp_path, traces, None, ("redundant",))} == {"redundant"}


def test_the_shipped_traces_are_real_licensed_and_load():
    for name, path, _ in anchors.TRACES[:2]:
        head = path.read_text().splitlines()[:40]
        assert any("LICENCE: MIT" in line for line in head) and any("SOURCE: https://github.com/uclasystem/bamboo" in line for line in head), name
        assert len(load_trace(str(path))) > 100


def row(policy, liveput, per_usd, notice=30.0):
    return {"shape": "s", "trace": "t", "notice_s": notice, "policy": policy, "liveput": liveput, "tokens_per_usd": per_usd, "vs_on_demand": per_usd / 10}


def test_the_verdict_names_every_policy_that_beats_elastic_llm_on_either_figure():
    rows = [row("elastic-llm", 0.95, 100.0), row("restart", 0.90, 90.0), row("replica-group", 0.96, 99.0)]
    [v] = anchors.verdicts(rows)
    assert v["best_other"] == "replica-group" and v["liveput_ratio"] == pytest.approx(0.95 / 0.96, abs=1e-3)
    assert v["tokens_per_usd_ratio"] == pytest.approx(100 / 99, abs=1e-3) and v["beaten_by"] == ["replica-group"]
    [ahead] = anchors.verdicts([row("elastic-llm", 0.97, 100.0), row("restart", 0.90, 90.0)])
    assert ahead["beaten_by"] == [] and ahead["liveput_ratio"] > 1


def test_one_simulation_of_the_grid_reports_liveput_tokens_per_dollar_and_its_width(tmp_path):
    name, path, _ = anchors.TRACES[0]
    shape, config, nodes, stages, replicas, cost, slots = anchors.SHAPES[1]
    job = {"shape": shape, "config": config, "nodes": nodes, "stages": stages, "replicas": replicas, "cost": cost, "slots": slots,
           "trace": str(path), "trace_name": name, "window": (0.0, 1800.0), "notice": 30.0, "policy": "replica-group", "prices": None,
           "out": str(tmp_path / "one")}
    r = anchors._one(job)
    assert r["survived"] and 0 < r["liveput"] <= 1.0 and r["committed_steps"] > 0
    assert r["tokens_per_usd"] > 0 and r["vs_on_demand"] > 0 and r["spot_usd"] > 0
    assert r["width"] and max(w for _, w in r["width"]) <= replicas and r["oracle_width"]
    png = anchors.plot([r], tmp_path / "w.png")
    assert png.stat().st_size > 1000


def test_a_bad_price_table_or_trace_is_refused_before_anything_runs(tmp_path, capsys):
    (tmp_path / "p.yaml").write_text("cpu-2core: {spot_per_h: 0.03, on_demand_per_h: 0.1}\n")
    assert main(["bench", "anchors", "--prices", str(tmp_path / "p.yaml")]) == 2
    assert "no prices for node type(s) ['gpu-a100']" in capsys.readouterr().err
    (tmp_path / "t.csv").write_text("time_ms,event,node\n0,add,a\n5,remove,b\n")
    assert main(["bench", "anchors", "--trace", str(tmp_path / "t.csv")]) == 2
    assert "'b' is removed but not alive" in capsys.readouterr().err
    assert main(["bench", "fleet", "--prices", str(tmp_path / "p.yaml")]) == 2
    assert "only for `bench anchors`" in capsys.readouterr().err
    assert main(["bench", "anchors", "--policy", "bamboo"]) == 2
    assert "--policy bamboo is not a policy bench anchors runs: use one of elastic-llm, restart, ray-train-elastic, replica-group, redundant" in capsys.readouterr().err


def test_a_rerun_of_one_policy_replaces_its_rows_and_keeps_the_others(tmp_path, monkeypatch):
    """``--from DIR --policy redundant``: the other policies' rows are read back, redundant's simulated again."""
    import json

    old = [dict(row("elastic-llm", 0.95, 100.0), timeline=[]), dict(row("redundant", 0.1, 1.0), timeline=[])]
    (tmp_path / "anchors.json").write_text(json.dumps({"bench": "anchors", "traces": [{"name": "t", "file": "f.csv", "window": None}], "rows": old}))
    ran = []
    monkeypatch.setattr(anchors, "SHAPES", anchors.SHAPES[1:])
    monkeypatch.setattr(anchors, "NOTICES", (30.0,))
    monkeypatch.setattr(anchors, "_one", lambda job: ran.append(job["policy"]) or dict(row(job["policy"], 0.5, 50.0), timeline=[]))
    monkeypatch.setattr(anchors, "ProcessPoolExecutor", lambda max_workers: __import__("concurrent.futures").futures.ThreadPoolExecutor(max_workers))
    monkeypatch.setattr(anchors, "published", lambda: {})
    monkeypatch.setattr(anchors, "plot", lambda rows, path: path)
    result = anchors.run_anchors_bench(out_dir=str(tmp_path / "out"), from_dir=str(tmp_path), policies=("redundant",))
    assert ran == ["redundant"] and sorted((r["policy"], r["liveput"]) for r in result["rows"]) == [("elastic-llm", 0.95), ("redundant", 0.5)]
    assert result["verdicts"][0]["best_other"] == "redundant" and result["reruns"][0]["policies"] == ["redundant"]
