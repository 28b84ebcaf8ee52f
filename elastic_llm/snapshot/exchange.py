"""A snapshot version's bytes between nodes, over the snapshot managers' own TCP links.

Owns: :class:`PieceServer` (one listening socket per snapshot manager, on its node's address:
each connection asks for one symbol of one version, a member's data chunk or a parity region,
and gets a fixed header, the raw bytes, sent straight from the object store's pages or the
parity buffer, and a trailer with the CRC-32 of each array as the server read it), and the two
ways of reading one: :func:`stream` hands the bytes to a sink in blocks that stay in cache (a
parity holder encodes as the bytes arrive), :func:`fetch` reads them straight into one buffer (a
rebuild). Nothing is pickled: the request and the answer are fixed structs, a role is an ASCII
node id.

Where the CRC-32 is computed: by the server, one block at a time just before the block is sent,
so the bytes are read from memory once for both (the send's copy finds them in cache), and the
reader makes one pass over them (its socket read) instead of three (read, CRC, encode): measured
in ``benchmarks.exchange``. The reader still compares every CRC with the one its piece recorded
when it was taken, so a piece corrupted at rest is refused as before; what the wire could do to
the bytes is TCP's checksum's to catch, and a rebuild checks what it decodes against the stage's
recorded CRC-32s end to end (:mod:`.rebuild`).

Why not Ray's object transfer: measured on the loopback cluster, a node-to-node object move
costs the raylets 30-40 ms of CPU per 13 MB (0.3-0.5 GB/s per core) and a rebuild pulled its
pieces at 0.15-0.23 GB/s, while one socket moves the same bytes at the loopback's rate. The
pieces still live in each node's object store (a snapshot outlives the processes that made it);
only their transfer changed.

Never decides what to ask for or whom (the manager's encode and :mod:`.rebuild` do) and never
trusts what it reads: the caller checks every piece's CRC-32 against the one recorded for it, and
an answer cut short (before its trailer) raises :class:`ExchangeError`, so a partial symbol is
never used.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from elastic_llm.priority import nicer
from elastic_llm.snapshot.erasure import checksum
from elastic_llm.snapshot.records import Piece

log = logging.getLogger(__name__)

MAGIC = b"ELSX"
REQUEST = struct.Struct("<4sqqiiH")  # magic, version, attempt (ANY_ATTEMPT: whichever is held), kind, index, role bytes
ANSWER = struct.Struct("<4siIq")  # magic, status (0: the bytes follow), CRC-32 of a parity region, count (or message bytes)
LENGTH = struct.Struct("<q")
SENT = struct.Struct("<I")  # the trailer: one per array, its CRC-32 as the server read it
ANY_ATTEMPT = -1  # a request's attempt for "whichever is held": a rebuild's, of a committed version
CHUNK, PARITY = 0, 1  # what a request asks for: a member's data chunk (its pieces in key order) or a parity region
BLOCK = 1 << 20  # bytes a server checks and sends at a time, and a sink is handed at most: stays in cache
CONNECT_S = 10.0  # longest a connection to a peer's server may take (a dead node refuses or times out)
SOCKET_BUF = 1 << 20
"""Send and receive buffer of every exchange connection (SO_SNDBUF, SO_RCVBUF). Measured on the
2-core VM, in one process: with Linux's defaults a 13 MB symbol streamed at 0.95-1.0 GB/s and
nine 4.4 MB reads in parallel (a rebuild's) at 1.1-1.2 GB/s; with 1 MiB, 1.9-2.7 and 1.75-1.9
GB/s (fewer, larger copies per system call; 4 MiB was no better)."""
NICE = 5  # how much nicer than its process the exchange's threads run (Ray starts workers at nice 15: 19, the lowest)

Lookup = Callable[[int, int, int, int, str], tuple[Sequence[np.ndarray], int]]  # (version, attempt, kind, index, role) -> (arrays, crc)
Sink = Callable[[int, int, np.ndarray], None]  # (array index, offset within it, bytes)


@dataclass(frozen=True)
class Answer:
    """What a read of one symbol got: its arrays' lengths, the CRC-32 the server holds for it (a
    parity region's, recorded when it was encoded; 0 for a data chunk) and each array's CRC-32 as
    the server read it (compare with the recorded ones: a mismatch is a corrupted piece)."""

    lengths: list[int]
    crc: int
    sent: list[int]

    def carries(self, pieces: Sequence[Piece]) -> bool:
        """Whether these are ``pieces``' bytes whole: their lengths, and their CRC-32s as recorded."""
        return self.lengths == [p.length for p in pieces] and self.sent == [p.crc for p in pieces]


def node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 on a loopback cluster and outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


class ExchangeError(ConnectionError):
    """A symbol could not be read from a peer's server: refused, not held there, or cut short."""


class PieceServer:
    """Serves this manager's symbols to its group's parity holders and to rebuilding stages.

    ``lookup(version, attempt, kind, index, role)`` gives the arrays to send (and the parity's
    recorded CRC-32) or raises ``LookupError`` (answered as a refusal naming it). One thread
    accepts; each connection is served by a thread of its own, at a lower priority than the
    training step (``NICE``) when it serves a version in flight; a rebuild's read (of a committed
    version, :data:`ANY_ATTEMPT`) runs at the process's own priority: the step waits for it.
    ``cut_after``: fault injection, the next answer's connection is closed after that many bytes
    of its body (or, with at least the whole body, before its trailer). :meth:`take_crc_s`: the CPU seconds its CRC-32s took since the last call."""

    def __init__(self, host: str, lookup: Lookup) -> None:
        self.lookup = lookup
        self.sock = socket.create_server((host, 0), backlog=64)
        self.address: tuple[str, int] = (host, self.sock.getsockname()[1])
        self.cut_after: int | None = None
        self.served = 0  # answers sent whole
        self._crc_s = 0.0  # CPU seconds of the answers' CRC-32s (each serving thread adds its own under the lock)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="piece-server", daemon=True)
        self._thread.start()

    def take_crc_s(self) -> float:
        with self._lock:
            out, self._crc_s = self._crc_s, 0.0
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="piece-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUF)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the trailer goes out at once (Nagle held it for the reader's delayed ACK: 40 ms)
                conn.settimeout(CONNECT_S)
                magic, version, attempt, kind, index, nrole = REQUEST.unpack(_read_exact(conn, REQUEST.size))
                if magic != MAGIC:
                    return
                if attempt != ANY_ATTEMPT:  # a version in flight's exchange runs beside the step: it gives way
                    yield_to_training()  # (a rebuild's read, of a committed version, is what the stalled step waits for)
                role = _read_exact(conn, nrole).decode("ascii") if nrole else ""
                try:
                    arrays, crc = self.lookup(version, attempt, kind, index, role)
                except LookupError as e:
                    msg = str(e).encode()[:4096]
                    conn.sendall(ANSWER.pack(MAGIC, 1, 0, len(msg)) + msg)
                    return
                conn.settimeout(None)  # the receiver's pace sets the sending's; it closes on failure
                conn.sendall(ANSWER.pack(MAGIC, 0, crc, len(arrays)) + b"".join(LENGTH.pack(len(a)) for a in arrays))
                budget, self.cut_after = self.cut_after, None
                sent, crc_s = [], 0.0
                for arr in arrays:
                    view, value = np.ascontiguousarray(arr).reshape(-1).view(np.uint8), 0
                    for lo in range(0, len(view), BLOCK):
                        block = view[lo : lo + BLOCK]
                        t = time.thread_time()
                        value = checksum(block, value)  # read into cache here: the send's copy finds it there
                        crc_s += time.thread_time() - t
                        if budget is not None and budget < len(block):
                            conn.sendall(block[:budget].data)
                            return  # the fault: cut mid-piece
                        conn.sendall(block.data)
                        budget = None if budget is None else budget - len(block)
                    sent.append(value)
                if budget is not None:
                    return  # the fault: the body whole, cut before its trailer
                conn.sendall(b"".join(SENT.pack(c) for c in sent))
                with self._lock:
                    self._crc_s += crc_s
                self.served += 1
            except OSError:  # the receiver went away: its read fails, this answer is over
                return


_yielded = threading.local()


def yield_to_training() -> None:
    """Run the calling thread :data:`NICE` steps nicer than it ran (Linux: per thread; once per
    thread, however often called): the exchange's sends and a holder's reading and encoding give
    way to the training step on the same cores. Relative, never absolute: Ray starts its workers
    at nice 15, and setting 5 would put the exchange ahead of training."""
    if getattr(_yielded, "done", False):
        return
    _yielded.done = True
    nicer(NICE)


def _read_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ExchangeError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _ask(address: tuple[str, int], version: int, attempt: int, kind: int, index: int, role: str, deadline: float) -> tuple[socket.socket, list[int], int]:
    """Connect, ask for one symbol, read the answer's header: (connection, array lengths, CRC-32)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ExchangeError(f"no time left to ask {address[0]}:{address[1]} for its symbol")
    conn = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUF)  # before the connection: its window scales to it
        conn.settimeout(min(CONNECT_S, left))
        conn.connect(address)
    except OSError as e:
        conn.close()
        raise ExchangeError(f"{address[0]}:{address[1]} refused the connection ({e})") from None
    try:
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        r = role.encode("ascii")
        conn.sendall(REQUEST.pack(MAGIC, version, attempt, kind, index, len(r)) + r)
        magic, status, crc, count = ANSWER.unpack(_read_exact(conn, ANSWER.size))
        if magic != MAGIC:
            raise ExchangeError(f"{address[0]}:{address[1]} is not a snapshot manager's piece server")
        if status != 0:
            raise ExchangeError(f"{address[0]}:{address[1]} refused: {_read_exact(conn, count).decode(errors='replace')}")
        lengths = [LENGTH.unpack(_read_exact(conn, LENGTH.size))[0] for _ in range(count)]
        return conn, lengths, crc
    except ExchangeError:
        conn.close()
        raise
    except (OSError, struct.error) as e:
        conn.close()
        raise ExchangeError(f"reading {address[0]}:{address[1]}'s answer failed ({e})") from None


def _receive(conn: socket.socket, view: memoryview, address: tuple[str, int], deadline: float, got: int, total: int) -> int:
    """One ``recv_into`` of ``view`` before ``deadline``: the bytes read; :class:`ExchangeError`
    if the peer fails or closes first (``got`` of ``total`` bytes read so far, for the message)."""
    conn.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        n = conn.recv_into(view)
    except OSError as e:
        raise ExchangeError(f"reading from {address[0]}:{address[1]} failed after {got} of {total} bytes ({e})") from None
    if n == 0:
        raise ExchangeError(f"{address[0]}:{address[1]} closed the connection after {got} of {total} bytes")
    return n


def _trailer(conn: socket.socket, address: tuple[str, int], count: int) -> list[int]:
    """The answer's last bytes: each array's CRC-32 as the server read it."""
    try:
        raw = _read_exact(conn, SENT.size * count)
    except OSError as e:
        raise ExchangeError(f"reading {address[0]}:{address[1]}'s checksums failed ({e})") from None
    return [SENT.unpack_from(raw, SENT.size * i)[0] for i in range(count)]


def stream(address: tuple[str, int], version: int, attempt: int, kind: int, index: int, role: str, sink: Sink, deadline: float) -> Answer:
    """Read one symbol, handing its bytes to ``sink(array, offset, block)`` in blocks of at most
    :data:`BLOCK` bytes (one reused buffer: the sink must not keep it). Raises
    :class:`ExchangeError` if it is refused or cut short (the sink has then seen only part of it)."""
    conn, lengths, crc = _ask(address, version, attempt, kind, index, role, deadline)
    buf = np.empty(min(BLOCK, max(lengths, default=0)) or 1, dtype=np.uint8)
    total, got = sum(lengths), 0
    with conn:
        for i, length in enumerate(lengths):
            pos = 0
            while pos < length:
                n = _receive(conn, buf.data[: min(len(buf), length - pos)], address, deadline, got, total)
                sink(i, pos, buf[:n])
                pos += n
                got += n
        return Answer(lengths, crc, _trailer(conn, address, len(lengths)))


def fetch(address: tuple[str, int], version: int, attempt: int, kind: int, index: int, role: str, deadline: float) -> tuple[np.ndarray, Answer]:
    """Read one symbol straight into one new buffer: its bytes (the arrays laid end to end) and
    the answer. Raises :class:`ExchangeError` if refused or cut short."""
    conn, lengths, crc = _ask(address, version, attempt, kind, index, role, deadline)
    out = np.empty(sum(lengths), dtype=np.uint8)
    pos = 0
    with conn:
        while pos < len(out):
            pos += _receive(conn, out.data[pos:], address, deadline, pos, len(out))
        return out, Answer(lengths, crc, _trailer(conn, address, len(lengths)))
