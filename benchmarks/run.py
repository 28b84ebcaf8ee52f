"""``elastic-llm bench WHAT``: which benchmark runs with which options, and its result on stdout.

Owns: the ``bench`` subcommand's arguments (added to the product's command line by
:func:`add_parser` when the benchmarks are installed), checking the options that go together,
running one benchmark module and printing its JSON, and ``python -m benchmarks.<what>``
(:func:`main`: the same, without the product's command line). Lives with the benchmarks, so the
product never imports them statically and they import nothing of its command line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from types import ModuleType
from typing import Any

from benchmarks.common import stdout_to_stderr

EXIT_USAGE = 2


def _sweep_problem(args: argparse.Namespace) -> str | None:
    """Why the ``bench`` options do not go together (``--sweep`` and its own options), or None."""
    sweep_only = [opt for opt, value in (("--models", args.models), ("--plot", args.plot), ("--only", args.only), ("--large-steps", args.large_steps)) if value is not None]
    if not args.sweep:
        return f"{', '.join(sweep_only)}: only with --sweep" if sweep_only else None
    if args.what != "pipeline":
        return "--sweep is only for `bench pipeline`"
    if args.config or args.set:
        return "--sweep runs its own configurations (jobs/tiny.yaml variants): drop --config and --set"
    if args.large_steps is not None and args.large_steps < 1:
        return f"--large-steps={args.large_steps} must be >= 1"
    return None


def _bench_sweep(bench: ModuleType, args: argparse.Namespace) -> int:
    """``bench pipeline --sweep``: the JSON line (``--json``) on stdout and the markdown table on
    stderr, or the table and notes on stdout; progress on stderr."""
    try:
        models = [m.strip() for m in (args.models or ",".join(bench.MODELS)).split(",") if m.strip()]
        only = bench.parse_only(args.only or [])
        if not bench.sweep_points(models, only)[0]:  # refuses unknown models before anything starts
            raise ValueError(f"--only {' '.join(args.only or [])} leaves no configuration of the grid (stages 2,4,8; microbatches 4,16,64; replicas 1,2,4; stages x replicas <= 16)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    import contextlib

    # Ray's driver prints raylet warnings and actor output on sys.stdout: with --json, stdout
    # carries the one JSON line only.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        result = bench.run_pipeline_sweep(
            models,
            steps=args.steps or 4,
            large_steps=args.large_steps or bench.LARGE_STEPS,
            only=only,
            plot=args.plot or "bench-pipeline-sweep.png",
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    table = bench.markdown_table(result)
    if args.json:
        print(json.dumps(result))
        print(table, file=sys.stderr)
    else:
        print(table)
        print("\n".join(f"- {n}" for n in result["notes"]))
    print(f"wrote {result['plot']}", file=sys.stderr)
    return 0


LEAST_STEPS = {"snapshot": 2, "memory": 2, "precision": 2}  # blocks of at least 2 steps: the first of each is not steady state


def _run_one(bench: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark ``args.what`` with the command line's settings."""
    if args.what == "pipeline":
        return bench.run_pipeline_bench(args.config or "jobs/tiny.yaml", steps=args.steps or 6, overrides=args.set or [])
    if args.what == "snapshot" and args.auto_only:
        return bench.run_snapshot_auto(args.config or "jobs/tiny.yaml", overrides=args.set or [])
    if args.what == "snapshot":
        return bench.run_snapshot_bench(args.config or "jobs/tiny.yaml", steps=args.steps or 12, overrides=args.set or [])
    if args.what == "erasure":
        return bench.run_erasure_bench(size_mib=args.size_mib)
    if args.what == "durable":
        return bench.run_durable_bench(args.config or "jobs/tiny.yaml", overrides=args.set or [], auto_only=args.auto_only)
    if args.what == "recovery":
        return bench.run_recovery_bench([args.config] if args.config else None, overrides=args.set or [], shots=args.steps or 3)
    if args.what == "transport":
        return bench.run_transport_bench(rounds=args.steps or 200)
    if args.what == "detect":
        return bench.run_detect_bench(rounds=args.steps or 3)
    if args.what == "failover":
        return bench.run_failover_bench(config=args.config or "jobs/tiny.yaml", rounds=args.steps or 2)
    if args.what == "simulate":
        return bench.run_simulate_bench(loopback=args.loopback, out_dir=args.out)
    if args.what == "fleet":
        return bench.run_fleet_bench(out_dir=args.out)
    if args.what == "rehome":
        return bench.run_rehome_bench(args.config or "jobs/tiny.yaml", rounds=args.steps or 3, overrides=args.set or [])
    if args.what == "memory":
        return bench.run_memory_bench([args.config] if args.config else None, overrides=args.set or [], steps=args.steps or 3,
                                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.what == "precision":
        return bench.run_precision_bench(args.config, steps=args.steps or 300, out=args.out, from_dir=args.from_dir, overrides=args.set or [])
    if args.what == "partitions":
        return bench.run_partitions_bench(shots=args.steps or 2, out_dir=args.out)
    if args.what == "anchors":
        return bench.run_anchors_bench(out_dir=args.out, traces=args.trace or [], prices=args.prices, loopback_too=args.loopback, from_dir=args.from_dir,
                                       policies=tuple(args.policy) if args.policy else None)
    if args.what == "calibrate":
        return bench.run_calibrate_bench(out=args.out, from_dir=args.from_dir)
    raise AssertionError(args.what)  # argparse restricts choices


def _anchors_problem(args: argparse.Namespace) -> str | None:
    """``--trace`` and ``--prices`` go with ``bench anchors``; a bad trace or price table is named before anything runs."""
    if args.what != "anchors":
        return "--trace, --prices and --policy are only for `bench anchors`" if args.trace or args.prices or args.policy else None
    from elastic_llm.replay.cost import PriceError, load_prices
    from elastic_llm.replay.trace import load_trace

    try:
        table = load_prices(args.prices)
        for trace in args.trace or []:
            load_trace(trace)
    except (PriceError, ValueError) as e:  # TraceError is a ValueError: it names the file, the line and the fix
        return str(e)
    missing = sorted({"gpu-a100", "cpu-2core"} - set(table))
    if missing:
        return f"price table {args.prices} has no prices for node type(s) {missing}, which bench anchors simulates: add them"
    from benchmarks.anchors import POLICIES

    unknown = sorted(set(args.policy or ()) - set(POLICIES))
    return f"--policy {', '.join(unknown)} is not a policy bench anchors runs: use one of {', '.join(POLICIES)}" if unknown else None


def cmd_bench(args: argparse.Namespace) -> int:
    """``elastic-llm bench WHAT``: run one benchmark; its result as JSON on stdout."""
    least = LEAST_STEPS.get(args.what, 1)
    problem = (
        _sweep_problem(args)
        or (f"--steps={args.steps} must be >= {least}" if args.steps is not None and args.steps < least else None)
        or ("--auto-only is only for `bench durable` and `bench snapshot`" if args.auto_only and args.what not in ("durable", "snapshot") else None)
        or _anchors_problem(args)
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    bench = importlib.import_module(f"benchmarks.{'pipeline_sweep' if args.sweep else args.what}")
    if args.sweep:
        return _bench_sweep(bench, args)
    with stdout_to_stderr():  # Ray's raylets and workers print on stdout: the result alone goes there
        result = _run_one(bench, args)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``bench`` subcommand on the product's command line (and the parser of ``python -m benchmarks.<what>``)."""
    b = sub.add_parser("bench", help="benchmarks against real peers (run from the root of a source checkout: they read jobs/*.yaml)")
    b.add_argument("what", choices=["pipeline", "erasure", "snapshot", "recovery", "durable", "transport", "detect", "failover", "simulate", "fleet",
                                    "calibrate", "rehome", "memory", "precision", "partitions", "anchors"])
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--loopback", action="store_true", help="simulate: also run the loopback replay it is cross-checked against (about 5 minutes) instead of reading its recorded report; "
                   "anchors: also replay every policy on a loopback Ray cluster (about 30 minutes)")
    b.add_argument("--out", help=("simulate, fleet: keep every simulation's replay.json / replay.png / metrics.jsonl under this directory; "
                                  "calibrate: the profile to write (default elastic_llm/sim/profiles/cpu-2core.yaml); precision: where the runs' metrics and the plot go; "
                                  "partitions: each faulted run's metrics and driver log"))
    b.add_argument("--from", dest="from_dir", help="calibrate: read the benchmarks' JSON from this directory instead of running them; precision: the runs' metrics; "
                   "anchors: the simulated part from this directory's anchors.json (a run of it) instead of simulating again")
    b.add_argument("--config", help="run config for 'pipeline' and 'snapshot' (default jobs/tiny.yaml); memory: the one config to measure (default tiny and llama-25m)")
    b.add_argument("--steps", type=int, default=None, help=(
        "timed steps per system (default: 6 for pipeline, 4 per configuration for pipeline --sweep, 12 for snapshot; round trips "
        "for transport, 200; node removals per setting for detect, 3; driver kills per resume kind for failover, 2; failures per "
        "in-memory path for recovery, 3; bursts for rehome, 3; shots per fault kind for partitions, 2)"))
    b.add_argument("--set", action="append", metavar="KEY=VALUE")
    b.add_argument("--trace", action="append", metavar="CSV", help="anchors: one more spot trace (time_ms,add|remove,node) to run every policy on")
    b.add_argument("--policy", action="append", metavar="NAME", help="anchors: simulate only this policy (repeatable); with --from, its rows replace those read back")
    b.add_argument("--prices", metavar="YAML", help="anchors: price table (node type -> spot_per_h, on_demand_per_h; default: elastic_llm/sim/prices.yaml)")
    b.add_argument("--size-mib", type=int, default=64, help="data size for 'erasure'")
    b.add_argument("--auto-only", action="store_true", help="durable, snapshot: only snapshot.every: auto against no snapshots on the 3-node loopback cluster "
                   "(snapshot: after a per-step trace of where a version's cost lands)")
    b.add_argument("--sweep", action="store_true", help="pipeline: driver cost over stages x microbatches x replicas (micro and tiny models) instead of the peer comparison")
    b.add_argument("--models", help="--sweep: comma-separated models, from micro,tiny (default: both)")
    b.add_argument("--plot", help="--sweep: PNG of driver CPU per step against microbatches (default: bench-pipeline-sweep.png)")
    b.add_argument("--large-steps", type=int, help="--sweep: timed steps of the 64-microbatch configurations (default: 2, at most --steps; keeps the sweep near its time budget)")
    b.add_argument("--only", action="append", metavar="S,M,DP", help=argparse.SUPPRESS)  # --sweep: just these configurations (trying it out)
    b.set_defaults(func=cmd_bench, steps_min=1)
    return b


def main(what: str, argv: list[str]) -> int:
    """``python -m benchmarks.<what> [options]``: exactly ``elastic-llm bench <what> [options]``."""
    from elastic_llm.logs import configure
    from elastic_llm.runtime.session import loopback_env

    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{what}")
    sub = p.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = p.parse_args(["bench", what, *argv])
    configure("info")
    loopback_env()
    if args.steps is not None and args.steps < 1:
        print(f"error: --steps={args.steps} must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    return int(args.func(args))
