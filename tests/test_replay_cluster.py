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


BURST = os.path.join(REPO, "tests", "data", "spot_trace_burst.csv")


@pytest.mark.slow  # a 60 s replay
@pytest.mark.timeout(420)
def test_a_first_minute_of_bursts_drains_and_removals_loses_no_committed_step(corpus_dir, tmp_path):
    """The burst trace's first hour at 60x (its first replay minute: 4 nodes of 2 CPUs, nodes
    drained 2 s before they go, two of them a second apart, refills between) with the settings of
    the run that died on real Ray in one of its first minutes (tiny's 4 stages of 0.5 CPU, width
    1-4, a global batch of 48): nodes go while recoveries and resizes place things on them, and
    the run goes on with no committed step lost."""
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [
        *SMALL, f"data.dir={corpus_dir}", "parallel.cpus_per_actor=0.5", "elastic.min_replicas=1", "elastic.max_replicas=4",
        "train.batch_size=48", "train.max_steps=1000000"])
    plan = plan_replay(load_trace(BURST), window=(0.0, 3600.0), time_scale=60, node_scale=0.25, notice_s=2, seed=0)
    assert [a.kind for a in plan.actions if a.at_s <= 60].count("remove") >= 6  # several drains and removals in its first minute
    report = Replay(cfg, plan, ReplayOptions(cpus_per_node=2, seed=0, progress=False)).run(tmp_path)
    assert report["failed"] is None and report["exit_code"] == 0
    assert report["committed_steps_lost"] == 0 and report["steps"] > 0
    committed = [p["steps_committed"] for p in json.loads((tmp_path / "replay.json").read_text())["timeline"]]
    assert committed == sorted(committed)  # no committed step was ever taken back


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
