"""Driver failover on a real loopback Ray cluster: a driver process (``elastic-llm train
--address``) is SIGKILLed mid-run; its detached snapshot managers keep the committed snapshot, and
``elastic-llm train --resume RUN_ID`` goes on from it, bit for bit; a run nobody resumes is
reclaimed after ``recovery.driver_grace_s``.

One ``ray.cluster_utils.Cluster`` (a head without CPUs + 3 worker nodes of 2 CPUs) for the module.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import ray

from elastic_llm.config import load_config
from elastic_llm.runtime.ray_runtime import ray_trainer
from elastic_llm.runtime.failover import published_committed

from .conftest import FOUR_SMALL_STAGES, REPO, loopback_cluster_fixture, wait_until

pytestmark = pytest.mark.timeout(300)
STEPS = 8
BASE = [*FOUR_SMALL_STAGES, "snapshot.group_size=3", "recovery.standby=0"]

cluster = loopback_cluster_fixture(3, 2)


def lines(path):
    if not os.path.exists(path):
        return []
    out = []
    for x in open(path).read().splitlines():
        try:
            out.append(json.loads(x))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def command(cluster, corpus_dir, out, *extra):
    sets = [a for s in [*BASE, f"data.dir={corpus_dir}", *extra] for a in ("--set", s)]
    return [sys.executable, "-m", "elastic_llm.cli", "train", "--config", os.path.join(REPO, "jobs", "tiny.yaml"), "--address", cluster.address,
            "--max-steps", str(STEPS), "--metrics-out", str(out), "--no-progress", *sets]


def driver(cluster, corpus_dir, out, *extra):
    return subprocess.Popen(command(cluster, corpus_dir, out, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_at(proc, out, step):
    """SIGKILL the driver once its metrics show ``step`` completed; returns the run id."""
    wait_until(lambda: any(x.get("step") == step and "loss" in x for x in lines(out)) or proc.poll() is not None, 180, f"the driver at step {step}")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (start,) = [x for x in lines(out) if x.get("event") == "start"]
    return start["run_id"]


def managers_of(run_id):
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["name"].startswith(f"smp-{run_id}-")]


def test_a_killed_driver_is_resumed_from_memory_bit_for_bit(cluster, corpus_dir, tmp_path):
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}"])
    t = ray_trainer(cfg, cluster=cluster)
    try:
        clean = {h["step"]: h["loss"] for h in t.fit(STEPS)}
    finally:
        t.shutdown()

    a = driver(cluster, corpus_dir, tmp_path / "a.jsonl", "recovery.driver_grace_s=120")
    run_id = kill_at(a, tmp_path / "a.jsonl", 5)
    assert managers_of(run_id), "the managers outlive their driver"
    committed = published_committed(run_id).version
    trained = max(x["step"] for x in lines(tmp_path / "a.jsonl") if "loss" in x)

    cmd = [*command(cluster, corpus_dir, tmp_path / "b.jsonl", "recovery.driver_grace_s=120"), "--resume", run_id]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = lines(tmp_path / "b.jsonl")
    (back,) = [x for x in out if x.get("event") == "reattach"]
    (start,) = [x for x in out if x.get("event") == "start"]
    assert {"ray", "retire", "managers", "stages", "reattach"} <= set(start["setup_s"])  # where the new driver's start went
    assert back["step"] == committed and 1 <= committed <= trained  # the newest committed snapshot: no committed step lost
    resumed = {x["step"]: x["loss"] for x in out if "loss" in x}
    assert sorted(resumed) == list(range(committed + 1, STEPS + 1))
    assert resumed == {s: clean[s] for s in resumed}  # bit for bit
    assert {x["step"]: x["loss"] for x in lines(tmp_path / "a.jsonl") if "loss" in x} == {s: clean[s] for s in range(1, trained + 1)}
    wait_until(lambda: not managers_of(run_id), 30, "the run's managers gone after its clean end")


@pytest.mark.slow  # 27 s; the suite keeps the killed driver resumed from memory (above)
def test_a_driver_nobody_resumes_is_reclaimed_after_its_grace(cluster, corpus_dir, tmp_path):
    a = driver(cluster, corpus_dir, tmp_path / "a.jsonl", "recovery.driver_grace_s=3")
    run_id = kill_at(a, tmp_path / "a.jsonl", 2)
    wait_until(lambda: not managers_of(run_id), 60, "the managers ending after recovery.driver_grace_s")
    late = subprocess.run([*command(cluster, corpus_dir, tmp_path / "b.jsonl"), "--resume", run_id], capture_output=True, text=True, timeout=240)
    assert late.returncode == 2, late.stderr[-3000:]
    assert f"--resume {run_id}: nothing to resume from in memory" in late.stderr and "durable.storage_path is not set" in late.stderr
