"""``elastic-llm bench calibrate``: the simulation's cost model of this machine, from the benchmarks.

Runs the benchmarks whose figures the cost model holds (or reads their JSON from ``--from DIR``),
each on ``jobs/tiny.yaml`` (the model of the loopback replays), and derives every figure from
them with :func:`profile_from` (pure), never from a replay (the replay is what the simulation is
then compared with: ``elastic-llm bench simulate``):

- ``bench snapshot``: the step on a loopback cluster of 3 nodes without snapshots and with one
  every step (parity 1): ``seq_stage_s`` (the step's work over the machine's cores: every
  loopback "node" shares them) and ``snapshot_step_s`` (the difference); the stage copy
  (``copy_mb_s``) and the parity encode (``parity_mb_s``);
- ``bench recovery``: a full restart's process starts (``actor_start_s``: the run's stage
  processes start two at a time on two cores), a warm standby's adoption (``adopt_s``), a killed
  stage noticed (``detect_process_s``), a stage's state copied from a data-parallel peer
  (``network_mb_s``) and restored from its node's manager (``restore_mb_s``);
- ``bench detect``: a vanished node noticed by the run's node watch (``detect_node_s``);
- ``bench transport``: the gradient exchange at width 2 over the step's socket links (``allreduce_s``);
- ``bench durable``: the flush through the managers (``flush_mb_s``);
- :mod:`benchmarks.widths`: the replays' job (``jobs/spot-tiny.yaml``) at a fixed width of 1 and
  of 2 on 4 one-CPU loopback nodes, no trace: what a second replica adds to a step on the shared
  cores beyond the exchange (``replica_s``).

Writes the profile (``--out``, default ``elastic_llm/sim/profiles/cpu-2core.yaml``) with its
provenance (machine, date, which benchmark gave which figure) and the benchmarks' JSON beside it.
Never changes product code or reads a replay.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import machine_info, median

PROFILE = "elastic_llm/sim/profiles/cpu-2core.yaml"
CONFIG = "jobs/tiny.yaml"
MB = 1e6


def _stage_mb(parameters: int, stages: int) -> float:
    return parameters * 12 / stages / MB  # fp32 weights + two AdamW moments, one stage's whole state


def profile_from(runs: dict[str, Any], cores: int, batch: int = 16) -> tuple[dict[str, Any], list[str]]:
    """The cost model's figures from the benchmarks' results (``runs``: snapshot, recovery,
    detect, transport, durable: tiny's; widths: spot-tiny's), each with the line saying where it
    came from. Pure."""
    snap, rec, det, tr, du = runs["snapshot"], runs["recovery"], runs["detect"], runs["transport"], runs["durable"]
    wid = runs.get("widths")
    stages, params = int(snap["stages"]), int(snap["parameters"])
    stage_mb = _stage_mb(params, stages)
    clean, snapped = float(snap["cluster_step_s_without_snapshot"]), float(snap["cluster_step_s_with_snapshot"])
    paths = rec["paths"]
    adopted = [p["actor_s"] for p in paths.values() if p.get("adopted") and p.get("actor_s") is not None]
    grad_mb = params * 4 / MB  # at width 2 each replica sends (and receives) 2 (dp - 1) / dp = 1x its gradient
    big = max(tr["rows"], key=lambda r: r["bytes"])
    socket_mb_s = big["bytes"] / MB / (big["systems"]["sockets"]["us_per_msg"] / 1e6)
    fig = {
        "seq_stage_s": clean * cores / (batch * stages),
        "allreduce_s": 2 * grad_mb / socket_mb_s,
        "actor_start_s": float(rec["full_restart"]["actor_s"]) * min(cores, stages) / stages,
        "adopt_s": median(adopted, or_none=True) or 0.0,
        "detect_process_s": float(paths["local_smp"]["detect_s"]),
        "detect_node_s": float(det["node_watch"]["median_s"]),
        "network_mb_s": stage_mb / float(paths["dp_peer"]["state_s"]),
        "restore_mb_s": stage_mb / float(paths["local_smp"]["state_s"]),
        "parity_mb_s": 1e3 * float(snap["parity_encode_GBps"]),
        "copy_mb_s": 1e3 * float(snap["snapshot_copy_GBps"]),
        "flush_mb_s": 1e3 * float(du["flush_GBps"]),
        "snapshot_step_s": max(0.0, snapped - clean),
        "cores": float(cores),
        "state_bytes_per_param": 12,
        "call_cpu_s": float(tr["driver_calls"]["driver_cpu_us_per_call"]) / 1e6 if "driver_calls" in tr else 0.0,
        "relayed_cpu_s": float(tr["driver_calls"].get("relayed_report_us", 0.0)) / 1e6 if "driver_calls" in tr else 0.0,
    }
    fig["replica_s"] = max(0.0, float(wid["width_2_extra_s"]) - fig["allreduce_s"]) if wid else 0.0
    why = [
        f"seq_stage_s: bench snapshot, tiny's step on a 3-node loopback cluster without snapshots ({clean:.3f} s) x {cores} cores / ({batch} sequences x {stages} stages)",
        f"snapshot_step_s: bench snapshot, the same step with a snapshot every step ({snapped:.3f} s) less without",
        f"allreduce_s: 2 x {grad_mb:.1f} MB of gradient at width 2 over the step's sockets (bench transport, {big['bytes'] >> 10} KiB messages: {socket_mb_s:.0f} MB/s)",
        f"actor_start_s: bench recovery, a full restart's {stages} process starts ({rec['full_restart']['actor_s']} s), {min(cores, stages)} at a time",
        f"adopt_s: bench recovery, a warm standby adopted (median over {len(adopted)} paths)",
        f"detect_process_s: bench recovery, a killed stage's step failing (local_smp path, {paths['local_smp']['detect_s']} s)",
        f"detect_node_s: bench detect, the node watch's median ({det['node_watch']['median_s']} s)",
        f"network_mb_s: bench recovery, a stage's state ({stage_mb:.1f} MB) copied from a data-parallel peer in {paths['dp_peer']['state_s']} s",
        f"restore_mb_s: bench recovery, the same restored from its node's manager in {paths['local_smp']['state_s']} s",
        f"parity_mb_s / copy_mb_s: bench snapshot, ISA-L encode {snap['parity_encode_GBps']} GB/s, the stage copy {snap['snapshot_copy_GBps']} GB/s",
        f"flush_mb_s: bench durable, the flush through the managers ({du['flush_GBps']} GB/s)",
        "call_cpu_s: bench transport, the driver process's CPU per small actor call sent as a step sends them (driver_calls)",
        "relayed_cpu_s: bench transport, the driver process's CPU per step report relayed by a replica's stage 0 (driver_calls' relayed_report_us)",
    ]
    if wid:
        why.append(f"replica_s: benchmarks/widths.py, spot-tiny's median step at width 2 ({wid['width_2']['median_step_s']} s) less at width 1 "
                   f"({wid['width_1']['median_step_s']} s) on {wid['nodes']} one-CPU loopback nodes, less allreduce_s")
    return {k: (round(v, 7 if k in ("call_cpu_s", "relayed_cpu_s") else 4) if isinstance(v, float) else v) for k, v in fig.items()}, why


def _run(name: str) -> Any:
    if name == "snapshot":
        from benchmarks.snapshot import run_snapshot_bench

        return run_snapshot_bench(CONFIG, steps=8)
    if name == "recovery":
        from benchmarks.recovery import run_recovery_bench

        return run_recovery_bench([CONFIG])[0]
    if name == "detect":
        from benchmarks.detect import run_detect_bench

        return run_detect_bench(rounds=3)
    if name == "widths":
        from benchmarks.widths import run_widths_bench

        return run_widths_bench()
    if name == "transport":
        from benchmarks.transport import run_transport_bench

        return run_transport_bench(rounds=100)
    from benchmarks.durable import run_durable_bench

    return run_durable_bench(CONFIG)


def run_calibrate_bench(out: str | None = None, from_dir: str | None = None, results_dir: str | None = None) -> dict[str, Any]:
    """Run (or read, ``from_dir``: the ones it holds) the benchmarks and write the profile to ``out``."""
    runs: dict[str, Any] = {}
    keep = Path(results_dir or "benchmarks/results/calibration")
    keep.mkdir(parents=True, exist_ok=True)
    for name in ("snapshot", "recovery", "detect", "transport", "durable", "widths"):
        if from_dir is not None and (Path(from_dir) / f"{name}.json").exists():
            runs[name] = json.loads((Path(from_dir) / f"{name}.json").read_text())
        else:
            runs[name] = _run(name)
            (keep / f"{name}.json").write_text(json.dumps(runs[name], indent=1, default=str))
    machine = machine_info()
    fig, why = profile_from(runs, int(machine.get("cpu_count") or 2))
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    header = [f"# Calibrated by `elastic-llm bench calibrate` on {date} on {machine.get('cpu')} ({machine.get('cpu_count')} cores),",
              "# from this machine's benchmarks of jobs/tiny.yaml (their JSON: benchmarks/results/calibration/), never from a replay:",
              *(f"# - {w}" for w in why)]
    doc = {"name": "cpu-2core", "provenance": f"measured by elastic-llm bench calibrate on {date} ({machine.get('cpu')}, {machine.get('cpu_count')} cores): "
                                              "bench snapshot, recovery, detect, transport, durable of jobs/tiny.yaml; "
                                              "benchmarks/widths.py of jobs/spot-tiny.yaml", **fig}
    path = Path(out or PROFILE)
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(doc, sort_keys=False))
    return {"bench": "calibrate", "machine": machine, "profile": str(path), "figures": fig, "sources": why}


if __name__ == "__main__":
    from benchmarks.common import main

    raise SystemExit(main("calibrate"))
