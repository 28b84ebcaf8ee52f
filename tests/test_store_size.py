"""How much object store a node needs for the run's snapshots, and the warning when it has less
(pure: ``ray.nodes()``-shaped dicts, no Ray)."""

from elastic_llm.config import load_config
from elastic_llm.pipeline.memory import SNAPSHOT_BYTES_PER_PARAM, SNAPSHOT_VERSIONS_HELD
from elastic_llm.runtime.session import NODE_STORE_BYTES, node_store_bytes, snapshot_store_bytes, store_warnings
from elastic_llm.shape import count_parameters

MIB = 1 << 20


def node(i, store, cpus=1.0, alive=True):
    return {"NodeID": f"{i:02d}" + "ab" * 27, "Alive": alive, "Resources": {"CPU": cpus, "object_store_memory": store}}


def test_the_estimate_follows_the_state_the_nodes_and_the_versions_held():
    cfg = load_config(None, ["parallel.stages=4", "snapshot.group_size=4", "snapshot.parity=1"])
    state = SNAPSHOT_BYTES_PER_PARAM * count_parameters(cfg.model.shape())
    # 4 nodes: a quarter of the state each, a third more for parity (1 of 3 data nodes; the peers'
    # chunks it encodes never land in the object store), 4 versions (2 in flight, committed, pinned)
    assert snapshot_store_bytes(cfg, 4) == int(state / 4 * (1 + 1 / 3) * 4)
    assert snapshot_store_bytes(cfg, 8) == snapshot_store_bytes(cfg, 4)  # no finer than a stage per node
    assert snapshot_store_bytes(cfg, 1) == int(state * 4)  # one node: no parity group
    two = load_config(None, ["parallel.stages=4", "snapshot.parity=2"])
    assert snapshot_store_bytes(two, 4) > snapshot_store_bytes(cfg, 4)
    assert snapshot_store_bytes(load_config(None, ["snapshot.enabled=false"]), 4) == 0


def test_a_node_too_small_for_its_snapshots_is_named_with_the_fix():
    cfg = load_config(None, ["parallel.stages=4"])
    need = snapshot_store_bytes(cfg, 3)
    nodes = [node(0, 64 * MIB), node(1, NODE_STORE_BYTES), node(2, NODE_STORE_BYTES), node(3, 10, cpus=0), node(4, 10, alive=False)]
    (warning,) = store_warnings(cfg, nodes)  # the head (no CPU) and a dead node are not counted
    assert warning.startswith(f"node {nodes[0]['NodeID'][:12]}'s object store holds 64 MiB")
    assert f"--object-store-memory={need}" in warning and "add nodes" in warning
    assert need < NODE_STORE_BYTES  # the loopback nodes' size holds the default model's snapshots
    assert snapshot_store_bytes(load_config(None, ["parallel.stages=4"]), 1) > 150 * MIB  # Cluster.add_node's default does not


def test_the_versions_held_are_the_coordinators():
    from elastic_llm.snapshot.coordinator import MAX_INFLIGHT

    assert SNAPSHOT_VERSIONS_HELD == MAX_INFLIGHT + 2  # in flight, the committed one, one pinned by a flush


def test_a_loopback_node_gets_the_store_its_snapshots_need():
    """Soak, replay and test clusters size their nodes with node_store_bytes: never below
    NODE_STORE_BYTES, and above it for a model whose snapshots would not fit."""
    small = load_config(None, ["parallel.stages=4"])
    assert node_store_bytes(small, 4) == NODE_STORE_BYTES
    big = load_config(None, ["model.dim=1024", "model.n_layers=8", "parallel.stages=4"])
    assert node_store_bytes(big, 4) == snapshot_store_bytes(big, 4) > NODE_STORE_BYTES
