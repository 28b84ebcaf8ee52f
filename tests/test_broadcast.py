"""Broadcast: commits and discards relayed to every snapshot manager, and delivered past a relay
that cannot answer. Driver-side logic over a Calls seam; here with calls that record what was
waited for and handles that record what they were asked."""

from __future__ import annotations

import itertools

from elastic_llm.snapshot.broadcast import Broadcast


class Ref:
    ids = itertools.count()

    def __init__(self, done: bool = True) -> None:
        self.id, self.done = next(self.ids), done


class Calls:
    def __init__(self) -> None:
        self.waits: list[tuple[list[Ref], float]] = []

    def wait(self, refs, n, timeout):
        self.waits.append((list(refs), timeout))
        return [r for r in refs if r.done], [r for r in refs if not r.done]

    def get(self, ref, timeout=None):
        if not ref.done:
            raise TimeoutError("no answer")
        return None


class Method:
    def __init__(self, log: list, node: str, name: str, answers: bool) -> None:
        self.log, self.node, self.name, self.answers = log, node, name, answers

    def remote(self, *args):
        self.log.append((self.node, self.name, args[:2] if self.name == "relay" else args))
        return Ref(done=self.answers)


class Manager:
    def __init__(self, log: list, node: str, relay_answers: bool = True) -> None:
        self.relay = Method(log, node, "relay", relay_answers)
        self.discard = Method(log, node, "discard", True)
        self.commit = Method(log, node, "commit", True)


def test_a_relay_with_a_member_on_a_dead_node_is_not_waited_for_its_live_members_get_the_call():
    log: list = []
    calls = Calls()
    managers = {n: Manager(log, n, relay_answers=False) for n in ("a", "b", "c")}  # a's relay waits on c, whose node died
    b = Broadcast(calls, wait_s=10.0)
    b.send(managers, "discard", 7, 1)
    assert [(n, m) for n, m, _ in log] == [("a", "relay")]
    log.clear()
    resent = b.settle(managers, block=True, gone=frozenset({"c"}))
    assert sorted((n, m, args) for n, m, args in log) == [("a", "discard", (7, 1)), ("b", "discard", (7, 1))]  # not c
    assert not any(10.0 == t and any(not r.done for r in refs) for refs, t in calls.waits)  # the stuck relay was not waited for
    assert len(resent) == 3 and b.pending == []  # the relay's ref and the two direct calls, for the caller to read


def sent(nodes: str, method: str, *args: int, relay_answers: bool = True):
    """A Broadcast over managers on ``nodes`` (one letter each) that sent ``method(*args)``
    through its relay; the managers' call log cleared after the send."""
    log: list = []
    calls = Calls()
    managers = {n: Manager(log, n, relay_answers=relay_answers) for n in nodes}
    b = Broadcast(calls, wait_s=10.0)
    b.send(managers, method, *args)
    log.clear()
    return log, calls, managers, b


def test_without_a_dead_node_a_relay_that_does_not_answer_is_waited_for_then_passed():
    log, calls, managers, b = sent("abc", "discard", 7, 1, relay_answers=False)
    b.settle(managers, block=True)
    assert calls.waits[-2][1] == 10.0 and not calls.waits[-2][0][0].done  # waited its wait_s for the relay
    assert sorted(n for n, m, _ in log) == ["b", "c"]  # then its other members got the call directly


def test_a_relay_that_answered_needs_nothing_more():
    log, _, managers, b = sent("ab", "discard", 3, 0)
    assert b.settle(managers, block=True, gone=frozenset({"z"})) == [] and log == [] and b.pending == []


def test_without_block_a_relay_with_a_member_on_a_dead_node_is_passed_at_once_and_a_slow_one_kept():
    """A run may fail before any blocking settle: the live members of a relay stuck on a dead
    node get the call at the next non-blocking one; a relay that is merely slow stays pending."""
    log, calls, managers, b = sent("abc", "commit", 7, 1, relay_answers=False)
    b.settle(managers, block=False)
    assert log == [] and len(b.pending) == 1  # nothing known dead: the relay may still answer
    resent = b.settle(managers, block=False, gone=frozenset({"a"}))  # the relay's own node died
    assert sorted((n, m, args) for n, m, args in log) == [("b", "commit", (7, 1)), ("c", "commit", (7, 1))]
    assert all(t == 0 for _, t in calls.waits) and b.pending == [] and len(resent) == 3
