"""Node failure detection: seconds from a vanished node (its raylet SIGKILLed:
``Cluster.remove_node(allow_graceful=False)``, so nothing tells the GCS) until Ray reports it dead,
with Ray's default health checks (the peer) and with the settings ``cluster.yaml`` passes to the
head's ``ray start --system-config`` (read from the file), side by side in one run on loopback
``ray.cluster_utils.Cluster``s (a head without CPUs, one 1-CPU node added and removed per round).

A dead stage process is noticed sooner than this (its peers' links close at once and the step
fails); this is what a whole node's disappearance costs before a recovery can plan around it.
Must never reach anything but 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is required),
leave Ray running, or judge its result (BENCHMARKS.md does).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import time
from typing import Any

from benchmarks.common import machine_info

DEAD_S = 120.0  # longest a round waits for Ray to report the node dead


def cluster_yaml_health(path: str = "cluster.yaml") -> dict[str, Any]:
    """The ``--system-config`` JSON of the head's ``ray start`` in ``path``."""
    import yaml

    with open(path) as f:
        cfg = yaml.safe_load(f)
    (command,) = [c for c in cfg["head_start_ray_commands"] if "ray start" in c]
    (flag,) = [a for a in shlex.split(command) if a.startswith("--system-config=")]
    return json.loads(flag.split("=", 1)[1])


def _rounds(system_config: dict[str, Any], rounds: int) -> list[float]:
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": dict(system_config)})
    try:
        ray.init(address=c.address, logging_level="ERROR")
        out = []
        for _ in range(rounds):
            node = c.add_node(num_cpus=1)
            c.wait_for_nodes()
            t = time.monotonic()
            c.remove_node(node, allow_graceful=False)
            while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
                if time.monotonic() - t > DEAD_S:
                    raise TimeoutError(f"Ray still reports the node alive {DEAD_S:.0f} s after its raylet was killed")
                time.sleep(0.05)
            out.append(time.monotonic() - t)
        return out
    finally:
        ray.shutdown()
        c.shutdown()


def run_detect_bench(rounds: int = 3, cluster_yaml: str = "cluster.yaml") -> dict[str, Any]:
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise RuntimeError("export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (and RAY_AUTH_MODE=token) first: the nodes must stay on 127.0.0.1")
    from elastic_llm.controller.session import loopback_env

    loopback_env()
    ours = cluster_yaml_health(cluster_yaml)
    result: dict[str, Any] = {"bench": "detect", "machine": machine_info(), "rounds": rounds}
    for name, sc in (("ray_default", {}), ("cluster_yaml", ours)):
        times = _rounds(sc, rounds)
        result[name] = {"median_s": round(statistics.median(times), 2), "max_s": round(max(times), 2), "runs_s": [round(x, 2) for x in times], "system_config": sc}
    result["speedup"] = round(result["ray_default"]["median_s"] / result["cluster_yaml"]["median_s"], 2)
    return result
