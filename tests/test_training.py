"""End-to-end training of `tiny` on the built-in corpus through stage actors on Ray."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from elastic_llm.config import load_config
from elastic_llm.runtime.session import PlacementError, check_placement
from elastic_llm.runtime.ray_runtime import ray_trainer

from .conftest import REPO

pytestmark = pytest.mark.timeout(300)
TINY = os.path.join(REPO, "jobs", "tiny.yaml")


def train(overrides, steps, corpus_dir, **kwargs):
    cfg = load_config(TINY, [f"data.dir={corpus_dir}", *overrides])
    trainer = ray_trainer(cfg, **kwargs)
    try:
        return trainer.fit(steps), trainer
    finally:
        trainer.shutdown()


@pytest.mark.slow  # 40 s; the suite checks determinism in every bit-identical recovery test (a recovered run against a clean one)
def test_same_seed_same_losses_other_seed_different(ray_local, corpus_dir):
    off = ["train.eval_every=0"]
    a, _ = train(off, 5, corpus_dir)
    b, _ = train(off, 5, corpus_dir)
    c, _ = train(off + ["train.seed=1"], 5, corpus_dir)
    la, lb, lc = ([h["loss"] for h in run] for run in (a, b, c))
    assert la == lb, "same config and seed must give bit-identical losses"
    assert la != lc
    assert [h["step"] for h in a] == [1, 2, 3, 4, 5]


def test_tiny_loss_falls_and_metrics_are_written(ray_local, corpus_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    history, trainer = train(["train.eval_every=15"], 30, corpus_dir, metrics_out=metrics)
    losses = [h["loss"] for h in history]
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    assert len(vals) == 2 and vals[1] < vals[0] and vals[0] < 4.0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    events = [line["event"] for line in lines if "event" in line]
    steps = [line for line in lines if "event" not in line]
    assert [e for e in events if e != "standby"] == ["start", "state", "state", "end"]
    assert all(x["per_node"] == 1 for x in lines if x.get("event") == "standby")  # warm standbys started in the background
    assert [(x["old"], x["new"]) for x in lines if x.get("event") == "state"] == [("starting", "running"), ("running", "finished")]
    assert len(steps) == 30
    for rec in steps:
        assert {"step", "loss", "tokens", "tokens_per_s", "elapsed_s"} <= rec.keys()
    assert steps[-1]["tokens"] == 30 * 16 * 128
    start = lines[0]
    assert len(start["actors"]) == 4 and all(a["node_id"] for a in start["actors"])


# dp 3 (slow; uneven shares stay in test_pipeline_equivalence's any-width step): 16 sequences in shares of 6, 5, 5; validation on replica 0's 6
@pytest.mark.slow  # 16 s; width 2 through the trainer stays in test_elastic_cluster and test_durable_cluster (a width-2 run flushing)
@pytest.mark.parametrize("dp", [2, 3])
def test_data_parallel_replicas_train(ray_local, corpus_dir, dp):
    history, _ = train(["parallel.stages=2", f"parallel.dp={dp}", "parallel.cpus_per_actor=0.25", "train.eval_every=2"], 2, corpus_dir)
    assert all(np.isfinite(h["loss"]) for h in history) and np.isfinite(history[-1]["val_loss"])


def test_placement_check_is_pure_and_explains():
    cfg = load_config(TINY, ["parallel.cpus_per_actor=1", "parallel.dp=2"])
    with pytest.raises(PlacementError, match="needs 8 CPUs but the cluster has 4"):
        check_placement(cfg, {"CPU": 4.0}, [{"Alive": True, "Resources": {"CPU": 4.0}}])
    gpu = load_config(TINY, ["parallel.gpus_per_actor=0.5"])
    with pytest.raises(PlacementError, match="set parallel.gpus_per_actor=0"):
        check_placement(gpu, {"CPU": 8.0}, [])
    spread = load_config(TINY, ["parallel.placement_strategy=STRICT_SPREAD"])
    with pytest.raises(PlacementError, match="STRICT_SPREAD"):
        check_placement(spread, {"CPU": 8.0}, [{"Alive": True, "Resources": {"CPU": 8.0}}])
    check_placement(cfg, {"CPU": 8.0}, [{"Alive": True, "Resources": {"CPU": 8.0}}])  # fits: no error


def test_cli_train_end_to_end(corpus_dir, tmp_path):
    metrics = tmp_path / "cli.jsonl"
    env = dict(os.environ, RAY_ADDRESS="")
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_llm.cli", "train", "--config", TINY, "--max-steps", "3",
         "--metrics-out", str(metrics), "--set", f"data.dir={corpus_dir}", "--set", "train.eval_every=3"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 3 steps" in proc.stdout
    assert "step" in proc.stderr and "loss=" in proc.stderr  # the live progress bar
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if '"event"' not in x]
    assert [s["step"] for s in steps] == [1, 2, 3] and "val_loss" in steps[-1]


@pytest.mark.slow  # the same stop on the simulated runtime stays in the suite (test_controller_sim)
def test_a_step_failing_the_same_way_every_time_stops_with_exit_4_and_the_cause(corpus_dir, tmp_path):
    """Stage 1 raises on every step from step 3 on (every actor stays alive): the step is retried
    recovery.max_retries_per_step times, then the run stops with exit code 4, naming the step,
    the stage, the error and its traceback, instead of replaying step 3 forever."""
    metrics = tmp_path / "fail.jsonl"
    env = dict(os.environ, RAY_ADDRESS="")
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_llm.cli", "train", "--config", TINY, "--max-steps", "6", "--no-progress",
         "--metrics-out", str(metrics), "--set", f"data.dir={corpus_dir}", "--set", "train.eval_every=0",
         "--set", "recovery.max_retries_per_step=2", "--set", "chaos.events=[{step: 3, kill: error, stage: 1}]"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=240,
    )
    assert proc.returncode == 4, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()
    error = next(i for i, line in enumerate(last) if line.startswith("error: training stopped (exit 4)"))
    tail = "\n".join(last[error:])
    assert "step 3 failed 3 times and recovery.max_retries_per_step=2" in tail
    assert "step 3, stage 1 replica 0 failed: InjectedFault" in tail
    assert "Traceback" in tail or "ray::StageWorker.forward" in tail  # the traceback's first lines
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines if "event" not in x] == [1, 2]  # step 3 never completed
    recoveries = [x for x in lines if x.get("event") == "recovery"]
    assert len(recoveries) == 2 and all(r["source"] == "none" for r in recoveries)  # nothing lost: replayed twice
    assert [x["exit_code"] for x in lines if x.get("event") == "failed"] == [4]


def test_bpe_corpus_trains_and_its_export_tokenizes_the_same(ray_local, tmp_path):
    """A BPE-prepared corpus trains (with durable checkpoints); the Hugging Face export carries
    the tokenizer, and AutoTokenizer gives the ids the training data was encoded with."""
    from elastic_llm.cli import main
    from elastic_llm.data import load_tokenizer, prepare

    transformers = pytest.importorskip("transformers")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    '''naïve café {i}'''\n    return x * {i} + len('the quick brown fox')\n" * 20)
    prepare([str(src)], tmp_path / "bpe", val_fraction=0.1, tokenizer="bpe", vocab_size=400)
    history, trainer = train(
        ["data.tokenizer=bpe", f"data.dir={tmp_path / 'bpe'}", "model.vocab_size=400", "train.eval_every=0",
         f"durable.storage_path={tmp_path / 'ckpt'}", "durable.every=2"],
        6, tmp_path / "bpe",
    )
    assert history[-1]["loss"] < history[0]["loss"]
    assert trainer.durable.stats.flushed >= 1
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt" / "tiny"), "--format", "hf", "--out", str(out)]) == 0
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def g(y):\n    return y * 3  # naïve ✓"
    assert auto(text, add_special_tokens=False)["input_ids"] == load_tokenizer(tmp_path / "bpe").encode(text, add_special_tokens=False).ids
