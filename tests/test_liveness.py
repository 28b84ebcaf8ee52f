"""The driver's node watch without Ray: the rule that turns probe outcomes into deaths and
suspects, the watch over a fake node table, and the TCP probe against real sockets on loopback."""

import socket

import pytest

from elastic_llm.config import ConfigError, load_config
from elastic_llm.controller.drains import NodeDeath, Outcome
from elastic_llm.runtime.liveness import NodeWatch, judge, tcp_probe

from .conftest import wait_until

ADDR = {"a": "10.0.0.1:7000", "b": "10.0.0.2:7000"}


def test_a_refused_connection_is_a_death_at_once():
    streak, dead, suspects = judge({}, {"a": Outcome.REFUSED, "b": Outcome.OK}, ADDR, failures=3, now=5.0)
    assert streak == {} and suspects == set()
    assert dead == [NodeDeath("a", "10.0.0.1:7000", Outcome.REFUSED, 1, 0.0)]
    assert "refused" in dead[0].reason() and "10.0.0.1:7000" in dead[0].reason()


def test_timeouts_in_a_row_make_a_suspect_never_a_death_and_an_answer_clears_it():
    """A driver that cannot reach a node (a network blip at the driver, a loaded machine) does not
    know that the node is dead: it stops placing there and shortens its steps' deadlines, but
    declares nothing to Ray, whose health checks decide for every job of the cluster."""
    streak, dead, suspects = judge({}, {"a": Outcome.TIMEOUT}, ADDR, failures=3, now=1.0)
    streak, dead2, suspects2 = judge(streak, {"a": Outcome.TIMEOUT}, ADDR, failures=3, now=1.5)
    assert dead == dead2 == [] and suspects == suspects2 == set() and streak == {"a": (2, 1.0)}
    streak, dead, suspects = judge(streak, {"a": Outcome.OK}, ADDR, failures=3, now=2.0)
    assert (streak, dead, suspects) == ({}, [], set())  # answered: the count starts again
    for t in (2.5, 3.0, 3.5, 4.0):
        streak, dead, suspects = judge(streak, {"a": Outcome.TIMEOUT}, ADDR, failures=3, now=t)
    assert dead == [] and suspects == {"a"} and streak == {"a": (4, 2.5)}
    assert judge(streak, {"a": Outcome.OK}, ADDR, failures=3, now=4.5) == ({}, [], set())


class FakeTable:
    def __init__(self, nodes):
        self.nodes = dict(nodes)
        self.declared = []
        self.reads = 0

    def workers(self):
        self.reads += 1
        return {n: a for n, a in self.nodes.items() if n not in {d.node for d in self.declared}}

    def declare_dead(self, death):
        self.declared.append(death)


def test_the_watch_declares_each_dead_node_once_and_stops_probing_it():
    table = FakeTable({"a": ("h", 1), "b": ("h", 2)})
    outcomes = {1: Outcome.OK, 2: Outcome.REFUSED}
    probed = []

    def probe(host, port, timeout):
        probed.append(port)
        return outcomes[port]

    w = NodeWatch(table, period_s=0.0, failures=3, probe=probe, clock=lambda: 0.0)
    assert [d.node for d in w.sweep()] == ["b"]
    assert w.sweep() == [] and w.sweep(refresh=True) == []
    assert [d.node for d in table.declared] == ["b"]  # told to Ray once
    assert probed == [1, 2, 1, 1]  # a declared node is not probed again
    assert w.watching() == {"a"}
    assert [d.node for d in w.take()] == ["b"] and w.take() == []


def test_a_verdict_is_handed_to_the_run_at_once_and_a_listener_that_raises_changes_no_verdict(caplog):
    """The run's step hears of a death when the watch judges it (on the judging thread), not at its
    next look; a listener that raises is logged, and the verdict and the next rounds stand."""
    table = FakeTable({"a": ("h", 1), "b": ("h", 2), "c": ("h", 3)})
    outcomes = {1: Outcome.OK, 2: Outcome.REFUSED, 3: Outcome.TIMEOUT}
    w = NodeWatch(table, period_s=0.0, failures=1, probe=lambda h, p, t: outcomes[p], clock=lambda: 0.0)
    told = []
    w.on_death = told.append
    assert [d.node for d in w.sweep()] == ["b"]
    assert told == [{"b"}]  # a suspect (a timeout) is not a death: "c" is not told
    w.sweep()
    assert told == [{"b"}]  # told once
    outcomes[1] = Outcome.REFUSED

    def broken(nodes):
        raise RuntimeError("the executor is gone")

    w.on_death = broken
    assert [d.node for d in w.sweep()] == ["a"]
    assert w.dead() == {"a", "b"} and [d.node for d in table.declared] == ["b", "a"]  # judged and declared all the same
    assert "telling the run about a failed (RuntimeError: the executor is gone)" in caplog.text


def test_a_watch_that_may_not_declare_reports_the_death_and_tells_ray_nothing():
    table = FakeTable({"a": ("h", 1), "b": ("h", 2)})
    w = NodeWatch(table, period_s=0.0, failures=3, probe=lambda h, p, t: Outcome.REFUSED if p == 2 else Outcome.TIMEOUT, clock=lambda: 0.0, declare=False)
    for _ in range(3):
        w.sweep()
    assert table.declared == [] and [d.node for d in w.take()] == ["b"]
    assert w.suspects() == {"a"} and w.watching() == {"a"}


def test_a_slow_declaration_or_probe_never_holds_the_training_thread():
    """take() and suspects() are called by the training thread after every step: a probe round
    (a node timing out) or a declaration Ray does not answer (the GCS of Ray 2.60 never answers an
    UnregisterNode for a node it already removed) must not make them wait."""
    import threading
    import time

    release = threading.Event()

    class SlowTable(FakeTable):
        def declare_dead(self, death):
            release.wait(30)
            super().declare_dead(death)

    table = SlowTable({"a": ("h", 1), "b": ("h", 2)})
    w = NodeWatch(table, period_s=0.0, failures=1, probe=lambda h, p, t: Outcome.REFUSED if p == 2 else Outcome.TIMEOUT, clock=lambda: 0.0)
    sweeper = threading.Thread(target=w.sweep)
    sweeper.start()
    try:
        wait_until(lambda: w._deaths, 10, "the verdict", every=0.01)  # the verdict is in, the declaration hangs
        t = time.monotonic()
        assert [d.node for d in w.take()] == ["b"] and w.suspects() == {"a"}
        assert time.monotonic() - t < 15  # not held by the declaration (it would be, for its 30 s)
        assert sweeper.is_alive()  # still declaring
    finally:
        release.set()
        sweeper.join(10)
    assert [d.node for d in table.declared] == ["b"]


def test_the_watch_reads_the_node_table_again_only_now_and_then():
    table = FakeTable({"a": ("h", 1)})
    now = [0.0]
    w = NodeWatch(table, period_s=0.0, failures=1, probe=lambda h, p, t: Outcome.OK, clock=lambda: now[0])
    w.sweep()
    w.sweep()
    assert table.reads == 1
    now[0] = 10.0
    w.sweep()
    w.sweep(refresh=True)
    assert table.reads == 3


def test_tcp_probe_on_loopback_sockets():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        assert tcp_probe("127.0.0.1", port, 1.0) is Outcome.OK
    assert tcp_probe("127.0.0.1", port, 1.0) is Outcome.REFUSED  # nothing listens there any more


@pytest.mark.parametrize("field, value", [("node_probe_s", "-1"), ("node_probe_failures", "0"), ("driver_grace_s", "-1")])
def test_bad_probe_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"recovery.{field}"):
        load_config(None, [f"recovery.{field}={value}"])


class LoopbackRaylet:
    """A stand-in raylet on 127.0.0.1: accepts connections and greets each (as gRPC's server
    sends its settings at once); :meth:`die` closes everything as a killed process would."""

    def __init__(self) -> None:
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.accepted = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                conn.sendall(b"settings")
            except OSError:  # a probe, closed already
                conn.close()
                continue
            self.conns.append(conn)

    def close_idle(self) -> None:
        """Close the connections it holds, listening on (gRPC's handshake timeout)."""
        conns, self.conns = self.conns, []
        for c in conns:
            c.close()

    def die(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept: a bare close would leave it listening
        except OSError:  # died already
            pass
        self.listener.close()
        self.close_idle()
        self.thread.join(5)


def test_a_held_connection_that_closes_starts_the_next_round_at_once():
    """Rounds every 60 s: a node is judged dead within the test's seconds only because the watch
    probed again when its held connection closed. A raylet that only closes an idle connection
    answers that probe and is held again; its greeting bytes are no death either."""
    from elastic_llm.runtime.liveness import tcp_hold

    raylet, other = LoopbackRaylet(), LoopbackRaylet()
    table = FakeTable({"a": ("127.0.0.1", raylet.port), "b": ("127.0.0.1", other.port)})
    w = NodeWatch(table, period_s=60.0, failures=3, hold=tcp_hold)
    w.start()
    try:
        wait_until(lambda: raylet.accepted == other.accepted == 2, 5, "the first round's probe and hold", every=0.005)  # the first round's probe and the held connection
        other.close_idle()
        wait_until(lambda: w.early == 1 and other.accepted == 4, 5, "a probe after the closed connection", every=0.005)  # probed at once, answered, held again
        assert table.declared == [] and w.errors == 0
        raylet.die()
        wait_until(lambda: [d.node for d in table.declared] == ["a"], 5, "the dead raylet declared", every=0.005)
        assert w.early == 2 and w.dead() == {"a"} and w.watching() == {"b"}
    finally:
        w.stop()
        raylet.die()
        other.die()
    assert w._thread is None and w._held == {}  # joined, and every held connection closed
