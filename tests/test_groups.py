"""Erasure groups (``snapshot.groups.make_groups``) and zone-correlated traces: nodes that fail
together never share a group beyond its parity. Pure."""

import random
from collections import Counter

import pytest

from elastic_llm.replay.trace import parse_trace, plan_replay
from elastic_llm.sim.traces import fleet_trace
from elastic_llm.snapshot.groups import domain_of, group_sizes, make_groups


@pytest.mark.parametrize("seed", range(60))
def test_no_group_holds_more_than_parity_nodes_of_one_domain_when_the_fleet_allows_it(seed):
    rng = random.Random(seed)
    parity = rng.randint(1, 3)
    size = rng.randint(parity + 1, 10)
    domains = rng.randint(2, 6)
    n = rng.randint(parity + 1, 80)
    nodes = [f"n{i:03d}" for i in range(n)]
    zone = {x: f"z{rng.randrange(domains)}" for x in nodes}
    groups = make_groups(nodes, size, parity, zone, seed=seed)
    assert sorted(x for g in groups for x in g) == nodes  # every node in exactly one group
    assert all(len(g) >= parity + 1 for g in groups)
    largest = max(Counter(zone.values()).values())
    if largest <= parity * (n // (parity + 1)):  # enough groups can form: the largest domain spreads over them
        assert all(max(Counter(zone[x] for x in g).values()) <= parity for g in groups), groups


def test_without_domains_groups_are_shuffled_per_version_and_never_consecutive_names():
    nodes = [f"n{i:03d}" for i in range(64)]
    a, b = make_groups(nodes, 8, 2, seed=1), make_groups(nodes, 8, 2, seed=2)
    assert [len(g) for g in a] == group_sizes(64, 8, 2) == [8] * 8
    assert a != b and a == make_groups(nodes, 8, 2, seed=1)  # re-formed every version, reproducibly
    consecutive = tuple(tuple(nodes[i : i + 8]) for i in range(0, 64, 8))
    assert not set(a) & set(consecutive)
    assert make_groups(nodes, 8, 2, {x: "z0" for x in nodes}, seed=1) == a  # one domain tells nothing: as without


def test_the_one_labelled_domain_of_a_fleet_without_labels_is_spread_for_every_version():
    """The coordinator marks draining nodes as one domain on a fleet whose nodes have none: every
    version spreads them over its groups (a CI run lost a version whose shuffle put both draining
    nodes of six in one group of 3 with parity 1, when only the draining nodes had a domain)."""
    nodes = [f"n{i}" for i in range(6)]
    for draining in ({"n0", "n3"}, {"n4", "n5"}, {"n1", "n2"}):
        for seed in range(32):
            groups = make_groups(nodes, 3, 1, {x: "\0draining" for x in draining}, seed=seed)
            assert [len(g) for g in groups] == [3, 3] and all(sum(1 for x in g if x in draining) == 1 for g in groups), (seed, groups)
    assert make_groups(nodes, 3, 1, {"n0": "z0"}, seed=1) == make_groups(nodes, 3, 1, seed=1)  # a domain of one spreads nothing


def test_a_whole_zone_lost_at_once_is_within_parity_for_every_group():
    """Four zones, parity 2, groups of 8: losing every node of one zone takes at most 2 of any group."""
    nodes = [f"n{i:03d}" for i in range(256)]
    zone = {x: f"z{i % 4}" for i, x in enumerate(nodes)}
    for g in make_groups(nodes, 8, 2, zone, seed=5):
        assert sum(1 for x in g if zone[x] == "z1") <= 2


def test_domain_labels():
    assert domain_of({"elastic-llm.io/failure-domain": "rack-3", "ray.io/availability-zone": "us-east-1a"}) == "rack-3"
    assert domain_of({"ray.io/availability-zone": "us-east-1a"}) == "us-east-1a"
    assert domain_of({"ray.io/node-id": "abc"}) is None


def test_a_zone_column_is_carried_to_the_replay_and_a_zone_burst_takes_that_zones_nodes():
    text = "time_ms,event,node,zone\n0,add,a,z0\n0,add,b,z0\n0,add,c,z1\n0,add,d,z1\n10000,remove,a\n10000,remove,b\n20000,add,e,z0\n30000,add,f,z1\n"
    plan = plan_replay(parse_trace(text), node_scale=2.0, notice_s=2.0, seed=3)
    zones = dict(plan.zones)
    assert Counter(zones[n] for n in plan.initial_nodes) == {"z0": 4, "z1": 4}
    removed = [a.node for a in plan.actions if a.kind == "remove"]
    assert len(removed) == 4 and {zones[n] for n in removed} == {"z0"}  # the burst took zone z0, scaled
    assert {zones[a.node] for a in plan.actions if a.kind == "add"} == {"z0"}


def test_the_fleet_trace_bursts_come_from_one_zone_and_dip_to_40_percent():
    events = parse_trace(fleet_trace(256, 3.0, seed=1))
    zone = {e.node: e.zone for e in events if e.kind == "add"}
    alive, low = set(), 256
    for t in sorted({e.time_ms for e in events}):
        burst = [e for e in events if e.time_ms == t]
        for e in burst:
            (alive.add if e.kind == "add" else alive.discard)(e.node)
        gone = [e.node for e in burst if e.kind == "remove"]
        if len(gone) > 1 and len({zone[n] for n in gone}) > 1:
            per_zone = Counter(zone[n] for n in gone)
            assert len(per_zone) == 2  # a zone ran out: the next one gave the rest
        if t:
            low = min(low, len(alive))
    assert int(0.4 * 256) <= low < 0.45 * 256  # the fleet dips to 40%


class _NoFleet:
    calls = None

    def domains(self):
        return {}

    def nodes(self):
        return {"a", "b", "c", "d", "e", "f"}


class _Unanswered:
    """A manager whose calls never answer (a re-home started here stays in flight)."""

    class _Method:
        def remote(self, *args):
            from elastic_llm.sim.world import SimRef

            return SimRef(float("inf"), "")

    def __getattr__(self, name):
        return self._Method()


class _SlowFleet(_NoFleet):
    def __init__(self):
        from elastic_llm.sim.world import Charged, SimCalls, SimClock

        self.calls = SimCalls(SimClock(), Charged())


def test_a_burst_of_notices_beyond_parity_re_protects_the_committed_version_with_the_next_step():
    """Two of three members of a group (parity 1) drain: the committed version would not survive
    their end. The next step takes a version at once (whatever the cadence) whose groups spread
    the draining nodes; once it commits, the re-protection is recorded with its time and bytes."""
    from elastic_llm.config import load_config
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator
    from elastic_llm.snapshot.groups import exposed
    from elastic_llm.snapshot.records import ShardInfo, ShardKey, VersionRecord

    from .conftest import REPO

    def shard(stage, node, version):
        return ShardInfo(ShardKey(stage, 0), version, 0, 1000 * (stage + 1), (), "{}", node_id=node)

    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["model.n_layers=6", "parallel.stages=6", "snapshot.parity=1", "snapshot.group_size=3", "snapshot.every=50"])
    clock = SimClock()
    coord = SnapshotCoordinator(cfg, _NoFleet(), "reprotect", clock)
    nodes = ["a", "b", "c", "d", "e", "f"]
    coord.committed = VersionRecord(50, (("a", "b", "c"), ("d", "e", "f")), tuple(shard(i, n, 50) for i, n in enumerate(nodes)))
    coord.last_begin = 50
    assert not coord.due(51)  # every 50 steps
    coord.avoid = frozenset({"a"})
    assert not coord.due(51)  # one member of a group: its parity covers it
    coord.avoid = frozenset({"a", "b"})
    assert coord.due(51)  # a and b together are beyond the group's parity
    spread = make_groups(nodes, 3, 1, {"a": "\0draining", "b": "\0draining"}, seed=51)
    assert not exposed(spread, frozenset({"a", "b"}), 1)
    clock.sleep(1.5)
    coord.exposure.committed(VersionRecord(51, spread, tuple(shard(i, n, 51) for i, n in enumerate(nodes))), frozenset({"a", "b"}))
    stranded, done = coord.reprotections  # (no managers here: the parts had nowhere to be re-homed, which was said at the notice)
    assert (stranded["how"], stranded["nodes"], stranded["in_time"]) == ("stranded", ["a", "b"], False)
    assert done == {"version": 51, "nodes": ["a", "b"], "seconds": 1.5, "bytes": 1000 + 2000, "in_time": True, "how": "version", "cause": "notice"}
    assert not coord.due(52)  # done: back to the cadence


def _shard(stage, node, version):
    from elastic_llm.snapshot.records import ShardInfo, ShardKey

    return ShardInfo(ShardKey(stage, 0), version, 0, 1000 * (stage + 1), (), "{}", node_id=node)


def test_draining_nodes_that_go_before_a_version_without_them_commits_are_recorded_late():
    """A version noticed exposed is not re-protected before a and b go: the record says they went
    first (in_time False), how long after the notice and the bytes of theirs it held; a version
    begun before a later notice does not end that later exposure: the next one tries again."""
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.exposure import Exposure
    from elastic_llm.snapshot.records import VersionRecord

    nodes = ["a", "b", "c", "d", "e", "f"]
    clock = SimClock()
    ex = Exposure(1, clock)
    v50 = VersionRecord(50, (("a", "b", "c"), ("d", "e", "f")), tuple(_shard(i, n, 50) for i, n in enumerate(nodes)))
    ex.notice(frozenset({"a", "b"}), v50, 50)
    assert ex.pending is not None and ex.pending.nodes == {"a", "b"}
    clock.sleep(20.0)
    ex.notice(frozenset(), v50, 51)  # both went: version 51 is still in flight
    assert ex.pending is None and ex.done == [{"version": 50, "nodes": ["a", "b"], "seconds": 20.0, "bytes": 1000 + 2000, "in_time": False, "cause": "notice"}]
    ex.done.clear()

    ex.notice(frozenset({"d", "e"}), v50, 52)
    v53 = VersionRecord(53, (("a", "d", "f"), ("b", "c", "e")), ())  # spreads d and e
    ex.notice(frozenset({"d", "e", "f"}), v50, 52)  # f noticed after 53 began: 53 has d and f together
    ex.committed(v53, frozenset({"d", "e"}))
    assert ex.pending is not None and ex.pending.after == 53 and not ex.done  # the next version tries again
    clock.sleep(5.0)
    ex.committed(VersionRecord(54, (("a", "d", "c"), ("b", "e", "f")), ()), frozenset({"d", "e", "f"}))
    assert ex.pending is None and not ex.done  # 54 could not spread three over two groups of parity 1: given up with a warning


def test_auto_at_an_interval_that_leaves_no_step_clean_leaves_one_clean_to_keep_its_baseline():
    """snapshot.every: auto measures what a snapshot costs against clean steps (no version in
    flight, none ended in the last SETTLE steps): at an interval of 1 none would come again and
    the baseline would go stale (on llama-25m auto stayed at every 1 while snapshots cost 4% of a
    2% budget). After AUTO_PROBE steps without a clean one, it begins no version until a step ran
    clean; then every step again."""
    from elastic_llm.cadence import AUTO_PROBE, COLD, SETTLE
    from elastic_llm.config import load_config
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator
    from elastic_llm.snapshot.records import VersionRecord

    from .conftest import REPO

    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["snapshot.every=auto"])
    coord = SnapshotCoordinator(cfg, _NoFleet(), "probe", SimClock())
    assert coord.costs is not None
    coord.costs.every, coord.last_begin = 1, 100
    coord.committed = VersionRecord(100, (("a", "b", "c"),), (_shard(0, "a", 100),))  # the committed version trails by a step
    coord.costs.since_clean, coord.costs.steps = AUTO_PROBE - 1, COLD  # past the run's cold first steps
    assert coord.due(101)  # within the probe's period: every step
    coord.observe_step(1.0, began=True)  # a step with a version: not clean
    assert coord.costs.since_clean == AUTO_PROBE and not coord.due(102)  # the period is over: a step is left clean
    coord.costs.since_end = SETTLE  # the last version ended long enough ago
    coord.observe_step(0.9)  # nothing in flight, nothing begun: the baseline is sampled
    assert coord.costs.since_clean == 0 and coord.costs.clean_s.value == 0.9 and coord.due(103)
    fixed = SnapshotCoordinator(load_config(f"{REPO}/jobs/tiny.yaml", ["snapshot.every=1"]), _NoFleet(), "fixed", SimClock())
    assert not fixed.auto and fixed.costs is None and fixed.every == 1


def test_a_member_lost_from_the_committed_version_re_protects_it_with_the_next_step_and_counts_against_a_later_notice():
    """A recovery finds node a gone (its part is rebuilt from parity): the committed version runs
    on spent parity in a's group, so the next step takes a version at once; until one commits, a
    single draining member of that group (b) is beyond parity too. A version without a commits:
    done, back to the cadence."""
    from elastic_llm.config import load_config
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator
    from elastic_llm.snapshot.records import VersionRecord

    from .conftest import REPO

    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["model.n_layers=6", "parallel.stages=6", "snapshot.parity=1", "snapshot.group_size=3", "snapshot.every=50"])
    coord = SnapshotCoordinator(cfg, _SlowFleet(), "degraded", SimClock())
    nodes = ["a", "b", "c", "d", "e", "f"]
    coord.managers = {n: _Unanswered() for n in nodes}
    coord.committed = VersionRecord(50, (("a", "b", "c"), ("d", "e", "f")), tuple(_shard(i, n, 50) for i, n in enumerate(nodes)))
    coord.last_begin = 50
    assert not coord.due(51)
    coord.note_alive(set(nodes) - {"g"})  # nothing of the version gone
    assert not coord.due(51)
    coord.note_alive(set(nodes) - {"a"})
    assert coord.due(51) and coord.exposure.pending.nodes == {"a"}
    coord.avoid = frozenset({"b"})  # one more of a's group: beyond parity with a gone
    assert coord.exposure.pending.nodes == {"a", "b"}
    coord.exposure.committed(VersionRecord(51, (("b", "c", "d"), ("e", "f")), ()), frozenset({"b"}))
    assert coord.exposure.pending is None and coord.exposure.lost == frozenset() and not coord.due(52)
    [done] = coord.reprotections
    assert done["version"] == 51 and done["nodes"] == ["a", "b"] and done["in_time"]


def test_parts_on_draining_nodes_are_re_homed_off_the_group_and_the_domain_first():
    """A role on a draining node goes to a live node holding the fewest members of its group,
    then the fewest in the same failure domain, then the least loaded; a second role of the
    same group goes elsewhere; with no live node left the roles are stranded. Pure."""
    from elastic_llm.snapshot.records import VersionRecord
    from elastic_llm.snapshot.rehome import choose_homes

    rec = VersionRecord(7, (("a", "b", "c"), ("d", "e", "f")), ())
    domains = {"a": "z0", "b": "z0", "c": "z1", "d": "z1", "e": "z2", "f": "z2"}
    moves, stranded = choose_homes(rec, frozenset({"a", "b"}), ["c", "d", "e", "f"], domains)
    assert set(moves) == {"a", "b"} and not stranded
    assert not {"c"} & set(moves.values())  # c holds a member of the group already
    assert moves["a"] != moves["b"]  # two roles of one group never share a node while another is free
    assert moves["a"] in {"e", "f"}  # d shares z1 with c, the group's member left
    moved = rec.rehomed(moves)
    assert moved.home("a") == moves["a"] and moved.home("c") == "c" and moved.placed[0][2] == "c"
    assert choose_homes(moved, frozenset({"a", "b"}), ["c"], domains) == ({}, ())  # nothing left on the draining nodes
    moves, stranded = choose_homes(rec, frozenset({"a", "b", "c", "d", "e", "f"}), ["a", "b"], {})
    assert moves == {} and sorted(stranded) == ["a", "b", "c", "d", "e", "f"]


def test_a_rehomed_record_survives_its_json_and_a_lost_member_keeps_the_exposure_until_a_new_version():
    """The homes travel with the published record (a resuming driver finds the re-homed parts);
    a re-home ends an exposure only when no member of the committed version is lost: a lost
    member's parity is spent and only a new version mends it."""
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.exposure import Exposure
    from elastic_llm.snapshot.records import VersionRecord, record_from_json, record_json

    rec = VersionRecord(9, (("a", "b", "c"),), (_shard(0, "a", 9),))
    moved = rec.rehomed({"a": "x", "b": "y"})
    assert record_from_json(record_json(moved)) == moved and moved.roles_on("x") == ("a",)
    ex = Exposure(1, SimClock())
    ex.notice(frozenset({"a", "b"}), rec, 0)
    assert ex.pending is not None
    ex.rehomed(moved)
    assert ex.pending is None and ex.done[-1]["how"] == "rehome"
    ex = Exposure(1, SimClock())
    ex.degraded(frozenset({"c"}), rec, 0)
    ex.notice(frozenset({"a"}), rec, 0)
    ex.rehomed(rec.rehomed({"a": "x"}))
    assert ex.pending is not None and ex.pending.nodes == {"c"}  # c is gone: the group's parity is spent, a new version is still due
    assert ex.done[-1]["how"] == "rehome" and ex.done[-1]["nodes"] == ["a"]  # ... but a's share of it ended with the copy


def test_a_node_whose_parts_were_all_re_homed_is_not_recorded_late_when_it_goes():
    """Draining nodes that go after their parts moved took nothing of the committed version: only
    the ones still holding parts are recorded as gone first; a loss that a notice joins says both
    causes, and its notice's share is timed from the notice. Pure."""
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.exposure import Exposure
    from elastic_llm.snapshot.records import VersionRecord

    nodes = ["a", "b", "c", "d", "e", "f"]
    clock = SimClock()
    rec = VersionRecord(9, (("a", "b", "c"), ("d", "e", "f")), tuple(_shard(i, n, 9) for i, n in enumerate(nodes)))
    ex = Exposure(1, clock)
    ex.degraded(frozenset({"c"}), rec, 0)
    clock.sleep(5.0)
    ex.notice(frozenset({"a", "b"}), rec, 0)
    assert ex.pending is not None and ex.pending.cause == "loss+notice"
    clock.sleep(2.0)
    moved = rec.rehomed({"a": "d"})
    ex.rehomed(moved)  # b is still on its node: a and b together with c are beyond parity 1
    assert not ex.done
    ex.notice(frozenset({"b"}), moved, 0)  # a went, its part on d: not late
    assert not ex.done
    clock.sleep(1.0)
    ex.notice(frozenset(), moved, 0)  # b went with its part
    [late] = ex.done
    assert late["nodes"] == ["b"] and not late["in_time"] and late["cause"] == "loss+notice" and late["seconds"] == 8.0
    ex = Exposure(1, clock)  # a node both gone and still reported draining: its share is the loss's, never an empty re-protection
    ex.degraded(frozenset({"a"}), rec, 0)
    ex.notice(frozenset({"a"}), rec, 0)
    ex.rehomed(rec.rehomed({"b": "d"}))
    assert ex.done == [] and ex.pending is not None and ex.pending.nodes == {"a"}


def test_a_burst_is_re_homed_over_many_links_and_the_copies_that_protect_the_version_start_first():
    """Many roles off draining nodes are spread over the live nodes' links (copies already queued
    on a link count), a failure domain takes a member beyond the group's parity only when every
    live node's does, and in each group the members beyond parity are copied before the rest. Pure."""
    from elastic_llm.snapshot.records import VersionRecord
    from elastic_llm.snapshot.rehome import choose_homes

    groups = tuple(tuple(f"n{g}{i}" for i in range(4)) for g in range(4))
    rec = VersionRecord(5, groups, ())
    draining = frozenset(m for g in groups[:3] for m in g[:3])  # 3 of 4 members of groups 0-2
    live = [m for g in groups for m in g] + ["x", "y", "z"]
    domains = {m: f"z{i}" for g in groups for i, m in enumerate(g)} | {"x": "zx", "y": "zx", "z": "zx"}
    moves, stranded = choose_homes(rec, draining, live, domains, parity=2)
    assert not stranded and set(moves) == set(draining)
    assert max(list(moves.values()).count(t) for t in set(moves.values())) <= 3  # 9 copies over the free links, not all onto x, y, z
    order = list(moves)
    assert {order[i] for i in range(3)} == {"n00", "n10", "n20"}  # one per group is beyond parity 2: those first
    for g in groups[:3]:  # no node holds two members of a group
        homes = [moves.get(m, m) for m in g]
        assert len(set(homes)) == len(homes)
    busy = choose_homes(rec, draining, live, domains, parity=2, queued={"x": 5, "y": 5, "z": 5})[0]
    assert not {"x", "y", "z"} & set(busy.values())  # their links are busy: others take the copies


def test_a_group_is_critical_once_it_lost_or_is_losing_as_many_members_as_parity_covers():
    """Re-protection waits for its version only while one more loss could be beyond parity. Pure."""
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.exposure import Exposure
    from elastic_llm.snapshot.records import VersionRecord

    rec = VersionRecord(3, (("a", "b", "c", "d"),), ())
    ex = Exposure(2, SimClock())
    assert not ex.critical(rec) and not ex.critical(None)
    ex.degraded(frozenset({"a"}), rec, 0)
    assert not ex.critical(rec)  # one of two spent
    ex.notice(frozenset({"b"}), rec, 0)
    assert ex.critical(rec)  # a gone and b draining: the next loss is beyond parity 2
    assert not ex.critical(rec.rehomed({"b": "x"}))  # b's part re-homed



def test_a_version_waiting_on_a_group_with_a_lost_member_is_dropped_at_once_and_one_already_answered_is_kept():
    """Across a cut link a relay's pull hangs until Ray declares the node dead (~60 s on the
    harness): once the run counts a node lost, a version whose unanswered group holds it is
    dropped at once; one whose groups avoid it stays in flight, and one whose answer is already
    in stays for the next poll to commit."""
    from elastic_llm.config import load_config
    from elastic_llm.sim.world import SimClock, SimRef
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator, _Inflight

    from .conftest import REPO

    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["snapshot.parity=1", "snapshot.group_size=3"])
    coord = SnapshotCoordinator(cfg, _SlowFleet(), "cut", SimClock())
    nodes = ["a", "b", "c", "d", "e", "f"]
    coord.managers = {n: _Unanswered() for n in nodes}
    groups = (("a", "b", "c"), ("d", "e", "f"))
    hangs = _Inflight(7, {"a": SimRef(float("inf"), "a"), "d": SimRef(float("inf"), "d")}, groups, ())
    answered = _Inflight(8, {"a": SimRef(0.0, "a"), "d": SimRef(float("inf"), "d")}, groups, ())
    coord.inflight = [hangs, answered]
    coord.note_alive(set(nodes) - {"g"})  # no member lost: both wait on
    assert coord.inflight == [hangs, answered] and coord.stats.discarded == 0
    coord.note_alive(set(nodes) - {"b"})
    assert coord.inflight == [answered] and coord.stats.discarded == 1  # 8's group with b answered already
    coord.note_alive(set(nodes) - {"b", "e"})
    assert coord.inflight == [] and coord.stats.discarded == 2  # e's group never answered


class _Recorder:
    """A manager that answers every call at once and keeps what it was sent; ``lag``: its parts
    are of an attempt that much older than their plan's (a zombie's)."""

    def __init__(self, sent, lag=0):
        self.sent, self.lag = sent, lag

    def __getattr__(self, name):
        sent, lag = self.sent, self.lag

        class _Method:
            def remote(self, *args):
                from elastic_llm.sim.world import SimRef

                from elastic_llm.snapshot.records import ManagerPart

                sent.append((name, args))
                parts = tuple(ManagerPart(plan.group[plan.me], (), attempt=plan.attempt - lag) for _, plan in args[0]) if name == "relay_versions" else None
                return SimRef(0.0, "", set(range(100)) if name == "held" else parts)  # held: every version

        return _Method()


class _RecordingFleet(_SlowFleet):
    def __init__(self):
        super().__init__()
        self.sent, self.ended, self.started = [], [], []

    def start(self, node, name, run_id, grace_s):
        self.started.append(name)
        return _Recorder(self.sent)

    def end(self, handle):
        self.ended.append(handle)


def test_the_first_version_after_a_node_is_lost_starts_a_generation_its_plans_and_commits_carry_and_a_node_back_gets_a_new_manager():
    """The plans of the first version begun after a node was lost carry its own attempt as the
    floor (what older attempts send from then on is a zombie's); later versions keep that floor,
    and so do the commits and discards. When the run places stages on the lost node again (its
    link healed), the manager it had there is ended and a new one started."""
    from elastic_llm.config import load_config
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator, StageMember
    from elastic_llm.snapshot.records import ATTEMPT_BITS, ShardKey

    from .conftest import REPO

    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["snapshot.parity=1", "snapshot.group_size=3"])
    fleet = _RecordingFleet()
    coord = SnapshotCoordinator(cfg, fleet, "gen", SimClock(), epoch=2)
    nodes = ["a", "b", "c", "d", "e", "f"]
    coord.managers = {n: _Recorder(fleet.sent) for n in nodes}
    old_c = coord.managers["c"]
    stages = [StageMember(ShardKey(i, 0), None, n) for i, n in enumerate(nodes)]

    def plans():
        out = [plan for name, args in fleet.sent if name == "relay_versions" for _, plan in args[0]]
        fleet.sent.clear()
        return out

    coord.begin(1, stages)
    first = plans()
    base = 2 << ATTEMPT_BITS
    assert {(p.attempt, p.floor) for p in first} == {(base, base)}
    coord.poll(block=True, timeout=1)  # answered at once: committed, with its attempt
    assert coord.committed.version == 1 and coord.committed.attempt == base
    assert [(args[0], args[1][-1]) for name, args in fleet.sent if name == "relay"] == [("commit", base)]  # commit(1, ..., floor), one relay for six
    fleet.sent.clear()
    coord.note_alive(set(nodes) - {"c"})
    coord.begin(2, [m for m in stages if m.node_id != "c"])
    assert {(p.attempt, p.floor) for p in plans()} == {(base + 1, base + 1)}  # a new generation
    coord.poll(block=True, timeout=1)
    coord.begin(3, [m for m in stages if m.node_id != "c"])
    assert {(p.attempt, p.floor) for p in plans()} == {(base + 2, base + 1)}
    coord.poll(block=True, timeout=1)
    assert fleet.ended == [] and "c" in coord.gone
    coord.begin(4, stages)  # stages on c again: c rejoins with a new manager
    assert fleet.ended == [old_c] and "c" not in coord.gone and fleet.started == ["smp-gen-c"]
    assert "c" in {p.group[p.me] for p in plans()}


def test_a_version_whose_group_answers_with_a_part_of_another_attempt_never_commits():
    """A committed version never mixes pieces from two generations: a relay that answers with a
    part of an older attempt (a zombie's) drops the version, and the committed one stays."""
    from elastic_llm.config import load_config
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator, StageMember
    from elastic_llm.snapshot.records import ShardKey

    from .conftest import REPO

    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["snapshot.parity=1", "snapshot.group_size=3"])
    fleet = _RecordingFleet()
    coord = SnapshotCoordinator(cfg, fleet, "mix", SimClock())
    nodes = ["a", "b", "c"]
    coord.managers = {n: _Recorder(fleet.sent) for n in nodes}
    stages = [StageMember(ShardKey(i, 0), None, n) for i, n in enumerate(nodes)]
    coord.begin(1, stages)
    coord.poll(block=True, timeout=1)
    assert coord.committed.version == 1
    coord.managers = {n: _Recorder(fleet.sent, lag=1) for n in nodes}  # the group's relay answers with older parts
    coord.begin(2, stages)
    coord.poll(block=True, timeout=1)
    assert coord.committed.version == 1 and not coord.inflight and coord.stats.discarded == 1
