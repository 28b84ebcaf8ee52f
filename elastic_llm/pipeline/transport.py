"""How activations, gradients and gradient chunks travel between stage actors within a step.

Owns: the :class:`Transport` seam (send to a peer, receive from a peer, abort, close the links of
a failed step) and its CPU implementation, :class:`SocketTransport`: one TCP connection per
directed pair of peers, set up by :meth:`~SocketTransport.connect` for one *generation* of the
run's membership before the first step that uses it. Each message is a fixed header (generation,
step, kind, microbatch, hop, dtype, shape) and the raw bytes, float32 or bfloat16 (``train.precision:
bf16``: half the bytes; any other dtype is refused by name): nothing is pickled. Sends are
queued to one thread per link (a stage never blocks on a slow receiver, and the messages of one
link stay in order); a receive blocks in ``select`` on the link and on a wake-up pipe, so it ends
at once when the message arrives, when the peer's connection closes (the peer died, or failed
and closed its links: :meth:`poison`), or when the driver aborts the step. It never decides
what to send: :mod:`elastic_llm.pipeline.step` does, from the plan.

A whole stage state travels the same way, outside any step (:func:`send_state`,
:meth:`SocketTransport.receive_state`): one connection to the receiver's listener, a header, the
manifest and the raw bytes read straight into the receiver's memory, then a one-byte answer (the
sender's memory may change from then on). A data-parallel peer's state, a new replica's and a
moved stage's come this way: no pickling, no object store, no copy on either side.

Why sockets and not gloo: measured on this machine (two Ray actors, 512 KiB float32 messages),
torch.distributed gloo send/recv cost 0.45 ms of CPU per side against ~3.1 ms for an actor call
into a mailbox (Ray's per-call overhead plus the object store), so a collective-style transport
was the right family. But a blocked gloo receive cannot be interrupted: ``ProcessGroupGloo.abort``
and ``shutdown`` return without waking it, ``Work.is_completed`` stays false until ``wait``, and a
``wait`` with a timeout closes the pair for good. A stage whose neighbour *failed* (raised, still
alive) would hang until the group's timeout. Plain sockets give the same cost class (a loopback
hop of 512 KiB is one ``sendall`` and one ``recv_into``) with the failure semantics this system
needs. On GPU actors the seam is where an NCCL transport goes (``ncclCommAbort`` can interrupt);
it is not written: no GPU is lent to this project.
"""

from __future__ import annotations

import enum
import queue
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from elastic_llm.pipeline.plan import STEP_DEADLINE_S
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.tensors import host as to_host

CONNECT_S = 30.0  # deadline for one generation's links to be set up
HELLO = struct.Struct("<qii")  # generation, stage, replica of the connecting peer
HEADER = struct.Struct("<qqiiiii4q")  # generation, step, kind, microbatch, hop, dtype code, ndim, shape (up to 4 dims)
FLOAT32, BFLOAT16 = 0, 1  # the dtypes that travel (a bfloat16 body is its raw 2-byte words)
STATE_COPY = -2  # the HELLO's generation of a connection that carries one whole state, not a step's link
STATE_HEADER = struct.Struct("<qq")  # manifest bytes, state bytes
STATE_WAIT_S = 600.0  # how late a state's sender may connect (one sending to several targets sends one after another); a dead one's wait is cancelled sooner


class Msg(enum.IntEnum):
    ACT = 1  # forward activation into hop ``hop`` of microbatch ``mb``
    GRAD = 2  # gradient of the output of hop ``hop``
    SHADOW = 3  # the gradient a stage received, passed on to the stage holding its redundant copy
    CHUNK = 4  # reduce-scatter: a replica's gradient chunk ``hop`` for its owner
    GATHER = 5  # all-gather: the summed chunk ``hop`` from its owner
    READY = 6  # barrier: this actor's gradients are final
    GO = 7  # barrier: every actor's are: update


class PeerLost(RuntimeError):
    """The link to ``peer`` closed or broke: the peer died, or it failed and closed its links."""

    def __init__(self, peer: ShardKey, why: str) -> None:
        self.peer, self.why = peer, why
        super().__init__(f"link to {peer} lost: {why}")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # crosses processes rebuilt from its fields
        return (type(self), (self.peer, self.why))


class Aborted(RuntimeError):
    """The driver aborted this step (another actor of it failed)."""


class DeadlineExceeded(RuntimeError):
    def __init__(self, peer: ShardKey, seconds: float) -> None:
        self.peer, self.seconds = peer, seconds
        super().__init__(f"no message from {peer} within {seconds:.0f} s")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(self), (self.peer, self.seconds))


class ProtocolError(RuntimeError):
    """A message that is not the one the schedule expects: a bug, never a peer failure."""


class StaleGeneration(RuntimeError):
    """A call or link of an older membership generation than this actor's links (a zombie's:
    its node was cut off, the run went on without it, and the partition healed): refused."""


class Transport(Protocol):
    """The stage-to-stage links of one actor (see the module docstring)."""

    def connect(self, generation: int, peers: dict[ShardKey, tuple[str, int]]) -> None: ...

    def begin(self, step: int, deadline_s: float) -> None: ...

    def send(self, peer: ShardKey, kind: Msg, mb: int, hop: int, array: Any) -> None: ...  # numpy or a tensor; None: an empty message

    def recv(self, peer: ShardKey, kind: Msg, mb: int, hop: int) -> np.ndarray | torch.Tensor: ...  # float32 as numpy, bfloat16 as a CPU tensor

    def abort(self, generation: int) -> None: ...

    def raise_if_aborted(self) -> None: ...  # Aborted if the running step's generation was aborted

    def poison(self) -> None: ...

    def sent_bytes(self) -> dict[str, int]: ...

    def received(self) -> dict[tuple[int, int], tuple[int, float]]: ...  # per peer (stage, replica): bytes of this step's message bodies, seconds spent reading them


class _Link:
    """One outbound connection and the thread that drains its send queue."""

    def __init__(self, sock: socket.socket, peer: ShardKey) -> None:
        self.sock, self.peer = sock, peer
        self.error: BaseException | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._drain, name=f"send-{peer.stage}-{peer.replica}", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            header, body = item
            try:
                self.sock.sendall(header)
                if body is not None:
                    self.sock.sendall(body)
            except OSError as e:
                self.error = e
                return

    def close(self) -> None:
        self.queue.put(None)
        _close(self.sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class SocketTransport:
    """TCP links of the actor ``me``, listening on ``host`` (the node's address)."""

    def __init__(self, me: ShardKey, host: str = "127.0.0.1") -> None:
        self.me = me
        self.listener = socket.create_server((host, 0), backlog=128)
        self.address = (host, self.listener.getsockname()[1])
        self.generation = -1
        self.step = 0
        self.deadline_s = STEP_DEADLINE_S  # each step's own (StepPlan.deadline_s) from begin() on
        self.aborted_generation = -2  # below any generation, -1 (no links yet) included: nothing aborted
        self.out: dict[ShardKey, _Link] = {}
        self.inbound: dict[ShardKey, socket.socket] = {}
        self.arrived: dict[int, dict[ShardKey, socket.socket]] = {}
        self.sent: dict[Msg, int] = {}
        self.got: dict[ShardKey, tuple[int, float]] = {}  # per peer: this step's message bodies, bytes and seconds read (a slow link's cost)
        self.early: dict[ShardKey, dict[tuple[int, int, int], np.ndarray | torch.Tensor]] = {}  # messages that came before they were asked for
        self.states_in: dict[ShardKey, socket.socket] = {}  # connections carrying a whole state (send_state), by sender
        self.refused: list[str] = []  # what came from an older generation since the last report (stale, take_refused)
        self.state_cancelled = False
        self.changed = threading.Condition()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.closed = False
        threading.Thread(target=self._accept, name="links-accept", daemon=True).start()

    # ------------------------------------------------------------------ links
    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                conn.settimeout(CONNECT_S)
                gen, stage, replica = HELLO.unpack(_read_exact(conn, HELLO.size))
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, struct.error, EOFError):
                _close(conn)
                continue
            with self.changed:
                if gen == STATE_COPY:
                    old = self.states_in.pop(ShardKey(stage, replica), None)
                    if old is not None:
                        _close(old)
                    self.states_in[ShardKey(stage, replica)] = conn
                    self.changed.notify_all()
                    continue
                if gen < self.generation:
                    self.stale(gen, f"a link from stage {stage} replica {replica}")
                    _close(conn)
                    continue
                self.arrived.setdefault(gen, {})[ShardKey(stage, replica)] = conn
                self.changed.notify_all()

    def connect(self, generation: int, peers: dict[ShardKey, tuple[str, int]]) -> None:
        """Drop the old links; connect to every peer of ``generation`` and wait until each of
        them has connected back."""
        self.poison()
        with self.changed:
            self.generation = generation
            for gen in [g for g in self.arrived if g < generation]:
                for s in self.arrived.pop(gen).values():
                    _close(s)
        deadline = time.monotonic() + CONNECT_S
        for peer, (addr, port) in sorted(peers.items(), key=lambda kv: (kv[0].replica, kv[0].stage)):
            sock = socket.create_connection((addr, port), timeout=CONNECT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)
            sock.sendall(HELLO.pack(generation, self.me.stage, self.me.replica))
            self.out[peer] = _Link(sock, peer)
        with self.changed:
            ok = self.changed.wait_for(lambda: set(peers) <= set(self.arrived.get(generation, {})), timeout=max(0.0, deadline - time.monotonic()))
            if not ok:
                missing = sorted(set(peers) - set(self.arrived.get(generation, {})), key=str)
                raise TimeoutError(f"{self.me}: peers {', '.join(map(str, missing))} did not connect within {CONNECT_S:.0f} s")
            self.inbound = self.arrived.pop(generation)
        self._drain_wake()

    def stale(self, generation: int, what: str) -> bool:
        """Whether ``generation`` is older than the links': then ``what`` of it is refused and
        recorded (:meth:`take_refused`), and the links are left as they are."""
        if generation >= self.generation:
            return False
        with self.changed:
            self.refused.append(f"{what} of link generation {generation} (links at {self.generation})")
        return True

    def take_refused(self) -> tuple[str, ...]:
        """What was refused as stale since the last call."""
        with self.changed:
            out, self.refused = tuple(self.refused), []
        return out

    def begin(self, step: int, deadline_s: float) -> None:
        self.step, self.deadline_s = step, deadline_s
        self.sent, self.early, self.got = {}, {}, {}

    def abort(self, generation: int) -> None:
        """Wake a receive blocked in this generation's step (called from another thread)."""
        self.aborted_generation = max(self.aborted_generation, generation)
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass

    def raise_if_aborted(self) -> None:
        """Raise :class:`Aborted` if this generation's step was aborted (the stage checks this
        between its layers, so an aborted step stops inside an op, not after it)."""
        if self.aborted_generation >= self.generation:
            raise Aborted(f"{self.me}: step {self.step} aborted by the driver")

    def poison(self) -> None:
        """Close every link (a failed step): peers blocked on this actor see the closed link."""
        for link in self.out.values():
            link.close()
        for sock in self.inbound.values():
            _close(sock)
        self.out, self.inbound = {}, {}

    def close(self) -> None:
        """End every link, the listener (its accept thread ends with it) and the wake pair."""
        self.closed = True
        self.poison()
        _close(self.listener)
        self.wake_r.close()
        self.wake_w.close()

    # ------------------------------------------------------------------ messages
    def send(self, peer: ShardKey, kind: Msg, mb: int, hop: int, array: Any) -> None:
        """Queue ``array`` (numpy, or a tensor on any device: this transport copies it to host
        memory, where a device transport would keep it) for ``peer``; returns at once. A host
        array is queued by reference, not copied: the caller must not change it until it is sent
        (the step's callers hand over fresh arrays: each microbatch's activation or gradient, the
        all-reduce's chunks of a gradient nothing writes to afterwards)."""
        code = FLOAT32
        if hasattr(array, "detach"):
            if array.dtype == torch.bfloat16:
                array, code = array.detach().view(torch.int16), BFLOAT16  # numpy has no bfloat16: its bits travel
            elif array.dtype != torch.float32:
                raise ProtocolError(f"only float32 and bfloat16 tensors travel between stages, got {array.dtype} {tuple(array.shape)}")
            array = to_host(array)
        link = self.out.get(peer)
        if link is None:
            raise ProtocolError(f"{self.me} has no link to {peer} (generation {self.generation})")
        if link.error is not None:
            raise PeerLost(peer, f"sending failed: {link.error}")
        if array is None:
            shape: tuple[int, ...] = ()
            body = None
            ndim = -1
        else:
            if (array.dtype != np.float32 and not (code == BFLOAT16 and array.dtype == np.int16)) or array.ndim > 4:
                raise ProtocolError(f"only float32 and bfloat16 arrays of up to 4 dimensions travel, got {array.dtype} {array.shape}")
            array = np.ascontiguousarray(array)
            shape, ndim = array.shape, array.ndim
            body = memoryview(array).cast("B")
            self.sent[kind] = self.sent.get(kind, 0) + array.nbytes
        dims = tuple(shape) + (0,) * (4 - len(shape))
        link.queue.put((HEADER.pack(self.generation, self.step, int(kind), mb, hop, code, ndim, *dims), body))

    def recv(self, peer: ShardKey, kind: Msg, mb: int, hop: int) -> np.ndarray | torch.Tensor:
        """The message ``(kind, mb, hop)`` of this step from ``peer``. A link carries one
        sender's messages in its order, which need not be the receiver's (a 1F1B stage visited
        twice by a swapped route sends in another order than its successor consumes): messages
        that arrive early are kept until asked for. A bfloat16 message comes back as a CPU
        bfloat16 tensor over the received bytes (numpy has no bfloat16), a float32 one as numpy."""
        sock = self.inbound.get(peer)
        if sock is None:
            raise ProtocolError(f"{self.me} has no link from {peer} (generation {self.generation})")
        early = self.early.setdefault(peer, {})
        want = (int(kind), mb, hop)
        if want in early:
            return early.pop(want)
        while True:
            self._wait_readable(sock, peer)
            try:
                gen, step, k, m, h, code, ndim, *dims = HEADER.unpack(_read_exact(sock, HEADER.size))
                if (gen, step) != (self.generation, self.step):
                    raise ProtocolError(f"{self.me} got a message of step {step} (generation {gen}) from {peer} in step {self.step} (generation {self.generation})")
                if code not in (FLOAT32, BFLOAT16):
                    raise ProtocolError(f"{self.me} got a message of dtype code {code} from {peer}: only float32 (0) and bfloat16 (1) travel")
                raw = np.empty(tuple(dims[:ndim]) if ndim >= 0 else 0, np.float32 if code == FLOAT32 else np.int16)
                if ndim >= 0:
                    t0 = time.perf_counter()
                    _read_into(sock, raw.data.cast("B"))
                    n, s = self.got.get(peer, (0, 0.0))
                    self.got[peer] = (n + raw.nbytes, s + time.perf_counter() - t0)
                out: np.ndarray | torch.Tensor = raw if code == FLOAT32 else torch.from_numpy(raw).view(torch.bfloat16)
            except EOFError as e:
                raise PeerLost(peer, str(e)) from None
            except OSError as e:
                raise PeerLost(peer, f"{type(e).__name__}: {e}") from None
            if (k, m, h) == want:
                return out
            if (k, m, h) in early:
                raise ProtocolError(f"{self.me} got message kind {k} mb {m} hop {h} of step {step} twice from {peer}")
            early[(k, m, h)] = out

    def receive_state(self, peer: ShardKey, into: Callable[[str, int], memoryview], timeout: float = STATE_WAIT_S) -> str:
        """The whole state ``peer`` sends with :func:`send_state`: waits (at most ``timeout``, or
        until :meth:`cancel_receive`) for its connection, reads the manifest, asks ``into(manifest,
        nbytes)`` where the bytes go (it raises to refuse them) and reads them straight there,
        then answers the sender. Returns the manifest; :class:`PeerLost` if the sender went."""
        with self.changed:
            arrived = self.changed.wait_for(lambda: peer in self.states_in or self.state_cancelled, timeout)
            if self.state_cancelled:
                self.state_cancelled = False
                raise Aborted(f"{self.me}: the copy of {peer}'s state was cancelled")
            if not arrived:
                raise TimeoutError(f"{self.me}: {peer} did not connect to send its state within {timeout:.0f} s")
            sock = self.states_in.pop(peer)
        try:
            n_manifest, n_state = STATE_HEADER.unpack(_read_exact(sock, STATE_HEADER.size))
            manifest = _read_exact(sock, n_manifest).decode()
            view = into(manifest, n_state)
            _read_into(sock, view)
            sock.sendall(b"\x01")
        except EOFError as e:
            raise PeerLost(peer, f"sending its state: {e}") from None
        except OSError as e:
            raise PeerLost(peer, f"sending its state: {type(e).__name__}: {e}") from None
        finally:
            _close(sock)
        return manifest

    def cancel_receive(self) -> None:
        """End a :meth:`receive_state` that waits for its sender (the sender failed before it
        connected); called from another thread."""
        with self.changed:
            self.state_cancelled = True
            self.changed.notify_all()

    def sent_bytes(self) -> dict[str, int]:
        return {k.name.lower(): v for k, v in self.sent.items()}

    def received(self) -> dict[tuple[int, int], tuple[int, float]]:
        """Per peer: the bytes of this step's message bodies and the seconds spent reading them
        once their header came (the time the link itself cost this actor: a body that arrived
        while it computed reads at memory speed)."""
        return {(k.stage, k.replica): v for k, v in self.got.items()}

    def _wait_readable(self, sock: socket.socket, peer: ShardKey) -> None:
        deadline = time.monotonic() + self.deadline_s
        while True:
            self.raise_if_aborted()
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(peer, self.deadline_s)
            ready, _, _ = select.select([sock, self.wake_r], [], [], left)
            if sock in ready:
                return
            if self.wake_r in ready:
                self._drain_wake()

    def _drain_wake(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass


def send_state(address: tuple[str, int], me: ShardKey, manifest: str, state: memoryview) -> int:
    """Send one whole state (``manifest`` and the raw bytes of ``state``) to the actor listening at
    ``address``, which takes it with :meth:`SocketTransport.receive_state`; returns once it has
    read every byte (``state`` may change from then on). Returns the bytes sent; :class:`PeerLost`
    if the receiver went or refused the state."""
    data = manifest.encode()
    peer = ShardKey(-1, -1)  # the receiver is known by its address only
    try:
        with socket.create_connection((str(address[0]), int(address[1])), timeout=CONNECT_S) as sock:
            sock.settimeout(None)
            sock.sendall(HELLO.pack(STATE_COPY, me.stage, me.replica) + STATE_HEADER.pack(len(data), state.nbytes) + data)
            sock.sendall(state)
            _read_exact(sock, 1)
    except (EOFError, BrokenPipeError, ConnectionResetError) as e:  # closed while we sent, or before it answered
        raise PeerLost(peer, f"the receiver at {address[0]}:{address[1]} closed the connection before it had the state (it refused it or died: {type(e).__name__})") from None
    except OSError as e:
        raise PeerLost(peer, f"sending the state to {address[0]}:{address[1]}: {type(e).__name__}: {e}") from None
    return state.nbytes


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(sock, memoryview(buf))
    return bytes(buf)


def _read_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("connection closed by the peer")
        got += k
