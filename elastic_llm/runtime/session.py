"""The Ray session: loopback, token authentication, starting or joining Ray, and whether a
placement can exist at all.

Owns: the environment Ray needs here (loopback addresses, token auth and its token file),
starting an embedded single-node Ray or joining a cluster (refused within seconds when nothing
answers at the address: :func:`check_reachable`), and :func:`check_placement`, a pure check that
refuses placements no cluster of this shape could satisfy.
Never places actors (the actor group does) and never waits for capacity (the controller does).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic_llm.config import RunConfig

NAMESPACE = "elastic-llm"
PROBE_S = 5.0  # longest a cluster address may take to accept a TCP connection


class PlacementError(RuntimeError):
    """The cluster cannot host the requested actors; the message says what is missing."""


class ClusterUnreachable(ConnectionError):
    """No Ray cluster answers at the address given; the message names it and the fix."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(
            f"no Ray cluster at --address {address} ({why}): start one (`ray start --head`), "
            "or pass the address of its GCS, e.g. --address 127.0.0.1:6379"
        )


def loopback_env() -> None:
    """Keep Ray on 127.0.0.1 and use token authentication (Ray >= 2.60 refuses clients
    otherwise), creating the token file if no token exists yet."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray" in sys.modules:  # Ray read its config when imported: make it see token mode too
            from ray._raylet import Config  # type: ignore[attr-defined]  # a compiled module: no stubs

            Config.initialize("")
    ensure_auth_token()


def ensure_auth_token() -> None:
    """Create ``~/.ray/auth_token`` (``ray get-auth-token --generate``) unless a token is already
    given: a Ray started by hand or by ``ray.cluster_utils.Cluster`` fails without one."""
    if os.environ.get("RAY_AUTH_MODE") != "token" or os.environ.get("RAY_AUTH_TOKEN"):
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if (path and Path(path).is_file()) or (Path.home() / ".ray" / "auth_token").is_file():
        return
    cli = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"]
    done = subprocess.run([*cli, "get-auth-token", "--generate"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise PlacementError(f"no Ray auth token and `ray get-auth-token --generate` failed: {done.stderr.strip()[-300:]}")


def start_ray(cfg: RunConfig, address: str | None = None, dashboard: bool = False) -> bool:
    """Connect to ``address`` or start an embedded single-node Ray. Returns True if we started it."""
    loopback_env()
    import ray

    if ray.is_initialized():
        return False
    if address:
        check_reachable(address)
        gcs = gcs_target(address)
        ip = driver_node_ip(gcs) if gcs and not address.startswith("ray://") else None
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True, **({"_node_ip_address": ip} if ip else {}))  # type: ignore[arg-type]  # ray.init's private keyword
        return False
    check_placement(cfg, local_resources(), [])  # refuse before starting anything
    ray.init(
        address="local",  # never join a cluster that another process started on this machine
        num_cpus=os.cpu_count() or 1,
        namespace=NAMESPACE,
        include_dashboard=dashboard,
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=True,
        logging_level="WARNING",
    )
    return True


def check_reachable(address: str, timeout_s: float = PROBE_S) -> None:
    """Raise :class:`ClusterUnreachable` unless the cluster at ``address`` accepts a TCP
    connection within ``timeout_s``: ``ray.init`` retries an unreachable GCS for a minute or more."""
    why = unreachable(address, timeout_s)
    if why is not None:
        raise ClusterUnreachable(address, why)


def unreachable(address: str, timeout_s: float = PROBE_S) -> str | None:
    """Why nothing answers at ``address``, or None when it accepts a TCP connection within
    ``timeout_s``. ``address``: a GCS ``host:port``; ``ray://host:port`` (a Ray client server);
    or ``auto``, found as ``ray.init`` finds it (RAY_ADDRESS, then the cluster ``ray start``
    recorded on this machine). Other schemes are left to Ray."""
    try:
        target = gcs_target(address)
    except ValueError as e:
        return str(e)
    if target is None:
        return None
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return f"{target!r} is not HOST:PORT"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return ("" if target == address else f"{target}: ") + (e.strerror or type(e).__name__)
    return None


def gcs_target(address: str) -> str | None:
    """The ``host:port`` that ``address`` reaches (see :func:`unreachable`; None for schemes left
    to Ray); ValueError when ``auto`` finds no cluster."""
    if address.startswith("ray://"):
        return address[len("ray://") :].split("/", 1)[0]
    if "://" in address:
        return None
    if address != "auto":
        return address
    from ray._private.services import canonicalize_bootstrap_address

    target = canonicalize_bootstrap_address(address)
    if target is None:
        raise ValueError("found none: RAY_ADDRESS is unset and `ray start` recorded no cluster on this machine")
    return str(target)


def local_ip(gcs: str) -> str:
    """This machine's IP as the GCS at ``gcs`` (``host:port``) sees it: what ``ray start
    --address`` registers a node with (a UDP socket's route, no packet sent). Not
    ``get_node_ip_address()``: with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which the CLI sets,
    that answers 127.0.0.1 everywhere."""
    from ray._private.services import node_ip_address_from_perspective

    return str(node_ip_address_from_perspective(gcs))


def driver_node_ip(gcs: str) -> str | None:
    """The address of the Ray node a driver on this machine joins: :func:`local_ip`, when an
    alive node of the cluster at ``gcs`` is registered at it; None (Ray's own choice) otherwise
    or when the GCS does not answer within 5 s. Where several nodes share one machine's
    processes (hosts in network namespaces: :mod:`elastic_llm.hosts`), Ray's choice is the
    head's node, whose address the driver cannot serve, and no object from another node ever
    reaches it."""
    import ray
    from ray.core.generated import gcs_pb2

    try:
        ip = local_ip(gcs)
        infos = ray._raylet.GcsClient(address=gcs).get_all_node_info(timeout=5)
    except Exception:  # noqa: BLE001 - RpcError and friends (their types move between Ray versions): Ray chooses, as before
        return None
    return ip if any(i.node_manager_address == ip and i.state == gcs_pb2.GcsNodeInfo.ALIVE for i in infos.values()) else None


def local_resources() -> dict[str, float]:
    """What an embedded Ray on this machine would offer."""
    import torch

    return {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}


def check_placement(cfg: RunConfig, resources: dict[str, float], nodes: list[dict[str, Any]]) -> None:
    """Refuse placements the cluster cannot satisfy (pure: resources in, error out)."""
    par = cfg.parallel
    n = par.stages * par.dp
    problems = []
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if n * par.cpus_per_actor > cpus:
        problems.append(
            f"{par.stages} stages x {par.dp} replicas x parallel.cpus_per_actor={par.cpus_per_actor} needs "
            f"{n * par.cpus_per_actor:g} CPUs but the cluster has {cpus:g}: lower parallel.cpus_per_actor "
            "(fractions are allowed), parallel.dp or parallel.stages, or add nodes"
        )
    if par.gpus_per_actor > 0 and n * par.gpus_per_actor > gpus:
        problems.append(
            f"{n} actors x parallel.gpus_per_actor={par.gpus_per_actor} needs {n * par.gpus_per_actor:g} GPUs "
            f"but the cluster has {gpus:g}: set parallel.gpus_per_actor=0 to train on CPUs, or use a fraction to share GPUs"
        )
    alive = [nd for nd in nodes if nd.get("Alive", True)] or [{"Resources": resources}]
    largest = max(nd.get("Resources", {}).get("CPU", 0.0) for nd in alive)
    if par.cpus_per_actor > largest:
        problems.append(
            f"parallel.cpus_per_actor={par.cpus_per_actor} exceeds the largest node's {largest:g} CPUs: no node can host one stage"
        )
    if par.placement_strategy == "STRICT_SPREAD" and n > len(alive):
        problems.append(
            f"parallel.placement_strategy=STRICT_SPREAD puts each of {n} actors on its own node but there are {len(alive)} nodes: use SPREAD or PACK"
        )
    if problems:
        raise PlacementError("impossible placement:\n" + "\n".join(f"  - {p}" for p in problems))


FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 1000}


NODE_STORE_BYTES = 1 << 30  # object store of a loopback worker node (Cluster.add_node's default is 150 MiB)
def snapshot_store_bytes(cfg: RunConfig, nodes: int) -> int:
    """The most one node's object store holds of the run's snapshots: the memory plan's
    (:func:`elastic_llm.pipeline.memory.snapshot_store_bytes`), imported here when asked (this
    module starts light: no torch)."""
    from elastic_llm.pipeline.memory import snapshot_store_bytes as planned

    return planned(cfg, nodes)


def node_store_bytes(cfg: RunConfig, nodes: int) -> int:
    """The object store a loopback worker node of a cluster of ``nodes`` gets for ``cfg``: at least
    :data:`NODE_STORE_BYTES`, more when its snapshots need it (:func:`snapshot_store_bytes`), so
    every-step snapshots never spill to disk."""
    return max(NODE_STORE_BYTES, snapshot_store_bytes(cfg, nodes))


def store_warnings(cfg: RunConfig, nodes: list[dict[str, Any]]) -> list[str]:
    """One warning per live node with CPUs whose object store (``ray.nodes()``'s
    ``object_store_memory``) cannot hold what :func:`snapshot_store_bytes` says its snapshot
    manager keeps: Ray would spill the snapshots to disk, slowly. Pure."""
    from elastic_llm.pipeline.memory import SNAPSHOT_VERSIONS_HELD

    workers = [n for n in nodes if n.get("Alive", True) and n.get("Resources", {}).get("CPU", 0) > 0]
    need = snapshot_store_bytes(cfg, len(workers))
    mib = 1 << 20
    return [
        f"node {n['NodeID'][:12]}'s object store holds {n['Resources'].get('object_store_memory', 0) / mib:.0f} MiB, but its snapshot manager "
        f"keeps up to {need / mib:.0f} MiB ({SNAPSHOT_VERSIONS_HELD} versions of its share of the state, with parity): "
        f"snapshots would spill to disk; start the node with `ray start --object-store-memory={need}` or more, "
        "or add nodes (each then holds a smaller share)"
        for n in workers
        if n.get("Resources", {}).get("object_store_memory", 0) < need
    ]


def add_loopback_node(cluster: Any, cpus: float, store_bytes: int = NODE_STORE_BYTES, labels: dict[str, str] | None = None) -> Any:
    """A worker node of a loopback ``Cluster`` with ``cpus`` CPUs and an object store of
    ``store_bytes`` (not ``Cluster.add_node``'s 150 MiB, which every-step snapshots overflow),
    with Ray node ``labels`` (e.g. its failure domain)."""
    return cluster.add_node(num_cpus=cpus, object_store_memory=store_bytes, **({"labels": labels} if labels else {}))


def loopback_cluster(
    workers: int,
    cpus_per_node: float,
    store_bytes: int = NODE_STORE_BYTES,
    *,
    head_store_bytes: int | None = None,
    system_config: Mapping[str, object] | None = None,
    log_to_driver: bool = True,
) -> Any:
    """A ``ray.cluster_utils.Cluster`` on 127.0.0.1 (for tests, replays and benchmarks): a head
    without CPUs plus ``workers`` nodes of ``cpus_per_node`` CPUs and ``store_bytes`` of object
    store each, a lost node noticed within about 2 s by Ray (the run's node watch notices sooner);
    this driver is connected to it. The caller shuts down Ray, then the cluster.
    ``head_store_bytes``: the head's object store (default ``store_bytes``); ``system_config``:
    the head's Ray system config (default :data:`FAST_HEALTH`; ``{}``: Ray's own defaults);
    ``log_to_driver``: whether the workers' output reaches this driver."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    head = {
        "num_cpus": 0,
        "object_store_memory": store_bytes if head_store_bytes is None else head_store_bytes,
        "include_dashboard": False,
        "_system_config": dict(FAST_HEALTH if system_config is None else system_config),
    }
    c = Cluster(initialize_head=True, head_node_args=head)  # the head's object_store_memory is in ``head``: not Ray's 150 MiB
    for _ in range(workers):
        add_loopback_node(c, cpus_per_node, store_bytes)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=log_to_driver, logging_level="WARNING")
    return c
