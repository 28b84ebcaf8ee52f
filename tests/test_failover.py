"""Driver failover without Ray: what ``--resume`` names, the keepalive thread, and the lease an
actor that outlives its driver holds."""

import threading

import pytest

from elastic_llm.controller.ports import is_run_id
from elastic_llm.lease import Lease
from elastic_llm.runtime.failover import Keepalive
from elastic_llm.sim.world import SimClock


def test_a_resume_names_a_run_or_a_checkpoint():
    assert is_run_id("3f2a9c")
    assert not is_run_id("/tmp/ckpt/checkpoint_000010") and not is_run_id("3F2A9C0") and not is_run_id("runs/3f2a9c")


class Manager:
    def __init__(self):
        self.calls = threading.Event()
        self.keepalive = self
        self.groups = []

    def options(self, concurrency_group):
        self.groups.append(concurrency_group)
        return self

    def remote(self):
        self.calls.set()


def test_the_keepalive_reaches_every_manager_until_stopped():
    managers = [Manager(), Manager()]
    k = Keepalive(lambda: [(managers[0], None), (managers[1], "control")], period_s=0.01)
    k.start()
    assert all(m.calls.wait(5) for m in managers)
    assert not managers[0].groups and set(managers[1].groups) == {"control"}  # a stage actor's goes to its control thread, not behind a step
    k.stop()
    assert not k._thread.is_alive()  # stop() waited for the thread
    for m in managers:
        m.calls.clear()
    assert not any(m.calls.wait(0.05) for m in managers)  # and nothing is sent after it


def test_a_keepalive_that_cannot_reach_a_manager_goes_on_and_counts_it():
    class Broken:
        class keepalive:  # noqa: N801 - stands for an actor method
            @staticmethod
            def remote():
                raise ConnectionError("the GCS is unreachable for a moment")

    good = Manager()
    k = Keepalive(lambda: [(Broken(), None), (good, None)], period_s=0.01)
    k.start()
    assert good.calls.wait(5)
    k.stop()
    assert k.errors >= 1


def test_a_lease_renewed_in_time_holds_and_one_left_alone_releases_then_ends():
    clock = SimClock()  # simulated seconds: only this test moves them, so each look sees a known instant
    ended, released = [], []
    held = Lease(30.0, "held", clock, release=lambda: released.append("held"), exit=ended.append)
    left = Lease(30.0, "left", clock, release=lambda: released.append("left"), exit=ended.append, poll_s=0.01)
    for _ in range(10):  # 50 simulated s, past the grace: only the renewed one holds
        held.renew()
        clock.advance(clock.now + 5.0)
        assert not held.expire_if_due()
        assert left.expire_if_due() == (clock.now >= 30.0), clock.now  # ends exactly when its grace has passed
        assert left.left_s() == pytest.approx(30.0 - clock.now)
    left._thread.join(5)  # its watch thread saw it expired and stopped
    assert not left._thread.is_alive() and left.expired and not held.expired
    assert released == ["left"] and ended == [0]  # what it holds released first, then the process ends, once
    held.stop()
    assert not held._thread.is_alive() and not held.expired


def test_a_lease_whose_release_fails_still_ends_the_process_from_its_watch_thread():
    clock, ended = SimClock(), []
    lease = Lease(1.0, "broken", clock, release=lambda: 1 / 0, exit=ended.append, poll_s=0.01)
    assert not lease.expired
    clock.advance(1.0)  # the grace passes with nobody looking but the lease's own thread
    lease._thread.join(5)
    assert ended == [0] and lease.expired
    with pytest.raises(ValueError, match="more than 0 seconds"):
        Lease(0, "none", clock)
