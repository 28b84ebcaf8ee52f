"""Chaos's in-step node removals (no Ray: a stand-in cluster and step executor): the removal runs
beside the driver, which goes on noticing the failure, and is over before a recovery observes."""

import threading
from types import SimpleNamespace

import pytest

from elastic_llm.chaos import Chaos, ChaosExecutor, FaultTargets
from elastic_llm.config import load_config
from elastic_llm.pipeline.plan import FaultAction
from elastic_llm.snapshot.records import ShardKey

from .conftest import REPO


class SlowCluster:
    """A test cluster whose node removal waits until ``release`` is set (or raises ``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.worker_nodes = [SimpleNamespace(node_id="node-a"), SimpleNamespace(node_id="node-b")]
        self.release = threading.Event()
        self.removed: list[str] = []
        self.error = error

    def remove_node(self, node, allow_graceful=True):
        assert not allow_graceful
        assert self.release.wait(10)
        if self.error is not None:
            raise self.error
        self.removed.append(node.node_id)
        self.worker_nodes.remove(node)


class Inner:
    """The real executor's calls as the chaos executor makes them; ``finish`` fails the step."""

    def __init__(self) -> None:
        self.planned = None
        self.settled = False

    def start(self, step, x, y, snapshot=None, faults=None):
        self.planned = dict(faults or {})
        return "pending"

    def finish(self, pending, timeout=None):
        raise RuntimeError("step 2, stage 1 replica 0 failed: its actor died")

    def settle(self):
        self.settled = True


def chaos_run(cluster, events="[{step: 2, kill: node, stage: 1}]"):
    cfg = load_config(f"{REPO}/jobs/tiny.yaml", [f"chaos.events={events}"])
    chaos = Chaos(cfg, cluster)
    chaos.ray_lists_alive = lambda node: node not in cluster.removed  # Ray's view follows the removal at once
    lines = []
    group = SimpleNamespace(nodes={ShardKey(s, 0): f"node-{'ab'[s % 2]}" for s in range(4)})
    targets = FaultTargets(group=group, snapshots=None, metrics=SimpleNamespace(emit=lines.append))
    inner = Inner()
    return ChaosExecutor(inner, chaos, lambda: targets), inner, lines


def test_a_node_removal_runs_beside_the_driver_and_is_over_before_the_recovery_observes():
    cluster = SlowCluster()
    ex, inner, lines = chaos_run(cluster)
    assert ex.start(2, None, None) == "pending"  # returned while the node is still being removed
    assert inner.planned[ShardKey(1, 0)].action is FaultAction.HOLD  # the victim waits at its op
    assert [ln.kill for ln in lines] == ["node"] and cluster.removed == []
    with pytest.raises(RuntimeError, match="its actor died"):
        ex.finish("pending")  # the failure is noticed while the removal is under way
    assert cluster.removed == []
    cluster.release.set()
    ex.settle()  # the recovery's first look: the removal is over
    assert cluster.removed == ["node-b"] and inner.settled and ex.chaos.removals == []


def test_two_removals_of_one_step_go_one_after_the_other_and_an_error_reaches_the_driver():
    cluster = SlowCluster()
    ex, _, lines = chaos_run(cluster, "[{step: 2, kill: node, stage: 0}, {step: 2, kill: node, stage: 1}]")
    ex.start(2, None, None)
    cluster.release.set()
    ex.settle()
    assert cluster.removed == ["node-a", "node-b"] and len(lines) == 2
    broken = SlowCluster(error=RuntimeError("raylet would not die"))
    ex, _, _ = chaos_run(broken)
    ex.start(2, None, None)
    broken.release.set()
    with pytest.raises(RuntimeError, match="raylet would not die"):
        ex.settle()
    ex.settle()  # raised once: nothing is left under way


def test_a_resize_strike_fires_in_the_first_grow_after_its_step_on_the_joining_replicas_node():
    """``during: resize`` fires once, at the first ``resize`` point at or after its step (when a
    grow comes is the cluster's business), and removes the node of the joining (last) replica's stage."""
    cluster = SlowCluster()
    cluster.release.set()
    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["chaos.events=[{step: 3, kill: node, stage: 1, during: resize}]"])
    chaos = Chaos(cfg, cluster)
    chaos.ray_lists_alive = lambda node: node not in cluster.removed
    lines = []
    group = SimpleNamespace(width=2, nodes={ShardKey(0, 0): "node-a", ShardKey(1, 0): "node-a", ShardKey(0, 1): "node-a", ShardKey(1, 1): "node-b"})
    targets = FaultTargets(group=group, snapshots=None, metrics=SimpleNamespace(emit=lines.append))
    assert chaos.due("in_step", 3) == [] and chaos.due("recovery", 3) == []
    chaos.fire("resize", 2, targets)  # a grow before the event's step
    assert cluster.removed == []
    chaos.fire("resize", 5, targets)  # the first grow after it
    assert cluster.removed == ["node-b"] and [(ln.kill, ln.during) for ln in lines] == [("node", "resize")]
    chaos.fire("resize", 6, targets)  # once
    assert cluster.removed == ["node-b"]


def test_partition_and_node_events_without_a_harness_or_test_cluster_are_refused_with_the_fix(monkeypatch):
    from elastic_llm.config import ConfigError

    monkeypatch.delenv("ELASTIC_LLM_LAB", raising=False)
    cut = load_config(f"{REPO}/jobs/tiny.yaml", ["chaos.events=[{step: 3, kill: partition, stage: 1}]"])
    with pytest.raises(ConfigError, match=r"kill: partition or heal need the multi-host harness .*run the driver on one of its hosts"):
        Chaos(cut)
    gone = load_config(f"{REPO}/jobs/tiny.yaml", ["chaos.events=[{step: 3, kill: node, stage: 1}]"])
    with pytest.raises(ConfigError, match=r"kill: node need a test cluster .* or the multi-host harness"):
        Chaos(gone)
    monkeypatch.setenv("ELASTIC_LLM_LAB", "/nonexistent/lab.json")  # a harness named but not there
    with pytest.raises(ConfigError, match="kill: partition or heal need the multi-host harness"):
        Chaos(cut)


def test_a_partition_event_may_name_a_node_by_index():
    load_config(f"{REPO}/jobs/tiny.yaml", ["chaos.events=[{step: 3, kill: partition, node: 1}]"])  # no ConfigError
