"""RecoveryPolicy is pure: observations in, plans out."""

from dataclasses import replace

import pytest

from elastic_llm.recovery.policy import Member, Observation, RecoveryPolicy, UnrecoverableError
from elastic_llm.snapshot.records import ShardKey

NODES = ("n0", "n1", "n2", "n3")


def obs(members, dead_nodes=(), dead_smp=(), committed=5, parity=1, groups=(NODES,)):
    shard_nodes = tuple((ShardKey(m.stage, m.replica), m.node) for m in members)
    return Observation(tuple(members), frozenset(dead_nodes), frozenset(set(dead_smp) | set(dead_nodes)), committed, shard_nodes, groups, parity)


def pipeline(step=5, dead=(), dp=1):
    return [Member(s, r, NODES[s], (s, r) not in dead, None if (s, r) in dead else step) for r in range(dp) for s in range(4)]


def test_dead_process_on_live_node_restores_from_local_manager():
    plan = RecoveryPolicy().decide(obs(pipeline(dead={(1, 0)})))
    assert [(a.stage, a.source) for a in plan.actions] == [(1, "local_smp")]
    assert plan.rollback_to == 5 and plan.lost_shards == ()


def test_healthy_stages_ahead_of_snapshot_roll_back():
    plan = RecoveryPolicy().decide(obs(pipeline(step=7, dead={(2, 0)}), committed=6))
    assert plan.rollback_to == 6 and "everyone rolls back" in plan.reason


def test_a_rollback_names_the_survivors_that_restore_from_their_own_copy():
    """Survivors observed to hold the committed version in their own copy restore from it; the
    plan says which, the others (and the lost stage) come through the snapshot managers."""
    held = frozenset({ShardKey(0, 0), ShardKey(2, 0), ShardKey(1, 0)})  # stage 1 is the lost one: its copy went with it
    plan = RecoveryPolicy().decide(replace(obs(pipeline(step=7, dead={(1, 0)}), committed=6), own_copies=held))
    assert plan.rollback_to == 6 and plan.own_copies == (ShardKey(0, 0), ShardKey(2, 0))
    assert "2 survivor(s) from their own copy" in str(plan)
    no_rollback = RecoveryPolicy().decide(replace(obs(pipeline(dead={(3, 1)}, dp=2)), own_copies=held))
    assert no_rollback.rollback_to is None and no_rollback.own_copies == ()  # a peer copy, nobody rolls back


def test_dp_peer_preferred_when_consistent_and_no_rollback():
    members = pipeline(dead={(3, 1)}, dp=2)
    plan = RecoveryPolicy().decide(obs(members))
    assert [(a.stage, a.replica, a.source, a.peer) for a in plan.actions] == [(3, 1, "dp_peer", 0)]
    assert plan.rollback_to is None


def test_lost_node_rebuilds_from_parity():
    members = pipeline(dead={(2, 0)})
    plan = RecoveryPolicy().decide(obs(members, dead_nodes={"n2"}))
    assert [(a.stage, a.source) for a in plan.actions] == [(2, "parity")]
    assert plan.lost_shards == (ShardKey(2, 0),) and plan.rollback_to == 5


def test_two_lost_nodes_need_parity_two():
    members = pipeline(dead={(1, 0), (2, 0)})
    plan = RecoveryPolicy().decide(obs(members, dead_nodes={"n1", "n2"}, parity=2))
    assert {a.source for a in plan.actions} == {"parity"}
    with pytest.raises(UnrecoverableError, match=r"2 nodes \([^)]*\) of an erasure group of 4 lost their snapshots but parity covers 1"):
        RecoveryPolicy().decide(obs(members, dead_nodes={"n1", "n2"}, parity=1))


def test_nothing_committed_is_unrecoverable_with_a_reason():
    with pytest.raises(UnrecoverableError, match="no snapshot has been committed yet"):
        RecoveryPolicy().decide(obs(pipeline(dead={(0, 0)}), committed=None))


def test_inconsistent_steps_roll_back_even_with_peers():
    members = pipeline(step=5, dp=2, dead={(0, 1)})
    members[1] = Member(1, 0, "n1", True, 6)  # finished its optimizer step, others did not
    plan = RecoveryPolicy().decide(obs(members))
    assert plan.rollback_to == 5 and plan.actions[0].source == "local_smp"


# ---------------------------------------------------------------------- elastic width


def elastic_obs(members, dead_nodes=(), min_width=1, unplaceable=(), committed=5):
    return replace(obs(members, dead_nodes=dead_nodes, committed=committed), min_width=min_width, unplaceable=frozenset(unplaceable))


def test_a_replica_that_cannot_be_placed_is_dropped_when_a_whole_one_survives():
    members = pipeline(dead={(1, 1), (2, 1)}, dp=2)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n2"}, unplaceable={1}))
    assert plan.drop_replicas == (1,) and plan.width == (2, 1)
    assert plan.actions == () and plan.rollback_to is None and "dropped, 2 -> 1 replicas" in plan.reason


def test_placeable_losses_are_replaced_not_dropped():
    members = pipeline(dead={(1, 1)}, dp=2)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1"}, unplaceable=()))
    assert plan.drop_replicas == () and [(a.stage, a.replica, a.source) for a in plan.actions] == [(1, 1, "dp_peer")]


def test_never_below_min_replicas():
    members = pipeline(dead={(1, 1)}, dp=2)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1"}, min_width=2, unplaceable={1}))
    assert plan.drop_replicas == () and plan.actions[0].source == "dp_peer"  # the executor then waits for capacity


def test_no_whole_replica_no_shrink():
    members = pipeline(dead={(1, 0), (2, 1)}, dp=2)  # every replica broken
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n2"}, unplaceable={0, 1}))
    assert plan.drop_replicas == ()


def test_with_every_replica_broken_unplaceable_ones_go_while_the_rest_hold_every_stage():
    """A burst of losses across a large fleet leaves no replica whole (the simulated 256-node
    fleet waited for capacity forever on this): replicas that cannot be placed are dropped as
    long as the kept ones hold a live copy of every stage, which their lost actors copy."""
    members = pipeline(dead={(1, 0), (2, 1), (3, 2)}, dp=3)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n2", "n3"}, unplaceable={2}))
    assert plan.drop_replicas == (2,) and plan.width == (3, 2) and plan.rollback_to is None
    assert [(a.stage, a.replica, a.source, a.peer) for a in plan.actions] == [(1, 0, "dp_peer", 1), (2, 1, "dp_peer", 0)]
    # dropping both unplaceable replicas would leave stage 2 without a live copy: only one goes
    both = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n2", "n3"}, unplaceable={1, 2}))
    assert both.drop_replicas == (2,)
    # survivors at different steps: nothing is dropped (peers do not hold the same state)
    from elastic_llm.recovery.policy import replicas_to_drop

    members[0] = Member(0, 0, "n0", True, 6)
    assert replicas_to_drop(elastic_obs(members, dead_nodes={"n1", "n2", "n3"}, unplaceable={2})) == ()


def test_dropping_renumbers_the_rest_and_repairs_them_from_a_peer():
    # width 3: replica 0 loses a stage it cannot place, replica 2 loses one it can place
    members = pipeline(dead={(1, 0), (3, 2)}, dp=3)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n3"}, unplaceable={0}))
    assert plan.drop_replicas == (0,) and plan.width == (3, 2)
    # old replica 2 is now replica 1; its peer old replica 1 is now replica 0
    assert [(a.stage, a.replica, a.source, a.peer) for a in plan.actions] == [(3, 1, "dp_peer", 0)]


def test_only_as_many_dropped_as_min_replicas_allows():
    members = pipeline(dead={(0, 1), (0, 2)}, dp=3)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n0"}, min_width=2, unplaceable={1, 2}))
    assert plan.drop_replicas == (2,) and plan.width == (3, 2)
    assert [(a.stage, a.replica, a.source) for a in plan.actions] == [(0, 1, "dp_peer")]


def test_beyond_parity_with_a_whole_replica_is_a_shrink_not_unrecoverable():
    # replica 1 lost 3 of 4 stages with their nodes (parity 1 cannot rebuild its shards)
    members = [Member(s, r, f"n{r}{s}", not (r == 1 and s < 3), None if (r == 1 and s < 3) else 5) for r in range(2) for s in range(4)]
    dead = {"n10", "n11", "n12"}
    groups = (tuple(f"n{r}{s}" for r in range(2) for s in range(4)),)
    o = Observation(tuple(members), frozenset(dead), frozenset(dead), 5, tuple((ShardKey(m.stage, m.replica), m.node) for m in members), groups, 1, 1, frozenset({1}))
    plan = RecoveryPolicy().decide(o)
    assert plan.drop_replicas == (1,) and plan.rollback_to is None


def test_fewest_drops_is_the_smallest_set_that_makes_room_brute_force():
    """Dropping a broken replica frees the slots of its survivors: the fewest drops that let the
    other replicas' lost actors fit, checked against every subset on small fleets."""
    import itertools
    import random

    from elastic_llm.recovery.policy import fewest_drops

    rng = random.Random(7)
    for _ in range(400):
        stages = rng.randint(2, 6)
        need = {r: rng.randint(1, stages) for r in range(rng.randint(1, 6))}
        free = rng.randint(0, 3 * stages)

        def fits(drop, need=need, stages=stages, free=free):
            return sum(n for r, n in need.items() if r not in drop) <= free + sum(stages - need[r] for r in drop)

        best = min(len(d) for k in range(len(need) + 1) for d in itertools.combinations(need, k) if fits(d))
        got = fewest_drops(need, stages, free)
        assert fits(got) and len(got) == best, (need, stages, free, got)


def test_a_burst_drops_the_fewest_replicas_not_every_one_that_did_not_fit():
    """Three of four replicas lost one actor each with its node and one slot is free: the
    runtime's greedy view calls two of them unplaceable, but dropping one frees three slots."""
    members = [Member(s, r, f"n{s}{r}", not (s == 0 and r > 0), None if s == 0 and r > 0 else 5) for r in range(4) for s in range(4)]
    o = replace(obs(members, dead_nodes={"n01", "n02", "n03"}, committed=5), free_slots=1)
    plan = RecoveryPolicy().decide(o)
    assert len(plan.drop_replicas) == 1 and plan.width == (4, 3)
    assert [(a.stage, a.source) for a in plan.actions] == [(0, "dp_peer"), (0, "dp_peer")]  # the two kept copy a whole peer
