"""Actor handles in the snapshot plans go to each receiver once: by id only after it answered.

Pure tests of :mod:`elastic_llm.snapshot.introductions` and of the coordinator's plans over
recording managers; the managers' side on a real cluster is in ``tests/test_snapshot_cluster.py``.
"""

from __future__ import annotations

import pytest

from elastic_llm.snapshot.introductions import KEEP, TRUST, Acquaintances, Introductions, Known, Unknown, actor_id

from .test_groups import _Recorder, _RecordingFleet

pytestmark = pytest.mark.timeout(60)


class Actor:
    pass


def test_a_handle_goes_with_each_plan_until_the_receiver_answered_then_by_id_while_its_answer_is_recent():
    intro, a = Introductions(), Actor()
    first = intro.name("lead", a, 10)
    assert first == Known(actor_id(a), a)
    assert intro.name("lead", a, 11).handle is a  # sent, not answered yet: sent again
    intro.answered("lead", [first], 10)
    assert intro.name("lead", a, 11) == Known(actor_id(a), None)
    assert intro.name("lead", a, 10 + TRUST).handle is None
    assert intro.name("lead", a, 11 + TRUST).handle is a  # its answer is too old: it may have forgotten
    assert intro.name("other", a, 11).handle is a  # another receiver was never sent it


def test_a_failed_call_makes_the_next_plan_carry_every_handle_again():
    intro, a, b = Introductions(), Actor(), Actor()
    intro.answered("lead", [Known.of(a), Known.of(b)], 5)
    assert intro.name("lead", b, 6).handle is None
    intro.failed("lead")
    assert intro.name("lead", a, 6).handle is a and intro.name("lead", b, 6).handle is b


def test_a_receiver_keeps_what_it_was_sent_refuses_an_id_it_never_got_and_forgets_what_no_plan_named_for_keep_attempts():
    known, a, b = Acquaintances(), Actor(), Actor()
    assert known.handle(Known.of(a), 3) is a
    assert known.handle(Known(actor_id(a)), 3) is a  # by id only: the one it holds
    with pytest.raises(Unknown, match=actor_id(b)):
        known.handle(Known(actor_id(b)), 4)
    known.handle(Known.of(b), 4)
    assert known.handle(Known(actor_id(b)), 4 + KEEP) is b  # a plan of a newer attempt: b was last named KEEP attempts ago, a one more
    assert len(known) == 1
    with pytest.raises(Unknown):
        known.handle(Known(actor_id(a)), 4 + KEEP)


def test_what_a_sender_trusts_a_receiver_has_never_outlives_what_the_receiver_keeps():
    """The sender leaves a handle out only within TRUST attempts of an answer; the receiver keeps
    it KEEP attempts after the last plan named it; two versions may be in flight at once."""
    assert KEEP > 2 * TRUST


def _coordinator():
    from elastic_llm.config import load_config
    from elastic_llm.sim.world import SimClock
    from elastic_llm.snapshot.coordinator import SnapshotCoordinator, StageMember
    from elastic_llm.snapshot.records import ShardKey

    from .conftest import REPO

    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["snapshot.parity=1", "snapshot.group_size=3"])
    fleet = _RecordingFleet()
    coord = SnapshotCoordinator(cfg, fleet, "intro", SimClock())
    coord.managers = {n: _Recorder(fleet.sent) for n in "abc"}
    stages = [StageMember(ShardKey(i, 0), Actor(), n) for i, n in enumerate("abc")]
    return coord, fleet, stages


def _named(fleet) -> list[Known]:
    """Every actor the relay_versions calls named since the last look (by handle or by id only)."""
    out = []
    for name, args in fleet.sent:
        if name == "relay_versions":
            for member, plan in args[0]:
                out += [member, *(s for _, s in plan.stages), *plan.peers]
    fleet.sent.clear()
    return out


def _handles_sent(fleet) -> list[object]:
    return [k.handle for k in _named(fleet) if k.handle is not None]


def test_the_coordinators_plans_name_the_actors_by_id_once_the_lead_answered_and_with_handles_again_after_it_failed():
    coord, fleet, stages = _coordinator()
    coord.begin(1, stages)
    first = _handles_sent(fleet)
    assert set(map(id, first)) == {id(m) for m in coord.managers.values()} | {id(s.actor) for s in stages}
    coord.begin(2, stages)  # 1 not answered yet: 2 carries the handles too
    assert len(_handles_sent(fleet)) == len(first)
    coord.poll(block=True, timeout=1)
    assert coord.committed.version == 2
    coord.begin(3, stages)
    assert _handles_sent(fleet) == []  # the lead answered plans naming every one of them
    coord.poll(block=True, timeout=1)

    failing = coord.managers["a"]  # the group's lead (a, b, c: a sorts first)

    class Fails:
        def remote(self, *args):
            from elastic_llm.sim.world import SimRef

            fleet.sent.append(("relay_versions", args))
            return SimRef(0.0, "a", None, refused=True)  # its call fails (NodeGone)

    failing.__dict__["relay_versions"] = Fails()
    coord.begin(4, stages)
    assert _handles_sent(fleet) == []
    coord.poll(block=True, timeout=1)
    assert coord.stats.discarded >= 1 and coord.committed.version == 3
    del failing.__dict__["relay_versions"]
    coord.begin(5, stages)
    named = _named(fleet)
    assert named and all(k.handle is not None for k in named)  # after a failure: every handle again
