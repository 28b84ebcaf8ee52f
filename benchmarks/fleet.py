"""``elastic-llm bench fleet``: elasticity at fleet scale, by simulation, in liveput.

64 stages x 16 replicas of ``jobs/sim-fleet.yaml`` over 256 nodes (``gpu-a100``: published
figures, not measured by this project; the driver's CPU per actor call is this machine's, from
``bench transport``), no durable tier, on four traces: ``tests/data/spot_trace.csv`` scaled to 256
nodes and three synthetic fleet traces (``elastic_llm.sim.traces.fleet_trace``: zone-correlated
bursts of up to 25% of the fleet, dipping to 40%), each at notices of 0, 10, 30 and 120 s.
Per run: liveput (committed steps over an oracle that trains at every moment at the widest width
the live nodes hold, at the run's measured full-width rate), whether it survived, committed steps
lost, the narrowest width against the oracle's at that moment, recoveries, re-protections
within the notice (seconds from a burst's notice until the committed version outlived its draining
nodes within parity), the parts re-homed at notices (seconds from each notice until the draining
node's parts were all on live nodes), and the driver's CPU per step with its actor calls charged.

The peer every liveput is a ratio of is the oracle, computed in the same run from the same
trace; the fixed-width and reactive policies side by side are ``bench simulate``'s policy table.
Never changes product code or reads its internals: it runs ``Simulation`` and reads reports.
"""

from __future__ import annotations

import bisect
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info

TRACE = "tests/data/spot_trace.csv"
NOTICES = (0.0, 10.0, 30.0, 120.0)
SEEDS = (0, 1, 2)


def width_gap(report: dict[str, Any]) -> dict[str, float]:
    """The run's width against the oracle's over the timeline: the replica-seconds it trained
    below the oracle, as a share of the oracle's, and the largest gap at any sample. Pure."""
    rows, oracle = report.get("timeline", []), report.get("oracle_width", [])
    at = [o["t_s"] for o in oracle]
    below = total = 0.0
    worst = 0
    for a, b in zip(rows, rows[1:]):
        i = bisect.bisect_right(at, a["t_s"]) - 1
        o = oracle[i]["width"] if i >= 0 else 0
        dt = b["t_s"] - a["t_s"]
        below += dt * max(0, o - a.get("width", 0))
        total += dt * o
        if a["steps_committed"] > 0:  # after the start
            worst = max(worst, o - a.get("width", 0))
    return {"below_oracle_share": round(below / total, 4) if total else 0.0, "largest_gap": worst}


def run_fleet_bench(out_dir: str | None = None) -> dict[str, Any]:
    import json

    from elastic_llm.config import load_config
    from elastic_llm.sim.costs import load_costs
    from elastic_llm.sim.runner import SimOptions, Simulation
    from elastic_llm.sim.traces import write_trace

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        out = Path(out_dir or tmp)
        traces = [("test trace x16 (2 h)", TRACE)] + [
            (f"fleet trace seed {s} (3 h)", str(write_trace(out / f"fleet-{s}.csv", 256, 3.0, seed=s, harsh=True))) for s in SEEDS]
        for name, trace in traces:
            for notice in NOTICES:
                where = out / f"{Path(trace).stem}-notice{int(notice)}"
                sim = Simulation(load_config("jobs/sim-fleet.yaml"), SimOptions(nodes=256, stages=64, replicas=16, trace=trace, notice_s=notice),
                                 load_costs("gpu-a100"))
                rep = sim.run(where)
                body = json.loads((where / "replay.json").read_text())
                events = [json.loads(x) for x in (where / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
                lines = [x for x in events if x["event"] == "reprotect"]
                moves = [x for x in events if x["event"] == "rehome"]
                rows.append({
                    "trace": name, "notice_s": notice, "liveput": round(rep["liveput"] or 0.0, 4), "survived": rep["failed"] is None,
                    "steps": rep["committed_steps"], "oracle_steps": rep["oracle_steps"], "committed_steps_lost": rep["committed_steps_lost"],
                    "useful_fraction": round(rep["useful_fraction"] or 0.0, 4), **width_gap(body),
                    "recoveries": rep["events"]["recoveries"], "drains": rep["events"]["drains"],
                    **reprotection(lines), **rehoming(moves),
                    "driver_per_step_ms": rep["controller_cpu"]["driver_per_step_ms"],
                    "controller_per_step_ms": rep["controller_cpu"]["per_step_ms"], "per_plan_ms_max": rep["controller_cpu"]["per_plan_ms_max"],
                    "stage_calls_per_step": rep["controller_cpu"]["stage_calls_per_step"],
                    "manager_calls_per_step": rep["controller_cpu"]["manager_calls_per_step"],
                    "seconds_by_state": rep["seconds_by_state"], "real_s": rep["real_s"],
                })
    return {"bench": "fleet", "machine": machine_info(), "cost_model": "gpu-a100", "rows": rows}


def reprotection(lines: list[dict]) -> dict:
    """The run's re-protections: how many committed before their nodes went (and how long after
    the notice or loss, the most of them; the draining nodes' megabytes each covered per node; how
    many by re-homing their parts), how many times nodes went first, and how many times parts had
    nowhere to go (a collapse, said at the notice). ``notice_to_protected_s``: for each exposure a
    burst of notices caused (``cause`` notice or loss+notice), the seconds from its first notice
    until the committed version outlived every draining node within parity (p50, p90, max), and
    how many of them the nodes beat (``notice_went_first``). Pure."""
    done = [x for x in lines if x.get("in_time", True)]
    late = [x for x in lines if not x.get("in_time", True) and x.get("how") != "stranded"]
    per_node = [x["bytes"] / len(x["nodes"]) / 1e6 for x in done if x["nodes"]]
    noticed = [x["seconds"] for x in done if "notice" in x.get("cause", "notice")]
    return {"reprotections": len(done), "by_rehome": sum(1 for x in done if x.get("how") == "rehome"),
            "reprotect_s_max": round(max((x["seconds"] for x in done), default=0.0), 2),
            "reprotect_mb_per_node": round(sum(per_node) / len(per_node), 1) if per_node else 0.0,
            "went_first": len(late), "went_first_nodes": sum(len(x["nodes"]) for x in late),
            "notice_exposures": len(noticed) + sum(1 for x in late if "notice" in x.get("cause", "notice")),
            "notice_to_protected_s": {"p50": _quantile(noticed, 0.5), "p90": _quantile(noticed, 0.9), "max": round(max(noticed, default=0.0), 2)},
            "notice_went_first": sum(1 for x in late if "notice" in x.get("cause", "notice")),
            "stranded": sum(1 for x in lines if x.get("how") == "stranded")}


def _quantile(xs: list[float], q: float) -> float:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else 0.0


def rehoming(moves: list[dict]) -> dict:
    """Parts re-homed at notices: how many, their bytes, and the seconds from each draining
    node's notice until its parts of the version committed then were all on live nodes (the
    first version re-homed off it; p50, p90, max over the draining nodes; a burst larger than the
    live nodes' links can take at once ends later than the exposure it caused). Pure."""
    first: dict[str, int] = {}
    for m in moves:
        first.setdefault(m["source"], m["version"])
    evacuated: dict[str, float] = {}
    for m in moves:
        if m["version"] == first[m["source"]]:
            evacuated[m["source"]] = max(evacuated.get(m["source"], 0.0), m["seconds"])
    secs = list(evacuated.values())
    return {"rehomes": len(moves), "rehome_gb": round(sum(m["bytes"] for m in moves) / 1e9, 1), "rehomed_nodes": len(secs),
            "notice_to_evacuated_s": {"p50": _quantile(secs, 0.5), "p90": _quantile(secs, 0.9), "max": round(max(secs, default=0.0), 2)}}


if __name__ == "__main__":
    from benchmarks.common import main

    raise SystemExit(main("fleet"))
