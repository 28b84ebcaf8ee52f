"""Driver failover: seconds from a new driver's start to its first completed step after the old
driver was SIGKILLed, resuming from the run's snapshots in memory (``elastic-llm train --resume
RUN_ID``) against resuming from the run's newest durable checkpoint (``--resume RUN_DIR``, the
peer: what a restart without failover does at best), side by side on one loopback
``ray.cluster_utils.Cluster`` (a head without CPUs + 3 worker nodes of 2 CPUs).

Per round: a driver process (``elastic-llm train --address``: the config, a durable checkpoint
every 2 committed snapshots into a temporary directory) trains until ``kill_at`` steps are done
and its first durable checkpoint is committed (the peer needs one), and is SIGKILLed; then one of the two resumes runs as a new process (alternating which goes first
between rounds) until 2 steps past the kill, and the other from a fresh killed run. Timed from
outside (``perf_counter`` around the process): until the resumed driver's metrics file shows its
first step; also the product's own ``reattach`` / ``resume`` line (``seconds``: the restore), its
start line (when it came, and its ``setup_s``: where the setup went: Ray, managers, stages), and
the step each resumed from (memory: the newest committed snapshot; durable: an older one), and
how many stage processes the resumed driver started anew (memory: its stage actors are taken
over, so none unless one died; the durable peer's round first ends everything the killed run left,
as ``recovery.driver_grace_s`` would, and starts all of them).
Must never reach anything but 127.0.0.1, or judge its result (BENCHMARKS.md does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, median
from elastic_llm import events
from elastic_llm.events import read_lines

REPO = Path(__file__).resolve().parent.parent
SMALL = [  # 4 one-CPU stages of a small model over 3 nodes of 2 CPUs
    "model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4", "parallel.stages=4",
    "parallel.microbatches=2", "parallel.cpus_per_actor=1", "parallel.placement_strategy=SPREAD",
    "train.batch_size=4", "train.eval_every=0", "snapshot.group_size=3", "recovery.standby=0",
]
STEP_S = 300.0  # longest a driver may take to reach a step


def _lines(path: Path) -> list[dict[str, Any]]:
    return read_lines(path, growing=True)


def _steps(path: Path) -> list[int]:
    return [x["step"] for x in _lines(path) if "loss" in x]


def _command(config: str, address: str, out: Path, steps: int, sets: list[str]) -> list[str]:
    args = [a for s in sets for a in ("--set", s)]
    return [sys.executable, "-m", "elastic_llm.cli", "train", "--config", config, "--address", address,
            "--max-steps", str(steps), "--metrics-out", str(out), "--no-progress", *args]


def _wait(pred: Any, proc: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + STEP_S
    while not pred():
        if proc.poll() is not None:
            raise RuntimeError(f"the driver ended before {what}: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {STEP_S:.0f} s")
        time.sleep(0.05)


def _killed_run(config: str, address: str, work: Path, kill_at: int, sets: list[str]) -> tuple[str, int]:
    out = work / "killed.jsonl"
    p = subprocess.Popen(_command(config, address, out, kill_at + 50, sets), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    flushed = lambda: any(isinstance(ev, events.Durable) for ev in map(events.parse, _lines(out)))  # noqa: E731 - the peer needs a committed checkpoint
    _wait(lambda: max(_steps(out), default=0) >= kill_at and flushed(), p, f"step {kill_at} and a durable checkpoint")
    p.send_signal(signal.SIGKILL)
    p.wait()
    (start,) = [ev for ev in map(events.parse, _lines(out)) if isinstance(ev, events.Start)]
    return start.run_id, max(_steps(out)), _pids(start)


def _pids(start: Any) -> dict[str, int]:
    return {f"{a['stage']}/{a['replica']}": a["pid"] for a in start.actors}


def _reclaim(run_id: str) -> None:
    """End whatever of run ``run_id`` outlived its driver (managers, stage actors, standbys, their
    placement groups), as their leases would after ``recovery.driver_grace_s``."""
    import ray

    from elastic_llm.lease import remove_run_groups

    for e in ray.util.list_named_actors(all_namespaces=True):
        if e["name"].startswith((f"smp-{run_id}-", f"stage-{run_id}-", f"standby-{run_id}-")):
            ray.kill(ray.get_actor(e["name"], namespace=e["namespace"]))
    remove_run_groups(run_id)


def _resume(config: str, address: str, work: Path, name: str, target: str, steps: int, sets: list[str]) -> dict[str, Any]:
    out = work / f"{name}.jsonl"
    t, wall = time.perf_counter(), time.time()
    p = subprocess.Popen([*_command(config, address, out, steps, sets), "--resume", target], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait(lambda: bool(_steps(out)), p, "a first step after the resume")
    first_step_s = time.perf_counter() - t
    p.wait(timeout=STEP_S)
    typed = [ev for ev in map(events.parse, _lines(out)) if ev is not None]
    (line,) = [ev for ev in typed if isinstance(ev, (events.Reattach, events.Resume))]
    (start,) = [ev for ev in typed if isinstance(ev, events.Start)]
    return {
        "first_step_s": first_step_s, "restore_s": line.seconds, "resumed_at": line.step, "how": line.kind.value,
        "to_start_line_s": round(start.time - wall, 3),  # process start to its start line (Python, imports, setup)
        "setup_s": start.setup_s or {},  # the product's own spans of that setup
        "pids": _pids(start),
        "kept": getattr(line, "kept", None),  # memory: stage actors taken over with the committed state in place
    }


def run_failover_bench(config: str = "jobs/tiny.yaml", rounds: int = 2, kill_at: int = 6) -> dict[str, Any]:
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise RuntimeError("export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (and RAY_AUTH_MODE=token) first: the nodes must stay on 127.0.0.1")
    import ray

    from elastic_llm.runtime.session import loopback_cluster, loopback_env

    loopback_env()
    cluster = loopback_cluster(3, 2)
    result: dict[str, Any] = {"bench": "failover", "config": config, "machine": machine_info(), "rounds": rounds, "kill_at": kill_at}
    runs: dict[str, list[dict[str, Any]]] = {"memory": [], "durable": []}
    try:
        for r in range(rounds):
            order = ("memory", "durable") if r % 2 == 0 else ("durable", "memory")
            for how in order:
                with tempfile.TemporaryDirectory(prefix="elastic-llm-failover-") as tmp:
                    work = Path(tmp)
                    sets = [*SMALL, f"durable.storage_path={work / 'store'}", "durable.every=2", "durable.run_name=bench"]
                    run_id, killed, pids = _killed_run(str(REPO / config), cluster.address, work, kill_at, sets)
                    target = run_id if how == "memory" else str(work / "store" / "bench")
                    if how == "durable":  # nothing outlives the driver: the peer restarts from storage only
                        _reclaim(run_id)
                        sets = [*sets, "recovery.driver_grace_s=0"]
                    got = _resume(str(REPO / config), cluster.address, work, how, target, killed + 2, sets)
                    got["new_stage_processes"] = sum(1 for k, pid in got["pids"].items() if pids.get(k) != pid)
                    runs[how].append({"killed_at": killed, **got})
                    _reclaim(run_id)  # anything left of either round
    finally:
        ray.shutdown()
        cluster.shutdown()
    for how, rs in runs.items():
        result[how] = {
            "first_step_s_median": round(median(x["first_step_s"] for x in rs), 2),
            "restore_s_median": round(median(x["restore_s"] for x in rs), 3),
            "steps_redone_median": median(x["killed_at"] - x["resumed_at"] for x in rs),
            "new_stage_processes_max": max(x["new_stage_processes"] for x in rs),
            "runs": rs,
        }
    result["speedup"] = round(result["durable"]["first_step_s_median"] / result["memory"]["first_step_s_median"], 2)
    return result
