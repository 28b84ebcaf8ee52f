"""Node failure detection: seconds from a vanished node (its raylet SIGKILLed:
``Cluster.remove_node(allow_graceful=False)``, so nothing tells the GCS) until Ray reports it dead,
with Ray's default health checks (the peer), with the settings ``cluster.yaml`` passes to the
head's ``ray start --system-config`` (read from the file), and with those settings plus the run's
own node watch (:class:`~elastic_llm.runtime.ray_runtime.RayNodes` at the config's defaults, as a
Trainer runs it: it probes the raylets, holds a connection to each between rounds, and declares a
node whose raylet refuses connections dead to the GCS), side by side in one run on loopback
``ray.cluster_utils.Cluster``s (a head without CPUs, one 1-CPU node added and removed per round).
On loopback a killed raylet's port refuses connections; a machine that vanished from a real
network answers nothing, and the watch then needs ``node_probe_failures`` timed-out probes
(about ``failures x (period + 0.5 s)``): that case is not measured here.

A dead stage process is noticed sooner than this (its peers' links close at once and the step
fails); this is what a whole node's disappearance costs before a recovery can plan around it.
Must never reach anything but 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is required),
leave Ray running, or judge its result (BENCHMARKS.md does).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from typing import Any

from benchmarks.common import machine_info, median
from elastic_llm.config import RecoveryConfig

DEAD_S = 120.0  # longest a round waits for Ray to report the node dead


def cluster_yaml_health(path: str = "cluster.yaml") -> dict[str, Any]:
    """The ``--system-config`` JSON of the head's ``ray start`` in ``path``."""
    import yaml

    with open(path) as f:
        cfg = yaml.safe_load(f)
    (command,) = [c for c in cfg["head_start_ray_commands"] if "ray start" in c]
    (flag,) = [a for a in shlex.split(command) if a.startswith("--system-config=")]
    return json.loads(flag.split("=", 1)[1])


def _rounds(system_config: dict[str, Any], rounds: int, watch: bool = False) -> list[float]:
    import ray

    from elastic_llm.runtime.liveness import REFRESH_S
    from elastic_llm.runtime.ray_runtime import RayNodes
    from elastic_llm.runtime.session import add_loopback_node, loopback_cluster

    c = loopback_cluster(0, 1, system_config=system_config)
    w = None
    try:
        rc = RecoveryConfig()
        if watch:  # the run's own: probes every period, holds a connection to each raylet between rounds
            w = RayNodes()
            w.start(rc.node_probe_s, rc.node_probe_failures, rc.node_probe_declare)
        out = []
        for _ in range(rounds):
            node = add_loopback_node(c, 1)
            c.wait_for_nodes()
            seen_by = time.monotonic() + 10 * REFRESH_S
            while w is not None and w.watch is not None and node.node_id not in w.watch.watching():  # a run's nodes are watched long before they die
                if time.monotonic() > seen_by:
                    raise TimeoutError(f"the node watch did not pick up the new node within {10 * REFRESH_S:.0f} s")
                time.sleep(0.05)
            if w is not None:
                time.sleep(2 * rc.node_probe_s)  # a round after the one that found it: its connection is held
            t = time.monotonic()
            c.remove_node(node, allow_graceful=False)
            while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
                if time.monotonic() - t > DEAD_S:
                    raise TimeoutError(f"Ray still reports the node alive {DEAD_S:.0f} s after its raylet was killed")
                time.sleep(0.05)
            out.append(time.monotonic() - t)
        return out
    finally:
        if w is not None:
            w.stop()
        ray.shutdown()
        c.shutdown()


def run_detect_bench(rounds: int = 3, cluster_yaml: str = "cluster.yaml") -> dict[str, Any]:
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise RuntimeError("export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (and RAY_AUTH_MODE=token) first: the nodes must stay on 127.0.0.1")
    from elastic_llm.runtime.session import loopback_env

    loopback_env()
    ours = cluster_yaml_health(cluster_yaml)
    result: dict[str, Any] = {"bench": "detect", "machine": machine_info(), "rounds": rounds}
    for name, sc, watch in (("ray_default", {}, False), ("cluster_yaml", ours, False), ("node_watch", ours, True)):
        times = _rounds(sc, rounds, watch)
        result[name] = {"median_s": round(median(times), 2), "max_s": round(max(times), 2), "runs_s": [round(x, 2) for x in times], "system_config": sc}
    result["node_watch"]["probe"] = {"node_probe_s": RecoveryConfig().node_probe_s, "node_probe_failures": RecoveryConfig().node_probe_failures}
    med = {k: max(result[k]["median_s"], 0.01) for k in ("ray_default", "cluster_yaml", "node_watch")}
    result["speedup"] = round(med["ray_default"] / med["cluster_yaml"], 2)
    result["speedup_watch_vs_default"] = round(med["ray_default"] / med["node_watch"], 1)
    result["speedup_watch_vs_cluster_yaml"] = round(med["cluster_yaml"] / med["node_watch"], 1)
    return result
