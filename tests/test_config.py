"""Config errors name the field and the fix; the CLI turns them into exit code 2 before starting anything."""

import os
import subprocess
import sys

import pytest

from elastic_llm.config import ConfigError, RunConfig, load_config, validate

from .conftest import REPO

TINY = os.path.join(REPO, "jobs", "tiny.yaml")


@pytest.mark.parametrize("path", ["tiny", "llama-25m", "llama-124m", "llama-500m", "llama-1.5b"])
def test_shipped_configs_load(path):
    cfg = load_config(os.path.join(REPO, "jobs", f"{path}.yaml"))
    assert cfg.model.n_layers % cfg.parallel.stages == 0


def test_paper_shapes():
    c124 = load_config(os.path.join(REPO, "jobs", "llama-124m.yaml"))
    assert (c124.model.dim, c124.model.n_heads, c124.parallel.stages, c124.model.n_layers // c124.parallel.stages, c124.model.seq_len) == (512, 8, 4, 3, 512)
    c15 = load_config(os.path.join(REPO, "jobs", "llama-1.5b.yaml"))
    assert (c15.model.dim, c15.model.n_heads, c15.parallel.stages, c15.model.n_layers // c15.parallel.stages, c15.model.seq_len) == (2048, 16, 6, 4, 4096)
    assert c15.model.shape().ffn_hidden == 4 * 2048


@pytest.mark.parametrize(
    "override,expected",
    [
        ("parallel.stages=3", "parallel.stages=3 does not divide model.n_layers=4: choose parallel.stages in {1, 2, 4}"),
        ("model.n_heads=3", "model.dim=256 is not divisible by model.n_heads=3"),
        ("parallel.dp=17", "parallel.dp=17 replicas is more than train.batch_size=16 sequences: every replica needs at least one sequence"),
        ("parallel.schedule=zigzag", "parallel.schedule='zigzag' is unknown: use one of gpipe, 1f1b"),
        ("train.lrr=0.1", "unknown key train.lrr: valid keys of train are batch_size"),
        ("model.dim=big", "model.dim='big' must be an integer"),
        ("train.min_lr=1.0", "train.min_lr=1.0 must be between 0 and train.lr"),
        ("parallel.gpus_per_actor=-1", "parallel.gpus_per_actor=-1.0 must be >= 0"),
        ("model.vocab_size=100", "model.vocab_size=100 is too small for data.tokenizer='byte'"),
        ("optimizer.lr=1", "unknown key optimizer: valid keys are name, model, parallel, train, data"),
        ("chaos.events=[{step: 3, kill: stage, node: 1}]", "chaos.events[0].node=1: a node index (>= 0) only goes with kill: node, smp or partition"),
        ("chaos.events=[{step: 3, kill: node, node: -1}]", "chaos.events[0].node=-1: a node index (>= 0)"),
        ("chaos.events=[{step: 3, kill: stage, during: resize}]", "chaos.events[0]: during: resize goes with kill: node"),
    ],
)
def test_bad_values_are_named(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert expected in str(err.value)


def test_several_problems_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["parallel.stages=3", "parallel.schedule=zigzag"])
    assert len(err.value.problems) == 2


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)
    with pytest.raises(ConfigError, match="is not key=value"):
        load_config(TINY, ["train.lr"])


def test_overrides_apply_and_the_hash_is_the_identity_of_the_state():
    """The hash a restore checks is what defines the model and the state's layout (the model, the
    stage count): a resume may change anything else (CPUs per actor, microbatches, the learning
    rate, the run's length) and still restore; another model or stage split may not."""
    a = load_config(TINY)
    b = load_config(TINY, ["train.lr=3e-4", "parallel.microbatches=2", "parallel.cpus_per_actor=1", "train.max_steps=7", "parallel.threads_per_actor=2"])
    assert b.train.lr == 3e-4 and b.parallel.microbatches == 2
    assert a.config_hash() == b.config_hash()
    assert a.config_hash() != load_config(TINY, ["model.dim=128"]).config_hash()
    assert a.config_hash() != load_config(TINY, ["parallel.stages=2"]).config_hash()
    assert validate(RunConfig()).train.grad_clip == 1.0


def run_cli(*args):
    env = dict(os.environ, RAY_ADDRESS="")
    return subprocess.run([sys.executable, "-m", "elastic_llm.cli", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["train", "--set", "parallel.stages=3"], "choose parallel.stages in {1, 2, 4}"),
        (["train", "--config", "jobs/missing.yaml"], "does not exist"),
        (["train", "--max-steps", "0"], "--max-steps=0 must be >= 1"),
        (["bench", "snapshot", "--steps", "1"], "--steps=1 must be >= 2"),
        (["bench", "pipeline", "--plot", "sweep.png"], "--plot: only with --sweep"),
        (["bench", "pipeline", "--sweep", "--config", "jobs/tiny.yaml"], "--sweep runs its own configurations"),
        (["bench", "recovery", "--auto-only"], "--auto-only is only for `bench durable` and `bench snapshot`"),
        (["train", "--set", "chaos.events=[{step: 2, kill: stage, op: allreduce}]"], "op=allreduce needs parallel.dp >= 2"),
        (["train", "--set", "chaos.events=[{step: 2, kill: stage, op: sideways}]"], "chaos.events[0].op='sideways' is unknown"),
        (["train", "--set", "parallel.cpus_per_actor=64"], "exceeds the largest node"),
        (["train", "--set", "train.learning_rate=3e-4"], "unknown key train.learning_rate: valid keys of train are batch_size, max_steps, lr,"),
        (["train", "--set", "train.lr=fast"], "train.lr='fast' must be a float"),
        (["train", "--set", "snapshot.enabled=maybe"], "snapshot.enabled='maybe' must be true or false"),
    ],
)
def test_cli_refuses_with_exit_2_and_no_traceback(args, expected):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_unknown_argument_exit_2():
    proc = run_cli("train", "--frobnicate")
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr


def test_elastic_bounds_must_hold_the_starting_width():
    with pytest.raises(ConfigError, match=r"elastic.min_replicas=2 <= parallel.dp=1"):
        load_config(None, ["elastic.min_replicas=2", "train.batch_size=16", "parallel.microbatches=2"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.batch_size=12", "parallel.microbatches=2", "elastic.min_replicas=1", "elastic.max_replicas=4"],
        ["train.batch_size=16", "parallel.microbatches=4", "elastic.min_replicas=1", "elastic.max_replicas=4"],
        ["train.batch_size=8", "parallel.microbatches=4", "parallel.dp=3"],
        ["train.batch_size=10", "parallel.microbatches=4"],
        ["train.batch_size=5", "parallel.microbatches=4", "parallel.dp=5"],  # one sequence per replica
    ],
)
def test_every_width_up_to_the_batch_size_is_accepted(overrides):
    # widths that leave a share not divisible into whole microbatches used to be refused
    cfg = load_config(None, overrides)
    assert cfg.elastic.bounds(cfg.parallel.dp)[1] <= cfg.train.batch_size


def test_the_spot_replay_config_may_grow_to_four_replicas():
    cfg = load_config(os.path.join(REPO, "jobs", "spot-tiny.yaml"), ["elastic.max_replicas=4"])
    assert (cfg.train.batch_size, cfg.parallel.microbatches, cfg.elastic.bounds(cfg.parallel.dp)) == (16, 4, (1, 4))


def test_a_width_above_the_batch_size_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"elastic.max_replicas=5 replicas is more than train.batch_size=4 sequences: .*lower elastic.max_replicas or raise train.batch_size to at least 5"):
        load_config(None, ["train.batch_size=4", "elastic.min_replicas=1", "elastic.max_replicas=5"])
    with pytest.raises(ConfigError, match=r"parallel.dp=3 replicas is more than train.batch_size=2"):
        load_config(None, ["train.batch_size=2", "parallel.dp=3"])


def test_the_width_is_not_part_of_the_config_identity():
    a = load_config(None, ["train.batch_size=8", "parallel.dp=1", "parallel.microbatches=2"])
    b = load_config(None, ["train.batch_size=8", "parallel.dp=2", "parallel.microbatches=2"])
    assert a.config_hash() == b.config_hash()


def test_durable_storage_path_cluster_is_the_clusters_bucket_or_none_and_spot_runs_without_one_are_warned(monkeypatch):
    """``durable.storage_path: cluster`` (the GPU and spot jobs ship it) reads the durable location
    cluster.yaml exports on the head, and is no durable tier elsewhere; a run on spot nodes
    without a durable tier gets a warning naming the field, one with a tier or without spot
    nodes gets none."""
    from elastic_llm.config.loading import DURABLE_ENV
    from elastic_llm.config.rules import spot_warning

    monkeypatch.delenv(DURABLE_ENV, raising=False)
    bare = load_config(os.path.join(REPO, "jobs", "llama-124m.yaml"))
    assert bare.durable.storage_path is None and bare.durable.every == "auto"
    monkeypatch.setenv(DURABLE_ENV, "s3://elastic-llm-1-us-west-2/runs?region=us-west-2")
    there = load_config(os.path.join(REPO, "jobs", "llama-124m.yaml"))
    assert there.durable.storage_path == "s3://elastic-llm-1-us-west-2/runs?region=us-west-2"
    assert "durable.storage_path" in spot_warning(bare, 3) and "3 node(s)" in spot_warning(bare, 3)
    assert spot_warning(bare, 0) is None and spot_warning(there, 3) is None and spot_warning(bare, 3, durable=True) is None
