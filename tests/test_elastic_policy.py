"""The elastic policy of one look at the cluster (``controller.elastic.decide``): which spares to
start or give up, when a drain is acted on, when the run grows. Pure: views are built by hand."""

from elastic_llm.controller.drains import Drain
from elastic_llm.controller.elastic import MOVE_S, SETTLE_S, SPARE_START_S, ElasticView, SpareView, decide, settle_within
from elastic_llm.snapshot.records import ShardKey

NODES = tuple((ShardKey(s, r), f"n{s + 2 * r}") for r in range(2) for s in range(2))  # 2 stages x 2 replicas on n0..n3


def view(draining=(), spares=(), stage_spares=(), free=None, room=None, width=2, wall=1000.0, step_s=0.0):
    return ElasticView(tuple(draining), NODES, width, 2, tuple(spares), tuple(stage_spares), free, room, wall, step_s)


def spare(ready=False, nodes=(), age=1.0, key=None):
    return SpareView(object(), key, frozenset(nodes), age, ready)


def test_a_drain_starts_the_stage_spare_its_move_needs_and_waits_for_it():
    drain = Drain("n1", 1060.0)  # stage 1 of replica 0, a minute left
    first = decide(view([drain], free=1), set(), max_width=2)
    assert first.start_stage_spares == (ShardKey(1, 0),) and not first.start_spare
    assert first.drains == () and first.avoid == {"n1"} and "replica 0: stages" in first.note
    started = spare(ready=False, nodes={"n4"}, key=ShardKey(1, 0))
    waiting = decide(view([drain], stage_spares=[started], free=0), set(), 2)
    assert waiting.drains == () and waiting.start_stage_spares == () and waiting.cancel == ()  # it is starting: train on
    ready = decide(view([drain], stage_spares=[spare(ready=True, nodes={"n4"}, key=ShardKey(1, 0))], free=0), set(), 2)
    assert ready.drains == (drain,)  # its spare has started: act now
    near = decide(view([drain], stage_spares=[started], free=0, wall=1057.0), set(), 2)
    assert near.drains == (drain,)  # 3 s left: act with what there is
    assert decide(view([drain], free=1), {"n1"}, 2).drains == ()  # acted on before: not again


def test_a_drain_due_before_the_next_look_is_acted_on_now():
    """With 12 s steps (a large model) a drain 15 s from its deadline cannot wait one more step
    for its spare: the simulated 256-node fleet lost nodes mid-step that way."""
    from elastic_llm.controller.elastic import LookTimer

    drain = Drain("n1", 1015.0)
    started = spare(ready=False, nodes={"n4"}, key=ShardKey(1, 0))
    assert decide(view([drain], stage_spares=[started], free=0, step_s=1.0), set(), 2).drains == ()  # short steps: wait
    assert decide(view([drain], stage_spares=[started], free=0, step_s=12.0), set(), 2).drains == (drain,)
    timer = LookTimer()
    assert [timer.look(t) for t in (0.0, 12.0, 24.5, 80.0, 92.0)] == [0.0, 12.0, 12.0, 12.0, 12.0]  # a 55 s pause does not count
    after = LookTimer()
    assert [after.look(t, step) for t, step in ((0.0, 1), (12.0, 2), (12.4, 2), (24.0, 3))] == [0.0, 12.0, 12.0, 12.0]  # a second look after step 2 (a drain's) is no interval


def test_a_drain_whose_replica_stayed_is_due_again_once_at_the_last_look_before_its_node_goes():
    """No room: the replica on n1 stayed when the drain was acted on (``seen``). It trains on while
    its node outlives the next step; at the last look before n1 goes (within a step plus
    MOVE_S) the drain is due again, so that what stayed is given up at the step boundary
    instead of failing the next step; once given its last look it is not due again."""
    from dataclasses import replace

    drain = Drain("n1", 1010.0)
    assert decide(view([drain], free=0, wall=1000.0, step_s=3.0), {"n1"}, 2).drains == ()  # 10 s left: another step fits
    last = view([drain], free=0, wall=1005.5, step_s=3.0)  # 4.5 s left: the next step would end after n1 went
    assert decide(last, {"n1"}, 2).drains == (drain,)
    assert decide(replace(last, last_looked=frozenset({"n1"})), {"n1"}, 2).drains == ()
    assert decide(last, set(), 2).drains == (drain,)  # never acted on: due anyway (no room: it stays at once)


def test_no_room_to_move_acts_at_once_and_a_whole_replica_needs_a_spare():
    drain = Drain("n1", None)
    shrink = decide(view([drain], free=0), set(), 2)
    assert shrink.drains == (drain,) and shrink.start_stage_spares == () and "replica 0: stay" in shrink.note
    both = decide(view([Drain("n0", None), Drain("n1", None)], free=2), set(), 2)  # every stage of replica 0
    assert both.start_spare and both.start_stage_spares == () and both.drains == ()


def test_spares_on_draining_nodes_or_that_never_started_are_given_up():
    on_drain = spare(ready=True, nodes={"n3"})
    stale = spare(ready=False, nodes=(), age=SPARE_START_S + 1)
    plan = decide(view([Drain("n3", None)], spares=[on_drain, stale], free=0), {"n3"}, 3)
    assert set(plan.cancel) == {on_drain, stale} and plan.grow_to is None
    orphaned = spare(ready=False, nodes={"n5"}, key=ShardKey(0, 1))  # its drain went away
    assert decide(view(stage_spares=[orphaned]), set(), 3).cancel == (orphaned,)


def test_the_run_grows_once_a_spare_has_started_and_starts_one_where_there_is_room():
    assert decide(view(spares=[spare(ready=True, nodes={"n4", "n5"})]), set(), 3).grow_to == 3
    assert decide(view(spares=[spare(ready=False, nodes={"n4"})]), set(), 3).grow_to is None
    room = decide(view(room=1), set(), 3)
    assert room.start_spares == 1 and "room for replica 3" in room.note
    assert not decide(view(room=0), set(), 3).start_spares and not decide(view(room=None), set(), 3).start_spares
    extra = spare(ready=True, nodes={"n4"})
    full = decide(view(spares=[extra]), set(), 2)  # already at elastic.max_replicas
    assert full.cancel == (extra,) and full.grow_to is None


def test_a_late_stage_spare_is_kept_and_moves_its_key_once_started_while_the_node_lives():
    """A drain acted on before its stage spare started (its replica stayed, nothing dropped): the
    spare is kept, and once it has started the drain is acted on again while there is time for
    the move; too close to the deadline it is due again too, to be given up (the recovery then
    puts the spare in its place) instead of failing the next step."""
    drain = Drain("n1", 1060.0)
    late = spare(ready=False, nodes={"n4"}, key=ShardKey(1, 0))
    kept = decide(view([drain], stage_spares=[late], free=0), {"n1"}, 2)
    assert kept.cancel == () and kept.drains == ()  # acted on already, still starting: kept, nothing to do
    ready = spare(ready=True, nodes={"n4"}, key=ShardKey(1, 0))
    assert decide(view([drain], stage_spares=[ready], free=0), {"n1"}, 2).drains == (drain,)  # move it now
    assert decide(view([drain], stage_spares=[ready], free=0, wall=1059.0), {"n1"}, 2).drains == (drain,)  # 1 s left: too late to move, given up
    gone = decide(view(stage_spares=[ready]), {"n1"}, 2)  # n1 went (no longer draining): the recovery's
    assert gone.cancel == ()
    moved = NODES[:1] + ((ShardKey(1, 0), "n4"),) + NODES[2:]  # the key left n1 another way: the spare is not needed
    other = ElasticView((), moved, 2, 2, (), (ready,), None, None, 1000.0, 0.0)
    assert decide(other, {"n1"}, 2).cancel == (ready,)


def test_regrowth_starts_every_spare_the_room_allows_and_joins_the_started_ones_at_once():
    batch = decide(view(room=5), set(), 5)  # room for 5 more, 3 until elastic.max_replicas
    assert batch.start_spares == 3 and "replicas 3-5" in batch.note
    one_more = decide(view(spares=[spare(ready=False, nodes={"n4"})], room=4), set(), 5)
    assert one_more.start_spares == 2 and one_more.grow_to is None  # two were not started yet
    started = [spare(ready=True, nodes={"n4"}), spare(ready=True, nodes={"n5"})]
    assert decide(view(spares=[*started, spare(ready=False, nodes={"n6"})]), set(), 5).grow_to is None  # one still starting: wait for it
    assert decide(view(spares=[*started, spare(ready=False)]), set(), 5).grow_to == 4  # one still waits for room: the started ones join
    assert decide(view(spares=[*started, spare(ready=True, nodes={"n6"})]), set(), 3).grow_to == 3  # never past max_replicas


def test_snapshot_settling_before_a_whole_replica_moves_gets_the_time_its_first_node_has_left_less_a_move():
    now = 1000.0
    assert settle_within((), now) == SETTLE_S  # a grow: no node is going
    assert settle_within((Drain("n1", None),), now) == SETTLE_S  # a drain without a deadline
    assert settle_within((Drain("n1", now + 3600), Drain("n2", now + 10.0)), now) == 10.0 - MOVE_S  # the first to go bounds it
    assert settle_within((Drain("n1", now + MOVE_S / 2),), now) == 0.0  # no time: skipped
