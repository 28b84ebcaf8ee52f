"""Command line of the fleet commands: ``elastic-llm replay`` (a spot trace on a loopback Ray
cluster while a run trains) and ``elastic-llm simulate`` (the real controller on a simulated
fleet), with the price table both report their cost from.

Owns: these two subcommands' options, the checks that turn a bad argument (or a bad price
table, or one without the run's node type) into one message naming it and exit code 2, and the
hand-over to :mod:`elastic_llm.replay.runner` and :mod:`elastic_llm.sim.runner`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_llm.replay.cost import Price

EXIT_USAGE = 2


def run_price(prices: str | None, node_type: str, required: bool) -> Price | None:
    """The :class:`~elastic_llm.replay.cost.Price` of ``node_type`` from the table ``prices`` (None:
    the shipped one). Raises :class:`~elastic_llm.replay.cost.PriceError` when the table is bad,
    or lacks the type and ``required`` (a table the user gave); else None for a missing type."""
    from elastic_llm.replay.cost import load_prices, price_for

    table = load_prices(prices)
    if node_type not in table and not required:
        return None
    return price_for(table, node_type, f"price table {prices}" if prices else "the shipped price table")


def cmd_replay(args: argparse.Namespace) -> int:
    from elastic_llm.config import load_config
    from elastic_llm.replay.runner import Replay, ReplayOptions, nodes_per_replica
    from elastic_llm.replay.trace import load_trace, parse_window, plan_replay

    cfg = load_config(args.config, list(args.set or []))
    try:
        plan = plan_replay(
            load_trace(args.trace),
            window=parse_window(args.window) if args.window else None,
            time_scale=args.time_scale,
            node_scale=args.node_scale,
            notice_s=args.notice_s,
            seed=args.seed,
        )
        nodes_per_replica(cfg, args.cpus_per_node)
        price = run_price(args.prices, args.node_type, required=True)
    except ValueError as e:  # TraceError and PriceError too: they name the line, the entry or the option and the fix
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    report = Replay(cfg, plan, ReplayOptions(args.cpus_per_node, args.seed, not args.no_progress, price)).run(args.out)
    keys = ("steps", "committed_steps_lost", "useful_fraction", "liveput", "cost", "seconds_by_state", "events", "failed")
    print(json.dumps({k: report[k] for k in keys}))
    print(f"wrote {Path(args.out) / 'replay.json'} and {Path(args.out) / 'replay.png'}", file=sys.stderr)
    return int(report["exit_code"])


def _simulate_problem(args: argparse.Namespace) -> str | None:
    """The first bad ``simulate`` argument, named with its fix (pure)."""
    for name in ("nodes", "stages", "replicas"):
        if getattr(args, name) < 1:
            return f"--{name}={getattr(args, name)} must be >= 1"
    if args.trace is None and args.steps is None:
        return "--steps: without --trace the simulation needs --steps K (how many steps to run)"
    if args.trace is None and (args.window or args.notice_s):
        return "--window and --notice-s go with --trace: pass a trace or drop them"
    if args.slots_per_node is not None and args.slots_per_node < 1:
        return f"--slots-per-node={args.slots_per_node} must be >= 1"
    if args.durable_every < 0:
        return f"--durable-every={args.durable_every} must be >= 0 (0: no durable tier)"
    if args.process_failures_per_hour < 0:
        return f"--process-failures-per-hour={args.process_failures_per_hour:g} must be >= 0"
    return None


def cmd_simulate(args: argparse.Namespace) -> int:
    from elastic_llm.config import load_config
    from elastic_llm.replay.trace import parse_window
    from elastic_llm.sim.costs import CostError, load_costs
    from elastic_llm.sim.runner import SimOptions, simulate

    problem = _simulate_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    cfg = load_config(args.config, list(args.set or []))
    try:
        costs = load_costs(args.cost)
        price = run_price(args.prices, costs.name, required=args.prices is not None)
        options = SimOptions(args.nodes, args.stages, args.replicas, args.trace, parse_window(args.window) if args.window else None,
                             args.notice_s, args.time_scale, args.steps, args.slots_per_node, args.process_failures_per_hour, args.seed,
                             args.durable_every, price)
        report = simulate(cfg, options, costs, args.out)
    except (ValueError, CostError) as e:  # TraceError and ConfigError too: they name the line or the field and the fix
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    keys = ("steps", "committed_steps_lost", "useful_fraction", "liveput", "cost", "seconds_by_state", "events", "controller_cpu", "failed", "real_s")
    print(json.dumps({k: report[k] for k in keys}))
    print(f"wrote {Path(args.out) / 'replay.json'} and {Path(args.out) / 'replay.png'}", file=sys.stderr)
    return int(report["exit_code"])


def replay_command(sub: Any, default_config: str) -> None:
    rp = sub.add_parser("replay", help="replay a spot availability trace on a loopback Ray cluster while a run trains")
    rp.add_argument("--trace", required=True, help="CSV lines time_ms,add|remove,node_name[,zone][,price] (a price column: spot dollars per node-hour from that event on)")
    rp.add_argument("--config", default=default_config, help="YAML run config (default: jobs/tiny.yaml)")
    rp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value")
    rp.add_argument("--time-scale", type=float, default=60.0, help="trace seconds per replay second (default 60: an hour in a minute)")
    rp.add_argument("--window", help="START_S:END_S, the stretch of trace time to replay (default: all of it)")
    rp.add_argument("--node-scale", type=float, default=0.25, help="replay nodes per trace node (default 0.25)")
    rp.add_argument("--cpus-per-node", type=float, default=1.0, help="CPUs of each replay node (default 1)")
    rp.add_argument("--notice-s", type=float, default=0.0, help="drain each removed node this many replay seconds before it goes (default 0: no notice)")
    rp.add_argument("--seed", type=int, default=0, help="seed of the victims drawn when the fleet shrinks")
    rp.add_argument("--out", required=True, help="directory for replay.json, replay.png and metrics.jsonl")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")
    rp.add_argument("--prices", help="YAML price table (node type -> spot_per_h, on_demand_per_h; default: the shipped elastic_llm/sim/prices.yaml)")
    rp.add_argument("--node-type", default="cpu-2core", help="the replay nodes' type in the price table (default cpu-2core)")
    rp.set_defaults(func=cmd_replay)


def simulate_command(sub: Any, default_config: str) -> None:
    sm = sub.add_parser("simulate", help="the real controller on a simulated fleet (no Ray): a trace or a fault schedule, in simulated time")
    sm.add_argument("--config", default=default_config, help="YAML run config (default: jobs/tiny.yaml; jobs/sim-fleet.yaml has 64 layers)")
    sm.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value")
    sm.add_argument("--nodes", type=int, required=True, help="nodes of the fleet (with --trace: at the window's start; the trace is scaled to it)")
    sm.add_argument("--stages", type=int, required=True, help="pipeline stages (must divide model.n_layers)")
    sm.add_argument("--replicas", type=int, required=True, help="data-parallel replicas at the start")
    sm.add_argument("--trace", help="CSV lines time_ms,add|remove,node_name[,zone][,price] (the replay's format); without it the fleet is steady")
    sm.add_argument("--window", help="START_S:END_S, the stretch of trace time to simulate (default: all of it)")
    sm.add_argument("--time-scale", type=float, default=1.0, help="trace seconds per simulated second (default 1: real time)")
    sm.add_argument("--notice-s", type=float, default=0.0, help="drain each removed node this many seconds before it goes (default 0: no notice)")
    sm.add_argument("--steps", type=int, help="stop after this many steps (needed without --trace)")
    sm.add_argument("--slots-per-node", type=int, help="stage actors a node holds (default: stages x replicas / nodes, rounded up)")
    sm.add_argument("--process-failures-per-hour", type=float, default=0.0, help="stage processes dying on live nodes, per actor per hour (seeded)")
    sm.add_argument("--durable-every", type=int, default=0, help="flush every N-th committed snapshot to a simulated durable tier (default 0: none)")
    sm.add_argument("--cost", default="cpu-2core", help="cost model: a YAML file or a profile (cpu-2core: measured here; gpu-a100: published figures)")
    sm.add_argument("--prices", help="YAML price table (node type -> spot_per_h, on_demand_per_h; default: the shipped one); the cost model's name is the node type")
    sm.add_argument("--seed", type=int, default=0, help="seed of the trace's victims and of the fault schedule")
    sm.add_argument("--out", required=True, help="directory for replay.json, replay.png and metrics.jsonl")
    sm.set_defaults(func=cmd_simulate)
