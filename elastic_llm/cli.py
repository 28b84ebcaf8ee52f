"""Command line: ``elastic-llm train | plan | submit | status | spot-watcher | prepare | replay | simulate |
chaos | experiment | checkpoints | export | bench``.

Owns: argument parsing and turning user errors into one clear message and exit code 2.
Everything else is delegated (controller, data, bench).

Why ~500 lines: eleven of its thirteen subcommands (replay and simulate: :mod:`elastic_llm.fleet_cli`), each with its options, help text and the checks that turn a
bad argument into a message naming it; each command body is a few lines handing over to the
module that does the work.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from elastic_llm.fleet_cli import replay_command, simulate_command
from elastic_llm.logs import LEVELS

EXIT_USAGE = 2


def _default_config() -> str:
    return "jobs/tiny.yaml"


def cmd_train(args: argparse.Namespace) -> int:
    from elastic_llm.config import load_config

    overrides = list(args.set or [])
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    cfg = load_config(args.config, overrides)  # a bad config is refused before torch and Ray are imported (2-3 s)
    from elastic_llm.runtime.ray_runtime import ray_trainer

    trainer = ray_trainer(cfg, address=args.address, metrics_out=args.metrics_out, progress=not args.no_progress, dashboard=args.dashboard, resume=args.resume)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    if history:
        first, last = history[0], history[-1]
        msg = f"done: {last['step']} steps, loss {first['loss']:.3f} -> {last['loss']:.3f}"
        vals = [h["val_loss"] for h in history if "val_loss" in h]
        if vals:
            msg += f", val_loss {vals[-1]:.3f}"
        print(msg + f", {last['tokens']} tokens in {last['elapsed_s']:.1f} s")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from elastic_llm.pipeline import memory
    from elastic_llm.config import load_config

    overrides = list(args.set or [])
    if args.gpu_memory_gib is not None:
        overrides.append(f"parallel.gpu_memory_gib={args.gpu_memory_gib}")
    if args.nodes is not None and args.nodes < 1:
        print(f"error: --nodes={args.nodes} must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    cfg = load_config(args.config, overrides)
    p = memory.plan(cfg, args.nodes)
    gib = cfg.parallel.gpu_memory_gib
    fits = gib is None or memory.fits(cfg, memory.share(cfg, gib * memory.GIB))
    if args.json:
        print(json.dumps({"config": cfg.name, "stages": [{**asdict(st), "device": st.device, "host": st.host} for st in p.stages],
                          "object_store_per_node": p.object_store_per_node, "nodes": p.nodes, "gpu_memory_gib": gib, "fits": fits}))
    else:
        print(memory.render(cfg, p, gib))
    return 0 if fits else 1


def cmd_submit(args: argparse.Namespace) -> int:
    from elastic_llm.ops.submit import submit

    return submit(args)


def cmd_status(args: argparse.Namespace) -> int:
    from elastic_llm.ops.status import status

    return status(args)


def cmd_spot_watcher(args: argparse.Namespace) -> int:
    from elastic_llm.ops.spot_watcher import main as watch

    return watch(args)


def cmd_prepare(args: argparse.Namespace) -> int:
    from elastic_llm.data import builtin_corpus_dir, prepare

    problem = None
    if args.tokenizer == "byte" and (args.vocab_size is not None or args.tokenizer_file):
        problem = "--vocab-size and --tokenizer-file go with --tokenizer bpe (byte tokens are always 256): add --tokenizer bpe or drop them"
    elif args.vocab_size is not None and args.tokenizer_file:
        problem = "pass --vocab-size to train a BPE or --tokenizer-file to use an existing one, not both"
    elif args.sources and not args.out:
        problem = "--out DIR is required when you pass your own sources"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    out = args.out or str(builtin_corpus_dir(args.tokenizer, args.vocab_size, args.tokenizer_file))
    meta = prepare(args.sources, out, val_fraction=args.val_fraction, tokenizer=args.tokenizer, vocab_size=args.vocab_size, tokenizer_file=args.tokenizer_file)
    print(json.dumps({"out": str(out), **meta}))
    return 0


def _chaos_problem(args: argparse.Namespace) -> str | None:
    """The first bad ``chaos`` argument, named with its fix (pure)."""
    if args.trials < 1:
        return f"--trials={args.trials} must be >= 1"
    if args.first_trial < 0:
        return f"--first-trial={args.first_trial} must be >= 0"
    if args.faults_per_trial < 1:
        return f"--faults-per-trial={args.faults_per_trial} must be >= 1"
    if args.workers < 2:
        return f"--workers={args.workers} must be >= 2 (a node fault needs another node to recover on)"
    if args.cpus_per_node <= 0:
        return f"--cpus-per-node={args.cpus_per_node:g} must be > 0"
    if args.trial_timeout_s <= 0:
        return f"--trial-timeout-s={args.trial_timeout_s:g} must be > 0 (seconds before a trial counts as hung)"
    return None


def cmd_chaos(args: argparse.Namespace) -> int:
    from elastic_llm.config import load_config
    from elastic_llm.hosts.lab import unavailable
    from elastic_llm.soak.lab import LabSoak
    from elastic_llm.soak.plan import HARNESS, kinds_problem, on_harness, parse_kinds, plan_soak
    from elastic_llm.soak.runner import Soak, SoakOptions

    problem = _chaos_problem(args)
    try:
        kinds = parse_kinds(args.faults)
        problem = problem or kinds_problem(kinds)
    except ValueError as e:
        problem = problem or str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    harness = on_harness(kinds)
    why = unavailable(directional=True) if harness else None
    if why is not None:
        print(f"error: --faults {','.join(k.value for k in kinds if k in HARNESS)} need the multi-host harness (elastic_llm.hosts), "
              f"and {why}: run it as root on Linux with iproute2 and nftables, or soak the kinds that run on a loopback cluster", file=sys.stderr)
        return EXIT_USAGE
    overrides = list(args.set or [])
    cfg = load_config(args.config, overrides)  # a bad config is refused before any node starts
    lo, hi = cfg.elastic.bounds(cfg.parallel.dp)
    plans = plan_soak(kinds, args.trials, args.faults_per_trial, args.seed, cfg.parallel.stages, args.first_trial, resize=lo < hi and not harness)
    if harness:
        report = LabSoak(args.config, overrides, plans, args.workers, args.cpus_per_node, args.trial_timeout_s, args.seed).run(args.out)
    else:
        options = SoakOptions(args.workers, args.cpus_per_node, args.trial_timeout_s, seed=args.seed)
        driver_argv = ["--config", args.config, *[a for o in overrides for a in ("--set", o)]]  # driver trials start `elastic-llm train` with these
        report = Soak(lambda extra: load_config(args.config, [*overrides, *extra]), plans, options, driver_argv=driver_argv).run(args.out)
    print(json.dumps({"ok": report["ok"], **report["totals"], "failed": [f"trial {f['trial']}: {f['invariant']}" for f in report["failures"]]}))
    print(f"wrote {Path(args.out) / 'report.json'} and {Path(args.out) / 'report.md'}", file=sys.stderr)
    return 0 if report["ok"] else 1


def cmd_experiment(args: argparse.Namespace) -> int:
    from elastic_llm.experiment.convergence import (
        PAPER_RATES,
        ExperimentError,
        default_eval_every,
        parse_failure_probs,
        parse_failure_rates,
        parse_strategies,
    )
    from elastic_llm.experiment.runner import ConvergenceSpec, files, run_convergence

    try:
        if args.failure_rates is not None and args.failure_probs is not None:
            raise ExperimentError("--failure-rates and --failure-probs are both given: give one (rates from the paper's table, or per-step probabilities)")
        for opt, value in (("--eval-every", args.eval_every), ("--checkpoint-every", args.checkpoint_every)):
            if value is not None and value < 1:
                raise ExperimentError(f"{opt}={value} must be >= 1")
        if args.failure_probs is not None:
            rates = parse_failure_probs(args.failure_probs)
        else:
            rates = parse_failure_rates(args.failure_rates if args.failure_rates is not None else ",".join(map(str, PAPER_RATES)))
        spec = ConvergenceSpec(
            config=args.config,
            overrides=tuple(args.set or ()),
            strategies=parse_strategies(args.strategies),
            rates=rates,
            steps=args.steps,
            eval_every=args.eval_every or default_eval_every(args.steps),
            checkpoint_every=args.checkpoint_every,
            seed=args.seed,
            target_loss=args.target_loss,
            progress=not args.no_progress,
        )
        summary = run_convergence(spec, args.out)
    except ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(summary))
    print("wrote " + ", ".join(str(f) for f in files(args.out)), file=sys.stderr)
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from elastic_llm.durable.format import Checkpoint, list_checkpoints, open_checkpoint, runs_in, storage_root_problem
    from elastic_llm.durable.storage import Storage

    if args.action == "list":
        where = Storage(args.uri)
        entries = list_checkpoints(where)
        runs = [] if entries else runs_in(where) if where.is_dir() else []
        if not entries and not runs:  # a storage root lists its runs' checkpoints; anything else is refused
            problem = (storage_root_problem(where) or f"{where.display()} holds no durable checkpoints: give a run directory or a durable.storage_path") \
                if where.is_dir() else f"{where.display()} does not exist: give a run directory of durable checkpoints or a durable.storage_path"
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_USAGE
        for run, listed in [(where, entries)] if entries else [(where.child(r), list_checkpoints(where.child(r))) for r in runs]:
            for e in listed:
                size = ""
                if e.committed:
                    ck = Checkpoint(run, e.name)
                    size = f"{sum(f['nbytes'] for f in ck.manifest['files'].values()) / 1e6:.1f} MB, width {ck.manifest.get('width')}"
                print(json.dumps({"run": run.root.rsplit("/", 1)[-1], "checkpoint": run.display(e.name), "step": e.step, "committed": e.committed, "size": size, "problem": e.problem}))
        return 0
    ck = open_checkpoint(args.uri)
    print(json.dumps(ck.verify()))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import tempfile

    from elastic_llm.config import ModelConfig
    from elastic_llm.durable.format import TOKENIZER, open_checkpoint
    from elastic_llm.export import write_hf

    ck = open_checkpoint(args.checkpoint)
    shape = ModelConfig(**ck.manifest["model"]).shape()
    tensors = ck.model_tensors()
    with tempfile.TemporaryDirectory() as tmp:
        tok = None
        if ck.manifest.get("tokenizer_file"):
            tok = Path(tmp) / TOKENIZER
            tok.write_bytes(ck.storage.read_bytes(f"{ck.name}/{TOKENIZER}"))
        out = write_hf(shape, tensors, args.out, tokenizer_file=tok, eos_id=None if tok is not None else 0)  # byte tokens: NUL ends a document
    print(json.dumps({"out": str(out), "step": ck.step, "parameters": sum(t.numel() for t in tensors.values()), "tokenizer": tok is not None}))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    print(
        "error: this install of elastic-llm has no `benchmarks` package: "
        "install it from a source checkout (`pip install -e \".[bench]\"`) and run `elastic-llm bench` from the checkout's root",
        file=sys.stderr,
    )
    return EXIT_USAGE


def _train_command(sub: Any) -> None:
    t = sub.add_parser("train", help="train a model (embedded Ray, or --address to join a cluster)")
    t.add_argument("--config", default=_default_config(), help="YAML run config (default: jobs/tiny.yaml)")
    t.add_argument("--max-steps", type=int, help="override train.max_steps")
    t.add_argument("--address", help="Ray cluster address (default: start an embedded single-node Ray)")
    t.add_argument("--metrics-out", help="write JSON-lines metrics here")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value, e.g. --set train.lr=3e-4")
    t.add_argument("--dashboard", action="store_true", help="start the Ray dashboard on 127.0.0.1:8265 (embedded Ray)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--resume", metavar="URI_OR_RUN_DIR_OR_RUN_ID", help=(
        "start from a durable checkpoint (a checkpoint_* directory, or a run directory: its newest committed one), or go on with "
        "run RUN_ID (six hex digits, as `elastic-llm status` shows it) whose driver died: from its newest committed in-memory "
        "snapshot, else its newest durable checkpoint"))
    t.set_defaults(func=cmd_train)


def _plan_command(sub: Any) -> None:
    pl = sub.add_parser("plan", help="the memory plan of a config: per stage, device and host bytes; whether it fits a GPU (exit 1 if not)")
    pl.add_argument("--config", default=_default_config(), help="YAML run config (default: jobs/tiny.yaml)")
    pl.add_argument("--gpu-memory-gib", type=float, help="memory of each stage's GPU in GiB, e.g. 80 (default: the config's parallel.gpu_memory_gib)")
    pl.add_argument("--nodes", type=int, help="worker nodes the stage actors spread over, for the host memory per node (default: one per actor)")
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value, as for train")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.set_defaults(func=cmd_plan)


def _submit_command(sub: Any) -> None:
    sb = sub.add_parser("submit", help="submit a training run to a Ray cluster as a Ray job")
    sb.add_argument("--config", default=_default_config(), help="YAML run config (default: jobs/tiny.yaml)")
    sb.add_argument("--address", default="http://127.0.0.1:8265", help="the cluster's dashboard (job server) address (default: http://127.0.0.1:8265, e.g. through `ray dashboard cluster.yaml`)")
    sb.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value of the run")
    sb.add_argument("--max-steps", type=int, help="override train.max_steps")
    sb.add_argument("--working-dir", help="upload this directory with the job and install it there (default: the source checkout when run from one; otherwise the cluster's installed elastic-llm)")
    sb.add_argument("--submission-id", help="the job's id (default: Ray picks one)")
    sb.add_argument("--wait", action="store_true", help="follow the job's logs until it ends; exit with its outcome")
    sb.set_defaults(func=cmd_submit)


def _status_command(sub: Any) -> None:
    st = sub.add_parser("status", help="stages, replicas, nodes, states, snapshot versions and recoveries of the runs on a cluster")
    st.add_argument("--address", default="auto", help="Ray cluster address (default: auto, the cluster this machine belongs to)")
    st.add_argument("--run", help="only this run id (default: every run on the cluster)")
    st.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    st.set_defaults(func=cmd_status)


def _spot_watcher_command(sub: Any) -> None:
    sw = sub.add_parser("spot-watcher", help="drain this Ray node when EC2 schedules a spot interruption (run on every spot worker)")
    sw.add_argument("--address", default="auto", help="Ray cluster (GCS) address (default: auto)")
    sw.add_argument("--node-id", help="the Ray node to drain (default: the Ray node on this machine)")
    sw.add_argument("--metadata-url", default="http://169.254.169.254", help="instance metadata service (default: EC2's)")
    sw.add_argument("--interval-s", type=float, default=5.0, help="seconds between polls (default 5)")
    sw.set_defaults(func=cmd_spot_watcher)


def _prepare_command(sub: Any) -> None:
    pr = sub.add_parser("prepare", help="tokenize text into Parquet shards (default: the Python standard library)")
    pr.add_argument("sources", nargs="*", help="files, directories or URIs (text, .jsonl with 'text', .parquet with 'text')")
    pr.add_argument("--out", help="output directory or URI (default for the built-in corpus: the cache)")
    pr.add_argument("--val-fraction", type=float, default=0.02)
    pr.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte", help="byte (default) or bpe: a byte-level BPE (Hugging Face tokenizers), saved as tokenizer.json")
    pr.add_argument("--vocab-size", type=int, metavar="N", help="bpe: train a BPE of N tokens on the training documents (default 8192)")
    pr.add_argument("--tokenizer-file", metavar="PATH", help="bpe: encode with this tokenizer.json instead of training one (needs an <|endoftext|> token)")
    pr.set_defaults(func=cmd_prepare)


def _chaos_command(sub: Any) -> None:
    ch = sub.add_parser("chaos", help="soak runs on a loopback Ray cluster (or the multi-host harness) with seeded faults; check them against an undisturbed run")
    ch.add_argument("--config", default=_default_config(), help="YAML run config (default: jobs/tiny.yaml)")
    ch.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value")
    ch.add_argument("--faults", default="stage,manager,node,drain,pause,corrupt,flush", help=(
        "fault kinds, comma-separated (default: stage,manager,node,drain,pause,corrupt,flush; driver runs in soaks of its own: "
        "--faults driver; partition, partition-heal, isolate-pair, slow-link run on the multi-host harness, as root, with stage, manager "
        "and node if given: one host per node, --cpus-per-node 1 there gives each node two stages of jobs/tiny.yaml)"))
    ch.add_argument("--trials", type=int, default=1, help="soaked runs, each with its own faults (default 1)")
    ch.add_argument("--first-trial", type=int, default=0, help="number of the first trial (default 0): re-run trial i alone with --first-trial i --trials 1")
    ch.add_argument("--faults-per-trial", type=int, default=3, help="faults in each soaked run, one at a time (default 3)")
    ch.add_argument("--seed", type=int, default=0, help="seed of the fault schedule: trial i's faults depend only on (seed, i)")
    ch.add_argument("--workers", type=int, default=4, help="worker nodes of the loopback cluster (default 4)")
    ch.add_argument("--cpus-per-node", type=float, default=2.0, help="CPUs of each worker node (default 2)")
    ch.add_argument("--trial-timeout-s", type=float, default=600.0, help="a trial not done by then fails as hung (default 600)")
    ch.add_argument("--out", required=True, help="directory for report.json, report.md and each run's metrics.jsonl")
    ch.set_defaults(func=cmd_chaos)


def _experiment_command(sub: Any) -> None:
    from elastic_llm.experiment.convergence import STRATEGIES  # pure and light: no Ray, no matplotlib

    ex = sub.add_parser("experiment", help="experiments that drive real training runs and compare them")
    ex_sub = ex.add_subparsers(dest="experiment", required=True)
    cv = ex_sub.add_parser(
        "convergence", help="validation loss against wall-clock per fault-tolerance strategy and failure rate (resumable)"
    )
    cv.add_argument("--config", default=_default_config(), help="YAML run config (default: jobs/tiny.yaml)")
    cv.add_argument("--failure-rates", help="the paper's failure rates in %% per stage per hour, from 5,10,16 (default: 5,10,16)")
    cv.add_argument("--failure-probs", help="per-step failure probabilities of each stage instead, e.g. 0.002,0.02")
    cv.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, from {','.join(STRATEGIES)} (default: all)")
    cv.add_argument("--steps", type=int, required=True, help="training steps N of every run (>= 2)")
    cv.add_argument("--out", required=True, help="directory for results.json, results.md, loss_vs_time.png and cells/")
    cv.add_argument("--checkpoint-every", type=int, default=100, help="strategy checkpoint: a checkpoint every K steps (default 100)")
    cv.add_argument("--eval-every", type=int, help="validate every E steps (default: max(1, N // 25))")
    cv.add_argument("--target-loss", type=float, help="the validation loss to reach (default: none's at the eval step nearest 80%% of N)")
    cv.add_argument("--seed", type=int, default=0, help="seed of the failure schedule, the same for every strategy (default 0)")
    cv.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value of every run")
    cv.add_argument("--no-progress", action="store_true", help="no progress bars")
    cv.set_defaults(func=cmd_experiment, steps_min=2)


def _checkpoints_command(sub: Any) -> None:
    ck = sub.add_parser("checkpoints", help="list or verify durable checkpoints (local directory or URI)")
    ck.add_argument("action", choices=["list", "verify"], help="list: every checkpoint of a run directory; verify: read and check every tensor of one")
    ck.add_argument("uri", help="run directory (list), or checkpoint / run directory (verify: its newest committed checkpoint)")
    ck.set_defaults(func=cmd_checkpoints)


def _export_command(sub: Any) -> None:
    exp = sub.add_parser("export", help="export a durable checkpoint to another format")
    exp.add_argument("checkpoint", help="checkpoint directory, or a run directory (its newest committed checkpoint)")
    exp.add_argument("--format", choices=["hf"], default="hf", help="hf: Hugging Face LlamaForCausalLM (config.json, model.safetensors, tokenizer)")
    exp.add_argument("--out", required=True, help="new directory to write (must not exist or be empty)")
    exp.set_defaults(func=cmd_export)


def _bench_command(sub: Any) -> None:
    """``bench``: the benchmarks package's own parser (it runs them); without it, a clear refusal."""
    import importlib

    try:
        importlib.import_module("benchmarks.common")
    except ImportError:
        b = sub.add_parser("bench", help="benchmarks (needs a source checkout: pip install -e '.[bench]')")
        b.add_argument("rest", nargs=argparse.REMAINDER)
        b.set_defaults(func=cmd_bench)
        return
    importlib.import_module("benchmarks.run").add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-llm", description="Elastic pipeline-parallel LLM pretraining on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    _train_command(sub)
    _plan_command(sub)
    _submit_command(sub)
    _status_command(sub)
    _spot_watcher_command(sub)
    _prepare_command(sub)
    replay_command(sub, _default_config())
    simulate_command(sub, _default_config())
    _chaos_command(sub)
    _experiment_command(sub)
    _checkpoints_command(sub)
    _export_command(sub)
    _bench_command(sub)
    for command in sub.choices.values():  # every subcommand: how much of the log to show
        command.add_argument("--log-level", choices=LEVELS, default="info", help="log lines shown on stderr, from this level up (default: info)")
    return p


LIGHT = ("status", "spot-watcher")  # commands that handle their own errors and must start fast (no torch)
RAY = ("train", "submit", "status", "spot-watcher", "replay", "chaos", "experiment", "bench")  # the commands that talk to Ray


def main(argv: list[str] | None = None) -> int:
    from elastic_llm.logs import configure

    args = build_parser().parse_args(argv)
    configure(args.log_level)
    if args.command in RAY:  # Ray on loopback with token auth (prepare, simulate, checkpoints and export need no Ray)
        from elastic_llm.runtime.session import loopback_env

        loopback_env()
    if args.command in LIGHT:
        return args.func(args)
    return _run(args)


# What a command's errors mean, by the module each is defined in: a usage error (exit 2: the input
# is wrong, nothing ran) or a training stop that keeps the committed snapshots (exit 3). Resolved
# from the modules the command loaded (an error can only be raised once its module is): a config
# refused at once never imports torch (2 s) to name the classes of errors it could not have met.
USAGE_ERRORS = (
    ("elastic_llm.config.schema", "ConfigError"), ("elastic_llm.stream", "DataError"), ("elastic_llm.runtime.session", "PlacementError"),
    ("elastic_llm.snapshot.layout", "LayoutError"), ("elastic_llm.durable.format", "DurableError"), ("elastic_llm.durable.storage", "StorageError"),
    ("elastic_llm.export", "ExportError"), ("elastic_llm.controller.metrics", "MetricsError"), ("elastic_llm.runtime.session", "ClusterUnreachable"),
    ("elastic_llm.controller.ports", "ResumeError"),
)
STOP_ERRORS = (("elastic_llm.sources", "UnrecoverableError"), ("elastic_llm.snapshot.state", "SnapshotFormatError"), ("elastic_llm.controller.ports", "Superseded"))


def loaded_errors(errors: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    """The classes of ``errors`` whose modules this process has imported."""
    return tuple(getattr(sys.modules[module], name) for module, name in errors if module in sys.modules)


def _run(args: argparse.Namespace) -> int:
    from elastic_llm.controller import RunFailed

    if getattr(args, "max_steps", None) is not None and args.max_steps < 1:
        print(f"error: --max-steps={args.max_steps} must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    least = getattr(args, "steps_min", 1)  # experiment convergence needs 2 (a first and a last step); the others 1
    if getattr(args, "steps", None) is not None and args.steps < least:
        print(f"error: --steps={args.steps} must be >= {least}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RunFailed as e:  # the controller already logged the reason; repeat it as the last word
        print(f"error: training stopped (exit {e.exit_code}), committed snapshots untouched: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if isinstance(e, loaded_errors(USAGE_ERRORS)):
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, loaded_errors(STOP_ERRORS)):
            print(f"error: training stopped, committed snapshots untouched: {e}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
