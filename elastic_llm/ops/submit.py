"""``elastic-llm submit``: a training run as a Ray job, through Ray's ``JobSubmissionClient``.

Owns: checking the run config here before anything is sent (a bad config is refused with the
same message ``train`` gives), giving a run without a durable tier the cluster's
(:func:`with_cluster_durable`), choosing what the job runs (the uploaded source checkout, or the
elastic-llm installed on the cluster), building the entrypoint and runtime env, submitting, and
telling the user how to follow the job (or following it with ``--wait``).
Never trains and never talks to the cluster except through the job server.

What runs: from a source checkout (the folder holding this project's ``pyproject.toml``, or
``--working-dir``), the checkout is uploaded as the job's working directory (without ``.git`` and
benchmark results) and the job runs ``python3 -m elastic_llm.cli`` from it, so the code you edit is
the code that runs; the config must then lie inside that directory. Otherwise only the config
file is uploaded and the job runs the cluster's installed ``elastic-llm``.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_llm.config import RunConfig

EXCLUDES = [".git", "benchmarks/results", "**/__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", "*.png"]
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
POLL_S = 2.0
AGENT_WAIT_S = 60.0  # longest a new cluster's job server may take to have an agent


class SubmitError(RuntimeError):
    """The run cannot be submitted as asked; the message says why and what to do."""


def source_checkout(start: Path) -> Path | None:
    """The elastic-llm source checkout holding ``start`` (the folder with its pyproject.toml), or None."""
    for d in (start, *start.parents):
        p = d / "pyproject.toml"
        if p.is_file() and (d / "elastic_llm").is_dir() and 'name = "elastic-llm"' in p.read_text(errors="replace"):
            return d
    return None


def job_spec(config: str, overrides: list[str], working_dir: Path | None, staging: Path) -> tuple[str, dict[str, Any]]:
    """(entrypoint, runtime_env) of the job. ``working_dir``: upload this checkout and run its
    code; None: upload only the config (copied into ``staging``) and run the installed package."""
    cfg_path = Path(config).resolve()
    env = {"RAY_AUTH_MODE": "token"}
    if working_dir is not None:
        try:
            rel = cfg_path.relative_to(working_dir.resolve())
        except ValueError:
            raise SubmitError(
                f"--config {config} is outside the working directory {working_dir} that is uploaded with the job: "
                "move the config into it, or pass --working-dir with a folder holding both"
            ) from None
        cmd = ["python3", "-m", "elastic_llm.cli", "train", "--config", rel.as_posix()]
        runtime_env = {"working_dir": str(working_dir), "excludes": EXCLUDES, "env_vars": env}
    else:
        shutil.copyfile(cfg_path, staging / "run.yaml")
        cmd = ["elastic-llm", "train", "--config", "run.yaml"]
        runtime_env = {"working_dir": str(staging), "env_vars": env}
    cmd += ["--address", "auto"]
    for o in overrides:
        cmd += ["--set", o]
    return shlex.join(cmd), runtime_env


def with_cluster_durable(cfg: "RunConfig", overrides: list[str]) -> list[str]:
    """``overrides`` plus ``durable.storage_path=cluster`` for a run that takes snapshots and has
    no durable tier of its own and no ``--set durable.storage_path=...``: on a cluster.yaml cluster
    (spot workers) the job then flushes to the cluster's bucket (``ELASTIC_LLM_DURABLE_PATH`` on
    the head); elsewhere ``cluster`` is no durable tier. Pure."""
    if cfg.durable.storage_path or not cfg.snapshots_on or any(o.startswith("durable.storage_path=") for o in overrides):
        return overrides
    return [*overrides, "durable.storage_path=cluster"]


def submit(args: argparse.Namespace) -> int:
    from elastic_llm.config import load_config

    overrides = list(args.set or [])
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    cfg = load_config(args.config, overrides)  # ConfigError: refused here, before the cluster sees it
    overrides = with_cluster_durable(cfg, overrides)
    if args.working_dir is not None:
        working_dir: Path | None = Path(args.working_dir)
        if working_dir is None or not working_dir.is_dir():
            print(f"error: --working-dir {args.working_dir} is not a directory", file=sys.stderr)
            return 2
    else:
        working_dir = source_checkout(Path.cwd())
    from ray.job_submission import JobSubmissionClient

    with tempfile.TemporaryDirectory(prefix="elastic-llm-submit-") as staging:
        try:
            entrypoint, runtime_env = job_spec(args.config, overrides, working_dir, Path(staging))
        except SubmitError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            client = JobSubmissionClient(args.address)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"error: no Ray job server at --address {args.address} ({first}): start the cluster with its dashboard "
                  "(`ray start --head`, or `ray dashboard cluster.yaml` to reach a launched one) or pass its address, "
                  "e.g. --address http://127.0.0.1:8265", file=sys.stderr)
            return 2
        try:
            job_id = submit_with_retry(client, entrypoint, runtime_env, args.submission_id, cfg.name)
        except RuntimeError as e:
            print(f"error: the job server at {args.address} did not take the job: {str(e).splitlines()[0][:300]}", file=sys.stderr)
            return 1
    print(job_id)
    addr = shlex.quote(args.address)
    print(f"submitted {cfg.name} as Ray job {job_id}: {entrypoint}\n"
          f"  follow its logs:  ray job logs --address {addr} --follow {job_id}\n"
          f"  its state:        ray job status --address {addr} {job_id}   (or elastic-llm status on a cluster node)\n"
          f"  stop it:          ray job stop --address {addr} {job_id}", file=sys.stderr)
    if not args.wait:
        return 0
    return follow(client, job_id)


def submit_with_retry(client: Any, entrypoint: str, runtime_env: dict[str, Any], submission_id: str | None, name: str, wait_s: float = AGENT_WAIT_S) -> str:
    """Submit; while the job server answers that no agent is up yet (the first seconds of a new
    cluster), try again for up to ``wait_s`` seconds. Any other refusal is raised at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id, metadata={"elastic_llm_config": name})
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            print("the job server has no agent up yet (a cluster that just started): trying again", file=sys.stderr)
            time.sleep(POLL_S)


def follow(client: Any, job_id: str) -> int:
    """Print the job's new log lines until it ends; 0 if it SUCCEEDED, 1 otherwise."""
    shown = 0
    while True:
        status = str(client.get_job_status(job_id)).split(".")[-1]
        logs = client.get_job_logs(job_id)
        sys.stdout.write(logs[shown:])
        sys.stdout.flush()
        shown = len(logs)
        if status in TERMINAL:
            print(f"job {job_id}: {status}", file=sys.stderr)
            return 0 if status == "SUCCEEDED" else 1
        time.sleep(POLL_S)
