"""Node liveness: the driver notices a dead node by its first refused connection and tells Ray.

Owns: :class:`NodeWatch`, which every ``recovery.node_probe_s`` (and once more whenever a recovery
observes the cluster) opens a TCP connection to the raylet of every live worker node, and the pure
rule that turns what it saw into verdicts (:func:`judge`):

- a **refused** connection is a dead node at once: the machine answered and nothing listens on
  the raylet's port any more (the raylet process is gone, and with it the node's actors and object
  store). With ``recovery.node_probe_declare`` (the default) the death is declared to Ray's GCS
  (``UnregisterNode`` with the reason), so Ray's own view follows at once: calls to the node's
  actors fail with ``ActorDiedError``, the node drops out of ``ray.nodes()`` and its bundles are
  placed again elsewhere;
- a connection that **times out** ``recovery.node_probe_failures`` times in a row makes the node a
  **suspect** of this run only: nothing is declared to Ray (a network blip at the driver is not a
  dead node, and on a shared cluster a node unregistered by one job is gone for every job). The
  run places nothing new there and gives steps with actors there a short deadline; an answer
  clears the suspicion. Ray's own health checks decide whether the node is dead.

Between rounds the watch holds one idle connection open to each raylet that answered (a
:data:`Hold` seam: :func:`tcp_hold` on Ray) and waits on them all: a raylet that dies while its
machine lives (killed, crashed, its machine shutting down for a preemption) closes its end at
once, and the watch probes again at that moment instead of at the next round (measured on the
loopback cluster: a removed node judged dead within milliseconds of its raylet's end, not up to
one period later). A raylet that closes an idle connection itself (gRPC's handshake timeout)
answers the probe that follows and is held again. A machine that vanishes closes nothing: the
rounds' timeouts remain the net for that.

A verdict reaches the run at once through :attr:`NodeWatch.on_death` (the step executor's
:meth:`~elastic_llm.pipeline.executor.RayStepExecutor.nodes_died`: a step in flight with an actor
there wakes its other actors from the judging thread), not at the driver's next look at
:meth:`NodeWatch.dead` (every ``LOOK_S``; measured on the loopback cluster, 33-47 ms after the
verdict in nine parity recoveries).

Without the watch (``recovery.node_probe_s: 0``), Ray's health checks notice a dead node
(``cluster.yaml``: period 1 s, timeout 1 s, 3 failures; Ray's defaults take 15-30 s).

Never probes the head node (if it died, the GCS went with it: that is driver failover's business),
never decides how to recover, and never touches an actor. Cost: one ``ray.nodes()`` every
:data:`REFRESH_S`, one TCP connect per worker node per round (sequential; a node that times
out holds the round up by ``timeout_s``) and one idle connection held per worker node. The Ray side
(node table, the GCS call, the socket probe, the held connection) sits behind the small
:class:`NodeTable`, :data:`Probe` and :data:`Hold` seams, so the rule and
the watch run with fakes.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from elastic_llm.controller.drains import PROBE_TIMEOUT_S, NodeDeath, Outcome


log = logging.getLogger("elastic_llm.runtime")
REFRESH_S = 2.0  # how often the watch reads Ray's node table again (new nodes are probed from then on)
DECLARE_S = 10.0  # how long a death declared to the GCS may go unanswered before its outcome is logged as unknown


def _declared(node: str, call: Any) -> None:
    """The outcome of a declared death (on gRPC's thread): logged, never raised."""
    err = call.exception()
    if err is None:
        log.debug("node %s declared dead to Ray", node[:12])
    else:  # unanswered: most often Ray had removed the node already (see RayNodeTable.declare_dead)
        log.debug("node %s: Ray did not confirm its death (%s); its own health checks decide", node[:12], getattr(err, "code", lambda: err)())


def judge(streak: dict[str, tuple[int, float]], seen: dict[str, Outcome], addresses: dict[str, str], failures: int,
          now: float) -> tuple[dict[str, tuple[int, float]], list[NodeDeath], set[str]]:
    """One probe round (pure). ``streak``: per node, failed probes in a row and when the first of
    them happened. Returns the new streaks, the nodes now judged dead (a refusal) and the
    suspects (``failures`` or more timeouts in a row, not answered since)."""
    out: dict[str, tuple[int, float]] = {}
    dead: list[NodeDeath] = []
    suspects: set[str] = set()
    for node, outcome in sorted(seen.items()):
        if outcome is Outcome.OK:
            continue
        count, since = streak.get(node, (0, now))
        count += 1
        if outcome is Outcome.REFUSED:
            dead.append(NodeDeath(node, addresses.get(node, "?"), outcome, count, now - since))
            continue
        out[node] = (count, since)
        if count >= failures:
            suspects.add(node)
    return out, dead, suspects


Probe = Callable[[str, int, float], Outcome]


def tcp_probe(host: str, port: int, timeout: float) -> Outcome:
    """Open (and close at once) a TCP connection to ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return Outcome.OK
    except ConnectionRefusedError:
        return Outcome.REFUSED
    except OSError:  # timed out, host or network unreachable
        return Outcome.TIMEOUT


Hold = Callable[[str, int, float], "socket.socket | None"]


def tcp_hold(host: str, port: int, timeout: float) -> socket.socket | None:
    """An idle connection to ``host:port`` to be held open (None if it cannot be opened now)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    sock.setblocking(False)
    return sock


def ended(sock: socket.socket) -> bool:
    """Whether a held connection that select() found readable was closed by its other end (what
    arrived otherwise, e.g. a gRPC server's greeting, is read and dropped)."""
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset: the process behind it is gone
        return True


class NodeTable(Protocol):
    """Ray's node table as the watch needs it."""

    def workers(self) -> dict[str, tuple[str, int]]:
        """Live worker nodes (the head left out): node id -> the raylet's host and port."""
        ...

    def declare_dead(self, death: NodeDeath) -> None:
        """Tell Ray the node is dead (its actors fail, its bundles are placed again)."""
        ...


class RayNodeTable:
    """:class:`NodeTable` over the running Ray: ``ray.nodes()`` and the GCS's ``UnregisterNode``."""

    def __init__(self) -> None:
        self._stub = None

    def workers(self) -> dict[str, tuple[str, int]]:
        import ray

        return {
            n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"]))
            for n in ray.nodes()
            if n["Alive"] and "node:__internal_head__" not in n.get("Resources", {})
        }

    def declare_dead(self, death: NodeDeath) -> None:
        import ray
        from ray.core.generated import common_pb2, gcs_service_pb2, gcs_service_pb2_grpc

        if self._stub is None:
            from ray._private.gcs_utils import create_gcs_channel  # carries the cluster's auth token

            channel = create_gcs_channel(ray.get_runtime_context().gcs_address)
            self._stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        info = common_pb2.NodeDeathInfo(reason=common_pb2.NodeDeathInfo.UNEXPECTED_TERMINATION, reason_message=death.reason())
        assert self._stub is not None
        # sent, not awaited: the GCS of Ray 2.60 never answers an UnregisterNode for a node it has
        # already removed (a drained node's own raylet unregisters it as it goes), so a blocking
        # call would hold the watch, and whoever waits on it, for the whole timeout
        call = self._stub.UnregisterNode.future(
            gcs_service_pb2.UnregisterNodeRequest(node_id=bytes.fromhex(death.node), node_death_info=info), timeout=DECLARE_S)
        call.add_done_callback(lambda done: _declared(death.node, done))


class NodeWatch:
    """Probes every live worker node's raylet each ``period_s`` on a daemon thread (and on demand
    with :meth:`sweep`): declares the dead ones to Ray (``declare``; else it only reports them)
    and keeps them for :meth:`take`; keeps the suspects for :meth:`suspects`."""

    def __init__(self, table: NodeTable, period_s: float, failures: int, timeout_s: float = PROBE_TIMEOUT_S, probe: Probe = tcp_probe,
                 clock: Callable[[], float] = time.monotonic, declare: bool = True, hold: Hold | None = None) -> None:
        """``hold``: opens the idle connections the watch's thread waits on between rounds (None:
        rounds only)."""
        self.table = table
        self.hold = hold
        self._held: dict[str, socket.socket] = {}  # node -> the idle connection held open to its raylet (the watch's thread's alone)
        self.early = 0  # rounds started before their time because a held connection closed
        self.period_s = period_s
        self.failures = max(1, failures)
        self.timeout_s = timeout_s
        self.probe = probe
        self.clock = clock
        self.declare = declare
        self._streak: dict[str, tuple[int, float]] = {}
        self._declared: set[str] = set()  # judged dead (told to Ray with ``declare``): not probed again
        self._suspects: set[str] = set()
        self._table: dict[str, tuple[str, int]] = {}
        self._table_at: float | None = None
        self._deaths: list[NodeDeath] = []
        self._sweeping = threading.Lock()  # one sweep at a time (the thread's and a recovery's)
        self._lock = threading.Lock()  # the verdicts (held briefly: never across a probe or a call to Ray)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None  # stop() wakes the thread's wait through it
        self.errors = 0  # sweeps that failed (Ray unreachable for a moment): the next one tries again
        self.last_error: str | None = None
        self.on_death: Callable[[set[str]], None] | None = None  # told the nodes judged dead, on the judging thread, before Ray is

    def sweep(self, refresh: bool = False) -> list[NodeDeath]:
        """One round: probe, judge, declare. Returns the deaths judged in this round. The node
        table is read again every :data:`REFRESH_S` (or with ``refresh``)."""
        with self._sweeping:
            now = self.clock()
            if refresh or self._table_at is None or now - self._table_at >= REFRESH_S:
                table = self.table.workers()
                with self._lock:
                    self._table, self._table_at = table, now
            nodes = {n: a for n, a in self._table.items() if n not in self._declared}
            seen = {n: self.probe(host, port, self.timeout_s) for n, (host, port) in nodes.items()}
            addresses = {n: f"{h}:{p}" for n, (h, p) in nodes.items()}
            streak, dead, suspects = judge(self._streak, seen, addresses, self.failures, self.clock())
            with self._lock:
                self._streak, self._suspects = streak, suspects
                self._declared.update(d.node for d in dead)
                self._deaths.extend(dead)
            if dead:
                self._tell({d.node for d in dead})
            for death in dead:
                if self.declare:
                    self.table.declare_dead(death)
            self._hold_answering({n: a for n, a in nodes.items() if seen[n] is Outcome.OK})
            return dead

    def _tell(self, nodes: set[str]) -> None:
        """Hand ``nodes``, just judged dead, to :attr:`on_death` (the step in flight wakes its
        other actors at once instead of at the driver's next look); a listener that raises is
        logged, and the watch goes on."""
        listener = self.on_death
        if listener is None:
            return
        try:
            listener(nodes)
        except Exception as e:  # noqa: BLE001 - the verdicts stand; the driver's next look finds them
            log.warning("node watch: telling the run about %s failed (%s: %s)", ", ".join(sorted(n[:12] for n in nodes)), type(e).__name__, e)

    def _hold_answering(self, answering: dict[str, tuple[str, int]]) -> None:
        """On the watch's thread (the only one that touches the held connections): hold one to
        each node that answered this round, close those of the others."""
        if self.hold is None or threading.current_thread() is not self._thread:
            return
        for n in [n for n in self._held if n not in answering]:
            self._held.pop(n).close()
        for n, (host, port) in answering.items():
            if n not in self._held:
                sock = self.hold(host, port, self.timeout_s)
                if sock is not None:
                    self._held[n] = sock

    def watching(self) -> set[str]:
        """The nodes the watch probes now (its copy of the node table, the dead left out)."""
        with self._lock:
            return set(self._table) - self._declared

    def dead(self) -> set[str]:
        """Nodes judged dead (a refused probe), whether or not Ray's view has followed yet."""
        with self._lock:
            return set(self._declared)

    def known_dead(self, nodes: set[str] | frozenset[str]) -> None:
        """Nodes the run found dead another way (Ray's scheduler refused them): not probed again,
        and no death of theirs judged here (it was reported where it was found)."""
        with self._lock:
            self._declared |= set(nodes)
            self._suspects -= set(nodes)

    def suspects(self) -> set[str]:
        """Nodes whose last ``failures`` probes or more timed out (never declared to Ray)."""
        with self._lock:
            return set(self._suspects)

    def take(self) -> list[NodeDeath]:
        """The deaths judged since the last call (for the run's metrics lines)."""
        with self._lock:
            out, self._deaths = self._deaths, []
            return out

    def start(self) -> None:
        if self._thread is None and self.period_s > 0:
            self._stop.clear()
            self._wake = socket.socketpair()
            self._thread = threading.Thread(target=self._loop, args=(self._wake[0],), name="elastic-llm-node-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and self._wake is not None:
            self._wake[1].send(b"x")
            thread.join(timeout=5)
            if not thread.is_alive():  # else it is still in a probe: it ends at its next look, and its sockets with it
                for sock in self._wake:
                    sock.close()
            self._wake = None

    def _wait(self, wake: socket.socket) -> None:
        """Until the next round is due, a held connection closed (the round starts now), or
        :meth:`stop` (through ``wake``)."""
        deadline = time.monotonic() + self.period_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([wake, *self._held.values()], [], [], left)
            closed = [n for n, sock in self._held.items() if sock in ready and ended(sock)]
            for n in closed:
                self._held.pop(n).close()
            if closed:
                self.early += 1
                return

    def _loop(self, wake: socket.socket) -> None:
        try:
            self._watch(wake)
        finally:
            for sock in self._held.values():
                sock.close()
            self._held = {}

    def _watch(self, wake: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception as e:  # noqa: BLE001 - a watch that stops would leave detection to Ray alone; the next round tries again
                self.errors += 1
                if self.last_error is None:
                    log.warning("node watch: a probe round failed (%s: %s); it goes on", type(e).__name__, e)
                self.last_error = f"{type(e).__name__}: {e}"
            self._wait(wake)
