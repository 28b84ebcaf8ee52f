"""Operations on a real loopback cluster: job submission, status, display names, Prometheus
metrics, and two runs side by side.

One ``ray.cluster_utils.Cluster`` for the module: a head with the dashboard (job server) on
127.0.0.1 and Ray's metrics export on a loopback port, plus one worker node, token auth as
everywhere. Two runs are submitted with ``elastic-llm submit`` (the real CLI, uploading this
checkout): A, then B once A trains; B is shorter and ends while A still trains. While both train
the module records what ``elastic-llm status --json``, Ray's state API and the Prometheus export
show; the tests then check what was recorded. Nothing is timed.
"""

import contextlib
import io
import json
import socket
import subprocess
import sys
import urllib.request

import pytest
import ray

from elastic_llm.cli import main
from elastic_llm.runtime.session import FAST_HEALTH, NAMESPACE, NODE_STORE_BYTES, add_loopback_node

from .conftest import REPO, wait_until

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]  # two submitted jobs of 1500 and 40 steps: 2-5 minutes
STAGES = 2
A_STEPS, B_STEPS = 1500, 40  # A outlasts B (B is submitted once A trains; A does ~10-30 steps/s)
RUN = [
    "model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=2",
    f"parallel.stages={STAGES}", "parallel.microbatches=2", "parallel.cpus_per_actor=0.5",
    "train.batch_size=8", "train.eval_every=0", "snapshot.group_size=2", "snapshot.parity=1",
]
RUN_METRICS = ["step", "loss", "tokens_per_s", "width", "snapshot_committed_version", "snapshot_lag_steps", "erasure_groups", "erasure_groups_protected"]
STAGE_METRICS = ["stage_step", "stage_snapshot_version"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args, timeout=120):
    done = subprocess.run([sys.executable, "-m", "elastic_llm.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"elastic-llm {args[0]} failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def submit(api, steps):
    """``elastic-llm submit`` through the CLI's entry point, in this process (torch is loaded
    here already; a fresh process would spend seconds importing it): the job id it prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["submit", "--config", f"{REPO}/jobs/tiny.yaml", "--working-dir", REPO, "--address", api,
                     "--max-steps", str(steps), *sum((["--set", o] for o in RUN), [])])
    assert code == 0, f"elastic-llm submit exited {code}"
    return out.getvalue().split()[0]


def status_json(gcs, run=None):
    """``elastic-llm status --json``, the real command in its own process."""
    return json.loads(cli("status", "--address", gcs, "--json", *(["--run", run] if run else [])))


def polled(api):
    """What status reports, asked from this process (polling the command would load the machine)."""
    from elastic_llm.ops.status import collect

    return collect(api)


def run_of(report, run):
    return next((r for r in report["runs"] if r["run"] == run), None)


def training(report, run):
    r = run_of(report, run)
    return r is not None and r["status"] is not None and len(r["stages"]) == STAGES and all((s["state"] or {}).get("step", 0) >= 2 for s in r["stages"])


def alive_actors(api, run):
    from ray.util.state import list_actors

    rows = list_actors(address=api, filters=[("state", "=", "ALIVE"), ("ray_namespace", "=", NAMESPACE)], detail=True, limit=10_000)
    return {a.actor_id: a for a in rows if f"-{run}-" in a.name or a.name == f"run-{run}"}


def scrape():
    """The Prometheus export of every node (each node's metrics agent exports its own processes)."""
    text = []
    for n in ray.nodes():
        if n["Alive"]:
            with urllib.request.urlopen(f"http://127.0.0.1:{n['MetricsExportPort']}/metrics", timeout=10) as r:
                text.append(r.read().decode())
    return "\n".join(text)


def has_metric(text, name, **labels):
    for line in text.splitlines():
        if line.startswith(f"ray_elastic_llm_{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return True
    return False


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """Start the cluster, submit A and B, record what the operator sees; tear down."""
    from ray.cluster_utils import Cluster
    from ray.job_submission import JobSubmissionClient

    dash, metrics = free_port(), free_port()
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": NODE_STORE_BYTES, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dash,
        "metrics_export_port": metrics, "_system_config": {**FAST_HEALTH, "metrics_report_interval_ms": 1000},
        "dashboard_agent_listen_port": free_port(),  # not the default 52365: another Ray on this machine may hold it
    })
    add_loopback_node(c, 2)
    c.wait_for_nodes()
    gcs, api = c.address, f"http://127.0.0.1:{dash}"
    ray.init(address=gcs, namespace=NAMESPACE, logging_level="WARNING")
    out = {"gcs": gcs, "api": api}
    try:
        client = JobSubmissionClient(api)
        out["job_a"] = job_a = submit(api, A_STEPS)
        wait_until(lambda: any(training(rep, r["run"]) for rep in [polled(api)] for r in rep["runs"]), 150, f"run A training (see `ray job logs {job_a}`)", every=1)
        run_a = polled(api)["runs"][0]["run"]
        out["job_b"] = job_b = submit(api, B_STEPS)

        def both():
            report = polled(api)
            return len(report["runs"]) == 2 and all(training(report, r["run"]) for r in report["runs"])

        wait_until(both, 150, "runs A and B both training", every=1)
        out["report"] = status_json(gcs)
        run_b = next(r["run"] for r in out["report"]["runs"] if r["run"] != run_a)
        out["run_a"], out["run_b"] = run_a, run_b
        out["alive_a"], out["alive_b"] = alive_actors(api, run_a), alive_actors(api, run_b)
        from ray.util.state import list_actors

        out["by_display_name"] = {
            (r, s, rep): list_actors(address=api, filters=[("repr_name", "=", f"Stage({s}/{STAGES}, replica {rep}, run {r})"), ("state", "=", "ALIVE")], detail=True)
            for r in (run_a, run_b) for s in range(STAGES) for rep in range(1)
        }

        def metrics_in():
            out["metrics"] = scrape()
            return all(has_metric(out["metrics"], m, run=run_a) for m in RUN_METRICS) and all(
                has_metric(out["metrics"], m, run=run_a, stage=s, replica=0) for m in STAGE_METRICS for s in range(STAGES))

        try:
            wait_until(metrics_in, 60, "the run's metrics in the Prometheus export", every=0.5)
        except AssertionError:
            raise AssertionError("metrics missing; seen: " + " ".join(sorted({ln.split("{")[0] for ln in out["metrics"].splitlines() if "elastic_llm" in ln and not ln.startswith("#")}))) from None
        wait_until(lambda: str(client.get_job_status(job_b)).split(".")[-1] in ("SUCCEEDED", "FAILED", "STOPPED"), 240, "job B ending")
        out["alive_a_after_b"] = alive_actors(api, run_a)
        a_now = run_of(polled(api), run_a)
        print(f"[ops] A at step {a_now and a_now['status']['step']} of {A_STEPS} when B ended", flush=True)
        out["a_training_when_b_ended"] = a_now is not None and a_now["status"]["state"] == "running" and a_now["status"]["step"] < A_STEPS
        out["alive_b_after_b"] = alive_actors(api, run_b)
        wait_until(lambda: str(client.get_job_status(job_a)).split(".")[-1] in ("SUCCEEDED", "FAILED", "STOPPED"), 300, "job A ending")
        out["status"] = {j: str(client.get_job_status(j)).split(".")[-1] for j in (job_a, job_b)}
        out["logs"] = {j: client.get_job_logs(j) for j in (job_a, job_b)}
        def leftovers():  # the ended runs' actors and placement groups (Ray records their end within moments)
            out["alive_after"] = {**alive_actors(api, run_a), **alive_actors(api, run_b)}
            out["pgs_after"] = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
            return not out["alive_after"] and not out["pgs_after"]

        with contextlib.suppress(AssertionError):  # what is left after 30 s is asserted by the test below
            wait_until(leftovers, 30, "the runs' actors and placement groups gone", every=0.5)
        yield out
    finally:
        ray.shutdown()
        c.shutdown()


def test_submitted_runs_reach_succeeded_and_train(seen):
    assert seen["status"] == {seen["job_a"]: "SUCCEEDED", seen["job_b"]: "SUCCEEDED"}, {j: seen["logs"][j][-1500:] for j in seen["logs"]}
    assert f"done: {A_STEPS} steps" in seen["logs"][seen["job_a"]]
    assert f"done: {B_STEPS} steps" in seen["logs"][seen["job_b"]]


def test_status_json_lists_every_actor_of_each_run_with_its_state(seen):
    report, nodes = seen["report"], {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    for run in (seen["run_a"], seen["run_b"]):
        r = run_of(report, run)
        assert r["status"]["run"] == run and r["status"]["state"] == "running" and r["status"]["stages"] == STAGES
        assert sorted((s["state"]["stage"], s["state"]["replica"]) for s in r["stages"]) == [(s, 0) for s in range(STAGES)]
        for s in r["stages"]:
            st = s["state"]
            assert st["run"] == run and st["step"] >= 2 and st["node_id"] == s["node_id"] in nodes and st["pid"] == s["pid"]
            assert st["bytes_held"] > 0 and st["role"] == ("embed+L0" if st["stage"] == 0 else "L1+head")
            assert s["name"].startswith(f"stage-{run}-{st['stage']}-{st['replica']}")
        assert {m["node_id"] for m in r["managers"]} == nodes  # one snapshot manager per node of this run
        assert all(m["state"]["run"] == run and m["name"].startswith(f"smp-{run}-") for m in r["managers"])
        # every live actor of the run is in the report, and nothing else
        listed = {s["actor_id"] for s in r["stages"]} | {m["actor_id"] for m in r["managers"]} | {r["monitor"]["actor_id"]}
        listed |= {s["actor_id"] for s in r["standbys"]}  # the run's idle warm standbys
        assert all(s["state"]["role"] == "standby" and s["name"].startswith(f"standby-{run}-") for s in r["standbys"] if s["state"])
        assert listed == set(seen["alive_a" if run == seen["run_a"] else "alive_b"])


def test_state_api_finds_stage_actors_by_their_display_names(seen):
    for (run, s, rep), rows in seen["by_display_name"].items():
        assert len(rows) == 1, (run, s, rep, rows)
        assert rows[0].name.startswith(f"stage-{run}-{s}-{rep}") and rows[0].class_name == "StageWorker"


def test_metrics_reach_the_nodes_prometheus_export_tagged_by_run_stage_and_replica(seen):
    text = seen["metrics"]
    for m in RUN_METRICS:
        assert has_metric(text, m, run=seen["run_a"]), m
    for m in STAGE_METRICS:
        for s in range(STAGES):
            assert has_metric(text, m, run=seen["run_a"], stage=s, replica=0), (m, s)
    assert has_metric(text, "manager_bytes_held", run=seen["run_a"])


def test_two_runs_on_one_cluster_keep_to_their_own_actors_and_clean_up(seen):
    a, b = seen["alive_a"], seen["alive_b"]
    assert a and b and not set(a) & set(b)
    assert {x.name for x in a.values()}.isdisjoint(x.name for x in b.values())
    assert seen["a_training_when_b_ended"], "run A ended before B: the check below would prove nothing"
    assert set(seen["alive_a_after_b"]) == set(a), "B's end changed A's actors"
    assert seen["alive_b_after_b"] == {}, "B's actors outlived B"
    assert seen["alive_after"] == {}, "actors outlived their runs"
    assert seen["pgs_after"] == [], "placement groups outlived their runs"
