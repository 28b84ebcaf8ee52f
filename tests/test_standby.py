"""Pure parts of warm standbys, per-stage drain moves and the span tracer (no Ray)."""

from dataclasses import replace

import pytest

from elastic_llm.controller.elastic import Move, drain_moves
from elastic_llm.runtime.standby import AUTO_MAX, standby_target
from elastic_llm.ops.status import parse_name
from elastic_llm.recovery.policy import Member, Observation, RecoveryPolicy
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.spans import Spans

NODES = ("n0", "n1", "n2", "n3")


def observation(dead=(), dead_nodes=(), dp=1, standbys=(), bundles=(), anywhere=True, unplaceable=(), min_width=1):
    members = tuple(
        Member(s, r, NODES[s], (s, r) not in dead, None if (s, r) in dead else 5) for r in range(dp) for s in range(4)
    )
    shard_nodes = tuple((ShardKey(m.stage, m.replica), m.node) for m in members)
    return Observation(
        members, frozenset(dead_nodes), frozenset(dead_nodes), 5, shard_nodes, (NODES,), 1, min_width=min_width,
        unplaceable=frozenset(unplaceable), standbys=tuple(standbys), bundle_nodes=tuple(bundles), standby_anywhere=anywhere,
    )


def test_a_lost_actor_adopts_the_standby_of_the_node_its_bundle_is_on():
    plan = RecoveryPolicy().decide(observation(dead={(1, 0)}, standbys=[("n1", 1)], bundles=[(ShardKey(1, 0), "n1")]))
    (a,) = plan.actions
    assert (a.source, a.adopt) == ("local_smp", "n1")
    assert "standby on n1" in str(plan)


def test_no_standby_there_means_a_new_process_and_the_plan_says_so():
    plan = RecoveryPolicy().decide(observation(dead={(1, 0)}, standbys=[("n2", 1)], bundles=[(ShardKey(1, 0), "n1")]))
    assert plan.actions[0].adopt is None and "new process" in str(plan)


def test_one_standby_serves_one_actor():
    bundles = [(ShardKey(1, 0), "n1"), (ShardKey(2, 0), "n1")]
    plan = RecoveryPolicy().decide(observation(dead={(1, 0), (2, 0)}, standbys=[("n1", 1)], bundles=bundles))
    assert [a.adopt for a in plan.actions] == ["n1", None]


def test_an_unplaced_bundle_adopts_nothing():
    plan = RecoveryPolicy().decide(observation(dead={(1, 0)}, dead_nodes={"n1"}, standbys=[("n2", 1)]))
    assert plan.actions[0].source == "parity" and plan.actions[0].adopt is None


def test_gpu_standbys_without_a_device_adopt_only_where_the_dead_actor_lived():
    # node n1 died, the bundle was re-placed on n2 which has a standby: a device-less standby cannot serve there
    gone = observation(dead={(1, 0)}, dead_nodes={"n1"}, standbys=[("n2", 1)], bundles=[(ShardKey(1, 0), "n2")], anywhere=False)
    assert RecoveryPolicy().decide(gone).actions[0].adopt is None
    assert RecoveryPolicy().decide(replace(gone, standby_anywhere=True)).actions[0].adopt == "n2"
    same = observation(dead={(1, 0)}, standbys=[("n1", 1)], bundles=[(ShardKey(1, 0), "n1")], anywhere=False)
    assert RecoveryPolicy().decide(same).actions[0].adopt == "n1"  # the dead process's device is free there


def test_after_a_shrink_standbys_follow_the_renumbered_replicas():
    # replica 0 loses stage 2 (unplaceable) and is dropped; replica 1 (now 0) lost stage 2 too (so
    # no survivor of replica 0 can take its place), with a standby where it starts
    o = observation(dead={(2, 0), (2, 1)}, dp=3, standbys=[("n2", 1)], bundles=[(ShardKey(2, 1), "n2")], unplaceable={0})
    plan = RecoveryPolicy().decide(o)
    assert plan.drop_replicas == (0,) and plan.borrow == ()
    assert [(a.stage, a.replica, a.adopt) for a in plan.actions] == [(2, 0, "n2")]


def test_after_a_drop_a_lost_actor_without_a_reservation_adopts_a_standby_where_the_drop_freed_a_slot():
    """Replicas 0 and 1 of 3 each lost stage 2, no slot is free: replica 1 is dropped, and replica 0's
    stage 2 starts in a slot it freed, on the node whose standby is ready (not on n0, whose
    standby is gone), so the standby there becomes it instead of a new process."""
    from dataclasses import replace

    o = replace(observation(dead={(2, 0), (2, 1)}, dp=3, standbys=[("n1", 1)], bundles=[]), free_slots=0)
    plan = RecoveryPolicy().decide(o)
    assert plan.drop_replicas == (1,)
    assert [(a.stage, a.replica, a.adopt) for a in plan.actions] == [(2, 0, "n1")]


@pytest.mark.parametrize(
    "setting,failures,elapsed,nodes,start,want",
    [(0, 9, 10.0, 2, 3.0, 0), (2, 0, 0.0, 0, 0.0, 2), ("auto", 0, 100.0, 4, 3.0, 1), ("auto", 4, 100.0, 4, 3.0, 1),
     ("auto", 15, 100.0, 1, 5.0, 2), ("auto", 40, 100.0, 4, 3.0, 1), ("auto", 10_000, 1.0, 1, 5.0, AUTO_MAX)],
)
def test_standby_target(setting, failures, elapsed, nodes, start, want):
    assert standby_target(setting, failures, elapsed, nodes, start) == want


def test_drain_moves_prefers_just_the_stages_when_there_is_room_for_them():
    assert drain_moves({0: 1}, 4, 1, False) == {0: Move.STAGES}
    assert drain_moves({0: 4}, 4, 4, False) == {0: Move.REPLICA}  # every stage: a whole replica is no dearer
    assert drain_moves({0: 2}, 4, 8, True) == {0: Move.REPLICA}  # a started spare: nothing to start
    assert drain_moves({0: 2}, 4, 1, False) == {0: Move.STAY}  # no room: it trains on until its node goes
    # room is shared out in replica order
    assert drain_moves({0: 2, 1: 2}, 4, 3, False) == {0: Move.STAGES, 1: Move.STAY}


def test_a_burst_of_notices_drops_no_replica_at_the_notice():
    """16 replicas of 64 stages, 12 of them with actors on draining nodes and no free slot: every
    one of them trains on until its nodes go (the first rule dropped all 12: the simulated fleet
    went 15 -> 1); the recovery then drops the fewest that make room for the others."""
    on = {r: 4 + (r % 3) for r in range(12)}  # 4-6 actors each on the draining nodes
    assert set(drain_moves(on, 64, 0, False).values()) == {Move.STAY}


def test_spans_sum_per_name_and_count_a_nested_span_once():
    s = Spans()
    with s.span("state"):
        with s.span("state"):
            pass
    with s.span("actor"):
        pass
    t = s.totals(0.0)
    assert set(t) == {"state_s", "actor_s"} and len(s.records) == 2
    assert s.totals(float("inf")) == {}


def test_status_finds_standbys_by_their_names():
    assert parse_name("standby-0a1b2c-0123456789ab.7") == ("standby", "0a1b2c")
    assert parse_name("standby-0a1b2c-xyz.7") is None


def test_after_a_drop_a_lost_actor_may_adopt_a_standby_on_a_node_with_a_free_slot():
    """As above, but the only ready standby is on n9, which has a free slot (one slot is not
    room for both lost actors, so a replica still goes): the kept lost actor starts there."""
    from dataclasses import replace

    o = replace(observation(dead={(2, 0), (2, 1)}, dp=3, standbys=[("n9", 1)], bundles=[]), free_slots=1, free_nodes=(("n9", 1),))
    plan = RecoveryPolicy().decide(o)
    assert plan.drop_replicas == (1,)
    assert [(a.stage, a.replica, a.adopt) for a in plan.actions] == [(2, 0, "n9")]
