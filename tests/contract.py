"""The contract both runtimes' primitives keep, as scenarios run the same way on each.

A scenario drives one runtime's stage actors (:class:`~elastic_llm.controller.ports.StageActors`
and its small ports) and nodes (:class:`~elastic_llm.controller.ports.Nodes`) through a
:class:`Side` (a loopback Ray cluster, or a simulated fleet), or (:data:`RUNS`) the controller
itself training on that runtime, and returns what it observed as plain facts: the width, who is ready, where a key went relative to where things were, what is
charged to the failure budget. ``tests/test_contract.py`` runs every scenario on both sides and
asserts each side's facts equal :data:`EXPECTED` (so equal each other). Node ids differ between
the runtimes (and Ray places bundles its own way), so the facts are relations: "the key now runs
where the giver ran", never a node id.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from elastic_llm.config import RunConfig, load_config
from elastic_llm.controller.ports import Nodes, StageActors
from elastic_llm.controller.trainer import Trainer
from elastic_llm.recovery.failure import StepFailure, reclaims_behind
from elastic_llm.snapshot.records import ShardKey as K

from .conftest import REPO

SHAPE = ["model.dim=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=2", "parallel.stages=2", "parallel.dp=2",
         "parallel.microbatches=2", "parallel.cpus_per_actor=1", "parallel.placement_strategy=SPREAD", "train.batch_size=4",
         "train.eval_every=0", "snapshot.enabled=false", "recovery.standby=0", "recovery.driver_grace_s=0"]
WORKERS = 6  # one slot each: the width's 4 actors and 2 free slots


def contract_config(*extra: str) -> RunConfig:
    return load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [*SHAPE, *extra])


class Side(Protocol):
    """One runtime as the scenarios drive it."""

    name: str
    nodes: Nodes

    def group(self) -> StageActors: ...  # a fresh width-2 group of 2 stages, placed and started, one actor per node
    def remove(self, node: str) -> None: ...  # the node goes now, without notice; returns once the runtime sees it gone
    def drain(self, node: str, seconds: float) -> None: ...  # a notice: the node goes in ``seconds``
    def until(self, done: Callable[[], bool], what: str) -> None: ...  # wait (Ray: real time, bounded; simulated: the clock moves)
    def cut(self, node: str) -> None: ...  # the driver can no longer reach the node (it lives: hung, or cut off by the network)
    def heal(self, node: str) -> None: ...  # the driver reaches it again
    def end(self, group: StageActors) -> None: ...  # shut the group down
    def trainer(self, out: Path) -> Trainer: ...  # the controller on this runtime, on the contract's shape and the built-in corpus


def charged(side: Side, group: StageActors, key: K) -> bool:
    """Whether a step failing at ``key`` now is charged to the failure budget (no reclaim explains it)."""
    failure = StepFailure(1, key.stage, key.replica, "ActorDiedError: contract")
    return not reclaims_behind(failure, group.nodes, side.nodes.reclaimed(), side.nodes.alive)


def join(side: Side, g: StageActors) -> dict[str, object]:
    """A spare replica is started, tended until ready and adopted as the last replica."""
    spare = g.spares.start()
    side.until(lambda: (g.spares.tend(), g.spares.ready(spare))[1], "the spare replica")
    before = set(g.nodes.values())
    r = g.resize.adopt(spare)
    g.resize.set_width()
    new = {g.nodes[K(s, r)] for s in range(g.stages)}
    return {"index": r, "width": g.width, "all_ready": g.ready == set(g.keys()), "spares_left": len(g.spares.replicas()),
            "new_nodes": len(new), "on_free_nodes": not new & before}


def drop(side: Side, g: StageActors) -> dict[str, object]:
    """Replica 0 is dropped: replica 1 becomes replica 0, on the nodes it ran on."""
    was = {s: g.nodes[K(s, 1)] for s in range(g.stages)}
    renumbered = g.resize.drop_replicas([0])
    g.resize.set_width()
    return {"renumbered": renumbered, "width": g.width, "kept_nodes": all(g.nodes[K(s, 0)] == n for s, n in was.items()),
            "all_ready": g.ready == set(g.keys())}


def borrow_and_merge(side: Side, g: StageActors) -> dict[str, object]:
    """Stage 1 of replica 0 is lost; replica 1 gives its stage 1 and is dropped: one whole replica."""
    giver_node = g.nodes[K(1, 1)]
    g.kill(K(1, 0))
    g.resize.borrow([(K(1, 1), K(1, 0))])
    renumbered = g.resize.drop_replicas([1])
    g.resize.set_width()
    return {"renumbered": renumbered, "width": g.width, "taker_where_giver_ran": g.nodes[K(1, 0)] == giver_node,
            "all_ready": g.ready == set(g.keys())}


def stage_spare_install(side: Side, g: StageActors) -> dict[str, object]:
    """A stage spare for stage 0 of replica 0 starts off its node and is swapped in with its state."""
    old = g.nodes[K(0, 0)]
    spare = g.spares.start(K(0, 0), frozenset({old}))
    side.until(lambda: (g.spares.tend(frozenset({old})), g.spares.ready(spare))[1], "the stage spare")
    where = g.spares.nodes(spare)
    g.resize.swap_in([spare])
    return {"moved": g.nodes[K(0, 0)] != old, "on_spare_node": {g.nodes[K(0, 0)]} == set(where), "spares_left": len(g.spares.of()),
            "all_ready": g.ready == set(g.keys()), "width": g.width}


def spare_whose_node_went(side: Side, g: StageActors) -> dict[str, object]:
    """A stage spare is placed, then its node goes before it is tended: tending starts it over
    elsewhere (off the node, and off the nodes to avoid) and it becomes ready."""
    home = g.nodes[K(1, 0)]
    avoid = frozenset({home})
    spare = g.spares.start(K(1, 0), avoid)
    side.until(lambda: bool(g.spares.nodes(spare)), "the stage spare placed")
    [gone] = g.spares.nodes(spare)
    side.remove(gone)
    side.until(lambda: (g.spares.tend(avoid), g.spares.ready(spare) and bool(g.spares.nodes(spare)) and gone not in g.spares.nodes(spare))[1],
               "the stage spare started over")
    where = g.spares.nodes(spare)
    g.spares.cancel(spare)
    return {"off_the_gone_node": gone not in where, "off_avoided": not where & avoid, "placed": len(where), "spares_left": len(g.spares.of())}


def drain_then_reclaim(side: Side, g: StageActors) -> dict[str, object]:
    """The node of stage 0 replica 0 gets a notice and then goes: it was seen draining, it is a
    reclaim, and the failure its actor's end causes is not charged."""
    node = g.nodes[K(0, 0)]
    side.drain(node, 30.0)
    side.until(lambda: node in side.nodes.draining(), "the drain seen")
    side.remove(node)
    return {"draining_seen": True, "reclaimed": node in side.nodes.reclaimed(), "charged": charged(side, g, K(0, 0)),
            "replicas_on_it": g.replicas_on(frozenset({node}))}


def reclaim_without_notice(side: Side, g: StageActors) -> dict[str, object]:
    """The node of stage 1 replica 1 goes without notice: the node watch's next probe is refused
    (one death), nothing said it was a reclaim, so the failure its actor's end causes is charged
    (a process dying on a live node is charged too)."""
    node = g.nodes[K(1, 1)]
    side.remove(node)
    return {"alive": node in side.nodes.alive(), "reclaimed": node in side.nodes.reclaimed(), "charged": charged(side, g, K(1, 1)),
            "live_process_charged": charged(side, g, K(0, 0)), "deaths": [d.outcome.value for d in side.nodes.deaths() if d.node == node]}


def suspect_node(side: Side, g: StageActors) -> dict[str, object]:
    """The node of stage 0 replica 1 stops answering the driver: after ``node_probe_failures``
    probes in a row time out it is a suspect, and only it; it is still alive, not a reclaim and
    not dead (no death reported), so a failure there is charged; a stage spare placed off the
    nodes to avoid does not go there; once it answers again it is no suspect."""
    node = g.nodes[K(0, 1)]
    side.cut(node)
    side.until(lambda: node in side.nodes.suspects(), "the node suspected")
    avoid = frozenset(side.nodes.suspects())
    spare = g.spares.start(K(0, 1), avoid)
    side.until(lambda: (g.spares.tend(avoid), g.spares.ready(spare))[1], "the stage spare")
    facts: dict[str, object] = {
        "only_it": avoid == {node}, "alive": node in side.nodes.alive(), "reclaimed": node in side.nodes.reclaimed(),
        "deaths": [d.node == node for d in side.nodes.deaths()], "charged": charged(side, g, K(0, 1)), "spare_off_it": node not in g.spares.nodes(spare),
    }
    g.spares.cancel(spare)
    side.heal(node)
    side.until(lambda: node not in side.nodes.suspects(), "the suspicion cleared")
    return {**facts, "cleared": not side.nodes.suspects()}


SCENARIOS: dict[str, Callable[[Side, StageActors], dict[str, object]]] = {
    "join": join, "drop": drop, "borrow_and_merge": borrow_and_merge, "stage_spare_install": stage_spare_install,
    "spare_whose_node_went": spare_whose_node_went, "drain_then_reclaim": drain_then_reclaim, "reclaim_without_notice": reclaim_without_notice,
    "suspect_node": suspect_node,
}

EXPECTED: dict[str, dict[str, object]] = {
    "join": {"index": 2, "width": 3, "all_ready": True, "spares_left": 0, "new_nodes": 2, "on_free_nodes": True},
    "drop": {"renumbered": {1: 0}, "width": 1, "kept_nodes": True, "all_ready": True},
    "borrow_and_merge": {"renumbered": {0: 0}, "width": 1, "taker_where_giver_ran": True, "all_ready": True},
    "stage_spare_install": {"moved": True, "on_spare_node": True, "spares_left": 0, "all_ready": True, "width": 2},
    "spare_whose_node_went": {"off_the_gone_node": True, "off_avoided": True, "placed": 1, "spares_left": 0},
    "drain_then_reclaim": {"draining_seen": True, "reclaimed": True, "charged": False, "replicas_on_it": [0]},
    "reclaim_without_notice": {"alive": False, "reclaimed": False, "charged": True, "live_process_charged": True, "deaths": ["refused"]},
    "suspect_node": {"only_it": True, "alive": True, "reclaimed": False, "deaths": [], "charged": True, "spare_off_it": True, "cleared": True},
}


def drain_moves_its_stage(side: Side, out: Path) -> dict[str, object]:
    """The controller trains on the side's runtime (2 stages x 2 replicas on four of the six
    nodes); after step 4 the node of stage 0 replica 0 gets a 60 s notice, with room for that one
    stage elsewhere. Its stage spare starts, the stage moves at a step boundary before the node
    goes (then the node goes): nothing is rolled back, recovered or charged, and the run keeps its
    width and every step."""
    t = side.trainer(out)
    drained: list[str] = []

    def on_step(rec: dict[str, object]) -> None:
        g = t.group
        if rec["step"] == 4:
            drained.append(g.nodes[K(0, 0)])
            side.drain(drained[0], 60.0)
        if rec["step"] == 5:  # the controller saw the notice at step 4's end and started the stage spare
            side.until(lambda: (g.spares.tend(), bool(g.spares.of()) and all(g.spares.ready(sp) for sp in g.spares.of().values()))[1], "the stage spare")

    try:
        history = t.fit(10, on_step=on_step)
        facts = {"steps": [h["step"] for h in history], "drains": [(d.how, d.moved, d.stayed, d.dropped, d.rollback_steps) for d in t.drains],
                 "recoveries": len(t.recoveries), "charged": t.budget.total, "off_the_node": drained[0] not in t.group.nodes.values(), "width": t.group.width}
    finally:
        t.shutdown()
    side.remove(drained[0])
    return facts


RUNS: dict[str, Callable[[Side, Path], dict[str, object]]] = {"drain_moves_its_stage": drain_moves_its_stage}

EXPECTED_RUNS: dict[str, dict[str, object]] = {
    "drain_moves_its_stage": {"steps": list(range(1, 11)), "drains": [("stages", 1, 0, 0, 0)], "recoveries": 0, "charged": 0, "off_the_node": True, "width": 2},
}
