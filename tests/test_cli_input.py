"""Bad input to the CLI is refused with one clear message and exit code 2, before Ray starts,
and nothing of the user's is written or lost. No Ray here: every refusal happens before it."""

import os
import socket
import time

import pytest
import ray

from elastic_llm.cli import main
from elastic_llm.config import load_config
from elastic_llm.controller.metrics import MetricsWriter
from elastic_llm.runtime.session import ClusterUnreachable, check_reachable, unreachable
from elastic_llm.durable.storage import StorageError
from elastic_llm.durable.tier import run_storage
from tests.test_data_s3 import s3  # noqa: F401  (moto's S3 server on 127.0.0.1, module scope)

from .conftest import REPO

pytestmark = pytest.mark.timeout(120)


def refused(capsys, *args: str) -> str:
    """Run the CLI; assert exit code 2 and a one-line error; return that line."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_metrics_out_under_a_file_or_onto_a_directory_is_refused(corpus_dir, tmp_path, capsys):
    (tmp_path / "afile").write_text("mine\n")
    train = ("train", "--set", f"data.dir={corpus_dir}", "--no-progress")
    line = refused(capsys, *train, "--metrics-out", str(tmp_path / "afile" / "m.jsonl"))
    assert f"cannot write the metrics file {tmp_path / 'afile' / 'm.jsonl'} ({tmp_path / 'afile'} is a file, not a directory)" in line
    assert "give a path in a directory you can write" in line
    line = refused(capsys, *train, "--metrics-out", str(tmp_path))
    assert f"({tmp_path} is a directory)" in line
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_metrics_out_creates_missing_directories(tmp_path):
    from elastic_llm.events import StateChange

    writer = MetricsWriter(tmp_path / "new" / "dirs" / "m.jsonl")
    writer.emit(StateChange(step=0, old="starting", new="running"))
    writer.close()
    assert (tmp_path / "new" / "dirs" / "m.jsonl").read_text().startswith('{"event": "state"')


def test_an_existing_metrics_file_is_untouched_when_another_input_is_refused(corpus_dir, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1}\n')
    line = refused(capsys, "train", "--set", f"data.dir={corpus_dir}", "--metrics-out", str(metrics), "--resume", str(tmp_path / "nothing"))
    assert "does not exist: give a checkpoint directory or a run directory" in line
    assert metrics.read_text() == '{"step": 1}\n'


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scheme", ["", "ray://", "auto"])
def test_train_at_an_address_where_nothing_listens_fails_within_seconds(corpus_dir, scheme, monkeypatch, capsys):
    port = closed_port()
    address = "auto" if scheme == "auto" else f"{scheme}127.0.0.1:{port}"
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # what auto finds (never a cluster of this machine)
    t = time.monotonic()
    line = refused(capsys, "train", "--address", address, "--set", f"data.dir={corpus_dir}", "--no-progress")
    assert time.monotonic() - t < 20  # Ray's own retries take over a minute
    assert line.startswith(f"error: no Ray cluster at --address {address} (")
    assert "Connection refused" in line and "start one (`ray start --head`), or pass the address of its GCS" in line
    assert (f"127.0.0.1:{port}: Connection refused" in line) == (address != f"127.0.0.1:{port}")  # where auto / ray:// led
    assert not ray.is_initialized()


def test_auto_without_any_cluster_and_malformed_addresses_say_why(monkeypatch):
    from ray._private import services

    monkeypatch.setattr(services, "canonicalize_bootstrap_address", lambda address, temp_dir=None: None)
    assert "RAY_ADDRESS is unset and `ray start` recorded no cluster" in unreachable("auto")
    assert unreachable("localhost") == "'localhost' is not HOST:PORT"
    assert unreachable("anyscale://somewhere") is None  # other schemes: Ray's business
    with pytest.raises(ClusterUnreachable, match=r"no Ray cluster at --address ray://nowhere \('nowhere' is not HOST:PORT\)"):
        check_reachable("ray://nowhere")


@pytest.mark.parametrize(
    "where,expected",
    [
        ("afile/store", "Not a directory"),  # a path under a file
        ("nosuchscheme://bucket/x", "durable.storage_path: storage path 'nosuchscheme://bucket/x' cannot be opened"),
    ],
)
def test_a_durable_storage_path_that_cannot_be_written_is_refused_before_ray(corpus_dir, tmp_path, where, expected, capsys):
    (tmp_path / "afile").write_text("mine\n")
    path = where if "://" in where else str(tmp_path / where)
    line = refused(capsys, "train", "--set", f"data.dir={corpus_dir}", "--set", f"durable.storage_path={path}", "--no-progress")
    assert expected in line
    if "://" not in where:
        assert f"durable.storage_path={path!r} cannot be written" in line and "give a directory or URI this user may create and write files in" in line
    assert not ray.is_initialized() and (tmp_path / "afile").read_text() == "mine\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission")
def test_a_durable_storage_path_without_write_permission_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(StorageError, match="durable.storage_path=.* cannot be written .*Permission denied"):
        run_storage(load_config("jobs/tiny.yaml", [f"durable.storage_path={tmp_path / 'ro'}"]))


def test_a_writable_durable_storage_path_gets_the_run_directory_and_no_probe_file(tmp_path):
    run = run_storage(load_config("jobs/tiny.yaml", [f"durable.storage_path={tmp_path / 'store'}", "durable.run_name=mine"]))
    assert run.root == str(tmp_path / "store" / "mine") and os.listdir(run.root) == []


def test_the_write_probe_on_an_object_store(s3):  # noqa: F811
    fs, query = s3
    run = run_storage(load_config("jobs/tiny.yaml", [f"durable.storage_path=s3://corpus/probe?{query}"]))
    assert run.display() == "s3://corpus/probe/tiny" and run.list_files() == []
    with pytest.raises(StorageError, match=r"durable.storage_path='s3://nobucket/x\?.*' cannot be written .*give a directory or URI"):
        run_storage(load_config("jobs/tiny.yaml", [f"durable.storage_path=s3://nobucket/x?{query}"]))


def test_parity_beyond_the_nodes_of_a_cluster_is_named_and_one_node_or_a_wide_group_is_fine():
    from elastic_llm.snapshot.groups import check_parity_fits, make_groups
    from elastic_llm.snapshot.layout import LayoutError

    with pytest.raises(LayoutError, match=r"snapshot.parity=2 needs erasure groups of at least parity \+ 1 = 3 nodes .*snapshot.group_size=4.* the cluster has 2: .*set snapshot.parity to at most 1, or add nodes"):  # noqa: E501 - the whole message, as the user reads it
        check_parity_fits(2, 2, 4)
    check_parity_fits(1, 3, 4)  # one node: no parity whatever the setting (embedded Ray)
    check_parity_fits(3, 2, 8)  # group_size beyond the nodes: one group of all of them
    assert make_groups(["c", "a", "b"], 8, 2) == (("a", "b", "c"),)
    assert make_groups(["a", "b"], 4, 2) == ()  # what the check keeps a run from: no group, no parity


class NoMonitor:
    """Stands in for the run's monitor actor (no Ray here)."""

    class _Call:
        def remote(self, *args):
            return None

    publish = record = stop = _Call()


def test_train_on_two_nodes_with_parity_two_is_refused_before_any_stage_starts(corpus_dir, monkeypatch, capsys):
    """The trainer's start on a (pretend) two-node Ray cluster: one snapshot manager per node, then
    the check; exit 2 naming the fields, and no stage actor was asked for."""
    from elastic_llm.runtime import ray_runtime
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator

    monkeypatch.setattr(ray_runtime.RayRuntime, "start", lambda self, cfg, run_id, spans: [])
    monkeypatch.setattr(ray_runtime, "start_monitor", lambda namespace, status: NoMonitor())
    monkeypatch.setattr(SnapshotCoordinator, "ensure_managers", lambda self: self.managers.update(node0=None, node1=None) or self.managers)
    monkeypatch.setattr(ray_runtime, "ActorGroup", None)  # calling it would fail the test
    line = refused(capsys, "train", "--address", "127.0.0.1:6379", "--set", f"data.dir={corpus_dir}", "--set", "snapshot.parity=2", "--no-progress")
    assert "snapshot.parity=2 needs erasure groups of at least parity + 1 = 3 nodes with CPUs (snapshot.group_size=4 per group), but the cluster has 2" in line


def test_checkpoints_at_the_storage_root_name_its_runs(tmp_path, capsys):
    for run in ("alpha", "beta"):
        (tmp_path / run / "checkpoint_00000002").mkdir(parents=True)
    (tmp_path / "notes").mkdir()  # not a run: no checkpoint_* inside
    for args in (("checkpoints", "verify", str(tmp_path)), ("export", str(tmp_path), "--out", str(tmp_path / "hf"))):
        line = refused(capsys, *args)
        assert line == f"error: {tmp_path} holds the runs alpha, beta, not checkpoints: give a run directory, e.g. {tmp_path / 'alpha'}"
    assert not (tmp_path / "hf").exists()
    line = refused(capsys, "checkpoints", "verify", str(tmp_path / "notes"))
    assert line == f"error: {tmp_path / 'notes'} holds no committed checkpoint: give another directory"


def test_checkpoints_list_at_a_storage_root_lists_every_runs_checkpoints(tmp_path, capsys):
    """What a user types after a run: the durable.storage_path it was given. Its runs' checkpoints
    are listed, each line naming its run (none is committed here: no manifest)."""
    import json

    for run in ("alpha", "beta"):
        (tmp_path / run / "checkpoint_00000002").mkdir(parents=True)
    (tmp_path / "beta" / "checkpoint_00000004").mkdir()
    assert main(["checkpoints", "list", str(tmp_path)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["run"], x["step"], x["committed"]) for x in lines] == [("alpha", 2, False), ("beta", 2, False), ("beta", 4, False)]
    assert refused(capsys, "checkpoints", "list", str(tmp_path / "notes")).startswith("error: ")  # neither a run nor a storage root


def test_steps_has_the_least_each_command_needs(tmp_path, capsys):
    """A simulation of one step is a simulation; a convergence experiment needs a first and a last step."""
    assert main(["simulate", "--config", f"{REPO}/jobs/spot-tiny.yaml", "--nodes", "4", "--stages", "4", "--replicas", "2", "--steps", "1",
                 "--cost", "cpu-2core", "--out", str(tmp_path / "sim")]) == 0
    line = refused(capsys, "experiment", "convergence", "--steps", "1", "--out", str(tmp_path / "cv"))
    assert line == "error: --steps=1 must be >= 2"


def test_commands_without_ray_do_not_set_up_ray(tmp_path, monkeypatch, capsys):
    """prepare, simulate, checkpoints and export never talk to Ray: they do not make an auth token
    or touch Ray's environment (a token made here costs a subprocess start)."""
    from elastic_llm.runtime import session

    called = []
    monkeypatch.setattr(session, "loopback_env", lambda: called.append("loopback"))
    (tmp_path / "run" / "checkpoint_00000002").mkdir(parents=True)
    main(["checkpoints", "list", str(tmp_path / "run")])
    main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert called == []


def test_every_error_the_command_line_explains_is_an_exception_class_of_its_module():
    """The exit codes' catalogue names each error by the module that defines it (resolved only
    once the module is loaded): every entry must be that module's own exception class."""
    import importlib

    from elastic_llm.cli import STOP_ERRORS, USAGE_ERRORS, loaded_errors

    for module, name in (*USAGE_ERRORS, *STOP_ERRORS):
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Exception) and cls.__module__ == module, (module, name, cls.__module__)
    assert len(loaded_errors(USAGE_ERRORS)) == len(USAGE_ERRORS) and len(loaded_errors(STOP_ERRORS)) == len(STOP_ERRORS)


def test_a_config_refused_at_once_never_imports_torch():
    """`train` with a config that cannot run is refused (exit 2, naming the field) before torch and
    Ray are imported: a fresh process shows neither loaded."""
    import subprocess
    import sys

    probe = ("import sys; from elastic_llm.cli import main; rc = main(['train', '--set', 'parallel.stages=3']); "
             "print(rc, sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr[-2000:]
    assert "choose parallel.stages in {1, 2, 4}" in done.stderr
