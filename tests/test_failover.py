"""Driver failover without Ray: what ``--resume`` names, and the keepalive thread."""

import threading

from elastic_llm.controller.failover import Keepalive, is_run_id


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
