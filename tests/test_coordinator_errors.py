"""What the snapshot coordinator treats as a lost manager and what it lets through: each place
where it reads a manager's answer handles the failures a run meets (an actor or node gone as
Ray's and the simulation's calls report it, :class:`ManagerLost`; a manager's own RuntimeError;
a version or shard not held, :class:`SnapshotMissingError`; no answer, TimeoutError; a refused
manager, :class:`NodeGone`) and propagates a bug in the code (a TypeError, an AttributeError)
instead of calling it a dead manager, a dropped version or a lost source.

The coordinator is the real one; its managers and their calls are stand-ins that answer with a
value or raise what they are told to, as Ray's ``get`` would raise a manager's exception.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from elastic_llm.config import load_config
from elastic_llm.snapshot.coordinator import SnapshotCoordinator, StageMember
from elastic_llm.snapshot.ports import ManagerLost
from elastic_llm.snapshot.rebuild import SnapshotMissingError
from elastic_llm.snapshot.records import ManagerPart, ShardInfo, ShardKey, VersionRecord
from elastic_llm.snapshot.introductions import Acquaintances
from elastic_llm.sources import NodeGone, SourceLost

from .conftest import REPO

pytestmark = pytest.mark.timeout(120)

HANDLED = [
    ManagerLost(RuntimeError("The actor died unexpectedly before finishing this task.")),
    RuntimeError("no snapshot of step 7 on stage 1 replica 0"),  # a manager's own failure
    SnapshotMissingError("step 7, attempt 1: discarded or superseded while its pieces were collected"),
    TimeoutError("no answer"),
    NodeGone(frozenset({"b"}), "Ray's scheduler refused a snapshot manager there"),
]
BUGS = [TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'"), AttributeError("'NoneType' object has no attribute 'shards'")]


class Ref:
    ids = itertools.count()

    def __init__(self, value: object = None, error: BaseException | None = None, ready: bool = True) -> None:
        self.id, self.value, self.error, self.ready = next(self.ids), value, error, ready


class Calls:
    def wait(self, refs, num_returns, timeout):
        return [r for r in refs if r.ready], [r for r in refs if not r.ready]

    def get(self, ref, timeout=None):
        if not ref.ready:
            raise TimeoutError("not ready")
        if ref.error is not None:
            raise ref.error
        return ref.value


class Method:
    def __init__(self, answer) -> None:
        self.answer = answer

    def remote(self, *args):
        return self.answer(*args)


class Manager:
    """A node's manager: holds ``held``; ``fail`` maps a method to what its answer raises."""

    def __init__(self, node: str, held: dict[int, bool], fail: dict[str, BaseException] | None = None, ready: bool = True) -> None:
        fail = fail or {}
        self.node = node

        def answer(method: str, value: object) -> Method:
            return Method(lambda *args: Ref(value(*args) if callable(value) else value, fail.get(method), ready or method != "relay_versions"))

        self.held = answer("held", held)
        known = Acquaintances()  # a plan names the members this manager was sent before by id only

        def relay_versions(calls):
            members = [(known.handle(h, p.attempt).node, p) for h, p in calls]
            return tuple(ManagerPart(n, tuple(ShardInfo(k, p.version, 0, 8, (), "{}", node_id=n) for k, _ in p.stages), attempt=p.attempt) for n, p in members)

        self.relay_versions = answer("relay_versions", relay_versions)
        for method in ("relay", "commit", "discard", "discard_all", "unpin"):
            setattr(self, method, answer(method, None))
        self.shard_parts = answer("shard_parts", ["piece"])


class Fleet:
    def __init__(self) -> None:
        self.calls = Calls()

    def nodes(self):
        return {"a", "b", "c"}

    def domains(self):
        return {}

    def start(self, node, name, run_id, grace_s):
        raise AssertionError("every test gives the coordinator its managers")

    def end(self, handle):
        pass


def coordinator(fails: dict[str, BaseException], on: str = "b", ready: bool = True, fleet: Fleet | None = None) -> SnapshotCoordinator:
    """Managers on a, b and c (those on ``on`` answer with ``fails``), version 7 committed on them."""
    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["parallel.stages=3", "model.n_layers=3", "snapshot.parity=1", "snapshot.group_size=3"])
    coord = SnapshotCoordinator(cfg, fleet or Fleet(), "errors")
    coord.managers = {n: Manager(n, {7: True}, fails if n in on else None, ready) for n in ("a", "b", "c")}
    coord.committed = VersionRecord(7, (("a", "b", "c"),), tuple(ShardInfo(ShardKey(i, 0), 7, 0, 8, (), "{}", node_id=n) for i, n in enumerate("abc")))
    return coord


def stages() -> list[StageMember]:
    return [StageMember(ShardKey(i, 0), None, n) for i, n in enumerate("abc")]


@pytest.mark.parametrize("err", HANDLED, ids=lambda e: type(e).__name__)
def test_a_manager_that_is_gone_counts_as_lost_with_why(err):
    why = coordinator({"held": err}).lost_parts({"a", "b", "c"})
    assert list(why) == ["b"]
    assert why["b"].startswith("its manager did not answer" if isinstance(err, TimeoutError) else "its manager is gone")


@pytest.mark.parametrize("err", BUGS, ids=lambda e: type(e).__name__)
def test_a_bug_in_the_census_of_lost_parts_propagates(err):
    with pytest.raises(type(err)):
        coordinator({"held": err}).lost_parts({"a", "b", "c"})


@pytest.mark.parametrize("err", HANDLED, ids=lambda e: type(e).__name__)
def test_a_version_whose_relay_failed_is_discarded_and_the_next_one_commits(err, caplog):
    coord = coordinator({"relay_versions": err}, on="abc")  # (whichever leads the group relays)
    coord.begin(8, stages())
    with caplog.at_level(logging.WARNING, "elastic_llm.snapshot"):
        coord.poll()
    assert coord.inflight == [] and coord.stats.discarded == 1 and coord.committed.version == 7
    assert "snapshot of step 8 discarded" in caplog.text
    for n, m in coord.managers.items():
        m.relay_versions = Manager(n, {}).relay_versions  # the managers work again (successors)
    coord.begin(9, stages())
    coord.poll()
    assert coord.committed.version == 9 and coord.stats.committed == 1


@pytest.mark.parametrize("err", BUGS, ids=lambda e: type(e).__name__)
def test_a_bug_reading_a_versions_answer_propagates_instead_of_discarding_it(err):
    coord = coordinator({"relay_versions": err}, on="abc")
    coord.begin(8, stages())
    with pytest.raises(type(err)):
        coord.poll()
    assert coord.stats.discarded == 0


@pytest.mark.parametrize("err", HANDLED + BUGS, ids=lambda e: type(e).__name__)
def test_the_late_answers_of_a_dropped_version_are_read_and_only_a_bug_among_them_propagates(err):
    coord = coordinator({"relay_versions": err}, on="abc", ready=False)
    coord.begin(8, stages())
    coord.abandon_pending()  # its training step failed: dropped while its relays still work
    assert coord.stats.discarded == 1 and coord._dropped
    for ref in coord._dropped:
        ref.ready = True  # the relays answer now, with the failure
    if type(err) in map(type, BUGS):
        with pytest.raises(type(err)):
            coord.poll()
    else:
        coord.poll()
        assert coord._dropped == []


@pytest.mark.parametrize("err", HANDLED, ids=lambda e: type(e).__name__)
def test_a_shard_that_fails_to_load_is_a_lost_source(err):
    coord = coordinator({"shard_parts": err})
    with pytest.raises(SourceLost, match="step 7 failed to load on its node b"):
        coord.fetch_stage_state(1, 0, frozenset())
    assert coord.unloadable == {"b": 7}
    assert coord.fetch_stage_state(0, 0, frozenset()).refs == ("piece",)  # a's shard loads


@pytest.mark.parametrize("err", BUGS, ids=lambda e: type(e).__name__)
def test_a_bug_loading_a_shard_propagates_and_marks_nothing_lost(err):
    coord = coordinator({"shard_parts": err})
    with pytest.raises(type(err)):
        coord.fetch_stage_state(1, 0, frozenset())
    assert coord.unloadable == {}


DIED = ManagerLost(RuntimeError("The actor died unexpectedly before finishing this task. The actor died because its node has died."))


class Starting(Fleet):
    """Starts managers as told: the n-th start on a node gets a manager whose answers to
    ``held`` raise ``script[node][n]`` (None: it answers)."""

    def __init__(self, script: dict[str, list[BaseException | None]]) -> None:
        super().__init__()
        self.script, self.started = script, []

    def start(self, node, name, run_id, grace_s):
        self.started.append(name)
        err = self.script[node].pop(0)
        return Manager(node, {7: True}, {"held": err} if err is not None else None)


class Counted(Manager):
    """A manager that answers ``held`` and counts how often it was asked."""

    def __init__(self, node: str) -> None:
        super().__init__(node, {7: True})
        self.asked = 0

        def held() -> Ref:
            self.asked += 1
            return Ref((7,))
        self.held = Method(held)


def test_a_node_whose_new_manager_dies_before_answering_counts_as_lost_and_nothing_raises():
    """The loopback replay of Bamboo's p3 trace stopped here: a removed node that Ray's node table
    still listed got a new manager, which died at once (``ActorDiedError``: its node had died)."""
    fleet = Starting({"b": [DIED]})
    coord = coordinator({"held": DIED}, fleet=fleet)  # b's manager is gone: the census finds it, a new one is started there
    assert coord.ensure_managers() == {"b"}
    assert set(coord.managers) == {"a", "c"} and "b" in coord.gone and len(fleet.started) == 1
    assert coord.ensure_managers() == frozenset() and len(fleet.started) == 1  # a gone node gets no new manager


def test_each_manager_is_asked_once_the_census_then_only_the_new_ones():
    """ensure_managers asks each manager there is once (the census of lost parts) and then only
    the new ones whether they answer. b's manager is gone: the census finds it and a new one is
    started there; a and c, which answered the census, are not asked again. A manager started now
    that dies before its first answer is a lost node (the test above)."""
    fleet = Starting({"b": [None]})
    coord = coordinator({"held": DIED}, fleet=fleet)
    coord.managers["a"], coord.managers["c"] = Counted("a"), Counted("c")
    assert coord.ensure_managers() == frozenset() and len(fleet.started) == 1 and set(coord.managers) == {"a", "b", "c"}
    assert (coord.managers["a"].asked, coord.managers["c"].asked) == (1, 1)
    assert coord.ensure_managers() == frozenset() and len(fleet.started) == 1  # all answer: nothing new started
    assert (coord.managers["a"].asked, coord.managers["c"].asked) == (2, 2)


@pytest.mark.parametrize("err", BUGS, ids=lambda e: type(e).__name__)
def test_a_bug_in_a_new_managers_answer_propagates(err):
    coord = coordinator({"held": DIED}, fleet=Starting({"b": [err]}))
    with pytest.raises(type(err)):
        coord.ensure_managers()
