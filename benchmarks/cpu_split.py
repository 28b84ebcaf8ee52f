"""CPU seconds per training step by process, every-step parity snapshots on and off.

One 3-node loopback cluster (a head without CPUs, one erasure group, the stages spread), two
trainers of ``--config`` one after the other: snapshots every step, then none; after
``--warmup`` steps each, ``--steps`` timed steps. Prints one JSON line: the code's directory
(whatever ``elastic_llm`` is first on ``PYTHONPATH``), each trainer's median step and CPU seconds
per step by process kind (the stages, the snapshot managers, the raylets, the driver, ...).

For comparing two trees of the code in one sitting, alternating them (the machine drifts between
runs)::

    git worktree add /tmp/old <commit>
    R=$PWD; for tree in /tmp/old $R /tmp/old $R; do (cd $tree && PYTHONPATH=$tree python3 $R/benchmarks/cpu_split.py); done

Not a benchmark of its own (no peer): a measuring tool for where a snapshot's CPU goes.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.snapshot import _cluster_extra, _cpu_delta, _cpu_tree, _start_cluster, _trainer_configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="jobs/tiny.yaml")
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()

    import ray

    import elastic_llm
    from elastic_llm.runtime.ray_runtime import ray_trainer
    from elastic_llm.runtime.session import loopback_env

    loopback_env()
    on_cfg, off_cfg = _trainer_configs(args.config, [], _cluster_extra(3))
    cluster, _ = _start_cluster(on_cfg, 3, 52_000_000)
    try:
        out: dict[str, object] = {"code": os.path.dirname(elastic_llm.__file__), "config": args.config, "steps": args.steps}
        for name, cfg in (("every_step_parity", on_cfg), ("no_snapshots", off_cfg)):
            trainer = ray_trainer(cfg, cluster=cluster)
            trainer.setup()
            try:
                for _ in range(args.warmup):
                    trainer.run_step()
                before, steps = _cpu_tree(os.getpid()), []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    trainer.run_step()
                    steps.append(time.perf_counter() - t0)
                cpu = _cpu_delta(before, _cpu_tree(os.getpid())) or {}
            finally:
                trainer.shutdown()
            out[name] = {
                "median_step_s": round(sorted(steps)[len(steps) // 2], 4),
                "cpu_s_per_step": {k: round(v / args.steps, 4) for k, v in sorted(cpu.items())},
                "cpu_s_per_step_total": round(sum(cpu.values()) / args.steps, 4),
            }
        print(json.dumps(out), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
