"""The step of the loopback replays' job at width 1 and at width 2, for the simulation's cost model.

``elastic-llm bench calibrate`` runs this beside its other benchmarks: ``jobs/spot-tiny.yaml``
(the job the loopback replays run) on a loopback cluster shaped as the replays start (4 worker
nodes of 1 CPU), snapshots as the job ships them, no trace: a fixed width of 1 for ``steps``
steps, then of 2. On one machine's shared cores a second replica costs more than its gradient
exchange: its microbatch calls, its optimizer update and its snapshot slice run on the same
cores. The cost model's ``replica_s`` is what width 2 adds beyond width 1 and the exchange.
Never a replay: no node comes or goes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

CONFIG = "jobs/spot-tiny.yaml"
WARMUP = 3  # steps left out: process starts, first forward and backward, cold snapshot buffers


def run_widths_bench(config: str = CONFIG, steps: int = 24, nodes: int = 4, cpus_per_node: float = 1.0) -> dict[str, Any]:
    import ray

    from benchmarks.common import machine_info, median
    from elastic_llm.config import load_config
    from elastic_llm.runtime.ray_runtime import ray_trainer
    from elastic_llm.runtime.session import loopback_cluster, node_store_bytes

    base = load_config(config)
    cluster = loopback_cluster(nodes, cpus_per_node, node_store_bytes(base, nodes))
    rows: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-widths-") as tmp:
            for width in (1, 2):
                cfg = load_config(config, [f"parallel.dp={width}", f"elastic.min_replicas={width}", f"elastic.max_replicas={width}"])
                t = ray_trainer(cfg, cluster=cluster, metrics_out=Path(tmp) / f"width{width}.jsonl")
                try:
                    history = t.fit(steps)
                finally:
                    t.shutdown()
                took = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(history, history[1:]) if b["step"] == a["step"] + 1][WARMUP:]
                rows[f"width_{width}"] = {"median_step_s": round(median(took), 4), "steps_timed": len(took),
                                          "step_s": [round(x, 4) for x in took]}
    finally:
        ray.shutdown()
        cluster.shutdown()
    extra = rows["width_2"]["median_step_s"] - rows["width_1"]["median_step_s"]
    return {"bench": "widths", "machine": machine_info(), "config": config, "nodes": nodes, "cpus_per_node": cpus_per_node,
            **rows, "width_2_over_width_1": round(rows["width_2"]["median_step_s"] / rows["width_1"]["median_step_s"], 3),
            "width_2_extra_s": round(extra, 4)}
