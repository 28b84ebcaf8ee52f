"""``elastic-llm bench anchors``: elastic-llm beside the recovery policies of the systems a user
would otherwise pick, on the same spot traces, in liveput and tokens per dollar.

Every policy is a named ``recovery.policy`` of the one controller (:mod:`elastic_llm.policies`):
``elastic-llm``, ``restart`` (torchrun + DeepSpeed/Megatron), ``ray-train-elastic`` (Ray Train
v2) and ``replica-group`` (torchft). ``redundant`` (Bamboo) is listed as not run: the simulation
does not model its redundant copies, and on Ray it trains one pipeline.

Three parts, each side by side in one run:
- ``simulated``: each policy on each trace at notices of 0, 30 and 120 s, on two shapes:
  64 stages x 16 replicas of ``jobs/sim-fleet.yaml`` over 256 nodes with the ``gpu-a100`` cost
  model, and 4 x 4 of ``jobs/spot-tiny.yaml`` over 16 one-CPU nodes with ``cpu-2core``. The
  traces are the real ones this package ships (``elastic_llm/sim/spot_traces``, AWS p3 and g4dn
  fleets from Bamboo, MIT licence: windows of their first hours), the synthetic test trace, and
  any ``--trace`` files given. Every run has the same durable tier (a flush of every committed
  snapshot, one at a time), the same snapshots, and waits for nodes as long as the trace lasts. Per run: liveput, useful fraction, committed
  steps lost, seconds by state, recoveries, resizes, tokens per dollar at the shipped prices and
  its ratio to an on-demand fleet of the full width, and the width over time (plotted per
  policy, 64 x 16 at 30 s notices).
- ``published``: torchft's published efficiency with a failure a minute, set up in the
  simulation (``replica-group`` on a steady 64 x 16 fleet), and how close the model comes;
- ``loopback`` (``--loopback``): every policy replayed on a loopback Ray cluster on the real p3
  trace (and ``elastic-llm`` once more without warm standbys: on loopback every node's processes
  share this machine's cores, so a standby's start slows the training it would not touch on
  real nodes): the order measured on real Ray, by committed steps (the same tokens each).

The peer every figure is a ratio of is in the same run: the oracle (liveput) and the on-demand
fleet (tokens per dollar). Never changes product code or reads its internals: it runs
``Simulation`` and ``Replay`` and reads their reports.
"""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, ratio

SHIPPED = Path(__file__).resolve().parent.parent / "elastic_llm" / "sim" / "spot_traces"
POLICIES = ("elastic-llm", "restart", "ray-train-elastic", "replica-group", "redundant")
NOTICES = (0.0, 30.0, 120.0)
TRACES = (  # (name, file, window in trace seconds)
    ("bamboo-aws-p3 (real, first 4 h)", SHIPPED / "bamboo-aws-p3.csv", (0.0, 14400.0)),
    ("bamboo-aws-g4dn (real, 4 h after its ramp-up)", SHIPPED / "bamboo-aws-g4dn.csv", (600.0, 15000.0)),
    ("spot_trace.csv (synthetic, 2 h)", Path("tests/data/spot_trace.csv"), None),
)
SHAPES = (  # (name, config, nodes, stages, replicas, cost model, slots per node)
    ("64x16 gpu-a100", "jobs/sim-fleet.yaml", 256, 64, 16, "gpu-a100", None),
    ("4x4 cpu-2core", "jobs/spot-tiny.yaml", 16, 4, 4, "cpu-2core", 1),
)
SHAPE_SETS = {"jobs/spot-tiny.yaml": ["parallel.dp=4", "elastic.max_replicas=4"]}
COMMON_SETS = ["recovery.capacity_timeout_s=86400"]  # every policy waits for nodes as long as a trace lasts (restart sets this itself)
PLOT_NOTICE = 30.0
SAMPLES = 400  # width points kept per run for the plot


def _one(job: dict[str, Any]) -> dict[str, Any]:
    """One simulation (in a worker process): its row of the table and its width curve."""
    import logging

    logging.getLogger("elastic_llm").setLevel(logging.WARNING)  # 180 simulations' recoveries: the table says what they did
    from elastic_llm.config import load_config
    from elastic_llm.replay.cost import load_prices, price_for
    from elastic_llm.sim.costs import load_costs
    from elastic_llm.sim.runner import SimOptions, Simulation

    costs = load_costs(job["cost"])
    price = price_for(load_prices(job["prices"]), costs.name)
    cfg = load_config(job["config"], [*SHAPE_SETS.get(job["config"], []), *COMMON_SETS, f"recovery.policy={job['policy']}"])
    where = Path(job["out"])
    rep = Simulation(cfg, SimOptions(nodes=job["nodes"], stages=job["stages"], replicas=job["replicas"], trace=job["trace"], window=job["window"],
                                     notice_s=job["notice"], slots_per_node=job["slots"], durable_every=1, price=price), costs).run(where)
    body = json.loads((where / "replay.json").read_text())
    timeline = body.get("timeline", [])
    stride = max(1, len(timeline) // SAMPLES)
    cost = rep.get("cost") or {}
    return {
        "shape": job["shape"], "trace": job["trace_name"], "notice_s": job["notice"], "policy": job["policy"],
        "survived": rep["failed"] is None, "failed": rep["failed"],
        "liveput": round(rep["liveput"] or 0.0, 4), "useful_fraction": round(rep["useful_fraction"] or 0.0, 4),
        "committed_steps": rep["committed_steps"], "oracle_steps": rep["oracle_steps"], "committed_steps_lost": rep["committed_steps_lost"],
        "tokens_per_usd": cost.get("tokens_per_usd"), "vs_on_demand": cost.get("vs_on_demand"), "spot_usd": cost.get("spot_usd"),
        "on_demand_usd": (cost.get("on_demand") or {}).get("usd"),
        "seconds_by_state": rep["seconds_by_state"], "recoveries": rep["events"]["recoveries"],
        "resizes": sum(rep["events"]["resizes"].values()), "drains": rep["events"]["drains"], "durable_flushes": rep["events"]["durable_flushes"],
        "real_s": rep["real_s"],
        "width": [(round(r["t_s"]), r.get("width", 0)) for r in timeline[::stride]],
        "oracle_width": [(round(o["t_s"]), o["width"]) for o in body.get("oracle_width", [])],
    }


def _jobs(out: Path, traces: list[tuple[str, str, tuple[float, float] | None]], prices: str | None, policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    jobs = []
    for shape, config, nodes, stages, replicas, cost, slots in SHAPES:
        for t, (trace_name, trace, window) in enumerate(traces):
            for notice in NOTICES:
                for policy in policies:
                    jobs.append({"shape": shape, "config": config, "nodes": nodes, "stages": stages, "replicas": replicas, "cost": cost,
                                 "slots": slots, "trace": trace, "trace_name": trace_name, "window": window, "notice": notice, "policy": policy,
                                 "prices": prices, "out": str(out / f"{shape.split()[0]}-t{t}-n{int(notice)}-{policy}")})
    return jobs


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (shape, trace, notice): elastic-llm's liveput and tokens per dollar against the best
    other policy's, and the other policies that beat it on either. Pure."""
    out = []
    keys = sorted({(r["shape"], r["trace"], r["notice_s"]) for r in rows}, key=str)
    for key in keys:
        group = {r["policy"]: r for r in rows if (r["shape"], r["trace"], r["notice_s"]) == key}
        ours = group.get("elastic-llm")
        others = [r for p, r in group.items() if p != "elastic-llm"]
        if ours is None or not others:
            continue
        best_live = max(others, key=lambda r: r["liveput"])
        best_cost = max(others, key=lambda r: r["tokens_per_usd"] or 0.0)
        out.append({
            "shape": key[0], "trace": key[1], "notice_s": key[2],
            "liveput": ours["liveput"], "best_other_liveput": best_live["liveput"], "best_other": best_live["policy"],
            "liveput_ratio": ratio(ours["liveput"], best_live["liveput"]),
            "tokens_per_usd_ratio": ratio(ours["tokens_per_usd"], best_cost["tokens_per_usd"]),
            "vs_on_demand": ours["vs_on_demand"],
            "beaten_by": sorted(p for p, r in group.items() if p != "elastic-llm" and (r["liveput"] > ours["liveput"] or (r["tokens_per_usd"] or 0) > (ours["tokens_per_usd"] or 0))),
        })
    return out


def plot(rows: list[dict[str, Any]], path: Path, notice: float = PLOT_NOTICE) -> Path:
    """Width over time per policy (and the oracle's), one panel per trace, for the first shape."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    shape = rows[0]["shape"] if rows else ""
    traces = list(dict.fromkeys(r["trace"] for r in rows if r["shape"] == shape))
    fig = Figure(figsize=(11, 3.2 * max(1, len(traces))))
    for i, trace in enumerate(traces):
        ax = fig.add_subplot(len(traces), 1, i + 1)
        chosen = [r for r in rows if r["shape"] == shape and r["trace"] == trace and r["notice_s"] == notice]
        if chosen and chosen[0]["oracle_width"]:
            t, w = zip(*chosen[0]["oracle_width"])
            ax.step([x / 3600 for x in t], w, where="post", color="black", linewidth=2, alpha=0.3, label="oracle")
        for r in chosen:
            if r["width"]:
                t, w = zip(*r["width"])
                ax.step([x / 3600 for x in t], w, where="post", linewidth=1, label=f"{r['policy']} (liveput {r['liveput']:.3f})")
        ax.set_title(f"{trace}: {shape}, {notice:.0f} s notices", fontsize=9)
        ax.set_ylabel("width (replicas)")  # the run's width: a run waiting for nodes keeps its width (its useful fraction says it waits)
        ax.legend(fontsize=7, loc="lower left")
    if fig.axes:
        fig.axes[-1].set_xlabel("hours")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


TORCHFT_EFFICIENCY = 0.81  # torchft's published efficiency with a failure a minute (as issue 52 cites it)


def published() -> dict[str, Any]:
    """A published figure the simulation can set up: torchft's efficiency with a failure a minute.
    ``replica-group`` (and ``elastic-llm`` beside it) on a steady 64 x 16 ``gpu-a100`` fleet whose
    stage processes die at one a minute in all, for an hour of training: liveput is the
    efficiency (the oracle trains at full width throughout)."""
    from elastic_llm.config import load_config
    from elastic_llm.sim.costs import load_costs
    from elastic_llm.sim.runner import SimOptions, Simulation

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-anchors-published-") as tmp:
        for policy in ("replica-group", "elastic-llm"):
            cfg = load_config("jobs/sim-fleet.yaml", [*COMMON_SETS, f"recovery.policy={policy}"])
            options = SimOptions(nodes=256, stages=64, replicas=16, steps=360, process_failures_per_hour=60.0 / (64 * 16), durable_every=1)
            rep = Simulation(cfg, options, load_costs("gpu-a100")).run(Path(tmp) / policy)
            rows.append({"policy": policy, "efficiency": round(rep["liveput"] or 0.0, 4), "simulated_s": round(rep["duration_s"] if rep["duration_s"] != float("inf") else rep["wall_s"], 1),
                         "seconds_by_state": rep["seconds_by_state"], "resizes": sum(rep["events"]["resizes"].values()), "recoveries": rep["events"]["recoveries"]})
    return {"claim": "torchft: 81% efficiency with a failure a minute", "published": TORCHFT_EFFICIENCY, "rows": rows,
            "model_vs_published": ratio(rows[0]["efficiency"], TORCHFT_EFFICIENCY)}


LOOPBACK_RUNS = (  # (row name, policy, extra config); every run but redundant's (no snapshots to flush) flushes every committed snapshot
    ("restart", "restart", ()),
    ("ray-train-elastic", "ray-train-elastic", ()),
    ("replica-group", "replica-group", ()),
    ("redundant", "redundant", ()),
    ("elastic-llm", "elastic-llm", ()),
    ("elastic-llm, no standbys", "elastic-llm", ("recovery.standby=0",)),
)
LOOPBACK_WINDOW = (0.0, 7200.0)  # the p3 trace's first 2 hours, at 30 trace seconds per replay second: 4 minutes each


def loopback(out: Path, prices: str | None) -> list[dict[str, Any]]:
    """Every policy replayed on a loopback Ray cluster (the replay's own: one-CPU nodes, a
    quarter of the trace's nodes, 10 s notices) on the real p3 trace, each with a durable
    checkpoint of every committed snapshot in a local directory. Each run's liveput is against
    its own full-width rate; the runs compare by committed steps (the same tokens per step)."""
    from elastic_llm.config import load_config
    from elastic_llm.replay.cost import load_prices, price_for
    from elastic_llm.replay.runner import Replay, ReplayOptions
    from elastic_llm.replay.trace import load_trace, plan_replay

    price = price_for(load_prices(prices), "cpu-2core")
    rows = []
    for name, policy, extra in LOOPBACK_RUNS:
        tag = name.replace(", ", "-").replace(" ", "-")
        durable = [f"durable.storage_path={out / 'durable' / tag}", "durable.every=1"] if policy != "redundant" else []
        cfg = load_config("jobs/spot-tiny.yaml", [f"recovery.policy={policy}", *durable, *extra])
        plan = plan_replay(load_trace(str(SHIPPED / "bamboo-aws-p3.csv")), window=LOOPBACK_WINDOW, time_scale=30.0, node_scale=0.25, notice_s=10.0, seed=0)
        rep = Replay(cfg, plan, ReplayOptions(1.0, 0, False, price)).run(out / f"loopback-{tag}")
        cost = rep.get("cost") or {}
        rows.append({"run": name, "policy": policy, "set": list(extra), "survived": rep["failed"] is None, "failed": rep["failed"], "liveput": rep.get("liveput"),
                     "useful_fraction": rep["useful_fraction"], "steps": rep["steps"], "committed_steps": rep["committed_steps"],
                     "committed_steps_lost": rep["committed_steps_lost"], "full_width_steps_per_s": rep.get("full_width_steps_per_s"),
                     "tokens_per_usd": cost.get("tokens_per_usd"), "vs_on_demand": cost.get("vs_on_demand"),
                     "seconds_by_state": rep["seconds_by_state"], "recoveries": rep["events"]["recoveries"], "resizes": rep["events"]["resizes"],
                     "wall_s": rep["wall_s"]})
    best = max((r["committed_steps"] for r in rows), default=0)
    for r in rows:
        r["vs_most_committed"] = round(r["committed_steps"] / best, 3) if best else None
    return rows


def run_anchors_bench(out_dir: str | None = None, traces: list[str] | None = None, prices: str | None = None, workers: int = 2,
                      shapes: tuple[str, ...] | None = None, loopback_too: bool = False, from_dir: str | None = None,
                      policies: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every policy x trace x notice x shape simulated, ``workers`` at a time (or, with
    ``from_dir``, the simulated part read from that directory's ``anchors.json``, a run of this
    bench, and with ``policies`` too, those policies simulated again in its place); with
    ``loopback_too``, then the loopback replays (:func:`loopback`). The result is written to
    ``anchors.json`` in the output directory too."""
    from elastic_llm.replay.cost import load_prices

    load_prices(prices)  # a bad table is refused before anything runs
    unknown = sorted(set(policies or ()) - set(POLICIES))
    if unknown:
        raise ValueError(f"--policy {', '.join(unknown)}: not a policy of this bench; use one of {', '.join(POLICIES)}")
    with tempfile.TemporaryDirectory(prefix="bench-anchors-") as tmp:
        out = Path(out_dir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        if from_dir is not None:
            result = json.loads((Path(from_dir) / "anchors.json").read_text())
            chosen = [(t["name"], t["file"], tuple(t["window"]) if t["window"] else None) for t in result["traces"]]
        else:
            chosen = [(n, str(f), w) for n, f, w in TRACES] + [(f"{Path(t).name} (given)", t, None) for t in traces or []]
            result = {"bench": "anchors", "machine": machine_info(), "traces": [{"name": n, "file": f, "window": w} for n, f, w in chosen],
                      "notices": list(NOTICES), "rows": [], "loopback": None}
        if from_dir is None or policies:
            jobs = [j for j in _jobs(out, chosen, prices, policies or POLICIES) if shapes is None or j["shape"] in shapes]
            with ProcessPoolExecutor(max_workers=workers) as pool:
                fresh = list(pool.map(_one, jobs))
            rows = [r for r in result["rows"] if r["policy"] not in {j["policy"] for j in jobs}] + fresh
            result.update(rows=rows, policies=list(POLICIES), verdicts=verdicts(rows), plot=str(plot(rows, out / "anchors-width.png")))
            result.pop("not_run", None)
            if from_dir is not None:
                result.setdefault("reruns", []).append({"policies": sorted({j["policy"] for j in jobs}), "machine": machine_info()})
        if "published" not in result:
            result["published"] = published()
        if loopback_too:
            result["loopback"] = {"machine": machine_info(), "trace": "bamboo-aws-p3", "window": LOOPBACK_WINDOW, "rows": loopback(out, prices)}
        (out / "anchors.json").write_text(json.dumps(result, indent=1))
        return result


if __name__ == "__main__":
    from benchmarks.common import main

    raise SystemExit(main("anchors"))
