"""The membership table both runtimes keep (:mod:`elastic_llm.controller.membership`): each
change moves every column with its key, renumbers in order, and tells the runtime each change
of a key's node. Pure: no Ray, no simulation."""

from __future__ import annotations

from collections import Counter

from elastic_llm.controller.membership import Membership
from elastic_llm.snapshot.records import ShardKey as K


def table(width=3, stages=2):
    """``width`` replicas of ``stages`` stages, replica r's stage s on node ``n{r}{s}``, all
    ready, a handle and a pid per key; and the per-node counts the ``on_host`` calls keep."""
    counts: Counter[str] = Counter()

    def count(old, new):
        if old is not None:
            counts[old] -= 1
        if new is not None:
            counts[new] += 1

    m = Membership(stages, width, on_host=count)
    handles, pids = m.column(), m.column()
    for k in m.keys():
        m.host(k, f"n{k.replica}{k.stage}")
        m.ready.add(k)
        handles[k], pids[k] = f"actor-{k.replica}{k.stage}", 100 * k.replica + k.stage
    return m, handles, pids, counts


def test_dropping_a_middle_replica_renumbers_the_later_ones_in_order_with_every_column():
    m, handles, pids, counts = table()
    assert m.drop_replicas([1]) == {0: 0, 2: 1}
    assert m.width == 2 and m.keys() == [K(0, 0), K(1, 0), K(0, 1), K(1, 1)]
    assert m.nodes == {K(0, 0): "n00", K(1, 0): "n01", K(0, 1): "n20", K(1, 1): "n21"}
    assert dict(handles) == {K(0, 0): "actor-00", K(1, 0): "actor-01", K(0, 1): "actor-20", K(1, 1): "actor-21"}
    assert pids[K(1, 1)] == 201 and m.ready == set(m.keys())
    assert +counts == Counter(m.nodes.values())  # the dropped replica's nodes were let go


def test_dropping_several_replicas_at_once_keeps_the_rest_in_their_order():
    m, handles, _, counts = table(width=4)
    assert m.drop_replicas([0, 2]) == {1: 0, 3: 1}
    assert [handles[K(0, r)] for r in range(m.width)] == ["actor-10", "actor-30"]
    assert +counts == Counter(m.nodes.values())


def test_a_borrowed_actor_takes_the_lost_keys_place_with_its_node_columns_and_readiness():
    m, handles, pids, counts = table()
    m.forget(K(1, 0))  # stage 1 of replica 0 was lost
    m.borrow([(K(1, 2), K(1, 0))])  # replica 2 gives its stage 1, and is dropped next
    assert m.nodes[K(1, 0)] == "n21" and handles[K(1, 0)] == "actor-21" and pids[K(1, 0)] == 201 and K(1, 0) in m.ready
    assert K(1, 2) not in m.nodes and K(1, 2) not in handles and K(1, 2) not in m.ready
    assert counts["n01"] == 0 and +counts == Counter(m.nodes.values())  # the lost actor's node hosts nothing now
    assert m.drop_replicas([2]) == {0: 0, 1: 1}
    assert m.nodes[K(1, 0)] == "n21" and m.width == 2 and +counts == Counter(m.nodes.values())


def test_a_stage_spare_installed_by_a_drain_is_ready_and_one_in_a_lost_keys_place_is_fresh_until_replaced():
    m, _, _, counts = table()
    m.install(K(0, 1), "spare-a")  # a drain's swap: it has the old actor's state
    assert m.nodes[K(0, 1)] == "spare-a" and K(0, 1) in m.ready and K(0, 1) not in m.fresh
    m.forget(K(1, 2))
    m.install(K(1, 2), "spare-b", up_at=12.5)  # late for the move: it takes the lost key's place with no state
    assert m.fresh == {K(1, 2): 12.5} and K(1, 2) not in m.ready
    assert m.drop_replicas([0]) == {1: 0, 2: 1}
    assert m.fresh == {K(1, 1): 12.5} and m.nodes[K(0, 0)] == "spare-a"
    assert +counts == Counter(m.nodes.values())


def test_a_spare_replica_joins_as_the_last_and_replicas_on_nodes_sees_it():
    m, handles, _, counts = table(width=2)
    r = m.add_replica(["x", "y"])
    assert r == 2 and m.width == 3 and {K(0, 2), K(1, 2)} <= m.ready
    assert m.replicas_on(["y", "n00"]) == [0, 2] and K(0, 2) not in handles  # its handles are the runtime's to add
    assert +counts == Counter(m.nodes.values())


def test_a_change_keeps_the_tables_a_reader_holds():
    m, _, _, _ = table()
    node_of, ready = m.nodes.get, m.ready  # as an executor holds node_of
    m.drop_replicas([0])
    assert node_of(K(0, 0)) == "n10" and ready is m.ready and K(0, 2) not in ready
