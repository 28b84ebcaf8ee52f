"""Driver failover without Ray: what ``--resume`` names, and the keepalive thread."""

import threading

from elastic_llm.controller.ports import is_run_id
from elastic_llm.runtime.failover import Keepalive


def test_a_resume_names_a_run_or_a_checkpoint():
    assert is_run_id("3f2a9c")
    assert not is_run_id("/tmp/ckpt/checkpoint_000010") and not is_run_id("3F2A9C0") and not is_run_id("runs/3f2a9c")


class Manager:
    def __init__(self):
        self.calls = threading.Event()
        self.keepalive = self

    def remote(self):
        self.calls.set()


def test_the_keepalive_reaches_every_manager_until_stopped():
    managers = [Manager(), Manager()]
    k = Keepalive(lambda: managers, period_s=0.01)
    k.start()
    assert all(m.calls.wait(5) for m in managers)
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
    k = Keepalive(lambda: [Broken(), good], period_s=0.01)
    k.start()
    assert good.calls.wait(5)
    k.stop()
    assert k.errors >= 1
