"""CheckFree / CheckFree+ and the other recovery modes, pure parts: the averaging math, the
swapped schedule, the seeded failure schedule and the policy's choices per mode."""

import numpy as np
import pytest

from elastic_llm.chaos import failures_at, prob_per_step
from elastic_llm.config import ConfigError, load_config
from elastic_llm.pipeline.schedules import Op, build_schedule, hops_of, routes, submission_order, swapped_route
from elastic_llm.recovery.checkfree import EPS, Rebuild, average, plan_rebuild, weights
from elastic_llm.recovery.policy import Member, Observation, RecoveryPolicy, UnrecoverableError
from elastic_llm.snapshot.records import ShardKey


# ---------------------------------------------------------------------- averaging


def test_weights_are_the_neighbours_gradient_norms_plus_epsilon():
    assert weights(0.5, 0.25) == (0.5 + EPS, 0.25 + EPS)
    assert weights(0.0, 0.0) == (EPS, EPS)  # never stepped: an even average, no division by zero


def test_average_weights_next_by_a_and_previous_by_b():
    nxt = np.array([1.0, 2.0, -4.0], dtype=np.float32)
    prev = np.array([3.0, 0.0, 4.0], dtype=np.float32)
    out = average(nxt, prev, 3.0, 1.0)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [1.5, 1.5, -2.0])  # (3 next + 1 prev) / 4
    np.testing.assert_array_equal(average(nxt, prev, 1.0, 1.0), (nxt + prev) / 2)
    np.testing.assert_array_equal(average(nxt, prev, 1.0, 1e-30), nxt)  # all weight on next


def test_average_refuses_neighbours_of_different_layouts():
    with pytest.raises(ValueError, match="neighbour layers differ"):
        average(np.zeros(3, np.float32), np.zeros(4, np.float32), 1.0, 1.0)


def keys(*pairs):
    return frozenset(ShardKey(s, r) for s, r in pairs)


def test_intermediate_stage_averages_both_neighbours_of_its_replica():
    rb = plan_rebuild(2, 0, 5, keys((0, 0), (1, 0), (3, 0), (4, 0)), mirrors=True)
    assert isinstance(rb, Rebuild) and rb.source == "checkfree"
    assert rb.donors == (ShardKey(3, 0), ShardKey(1, 0)) and rb.mirror is None


def test_neighbour_of_another_replica_stands_in():
    rb = plan_rebuild(1, 1, 4, keys((0, 1), (2, 0), (3, 0), (3, 1)), mirrors=True)
    assert rb.donors == (ShardKey(2, 0), ShardKey(0, 1))


def test_first_and_last_stage_copy_their_neighbour_and_take_its_mirror():
    alive = keys((1, 0), (2, 0))
    first, last = plan_rebuild(0, 0, 4, alive | keys((3, 0)), True), plan_rebuild(3, 0, 4, alive | keys((0, 0)), True)
    assert (first.source, first.donors, first.mirror) == ("checkfree_plus", (ShardKey(1, 0),), ShardKey(1, 0))
    assert (last.source, last.donors, last.mirror) == ("checkfree_plus", (ShardKey(2, 0),), ShardKey(2, 0))
    no_mirror = plan_rebuild(0, 0, 4, alive | keys((3, 0)), False)
    assert no_mirror.mirror is None and "re-initialised" in no_mirror.note
    assert "no mirror" in plan_rebuild(0, 0, 4, alive | keys((3, 0)), False, reinit=False)


def test_two_adjacent_lost_stages_cannot_be_averaged():
    why = plan_rebuild(1, 0, 4, keys((0, 0), (3, 0)), True)
    assert isinstance(why, str) and "[2]" in why


# ---------------------------------------------------------------------- swapped schedule


@pytest.mark.parametrize("n", [4, 5, 6, 8])
def test_swapped_route_swaps_first_two_and_last_two_stages_keeping_embedding_first_and_head_last(n):
    r = swapped_route(n)
    layers = [h.stage for h in r if h.layers]
    assert layers == [1, 0, *range(2, n - 2), n - 1, n - 2]
    assert r[0].embed and r[0].stage == 0 and not r[0].layers
    assert r[-1].head and r[-1].stage == n - 1 and not r[-1].layers
    assert sum(h.embed for h in r) == 1 and sum(h.head for h in r) == 1


def test_swapped_order_needs_four_stages():
    with pytest.raises(ValueError, match="at least 4 stages"):
        swapped_route(3)
    with pytest.raises(ConfigError, match="checkfree_plus needs parallel.stages >= 4"):
        load_config(None, ["recovery.mode=checkfree_plus", "parallel.stages=2", "model.n_layers=4"])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n,micro", [(4, 2), (4, 4), (5, 3), (6, 8), (8, 4), (4, 1)])
def test_each_step_runs_both_orders_and_every_visit_forward_then_backward(name, n, micro):
    rts = routes(n, micro, swapped=True)
    orders = {tuple(h.stage for h in r if h.layers) for r in rts}
    assert len(orders) == (2 if micro > 1 else 1)  # both orders in one step (one microbatch: straight only)
    schedule = build_schedule(name, n, micro, swapped=True)
    order = submission_order(schedule, rts)  # raises if the schedule could deadlock
    for s in range(n):
        ops = schedule[s]
        expected = sorted((kind, mb, v) for mb in range(micro) for v in range(len(hops_of(rts[mb], s))) for kind in "FB")
        assert sorted((o.kind, o.mb, o.visit) for o in ops) == expected
        for o in ops:
            if o.kind == "F":
                assert ops.index(o) < ops.index(Op("B", o.mb, o.visit))
        assert [op for st, op in order if st == s] == ops
    assert len(order) == sum(len(ops) for ops in schedule)


def test_swapped_training_accumulates_gradients_of_both_orders_in_one_step():
    """Two microbatches, one straight and one swapped, run through stage modules by hand exactly
    as the stage actors do: every stage's gradient is the sum of both orders' gradients."""
    import torch

    from elastic_llm.model import ModelShape, build_stage, lm_loss

    shape = ModelShape(vocab_size=32, dim=16, n_heads=2, n_layers=4, seq_len=8, ffn_hidden=32)
    stages = [build_stage(shape, 4, s, seed=1) for s in range(4)]
    x = torch.randint(0, 32, (2, 2, 8), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 32, (2, 2, 8), generator=torch.Generator().manual_seed(1))

    def run(route, mb):
        act = x[mb]
        for hop in route:
            act = stages[hop.stage].run(act, hop.embed, hop.layers, hop.head)
        return lm_loss(act, y[mb])

    def grads():
        return [torch.cat([p.grad.reshape(-1) for p in st.parameters()]).clone() for st in stages]

    rts = routes(4, 2, swapped=True)
    separate = []
    for mb in range(2):
        for st in stages:
            st.zero_grad(set_to_none=False)
        run(rts[mb], mb).backward()
        separate.append(grads())
    for st in stages:
        st.zero_grad(set_to_none=False)
    for mb in range(2):
        run(rts[mb], mb).backward()
    together = grads()
    for s in range(4):
        assert separate[0][s].abs().sum() > 0 and separate[1][s].abs().sum() > 0
        assert not torch.allclose(separate[0][s], separate[1][s])  # the orders differ
        torch.testing.assert_close(together[s], separate[0][s] + separate[1][s])


# ---------------------------------------------------------------------- failure schedule


def test_failure_schedule_depends_only_on_seed_and_step():
    a = [failures_at(7, step, 4, 1, 0.02) for step in range(1, 2001)]
    b = [failures_at(7, step, 4, 1, 0.02) for step in reversed(range(1, 2001))][::-1]
    assert a == b  # no hidden state: every strategy, fast or slow, sees the same failures
    assert a != [failures_at(8, step, 4, 1, 0.02) for step in range(1, 2001)]
    n = sum(len(f) for f in a)
    assert 100 < n < 200  # about 2000 x (1 - 0.98^4) = 155
    assert all(len(f) <= 1 and all(0 <= s < 4 and r == 0 for s, r in f) for f in a)


def test_a_higher_probability_only_adds_failures():
    low = {step: failures_at(3, step, 4, 2, 0.002) for step in range(1, 3001)}
    high = {step: failures_at(3, step, 4, 2, 0.004) for step in range(1, 3001)}
    assert all(high[s] == low[s] for s in low if low[s])
    assert sum(map(bool, high.values())) > sum(map(bool, low.values()))


def test_rate_per_hour_becomes_a_per_step_probability():
    assert prob_per_step(0.1, 3600.0) == pytest.approx(0.1)
    p = prob_per_step(0.1, 1.0)
    assert 1 - (1 - p) ** 3600 == pytest.approx(0.1)
    assert prob_per_step(0.0, 5.0) == 0.0


# ---------------------------------------------------------------------- policy per mode


def members(n=4, dp=1, dead=(), step=5):
    return tuple(Member(s, r, f"n{r}{s}", (s, r) not in dead, None if (s, r) in dead else step) for r in range(dp) for s in range(n))


def observe(mode, dead, n=4, dp=1, **kw):
    m = members(n, dp, dead)
    return Observation(m, frozenset(), frozenset(), None, mode=mode, **kw)


@pytest.mark.parametrize("mode", ["checkfree", "checkfree_plus"])
def test_checkfree_modes_rebuild_without_rollback(mode):
    plan = RecoveryPolicy().decide(observe(mode, {(2, 0)}, mirrors=mode == "checkfree_plus"))
    assert plan.rollback_to is None
    assert [(a.stage, a.source, a.lossless) for a in plan.actions] == [(2, "checkfree", False)]
    assert plan.actions[0].donors == (ShardKey(3, 0), ShardKey(1, 0))
    first = RecoveryPolicy().decide(observe(mode, {(0, 0)}, mirrors=mode == "checkfree_plus"))
    assert first.actions[0].source == "checkfree_plus"
    assert (first.actions[0].mirror is not None) == (mode == "checkfree_plus")


def test_checkfree_mode_prefers_a_data_parallel_peer():
    plan = RecoveryPolicy().decide(observe("checkfree_plus", {(1, 1)}, dp=2, mirrors=True))
    assert [(a.source, a.peer, a.lossless) for a in plan.actions] == [("dp_peer", 0, True)]


def test_redundant_promotes_the_predecessors_copy_ring_included():
    plan = RecoveryPolicy().decide(observe("redundant", {(0, 0)}))
    assert plan.rollback_to is None
    assert [(a.source, a.donors) for a in plan.actions] == [("redundant", (ShardKey(3, 0), ShardKey(1, 0)))]
    with pytest.raises(UnrecoverableError, match="hold its redundant copy or the copy it held, and no other replica holds stage 1"):
        RecoveryPolicy().decide(observe("redundant", {(1, 0), (2, 0)}))


def test_redundant_with_replicas_copies_a_live_replica_where_two_neighbours_are_lost():
    plan = RecoveryPolicy().decide(observe("redundant", {(1, 0), (2, 0), (0, 1)}, dp=2))
    assert [(a.stage, a.replica, a.source, a.peer) for a in plan.actions] == [(1, 0, "dp_peer", 1), (2, 0, "dp_peer", 1), (0, 1, "redundant", None)]
    assert plan.rollback_to is None and all(a.lossless for a in plan.actions) and "a live replica's stage is copied" in plan.reason
    with pytest.raises(UnrecoverableError, match="no other replica holds stage 2"):
        RecoveryPolicy().decide(observe("redundant", {(1, 0), (2, 0), (2, 1)}, dp=2))


def test_checkpoint_mode_rolls_everyone_back_to_the_newest_checkpoint_or_the_start():
    plan = RecoveryPolicy().decide(observe("checkpoint", {(1, 0)}, checkpoint=3))
    assert plan.rollback_to == 3 and [a.source for a in plan.actions] == ["checkpoint"]
    assert RecoveryPolicy().decide(observe("checkpoint", {(1, 0)}, checkpoint=None)).rollback_to == 0


def test_lossless_ladder_ends_in_checkfree_with_the_reason():
    m = members(4, 1, {(1, 0), (3, 0)})
    shard_nodes = tuple((ShardKey(x.stage, x.replica), x.node) for x in m)
    dead = frozenset({"n01", "n03"})
    o = Observation(m, dead, dead, 4, shard_nodes, (tuple(n for _, n in shard_nodes),), 1, mirrors=True)
    plan = RecoveryPolicy().decide(o)
    assert plan.rollback_to is None
    assert [(a.stage, a.source, a.lossless) for a in plan.actions] == [(1, "checkfree", False), (3, "checkfree_plus", False)]
    assert "no lossless copy survives" in plan.reason and "parity covers 1" in plan.reason
    o2 = Observation(m, dead, dead, 4, shard_nodes, (tuple(n for _, n in shard_nodes),), 1, mirrors=False)
    with pytest.raises(UnrecoverableError, match="has no mirror"):
        RecoveryPolicy().decide(o2)  # lossless never re-initialises an embedding or head


def test_modes_are_validated_with_the_fix():
    with pytest.raises(ConfigError, match="recovery.mode='fast' is unknown"):
        load_config(None, ["recovery.mode=fast"])
    assert load_config(None, ["recovery.mode=redundant", "parallel.dp=2", "parallel.stages=3", "model.n_layers=3"]).parallel.dp == 2  # a copy per replica
    with pytest.raises(ConfigError, match="recovery.mode=redundant needs parallel.stages >= 3, got 2"):
        load_config(None, ["recovery.mode=redundant", "parallel.stages=2"])
    with pytest.raises(ConfigError, match="write 0.1 for 10%"):
        load_config(None, ["chaos.failure_rate_per_hour=10"])
    with pytest.raises(ConfigError, match="set one of them"):
        load_config(None, ["chaos.failure_rate_per_hour=0.1", "chaos.failure_prob_per_step=0.01"])
    cfg = load_config(None, ["recovery.mode=checkfree_plus"])
    assert cfg.swapped and cfg.mirrors and not cfg.snapshots_on
    assert load_config(None, []).snapshots_on and not load_config(None, []).swapped
