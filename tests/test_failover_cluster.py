"""Driver failover on a real loopback Ray cluster: a driver process (``elastic-llm train
--address``) is SIGKILLed mid-run; its detached snapshot managers keep the committed snapshot and
its detached stage actors their processes and state, and ``elastic-llm train --resume RUN_ID``
takes them over and goes on, bit for bit (a stage killed while no driver ran is recovered then);
a run nobody resumes is reclaimed after ``recovery.driver_grace_s``, placement groups included.

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
from elastic_llm.runtime.failover import published_committed

from .conftest import FOUR_SMALL_STAGES, REPO, loopback_cluster_fixture, undisturbed_losses, wait_until

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


def run_id_of(out):
    starts = [x for x in lines(out) if x.get("event") == "start"]
    return starts[0]["run_id"] if starts else None


def kill_at(proc, out, step):
    """SIGKILL the driver once its metrics show ``step`` completed and it published a committed
    snapshot; returns the run id."""
    wait_until(lambda: (any(x.get("step") == step and "loss" in x for x in lines(out)) and published_committed(run_id_of(out)) is not None)
               or proc.poll() is not None, 180, f"the driver at step {step} with a committed snapshot")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return run_id_of(out)


def managers_of(run_id):
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["name"].startswith(f"smp-{run_id}-")]


def stages_of(run_id):
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["name"].startswith(f"stage-{run_id}-")]


def groups_of(run_id):
    return [g for g in ray.util.placement_group_table().values() if g.get("name", "").startswith(f"pg-{run_id}-") and g["state"] != "REMOVED"]


def pids(out):
    (start,) = [x for x in lines(out) if x.get("event") == "start"]
    return {(a["stage"], a["replica"]): a["pid"] for a in start["actors"]}


def clean_losses(cluster, corpus_dir):
    return undisturbed_losses(cluster, load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*BASE, f"data.dir={corpus_dir}"]), STEPS)


def resumed(cluster, corpus_dir, tmp_path, run_id):
    cmd = [*command(cluster, corpus_dir, tmp_path / "b.jsonl", "recovery.driver_grace_s=120"), "--resume", run_id]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return lines(tmp_path / "b.jsonl")


def test_a_killed_driver_is_resumed_from_memory_bit_for_bit_by_the_same_stage_processes(cluster, corpus_dir, tmp_path):
    clean = clean_losses(cluster, corpus_dir)
    a = driver(cluster, corpus_dir, tmp_path / "a.jsonl", "recovery.driver_grace_s=120")
    run_id = kill_at(a, tmp_path / "a.jsonl", 5)
    assert managers_of(run_id) and len(stages_of(run_id)) == 4, "the managers and the stage actors outlive their driver"
    committed = published_committed(run_id).version
    trained = max(x["step"] for x in lines(tmp_path / "a.jsonl") if "loss" in x)

    out = resumed(cluster, corpus_dir, tmp_path, run_id)
    (back,) = [x for x in out if x.get("event") == "reattach"]
    (start,) = [x for x in out if x.get("event") == "start"]
    assert {"ray", "retire", "managers", "stages", "reattach"} <= set(start["setup_s"])  # where the new driver's start went
    assert back["step"] == committed and 1 <= committed <= trained  # the newest committed snapshot: no committed step lost
    assert pids(tmp_path / "b.jsonl") == pids(tmp_path / "a.jsonl")  # no new stage process: the same four took the run on
    assert back["kept"] + back["restored"] == 4  # those past the committed step rolled back to it, the others kept theirs
    got = {x["step"]: x["loss"] for x in out if "loss" in x}
    assert sorted(got) == list(range(committed + 1, STEPS + 1))
    assert got == {s: clean[s] for s in got}  # bit for bit
    assert {x["step"]: x["loss"] for x in lines(tmp_path / "a.jsonl") if "loss" in x} == {s: clean[s] for s in range(1, trained + 1)}
    wait_until(lambda: not managers_of(run_id) and not stages_of(run_id) and not groups_of(run_id), 30, "the run's actors and groups gone after its clean end")


def test_a_driver_that_lived_on_after_a_newer_one_took_the_run_stops_at_its_next_commit_and_leaves_the_run_to_it(cluster, corpus_dir, tmp_path):
    """Driver A is frozen (SIGSTOP) at step 4; a newer driver publishes its epoch for the run, as
    ``--resume`` does first; A wakes. Before publishing its next committed step over the newer
    driver's it reads the run's epoch, stops (exit 3, naming the driver that took over) and ends
    nothing: the managers, the stage actors and the published record stay as they were. A
    resume from there goes on bit for bit."""
    from elastic_llm.runtime.failover import publish, read_run

    clean = clean_losses(cluster, corpus_dir)
    out_a = tmp_path / "a.jsonl"
    a = driver(cluster, corpus_dir, out_a, "recovery.driver_grace_s=120")
    wait_until(lambda: (any(x.get("step") == 4 and "loss" in x for x in lines(out_a)) and published_committed(run_id_of(out_a)) is not None)
               or a.poll() is not None, 180, "driver A at step 4 with a committed snapshot")
    assert a.poll() is None, a.communicate()[1][-3000:]
    a.send_signal(signal.SIGSTOP)
    run_id = run_id_of(out_a)
    record = published_committed(run_id)
    publish(run_id, "epoch", str(int(read_run(run_id, "epoch")) + 1))  # what a newer driver publishes first
    a.send_signal(signal.SIGCONT)
    _, err = a.communicate(timeout=120)
    assert a.returncode == 3, err[-3000:]
    assert f"run {run_id} was taken over by its driver 2 (--resume) while this one (driver 1) lived on" in err
    assert published_committed(run_id) == record  # nothing published over the newer driver's
    assert managers_of(run_id) and len(stages_of(run_id)) == 4  # nothing of the run ended

    out = resumed(cluster, corpus_dir, tmp_path, run_id)
    (back,) = [x for x in out if x.get("event") == "reattach"]
    got = {x["step"]: x["loss"] for x in out if "loss" in x}
    assert back["step"] == record.version and got == {s: clean[s] for s in range(record.version + 1, STEPS + 1)}
    assert pids(tmp_path / "b.jsonl") == pids(out_a)  # the same stage processes took the run on


@pytest.mark.slow  # 40-50 s; the resume from memory bit for bit stays (the killed driver above), and a lost stage's recovery everywhere else
def test_a_stage_killed_while_no_driver_runs_is_recovered_after_the_resume(cluster, corpus_dir, tmp_path):
    clean = clean_losses(cluster, corpus_dir)
    a = driver(cluster, corpus_dir, tmp_path / "a.jsonl", "recovery.driver_grace_s=120")
    run_id = kill_at(a, tmp_path / "a.jsonl", 4)
    before = pids(tmp_path / "a.jsonl")
    victim = ray.get_actor(next(n for n in stages_of(run_id) if n.startswith(f"stage-{run_id}-2-0.")))
    ray.kill(victim, no_restart=True)  # stage 2 dies with no driver to notice
    wait_until(lambda: len(stages_of(run_id)) == 3, 30, "the killed stage's name released")
    committed = published_committed(run_id).version

    out = resumed(cluster, corpus_dir, tmp_path, run_id)
    (back,) = [x for x in out if x.get("event") == "reattach"]
    after = pids(tmp_path / "b.jsonl")
    assert back["step"] == committed and back["restored"] >= 1
    assert after[(2, 0)] != before[(2, 0)] and {k: v for k, v in after.items() if k != (2, 0)} == {k: v for k, v in before.items() if k != (2, 0)}
    got = {x["step"]: x["loss"] for x in out if "loss" in x}
    assert sorted(got) == list(range(committed + 1, STEPS + 1)) and got == {s: clean[s] for s in got}


@pytest.mark.slow  # 27 s; the suite keeps the killed driver resumed from memory (above)
def test_a_driver_nobody_resumes_is_reclaimed_after_its_grace(cluster, corpus_dir, tmp_path):
    a = driver(cluster, corpus_dir, tmp_path / "a.jsonl", "recovery.driver_grace_s=3")
    run_id = kill_at(a, tmp_path / "a.jsonl", 2)
    wait_until(lambda: not managers_of(run_id) and not stages_of(run_id), 60, "the managers and stage actors ending after recovery.driver_grace_s")
    wait_until(lambda: not groups_of(run_id), 30, "the run's placement groups released by the leases")
    late = subprocess.run([*command(cluster, corpus_dir, tmp_path / "b.jsonl"), "--resume", run_id], capture_output=True, text=True, timeout=240)
    assert late.returncode == 2, late.stderr[-3000:]
    assert f"--resume {run_id}: nothing to resume from in memory" in late.stderr and "durable.storage_path is not set" in late.stderr
