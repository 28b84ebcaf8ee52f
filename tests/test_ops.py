"""The pure parts of operations, without Ray: actor names, the status table, the monitor's
records, what a submitted job runs, and the refusals of ``submit`` / ``status``.

The same parts on a real cluster: tests/test_operations.py.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_llm.cli import main
from elastic_llm.monitor import RunEvent, RunMonitor, RunStatus, event_of, protected_groups
from elastic_llm.ops.status import parse_name, render
from elastic_llm.ops.submit import SubmitError, job_spec, source_checkout, with_cluster_durable
from elastic_llm.snapshot.records import VersionRecord
from elastic_llm.telemetry import Metrics

from .conftest import REPO


def test_actor_names_give_kind_and_run_and_nothing_else_matches():
    assert parse_name("stage-3f2a9c-1-0.2") == ("stage", "3f2a9c")
    assert parse_name("smp-3f2a9c-683f3a7cc5b9-1") == ("smp", "3f2a9c")
    assert parse_name("run-3f2a9c") == ("run", "3f2a9c")
    for other in ("smp-683f3a7cc5b9", "stage-1-0", "_ray_internal_job_actor_x", "run-", "", "runner-3f2a9c"):
        assert parse_name(other) is None, other


def test_protected_groups_counts_groups_whose_nodes_are_all_alive():
    rec = VersionRecord(7, (("a", "b"), ("c", "d", "e")), ())
    assert protected_groups(rec, {"a", "b", "c", "d", "e"}) == (2, 2)
    assert protected_groups(rec, {"a", "b", "c", "e"}) == (2, 1)
    assert protected_groups(rec, set()) == (2, 0)
    assert protected_groups(None, {"a"}) == (0, 0)


def test_metrics_lines_become_the_events_status_shows():
    rec = event_of({"event": "recovery", "step": 12, "time": 5.0, "stage": 1, "replica": 0, "source": "parity", "rollback_steps": 2, "seconds": 1.5})
    assert rec == RunEvent("recovery", 12, 5.0, "stage 1 replica 0 from parity, rolled back 2 steps", "parity", 1.5)
    none = event_of({"event": "recovery", "step": 3, "time": 1.0, "stage": None, "replica": None, "source": "none", "seconds": 0.2})
    assert none.text.startswith("nothing lost") and none.source == "none"
    assert event_of({"event": "resize", "step": 4, "time": 0, "from_dp": 2, "to_dp": 1, "reason": "drain", "seconds": 3.0}).text == "width 2 -> 1 (drain)"
    drain = event_of({"event": "drain", "step": 4, "time": 0, "node": "ab" * 20, "deadline_s": 19.6, "moved": 2, "seconds": 2.0})
    assert drain.kind == "drain" and "20 s left" in drain.text and "2 actors moved" in drain.text
    assert event_of({"event": "start", "step": 0}) is None
    assert event_of({"step": 5, "loss": 2.0}) is None


def test_monitor_keeps_recent_events_and_its_display_name_names_the_run():
    m = RunMonitor(RunStatus("3f2a9c", "tiny", "running", 3, 100, 4, 2))
    assert repr(m) == "Run(3f2a9c, tiny, 4 stages x 2)"
    for i in range(30):
        m.record(RunEvent("recovery", i, float(i), f"r{i}", "local_smp"))
    m.record(RunEvent("capacity", 30, 30.0, "", seconds=4.0))
    view = m.state()
    assert [e.step for e in view.events] == list(range(10, 30))  # the newest 20; capacity ticks are counted, not kept
    m.publish(RunStatus("3f2a9c", "tiny", "recovering", 4, 100, 4, 1))
    assert m.state().status.state == "recovering"


def test_unknown_metric_names_are_programming_errors_but_metrics_outside_ray_do_nothing():
    m = Metrics()
    m.set("step", 3, run="x")  # no Ray here: nothing happens, nothing raises
    with pytest.raises(KeyError, match="no metric 'stpe'"):
        m.set("stpe", 3, run="x")


def report(events=()):
    status = {"run": "3f2a9c", "config": "tiny", "state": "running", "step": 12, "max_steps": 100, "stages": 2, "width": 1,
              "loss": 3.25, "tokens_per_s": 900.0, "committed_version": 10, "erasure_groups": 1, "erasure_groups_protected": 1, "time": 0}
    stage = {"name": "stage-3f2a9c-0-0.1", "display_name": "Stage(0/2, replica 0, run 3f2a9c)", "actor_id": "a1", "node_id": "683f3a7cc5b9ffff", "pid": 11,
             "state": {"stage": 0, "replica": 0, "role": "embed+L0", "step": 12, "snapshot_version": 12, "copy_in_flight": True, "bytes_held": 3_000_000}}
    late = {**stage, "name": "stage-3f2a9c-1-0.1", "actor_id": "a2", "state": None, "problem": "no state: GetTimeoutError"}
    mgr = {"name": "smp-3f2a9c-683f3a7cc5b9", "display_name": "SnapshotManager(...)", "actor_id": "m1", "node_id": "683f3a7cc5b9ffff", "pid": 9,
           "state": {"versions": [10, 12], "committed": 10, "pinned": [], "shards": [{"stage": 0, "replica": 0}], "parity_regions": 1, "bytes_held": 6_000_000}}
    return {"runs": [{"run": "3f2a9c", "status": status, "events": list(events), "stages": [stage, late], "managers": [mgr]}]}


def test_status_table_shows_run_line_stages_managers_and_recent_recoveries():
    ev = {"kind": "recovery", "step": 9, "time": 0, "text": "stage 1 replica 0 from parity, rolled back 0 steps", "source": "parity", "seconds": 1.25}
    text = render(report([ev, {"kind": "state", "step": 9, "time": 0, "text": "running -> recovering", "source": "", "seconds": 0}]))
    first = text.splitlines()[0]
    assert "run 3f2a9c" in first and "step 12/100" in first and "width 1 x 2 stages" in first and "snapshot 10 (lag 2)" in first
    assert "erasure groups 1/1 protected" in first and "loss 3.250" in first
    assert "embed+L0" in text and "683f3a7cc5b9" in text and "3.0 MB" in text and "Stage(0/2, replica 0, run 3f2a9c)" in text
    assert "no state: GetTimeoutError" in text  # an actor that did not answer is shown, not dropped
    assert "10,12" in text and "6.0 MB" in text
    assert "step 9: recovery: stage 1 replica 0 from parity, rolled back 0 steps (1.2 s)" in text
    assert "running -> recovering" not in text  # state changes are in --json, the table keeps to what an operator acts on
    assert render({"runs": []}) == "no elastic-llm runs on this cluster"


def test_a_submitted_job_runs_the_uploaded_checkout_with_the_config_inside_it(tmp_path):
    root = source_checkout(Path(REPO) / "tests")
    assert root is not None and (root / "elastic_llm").is_dir()
    entry, env = job_spec(f"{REPO}/jobs/tiny.yaml", ["train.lr=1e-3", "data.dir=/my data"], root, tmp_path)
    assert shlex.split(entry) == ["python3", "-m", "elastic_llm.cli", "train", "--config", "jobs/tiny.yaml", "--address", "auto",
                                  "--set", "train.lr=1e-3", "--set", "data.dir=/my data"]
    assert env["working_dir"] == str(root) and ".git" in env["excludes"] and "benchmarks/results" in env["excludes"]
    assert env["env_vars"]["RAY_AUTH_MODE"] == "token"
    outside = tmp_path / "mine.yaml"
    outside.write_text("name: mine\n")
    with pytest.raises(SubmitError, match="outside the working directory"):
        job_spec(str(outside), [], root, tmp_path)


def test_a_submitted_run_without_a_durable_tier_gets_the_clusters_and_an_explicit_choice_is_kept():
    from elastic_llm.config import load_config

    tiny = load_config(f"{REPO}/jobs/tiny.yaml")
    assert with_cluster_durable(tiny, ["train.lr=1e-3"]) == ["train.lr=1e-3", "durable.storage_path=cluster"]
    assert with_cluster_durable(tiny, ["durable.storage_path=null"]) == ["durable.storage_path=null"]  # opted out
    mine = load_config(f"{REPO}/jobs/tiny.yaml", ["durable.storage_path=/data/ckpts"])
    assert with_cluster_durable(mine, []) == []
    assert with_cluster_durable(load_config(f"{REPO}/jobs/tiny.yaml", ["snapshot.enabled=false"]), []) == []  # nothing to flush


def test_without_a_checkout_only_the_config_travels_and_the_installed_package_runs(tmp_path):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("name: mine\n")
    staging = tmp_path / "staging"
    staging.mkdir()
    assert source_checkout(tmp_path) is None
    entry, env = job_spec(str(cfg), [], None, staging)
    assert shlex.split(entry)[:4] == ["elastic-llm", "train", "--config", "run.yaml"]
    assert env["working_dir"] == str(staging) and (staging / "run.yaml").read_text() == "name: mine\n"


def test_submit_refuses_a_bad_config_before_contacting_any_cluster(capsys):
    # port 9 on loopback: nothing listens, so a contact attempt would fail differently
    assert main(["submit", "--address", "http://127.0.0.1:9", "--set", "parallel.stages=3"]) == 2
    err = capsys.readouterr().err
    assert "parallel.stages=3 does not divide model.n_layers" in err


def test_submit_and_status_name_the_address_when_no_cluster_answers():
    for args, expect in (
        (["submit", "--address", "http://127.0.0.1:9"], "no Ray job server at --address http://127.0.0.1:9"),
        (["status", "--address", "127.0.0.1:9"], "no Ray cluster at --address 127.0.0.1:9"),
    ):
        done = subprocess.run([sys.executable, "-m", "elastic_llm.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RAY_gcs_rpc_server_connect_timeout_s": "2"})
        assert done.returncode == 2, (args, done.stderr[-800:])
        assert expect in done.stderr and "Traceback" not in done.stderr, done.stderr[-800:]


class InProcess:
    """A RunMonitor called in this process the way Ray calls the actor (``h.method.remote(...)``)."""

    def __init__(self, body):
        self.body = body

    def __getattr__(self, name):
        method = getattr(self.body, name)
        return type("M", (), {"remote": staticmethod(method)})


def test_the_publisher_turns_metrics_lines_into_status_events_and_capacity_seconds(monkeypatch):
    from types import SimpleNamespace

    from elastic_llm.monitor import Publisher, RunFacts

    trainer = SimpleNamespace(run_id="3f2a9c", cfg=SimpleNamespace(name="tiny", parallel=SimpleNamespace(stages=2, dp=1)),
                              state=SimpleNamespace(name="running"), step=0, end=100, group=None, snapshots=None)
    monitor = RunMonitor(RunStatus("3f2a9c", "tiny", "starting", 0, 100, 2, 1))
    counted = []
    monkeypatch.setattr(monitor.metrics, "inc", lambda name, value=1.0, **tags: counted.append((name, value, tags)))
    def facts():  # what Trainer.run_facts makes of such a trainer
        return RunFacts(RunStatus(trainer.run_id, trainer.cfg.name, trainer.state.name, trainer.step, trainer.end, 2, 1), None, frozenset())

    ticks = iter([100.0, 103.0, 110.5])
    clock = SimpleNamespace(monotonic=lambda: next(ticks), time=lambda: 1.8e9)  # the feed reads its clock, not the machine's
    pub = Publisher(facts, lambda status: InProcess(monitor), clock=clock)
    trainer.step = 7
    pub.on_record({"step": 7, "loss": 2.5, "tokens_per_s": 800.0})
    assert monitor.state().status.step == 7 and monitor.state().status.loss == 2.5
    trainer.state.name = "waiting_for_capacity"
    pub.on_record({"event": "state", "step": 7, "time": 1.0, "old": "running", "new": "waiting_for_capacity", "reason": "need 1 CPU"})
    pub.on_record({"event": "waiting_for_capacity", "step": 7, "time": 2.0, "waited_s": 3.0})
    trainer.state.name = "running"
    pub.on_record({"event": "state", "step": 7, "time": 3.0, "old": "waiting_for_capacity", "new": "running", "reason": ""})
    pub.on_record({"event": "recovery", "step": 8, "time": 4.0, "stage": 1, "replica": 0, "source": "parity", "rollback_steps": 0, "seconds": 2.0})
    waits = [v for name, v, _ in counted if name == "capacity_wait_seconds"]
    assert waits == [3.0, 7.5]  # 100 -> 103 at the report, 103 -> 110.5 when the wait ended
    assert ("recoveries", 1.0, {"run": "3f2a9c", "source": "parity"}) in counted
    view = monitor.state()
    assert [e.kind for e in view.events] == ["state", "state", "recovery"] and view.status.state == "running"
    assert view.status.loss == 2.5  # kept between steps
