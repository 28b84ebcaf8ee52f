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


def test_a_rollback_restores_only_the_survivors_that_are_not_at_its_step():
    """Survivors whose completed steps are the committed version's already hold it: the plan
    keeps them (they restore nothing); one past it (it finished the failed step's update) and
    the lost stage restore, and an own copy is not used for a survivor already there."""
    members = pipeline(step=6, dead={(1, 0)})
    members[3] = Member(3, 0, NODES[3], True, 7)  # stage 3 applied the failed step's update
    plan = RecoveryPolicy().decide(replace(obs(members, committed=6), own_copies=frozenset({ShardKey(0, 0), ShardKey(3, 0)})))
    assert plan.rollback_to == 6 and plan.kept == (ShardKey(0, 0), ShardKey(2, 0))
    assert plan.own_copies == (ShardKey(3, 0),) and "2 survivor(s) already there" in str(plan)
    assert RecoveryPolicy().decide(obs(pipeline(step=7, dead={(2, 0)}), committed=6)).kept == ()  # everyone past it: everyone restores


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


@pytest.mark.parametrize("dead, steps", [({(0, 0), (1, 0)}, (3, 3, 3, 3)), ({(1, 0)}, (3, 3, 4, 4))], ids=["neighbours lost", "steps disagree"])
def test_before_the_first_commit_a_run_that_began_at_step_0_goes_back_to_its_initial_state(dead, steps):
    """Nothing committed, no CheckFree possible either (a stage and its neighbour lost; or stages
    that disagree on their step): a run that began at step 0 and has committed nothing since goes
    back to its initial state, lossless; a run that did not begin there (resumed) cannot."""
    members = [Member(s, 0, NODES[s], (s, 0) not in dead, None if (s, 0) in dead else steps[s]) for s in range(4)]
    plan = RecoveryPolicy().decide(replace(obs(members, committed=None), from_start=True))
    assert plan.rollback_to == 0 and plan.rollback_from == "initial" and "no committed step lost" in plan.reason
    assert sorted((a.stage, a.source) for a in plan.actions) == [(s, "initial") for s, _ in sorted(dead)]
    with pytest.raises(UnrecoverableError):
        RecoveryPolicy().decide(obs(members, committed=None))


def test_before_the_first_commit_the_initial_state_goes_before_checkfree_unless_the_run_resumed():
    """Going back to step 0 is lossless while nothing was committed: it comes before CheckFree
    (lossy). A run that resumed from a checkpoint did not begin there: CheckFree, as before."""
    plan = RecoveryPolicy().decide(replace(obs(pipeline(step=3, dead={(1, 0)}), committed=None), from_start=True))
    assert [(a.stage, a.source) for a in plan.actions] == [(1, "initial")] and plan.rollback_to == 0
    plan = RecoveryPolicy().decide(obs(pipeline(step=3, dead={(1, 0)}), committed=None))
    assert [(a.stage, a.source) for a in plan.actions] == [(1, "checkfree")] and plan.rollback_to is None


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


def test_no_whole_replica_merges_the_survivors_into_one():
    members = pipeline(dead={(1, 0), (2, 1)}, dp=2)  # every replica broken, neither can be placed
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n2"}, unplaceable={0, 1}))
    assert plan.drop_replicas == (1,) and plan.borrow == ((ShardKey(1, 1), ShardKey(1, 0)),) and plan.actions == ()
    # the same stage lost in both: no survivor can fill the place, nothing is dropped
    same = pipeline(dead={(1, 0), (1, 1)}, dp=2)
    assert RecoveryPolicy().decide(elastic_obs(same, dead_nodes={"n1"}, unplaceable={0, 1})).drop_replicas == ()


def test_with_every_replica_broken_unplaceable_ones_go_while_the_rest_hold_every_stage():
    """A burst of losses across a large fleet leaves no replica whole (the simulated 256-node
    fleet waited for capacity forever on this): replicas that cannot be placed are dropped as
    long as the kept ones hold a live copy of every stage, which their lost actors copy."""
    members = pipeline(dead={(1, 0), (2, 1), (3, 2)}, dp=3)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n2", "n3"}, unplaceable={2}))
    assert plan.drop_replicas == (2,) and plan.width == (3, 2) and plan.rollback_to is None
    # its survivors of stages 1 and 2 take the kept replicas' lost places: no copy at all
    assert plan.borrow == ((ShardKey(1, 2), ShardKey(1, 0)), (ShardKey(2, 2), ShardKey(2, 1))) and plan.actions == ()
    # without borrowing (the same stage lost where it would be needed) a kept replica copies a kept peer
    members = pipeline(dead={(1, 0), (2, 1), (1, 2)}, dp=3)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n2"}, unplaceable={2}))
    assert plan.drop_replicas == (2,) and plan.borrow == ((ShardKey(2, 2), ShardKey(2, 1)),)
    assert [(a.stage, a.replica, a.source, a.peer) for a in plan.actions] == [(1, 0, "dp_peer", 1)]
    # both unplaceable ones go: replica 0 lends its stage 2 to replica 1, which is whole then
    both = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n2"}, unplaceable={0, 2}))
    assert both.drop_replicas == (0, 2) and both.borrow == ((ShardKey(2, 0), ShardKey(2, 1)),) and both.actions == ()
    # survivors at different steps: nothing is dropped (peers do not hold the same state)
    from elastic_llm.recovery.policy import replicas_to_drop

    members[0] = Member(0, 0, "n0", True, 6)
    assert replicas_to_drop(elastic_obs(members, dead_nodes={"n1", "n2", "n3"}, unplaceable={2})) == ()


def test_dropping_renumbers_the_rest_and_repairs_them_from_a_peer():
    # width 3: replica 0 loses a stage it cannot place, replica 2 loses one it can place
    members = pipeline(dead={(1, 0), (3, 2)}, dp=3)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n1", "n3"}, unplaceable={0}))
    assert plan.drop_replicas == (0,) and plan.width == (3, 2)
    # old replica 0's stage 3 takes old replica 2's lost place (numbered as observed): no copy
    assert plan.borrow == ((ShardKey(3, 0), ShardKey(3, 2)),) and plan.actions == ()
    # the same stage lost in both: old replica 2 (now replica 1) copies its peer, old replica 1 (now 0)
    members = pipeline(dead={(3, 0), (3, 2)}, dp=3)
    plan = RecoveryPolicy().decide(elastic_obs(members, dead_nodes={"n3"}, unplaceable={0}))
    assert plan.drop_replicas == (0,) and plan.borrow == ()
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


def _unfilled(lost, drop, stages):
    """The kept replicas' lost places that the borrows leave to new actors."""
    from elastic_llm.recovery.policy import borrows

    return sum(len(lost[r]) for r in lost if r not in drop) - len(borrows(lost, drop, stages))


def _brute_reassembly(lost, stages, free, need):
    """Reference for borrow and merge on a small fleet: every subset of the broken replicas may
    go; a subset fits when the kept replicas' lost actors that need a slot fit in the free ones
    plus what the dropped replicas release; for each fitting subset of the fewest replicas, the
    kept replicas are filled place by place from a pool of the dropped replicas' survivors, a
    new actor where the pool has none of that stage. Returns (fewest drops, fewest new actors)."""
    import itertools

    best = None
    for k in range(len(lost) + 1):
        for drop in itertools.combinations(sorted(lost), k):
            if sum(n for r, n in need.items() if r not in drop) > free + sum(stages - need[r] for r in drop):
                continue
            pool = [s for r in drop for s in range(stages) if s not in lost[r]]
            new = 0
            for r in sorted(set(lost) - set(drop)):
                for s in sorted(lost[r]):
                    if s in pool:
                        pool.remove(s)
                    else:
                        new += 1
            best = min(best or (k, new), (k, new))
        if best is not None:
            return best
    return best


def test_reassembly_forms_the_most_whole_replicas_with_the_fewest_new_actors_brute_force():
    """Borrow and merge against brute force on 600 small fleets: as many replicas survive as any
    choice allows, the kept ones are whole after the borrows (each borrowed actor comes from a
    dropped replica that holds that stage, used once), and no choice needs fewer new actors."""
    import random

    from elastic_llm.recovery.policy import borrows, fewest_drops, merge_drops

    rng = random.Random(11)
    for _ in range(600):
        stages = rng.randint(2, 5)
        width = rng.randint(2, 6)
        lost = {r: frozenset(rng.sample(range(stages), rng.randint(1, stages - 1))) for r in rng.sample(range(width), rng.randint(1, width))}
        need = {r: len(s) for r, s in lost.items()}  # none of their lost actors is placed yet
        free = rng.randint(0, stages * 2)
        fewest, least_new = _brute_reassembly(lost, stages, free, need)
        count = len(fewest_drops(need, stages, free))
        assert count == fewest
        drop = merge_drops(lost, stages, count)
        assert len(drop) == count and set(drop) <= set(lost)
        assert _unfilled(lost, drop, stages) == least_new, (lost, stages, free, drop)
        have = {(s, r) for r in range(width) for s in range(stages) if r not in lost or s not in lost[r]}
        used = set()
        for s, giver, taker in borrows(lost, drop, stages):
            assert giver in drop and taker not in drop and (s, giver) in have and (s, giver) not in used and (s, taker) not in have
            used.add((s, giver))
            have.add((s, taker))
        kept_missing = sum(1 for r in lost if r not in drop for s in lost[r] if (s, r) not in have)
        assert kept_missing == least_new  # what the borrows did not fill is exactly the new actors


def test_reassembly_on_a_large_fleet_needs_no_more_new_actors_than_dropping_the_most_broken():
    """Beyond the exhaustive search (16 broken replicas of 64 stages, 8 to drop: 12,870 choices)
    the local search starts from the most broken and only improves on it."""
    import random

    from elastic_llm.recovery.policy import MERGE_SEARCH, merge_drops

    rng = random.Random(3)
    for _ in range(5):
        lost = {r: frozenset(rng.sample(range(64), rng.randint(1, 6))) for r in range(16)}
        naive = set(sorted(lost, key=lambda r: (-len(lost[r]), -r))[:8])
        drop = merge_drops(lost, 64, 8)
        assert len(drop) == 8 and math_comb(16, 8) > MERGE_SEARCH
        assert _unfilled(lost, drop, 64) <= _unfilled(lost, naive, 64)
        assert _unfilled(lost, drop, 64) < sum(len(lost[r]) for r in lost if r not in drop)  # some places borrowed


def math_comb(n, k):
    import math

    return math.comb(n, k)


def test_a_burst_with_no_room_and_no_whole_replica_merges_the_survivors_without_new_actors():
    """Two replicas of two stages each lose a different stage and no slot is free: the old rule
    kept both waiting for room (no replica whole, the kept one would miss a stage); now replica
    1 is dropped and its stage 0 takes replica 0's lost place: one whole replica, no new actor,
    no copy, no rollback."""
    members = [Member(0, 0, "a", False, None), Member(1, 0, "b", True, 5), Member(0, 1, "c", True, 5), Member(1, 1, "d", False, None)]
    o = replace(obs(members, dead_nodes={"a", "d"}, committed=5, groups=(("a", "b", "c", "d"),)), free_slots=0)
    plan = RecoveryPolicy().decide(o)
    assert plan.drop_replicas == (1,) and plan.width == (2, 1)
    assert plan.borrow == ((ShardKey(0, 1), ShardKey(0, 0)),)
    assert plan.actions == () and plan.rollback_to is None and "borrow and merge" in plan.reason
    # survivors at different steps are not interchangeable: nothing is borrowed or dropped
    from elastic_llm.recovery.policy import replicas_to_drop, with_borrows

    members[2] = Member(0, 1, "c", True, 6)
    assert replicas_to_drop(replace(o, members=tuple(members))) == ()
    assert with_borrows(replace(o, members=tuple(members)), (1,))[1] == ()


def test_borrowed_places_need_no_copy_and_the_rest_copy_a_kept_peer():
    """Width 3 of 3 stages, one free slot: replica 2 lost stages 0 and 1, replica 1 lost stage 1,
    replica 0 lost stage 2; one replica must go. Dropping replica 2 lends its stage 2 to replica 0;
    replica 1's stage 1 has no giver: a new actor copies it from replica 0."""
    dead = {(0, 2), (1, 2), (1, 1), (2, 0)}
    members = [Member(s, r, f"n{s}{r}", (s, r) not in dead, None if (s, r) in dead else 5) for r in range(3) for s in range(3)]
    o = replace(obs(members, dead_nodes={f"n{s}{r}" for s, r in dead}, committed=5, groups=(tuple(m.node for m in members),)), free_slots=1)
    plan = RecoveryPolicy().decide(o)
    assert plan.drop_replicas == (2,) and plan.borrow == ((ShardKey(2, 2), ShardKey(2, 0)),)
    assert [(a.stage, a.replica, a.source, a.peer) for a in plan.actions] == [(1, 1, "dp_peer", 0)]


def test_a_lost_place_that_would_start_a_new_process_drops_its_replica_too_when_the_fleet_is_wide():
    """Eight replicas of 2 stages fill the fleet; a burst takes stage 0 of replicas 1-3. Dropping
    the fewest (two) frees room for the third's lost actor: with a warm standby ready there it is
    adopted (no start) and the third is kept; with none, a new process would stall all six kept
    replicas for its start, so that replica goes too (a spare replica grows it back in the
    background), and no actor starts. In a narrow run the start is cheaper and it stays. Pure."""
    members = [Member(s, r, f"n{s}{r}", not (s == 0 and r in (1, 2, 3)), None if s == 0 and r in (1, 2, 3) else 5) for r in range(8) for s in range(2)]
    o = replace(obs(members, dead_nodes={"n01", "n02", "n03"}, committed=5), free_slots=0)
    cold = RecoveryPolicy().decide(o)
    assert len(cold.drop_replicas) == 3 and cold.width == (8, 5) and cold.rollback_to is None and cold.actions == ()
    warm = RecoveryPolicy().decide(replace(o, standbys=(("n11", 1), ("n12", 1), ("n13", 1))))
    assert len(warm.drop_replicas) == 2 and warm.width == (8, 6) and [(a.stage, a.source) for a in warm.actions] == [(0, "dp_peer")]
    assert all(a.adopt is not None for a in warm.actions)
    narrow = [m for m in members if m.replica < 4]  # 4 replicas: 2 dropped, the third's start stalls only 2 kept ones
    plan = RecoveryPolicy().decide(replace(obs(narrow, dead_nodes={"n01", "n02", "n03"}, committed=5), free_slots=0))
    assert len(plan.drop_replicas) == 2 and [a.adopt for a in plan.actions] == [None]
