"""``elastic-llm bench simulate``: the controller at cluster scale, by simulation.

Four parts, each side by side in one run:
- ``controller``: the controller's own CPU per step and per recovery plan (the ``controller_cpu``
  of each simulation's report) as the fleet grows from 64 to 2,048 stage actors, steady and
  under the test trace scaled up: how each grows with the number of actors;
- ``long_trace``: a 3-hour synthetic trace on 256 nodes (64 x 16): machine seconds to simulate it;
- ``policies``: liveput, useful fraction, steps and committed steps lost of fixed width, reactive
  elastic, elastic with notices and elastic with notices and warm standbys (4 per node: one per
  actor slot; with 1 a recovery still waits for the processes its other actors start), on full-size fleets
  (the test trace scaled to 256 nodes; the synthetic 3-hour trace);
- ``cross_check``: the loopback replay's scenario (tests/data/spot_trace.csv and a synthetic
  trace, time scale 30, a quarter of the nodes, 1-CPU nodes, 10 s notice, spot-tiny) simulated
  with the cost model calibrated on this machine from its benchmarks (``bench calibrate``),
  against the loopback replays' own reports (``--loopback``: run them now, about 10 minutes;
  else the recorded benchmarks/results/cross-check-*.json): steps, useful fraction, recoveries
  by source, resizes and drains.
Never changes product code or reads its internals: it runs ``Simulation`` and reads reports.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, ratio

TRACE = "tests/data/spot_trace.csv"
KEEP = ("steps", "committed_steps", "committed_steps_lost", "liveput", "oracle_steps", "useful_fraction", "seconds_by_state", "final_width", "failed", "controller_cpu", "real_s")


def _sim(config: str, sets: list[str], out: Path, costs: str, **options: Any) -> dict[str, Any]:
    from elastic_llm.config import load_config
    from elastic_llm.sim.costs import load_costs
    from elastic_llm.sim.runner import SimOptions, Simulation

    report = Simulation(load_config(config, sets), SimOptions(**options), load_costs(costs)).run(out)
    return {k: report[k] for k in KEEP} | {"events": report["events"]}


def controller_sweep(out: Path) -> list[dict[str, Any]]:
    """CPU per step (steady, 120 steps, a snapshot every step) and per plan (the test trace at
    full node scale, no notice, a durable checkpoint every 10 commits) as the actor count grows;
    nodes hold 4 actors each."""
    rows = []
    for stages, replicas in ((16, 4), (32, 8), (64, 16), (128, 16)):
        nodes = stages * replicas // 4
        sets = [f"model.n_layers={max(64, stages)}", f"train.batch_size={max(256, replicas * 16)}"]
        steady = _sim("jobs/sim-fleet.yaml", sets, out / f"steady-{stages}x{replicas}", "gpu-a100",
                      nodes=nodes, stages=stages, replicas=replicas, steps=120)
        traced = _sim("jobs/sim-fleet.yaml", sets, out / f"trace-{stages}x{replicas}", "gpu-a100",
                      nodes=nodes, stages=stages, replicas=replicas, trace=TRACE, durable_every=5)  # small fleets lose more than parity covers
        rows.append({
            "stages": stages, "replicas": replicas, "actors": stages * replicas, "nodes": nodes,
            "per_step_ms": steady["controller_cpu"]["per_step_ms"],
            "per_step_ms_under_trace": traced["controller_cpu"]["per_step_ms"],
            "plans": traced["controller_cpu"]["plans"],
            "per_plan_ms_median": traced["controller_cpu"]["per_plan_ms_median"],
            "per_plan_ms_max": traced["controller_cpu"]["per_plan_ms_max"],
            "recoveries": traced["events"]["recoveries"],
            "stage_calls_per_step": steady["controller_cpu"]["stage_calls_per_step"],
            "manager_calls_per_step": steady["controller_cpu"]["manager_calls_per_step"],
            "failed": traced["failed"],
        })
    return rows


def policies(out: Path, trace_3h: Path) -> list[dict[str, Any]]:
    """Each policy on each full-size trace (64 x 16 on 256 nodes, published GPU figures)."""
    table = []
    runs = (
        ("fixed width 16", ["elastic.min_replicas=16", "elastic.max_replicas=16"], 0.0),
        ("reactive elastic", [], 0.0),
        ("elastic, 30 s notices", [], 30.0),
        ("elastic, 30 s notices, warm standbys (4 per node)", ["recovery.standby=4"], 30.0),  # one per actor slot: a lost node's 4 actors can all adopt
    )
    for t, (trace_name, trace, window) in enumerate((("test trace x16 (2 h)", TRACE, None), ("synthetic 3 h", str(trace_3h), (0.0, 10800.0)))):
        for p, (name, sets, notice) in enumerate(runs):
            rep = _sim("jobs/sim-fleet.yaml", sets, out / f"policy-{t}-{p}", "gpu-a100",
                       nodes=256, stages=64, replicas=16, trace=trace, window=window, notice_s=notice)
            table.append({"trace": trace_name, "policy": name} | rep)
    return table


def _loopback(trace: str, out: Path) -> dict[str, Any]:
    """The loopback replay of ``trace`` at the cross-check's settings (run now: minutes)."""
    from elastic_llm.config import load_config
    from elastic_llm.replay.runner import Replay, ReplayOptions
    from elastic_llm.replay.trace import load_trace, plan_replay

    plan = plan_replay(load_trace(trace), time_scale=30.0, node_scale=0.25, notice_s=10.0, seed=0)
    return Replay(load_config("jobs/spot-tiny.yaml"), plan, ReplayOptions(1.0, 0, False)).run(out)


def _side_by_side(name: str, sim: dict[str, Any], peer: dict[str, Any], source: str) -> dict[str, Any]:
    ev_s, ev_p = sim["events"], peer["events"]
    return {
        "trace": name, "loopback_source": source,
        "steps": {"loopback": peer["steps"], "simulated": sim["steps"], "ratio": ratio(sim["steps"], peer["steps"])},
        "useful_fraction": {"loopback": round(peer["useful_fraction"], 4), "simulated": round(sim["useful_fraction"], 4),
                            "difference": round(abs(sim["useful_fraction"] - peer["useful_fraction"]), 4)},
        "liveput": {"loopback": peer.get("liveput"), "simulated": sim.get("liveput")},
        "committed_steps_lost": {"loopback": peer.get("committed_steps_lost"), "simulated": sim.get("committed_steps_lost")},
        "recoveries": {"loopback": ev_p.get("recoveries", {}), "simulated": ev_s.get("recoveries", {})},
        "resizes": {"loopback": ev_p.get("resizes", {}), "simulated": ev_s.get("resizes", {})},
        "drains": {"loopback": ev_p.get("drains", 0), "simulated": ev_s.get("drains", 0)},
        "simulated_real_s": sim["real_s"], "loopback_wall_s": peer.get("wall_s"),
    }


def cross_check(out: Path, loopback: bool) -> list[dict[str, Any]]:
    """The loopback replay's scenario simulated with ``cpu-2core`` (calibrated from this machine's
    benchmarks by ``bench calibrate``, never from a replay), side by side with the replay itself:
    ``tests/data/spot_trace.csv`` and a synthetic trace (16 nodes, 2 hours, seed 3), both at time
    scale 30, a quarter of the nodes (1-CPU nodes, 2 actor slots), 10 s notices, spot-tiny.
    Without ``loopback`` the replays are the recorded ones (benchmarks/results/cross-check-*.json)."""
    from elastic_llm.sim.traces import write_trace

    rows = []
    synthetic = write_trace(out / "synthetic-16x2h.csv", 16, 2.0, seed=3)
    for name, trace in (("spot_trace.csv", TRACE), ("synthetic 16 nodes x 2 h (seed 3)", str(synthetic))):
        key = "spot" if trace == TRACE else "synthetic"
        sim = _sim("jobs/spot-tiny.yaml", [], out / f"cross-sim-{key}", "cpu-2core",
                   nodes=4, stages=4, replicas=2, trace=trace, time_scale=30.0, notice_s=10.0, slots_per_node=2)
        recorded = Path(f"benchmarks/results/cross-check-{key}.json")
        if loopback:
            peer = _loopback(trace, out / f"cross-loopback-{key}")
            recorded.write_text(json.dumps(peer, indent=1, default=str))
            source = "run now"
        else:
            peer = json.loads(recorded.read_text())
            source = str(recorded)
        rows.append(_side_by_side(name, sim, peer, source))
    return rows


def run_simulate_bench(loopback: bool = False, out_dir: str | None = None) -> dict[str, Any]:
    from elastic_llm.sim.traces import write_trace

    with tempfile.TemporaryDirectory(prefix="bench-simulate-") as tmp:
        out = Path(out_dir or tmp)
        trace_3h = write_trace(out / "synthetic-256x3h.csv", 256, 3.0, seed=0)
        long = _sim("jobs/sim-fleet.yaml", [], out / "long", "gpu-a100", nodes=256, stages=64, replicas=16,
                    trace=str(trace_3h), window=(0.0, 10800.0), notice_s=30.0)
        return {
            "machine": machine_info(),
            "controller": controller_sweep(out),
            "long_trace": {"trace": "synthetic 3 h, 256 nodes (seed 0)", "simulated_s": 10800.0, "real_s": long["real_s"],
                           "speedup": ratio(10800.0, long["real_s"], 1), "steps": long["steps"], "failed": long["failed"]},
            "policies": policies(out, trace_3h),
            "cross_check": cross_check(out, loopback),  # last: a loopback run leaves Ray's threads in this process, whose CPU process_time would count
        }
