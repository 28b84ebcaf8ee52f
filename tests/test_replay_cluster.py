"""A spot trace replayed on a real loopback cluster while a real run trains on it (and the CLI's
refusals of bad replay input, which need no Ray).

The replay starts its own ``ray.cluster_utils.Cluster`` (a head without CPUs plus one 1-CPU node
per replay node): tests/data/spot_trace.csv at 100x speed and a quarter of its nodes is 72 s of
replay with 3 drains (5 s notice), 3 removals and 3 additions; the fleet moves between 4 and 2
nodes, so the run shrinks to one replica and grows back to two.
"""

import json
import os
import subprocess
import sys

import pytest

from elastic_llm.config import load_config
from elastic_llm.replay.runner import Replay, ReplayOptions
from elastic_llm.replay.trace import load_trace, plan_replay

from .conftest import REPO

TRACE = os.path.join(REPO, "tests", "data", "spot_trace.csv")
SMALL = ["model.dim=64", "model.n_heads=4", "model.seq_len=32"]


@pytest.mark.slow  # a 100 s replay of the whole test trace
@pytest.mark.timeout(420)
def test_replay_of_the_test_trace_completes_with_no_committed_step_lost(corpus_dir, tmp_path):
    cfg = load_config(os.path.join(REPO, "jobs", "spot-tiny.yaml"), [*SMALL, f"data.dir={corpus_dir}"])
    plan = plan_replay(load_trace(TRACE), time_scale=100, node_scale=0.25, notice_s=5, seed=0)
    assert [a.kind for a in plan.actions].count("drain") == 3
    report = Replay(cfg, plan, ReplayOptions(cpus_per_node=1, seed=0, progress=False)).run(tmp_path)

    assert report["failed"] is None and report["exit_code"] == 0
    assert report["committed_steps_lost"] == 0
    assert report["steps"] > 20 and 0 < report["committed_steps"] <= report["steps"]
    assert report["events"]["drains"] >= 1 and report["events"]["resizes"]  # it shrank (and maybe grew back)
    assert report["seconds_by_state"]["running"] > 0 and 0 < report["useful_fraction"] <= 1
    saved = json.loads((tmp_path / "replay.json").read_text())
    assert saved["steps"] == report["steps"] and saved["timeline"]
    alive = [p["nodes_alive"] for p in saved["timeline"]]
    assert alive[0] == 4 and min(alive) == 2 and alive[-1] == 4  # the fleet the plan says
    committed = [p["steps_committed"] for p in saved["timeline"]]
    assert committed == sorted(committed)  # no committed step was ever taken back
    assert (tmp_path / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "elastic_llm.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--window", "10"], "--window"),
        (["--time-scale", "0"], "time_scale=0"),
        (["--cpus-per-node", "0.25"], "--cpus-per-node=0.25 cannot hold one stage actor"),
    ],
)
def test_replay_cli_refuses_bad_options_with_exit_2(tmp_path, args, expected):
    proc = run_cli("replay", "--trace", TRACE, "--out", str(tmp_path), *args)
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr


def test_replay_cli_names_the_bad_trace_line(tmp_path):
    bad = tmp_path / "trace.csv"
    bad.write_text("0,add,a\n0,add,b\n5000,rem,a\n")
    proc = run_cli("replay", "--trace", str(bad), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "line 3" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # refused before anything started
