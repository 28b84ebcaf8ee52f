"""Shared fixtures: Ray stays on loopback with token auth; one Ray session per test module."""

import compileall
import json
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402

from elastic_llm.runtime.session import add_loopback_node, loopback_env  # noqa: E402

loopback_env()  # also creates the Ray auth token a test cluster's GCS needs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite starts hundreds of Ray worker processes, each importing the package. Where
# PYTHONDONTWRITEBYTECODE is set (this project's machines set it), none of them writes bytecode, and
# each compiled the package's sources again: 0.19 s of CPU a process. Compiled once here instead.
compileall.compile_dir(os.path.join(REPO, "elastic_llm"), quiet=2)


@pytest.fixture(scope="module")
def ray_local():
    """An embedded single-node Ray for one test module (start costs seconds: share it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",  # a private instance, never a cluster another process started
        num_cpus=8,
        namespace="elastic-llm-test",
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level="WARNING",
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def corpus_dir():
    """The built-in corpus (standard library sources), prepared once per machine."""
    from elastic_llm.data import ensure_builtin_corpus

    return ensure_builtin_corpus()


def live_workers():
    """Live Ray nodes with CPUs (the head of a test cluster has none)."""
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)


def wait_until(predicate, seconds, what, every=0.1):
    """Poll ``predicate`` every ``every`` seconds until it holds; fail naming ``what`` after ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(every)


# a 4-stage model small enough for multi-node tests: one CPU per stage, spread over the nodes
FOUR_SMALL_STAGES = [
    "model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4",
    "parallel.stages=4", "parallel.microbatches=2", "parallel.cpus_per_actor=1",
    "parallel.placement_strategy=SPREAD", "train.batch_size=4", "train.eval_every=0",
]


def written_lines(path):
    """The complete lines of a metrics file a run may still be writing (a last line without its
    newline yet is left for the next look); none while it does not exist."""
    text = path.read_text() if path.exists() else ""
    return text[: text.rfind("\n") + 1].splitlines()


def events(tmp_path, name):
    """The ``{"event": name}`` lines of ``tmp_path/metrics.jsonl`` (:func:`written_lines`)."""
    import json

    lines = [json.loads(x) for x in written_lines(tmp_path / "metrics.jsonl")]
    return [x for x in lines if x.get("event") == name]


def loopback_cluster_fixture(workers, cpus_per_node):
    """A module-scoped fixture: a loopback ``Cluster`` (a head without CPUs + ``workers`` nodes)
    that the module's tests share; Ray and the cluster are shut down after the module."""

    @pytest.fixture(scope="module")
    def cluster():
        import ray

        from elastic_llm.runtime.session import loopback_cluster

        c = loopback_cluster(workers, cpus_per_node)
        yield c
        ray.shutdown()
        c.shutdown()

    return cluster


def top_up(cluster, workers, cpus_per_node, exact=False):
    """Add nodes until ``workers`` worker nodes are live again (``exact``: no more than that)."""
    while len(cluster.worker_nodes) < workers:
        add_loopback_node(cluster, cpus_per_node)
    cluster.wait_for_nodes()
    wait_until(lambda: (live_workers() == workers) if exact else (live_workers() >= workers), 60, "worker nodes coming up")
    return cluster


@pytest.fixture(autouse=True)
def elastic_llm_logs_reach_caplog(monkeypatch):
    """Every test starts with the ``elastic_llm`` loggers propagating (``caplog`` reads them): a
    CLI test earlier in the process may have configured them not to (:func:`elastic_llm.logs.configure`)."""
    import logging

    monkeypatch.setattr(logging.getLogger("elastic_llm"), "propagate", True)


# What an undisturbed run's losses depend on: the model's math and the data, not where its actors
# run, nor what guards them (snapshots, parity, a durable tier, warm standbys) or strikes them (chaos).
_PLACEMENT_ONLY = ("cpus_per_actor", "gpus_per_actor", "placement_strategy", "gpu_memory_gib")
_UNDISTURBED: dict[str, dict[int, float]] = {}
UNDISTURBED_STEPS = 16  # at least this many steps, so the modules' shorter runs share one


def undisturbed_losses(cluster, cfg, steps):
    """Per-step losses of ``cfg``'s run trained ``steps`` steps without a fault and without the
    fault-tolerance machinery (no snapshots, no durable tier, no standbys, no chaos), on
    ``cluster``. Shared by the session: a run of the same math trained far enough already answers
    (the losses do not depend on the machinery, which is what every bit-identical comparison with
    them asserts)."""
    from elastic_llm.config import config_from_dict
    from elastic_llm.runtime.ray_runtime import ray_trainer

    d = cfg.to_dict()
    math = {k: d[k] for k in ("model", "train", "data", "elastic", "checkfree")}
    math["parallel"] = {k: v for k, v in d["parallel"].items() if k not in _PLACEMENT_ONLY}
    math["recovery_mode"] = d["recovery"]["mode"]
    key = json.dumps(math, sort_keys=True)
    have = _UNDISTURBED.get(key)
    if have is None or max(have) < steps:
        d["snapshot"]["enabled"] = False
        d["durable"]["storage_path"] = None
        d["recovery"]["standby"] = 0
        d["chaos"]["events"] = []
        d["chaos"]["failure_prob_per_step"] = d["chaos"]["failure_rate_per_hour"] = 0.0
        t = ray_trainer(config_from_dict(d), cluster=cluster)
        try:
            history = t.fit(max(steps, UNDISTURBED_STEPS))
            assert t.recoveries == [], t.recoveries
        finally:
            t.shutdown()
        have = _UNDISTURBED[key] = {h["step"]: h["loss"] for h in history}
    return {s: loss for s, loss in have.items() if s <= steps}
