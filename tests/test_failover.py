"""Driver failover without Ray: what ``--resume`` names, the keepalive thread, and the lease an
actor that outlives its driver holds."""

import threading
import time

import pytest

from elastic_llm.controller.ports import is_run_id
from elastic_llm.lease import Lease
from elastic_llm.runtime.failover import Keepalive


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
    ended, released = [], []
    held = Lease(0.3, "held", release=lambda: released.append("held"), exit=ended.append)
    left = Lease(0.3, "left", release=lambda: released.append("left"), exit=ended.append)
    for _ in range(10):  # 0.5 s, past the grace: only the renewed one holds
        held.renew()
        time.sleep(0.05)
    left._thread.join(5)
    assert left.expired and not held.expired
    assert released == ["left"] and ended == [0]  # what it holds released first, then the process ends
    held.stop()
    assert not held._thread.is_alive() and not held.expired


def test_a_lease_whose_release_fails_still_ends_the_process():
    ended = []
    lease = Lease(0.05, "broken", release=lambda: 1 / 0, exit=ended.append)
    lease._thread.join(5)
    assert ended == [0]
    with pytest.raises(ValueError, match="more than 0 seconds"):
        Lease(0, "none")
