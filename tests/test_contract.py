"""The contract suite: every scenario of :mod:`tests.contract` (join, drop, borrow and merge, a
stage spare's install, a spare whose node went, a drain, a reclaim with and without notice, a
suspect node) on the simulated runtime's primitives and on the Ray runtime's on a loopback
cluster (real actors, real node removals and drains, the driver's real node watch), and the
controller's run through a drain that moves one stage on each runtime, each held to the same
facts: the same membership and the same failure-budget charges.

A suspect on the loopback cluster: every node shares one address there, so no packet to one
node alone can be dropped (the namespaced harness of issue 51 will); the Ray side cuts a node off
at the one place the driver reaches it by network of its own, the node watch's probe, whose
connections to that node's raylet then time out (the probe's seam, ``NodeWatch.probe``, the
rest real). The simulated side plays ``cut`` and ``heal`` on its fleet. The one intended difference, that a simulated cloud can say which
removals were reclaims (``elastic-llm simulate``'s default, ``SimNodes.reclaims_known``), is a
named option, tested here by what it changes and nothing else.

One loopback ``Cluster`` (a head without CPUs and six worker nodes of one CPU: one stage actor
each) is shared by the module's Ray scenarios; the nodes a scenario removes are replaced before
the next one.
"""

from __future__ import annotations

import itertools
import time

import pytest
import ray

from elastic_llm.controller.drains import Outcome
from elastic_llm.controller.ports import StageActors
from elastic_llm.controller.trainer import Trainer
from elastic_llm.replay.trace import ReplayAction
from elastic_llm.runtime.drains import request_drain
from elastic_llm.runtime.liveness import RayNodeTable, tcp_probe
from elastic_llm.runtime.ray_runtime import RayRuntime, ray_trainer
from elastic_llm.sim.costs import load_costs
from elastic_llm.sim.runtime import SimRuntime
from elastic_llm.sim.world import Charged, Fleet, SimClock, World

from .conftest import loopback_cluster_fixture, top_up, wait_until
from .contract import EXPECTED, EXPECTED_RUNS, RUNS, SCENARIOS, WORKERS, Side, contract_config

pytestmark = pytest.mark.timeout(300)
RUN_IDS = (f"c0{i:04x}" for i in itertools.count())


def started(g: StageActors) -> StageActors:
    """``g`` placed and its actors started."""
    g.placement.place()
    g.spawn_all()
    return g


def watch(side: Side) -> None:
    """The driver's node watch, as a run starts it (``recovery.node_probe_*``)."""
    rc = contract_config().recovery
    side.nodes.start(rc.node_probe_s, rc.node_probe_failures, rc.node_probe_declare)  # type: ignore[attr-defined]  # both runtimes' Nodes have it


class SimSide:
    """The simulated runtime on six nodes of one slot; its clock moves half a second per look."""

    name = "simulated"

    def __init__(self, reclaims_known: bool = False, corpus: str = "") -> None:
        self.clock = SimClock()
        self.corpus = corpus
        self.fleet = Fleet(self.clock, tuple(f"n{i}" for i in range(WORKERS)), (), 1)
        self.rt = SimRuntime(World(self.clock, self.fleet, load_costs("cpu-2core"), Charged()), reclaims_known=reclaims_known)
        self.nodes = self.rt.nodes
        watch(self)

    def group(self) -> StageActors:
        return started(self.rt.group(contract_config(), next(RUN_IDS), None))

    def trainer(self, out) -> Trainer:
        return Trainer(contract_config(f"data.dir={self.corpus}"), self.rt, metrics_out=out / "metrics.jsonl")

    def remove(self, node: str) -> None:
        self.fleet.play(ReplayAction(self.clock.now, "remove", node))

    def drain(self, node: str, seconds: float) -> None:
        self.fleet.play(ReplayAction(self.clock.now, "drain", node, seconds))

    def cut(self, node: str) -> None:
        self.fleet.play(ReplayAction(self.clock.now, "cut", node))

    def heal(self, node: str) -> None:
        self.fleet.play(ReplayAction(self.clock.now, "heal", node))

    def until(self, done, what: str) -> None:
        for _ in range(1200):  # 600 simulated seconds
            if done():
                return
            self.clock.sleep(0.5)
        raise AssertionError(f"{what}: not within 600 simulated seconds")

    end = staticmethod(lambda group: group.shutdown())


class RaySide:
    """The Ray runtime's primitives on the module's loopback cluster, its node watch running."""

    name = "ray"

    def __init__(self, cluster, corpus: str = "") -> None:
        self.cluster = cluster
        self.corpus = corpus
        self.rt = RayRuntime(contract_config(), cluster=cluster)
        self.nodes = self.rt.nodes
        self.cut_off: set[tuple[str, int]] = set()  # raylet addresses whose probes time out
        watch(self)
        assert self.nodes.watch is not None
        self.nodes.watch.probe = self._probe

    def _probe(self, host: str, port: int, timeout: float) -> Outcome:
        if (host, port) in self.cut_off:
            time.sleep(timeout)  # what a connection to a machine that answers nothing does
            return Outcome.TIMEOUT
        return tcp_probe(host, port, timeout)

    def group(self) -> StageActors:
        return started(self.rt.group(contract_config(), next(RUN_IDS), None))

    def trainer(self, out) -> Trainer:
        return ray_trainer(contract_config(f"data.dir={self.corpus}"), cluster=self.cluster, metrics_out=out / "metrics.jsonl")

    def remove(self, node: str) -> None:
        self.cluster.remove_node(next(n for n in self.cluster.worker_nodes if n.node_id == node), allow_graceful=False)
        wait_until(lambda: node not in self.nodes.alive(), 60, f"Ray seeing node {node[:12]} gone")

    def drain(self, node: str, seconds: float) -> None:
        request_drain(node, seconds, "contract suite")

    def cut(self, node: str) -> None:
        self.cut_off.add(RayNodeTable().workers()[node])

    def heal(self, node: str) -> None:
        self.cut_off.discard(RayNodeTable().workers()[node])

    def until(self, done, what: str) -> None:
        wait_until(done, 120, what)

    def stop(self) -> None:
        self.nodes.stop()

    end = staticmethod(lambda group: group.shutdown())


def play(side: Side, name: str) -> dict[str, object]:
    g = side.group()
    try:
        assert g.width == 2 and g.ready == set(g.keys()) and len(set(g.nodes.values())) == 4  # one actor per node, as the scenarios assume
        return SCENARIOS[name](side, g)
    finally:
        side.end(g)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_simulated_runtime_keeps_the_contract(name):
    assert play(SimSide(), name) == EXPECTED[name]


def test_the_simulations_named_option_says_removals_were_reclaims_and_changes_only_that():
    """``reclaims_known`` (simulate's default): a node removed without notice is a reclaim, so
    the failure it causes is not charged; a process dying on a live node still is."""
    got = play(SimSide(reclaims_known=True), "reclaim_without_notice")
    assert got == {**EXPECTED["reclaim_without_notice"], "reclaimed": True, "charged": False}
    for name in ("drain_then_reclaim", "join", "borrow_and_merge"):
        assert play(SimSide(reclaims_known=True), name) == EXPECTED[name]


cluster = loopback_cluster_fixture(WORKERS, 1)


@pytest.fixture
def ray_side(cluster, corpus_dir):
    top_up(cluster, WORKERS, 1, exact=True)
    side = RaySide(cluster, corpus_dir)
    yield side
    side.stop()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_ray_runtime_keeps_the_contract(ray_side, name):
    assert ray.is_initialized()
    assert play(ray_side, name) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_controller_on_the_simulated_runtime_keeps_the_contract(name, corpus_dir, tmp_path):
    assert RUNS[name](SimSide(corpus=corpus_dir), tmp_path) == EXPECTED_RUNS[name]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_controller_on_the_ray_runtime_keeps_the_contract(ray_side, name, tmp_path):
    assert RUNS[name](ray_side, tmp_path) == EXPECTED_RUNS[name]


def test_asking_about_a_spare_places_and_starts_nothing_tend_does():
    """A spare replica started with no room waits unplaced however often it is asked about (the
    elastic look's view is built from these queries); once room is there, the one explicit
    ``tend`` places it, and its processes start from then."""
    side = SimSide()
    g = side.group()
    first = g.spares.start()  # takes the two free slots
    waiting = g.spares.start()  # no room left
    assert len(g.spares.nodes(first)) == 2 and not g.spares.nodes(waiting)
    g.spares.cancel(first)  # room again
    for _ in range(5):
        assert not g.spares.ready(waiting) and not g.spares.nodes(waiting) and g.spares.replicas() == [waiting]
        side.clock.sleep(10.0)
    g.spares.tend()
    assert len(g.spares.nodes(waiting)) == 2 and not g.spares.ready(waiting)
    side.until(lambda: g.spares.ready(waiting), "the spare started")
    assert g.spares.age(waiting) >= 50.0
