"""The snapshot exchange's transport alone: the managers' piece servers against a loopback socket.

Measures, in one process on 127.0.0.1, with the product's own parts (:class:`PieceServer`,
:func:`exchange.stream`, :func:`exchange.fetch`, ``ReedSolomon.updater``),
taking turns round by round with its peer, one TCP connection moving as many bytes between warm
buffers (``benchmarks.common.reference_rates``):

* ``holder``: a parity holder reading one member's chunk of ``chunk_bytes`` from that member's
  piece server (which computes its CRC-32 as it sends it) and encoding it as it arrives (the
  manager's sink, ``ReedSolomon.updater``), then comparing the CRC-32 with the recorded one;
* ``rebuild``: a lost stage of ``stage_bytes`` rebuilt the way :mod:`elastic_llm.snapshot.rebuild`
  reads it: each of its ``k`` codewords' ``k`` surviving symbols (``stage_bytes / k`` each) read at
  once, on a pool of threads, from ``k`` piece servers, each into a buffer of its own, each
  symbol's CRC-32 (as its server read it) compared with the recorded one.

Rates are bytes moved over the socket per second. Beside training the exchange runs at the lowest
priority on the same cores (``bench snapshot``'s ``parity_exchange_GBps`` measures that priority as
much as the transport); this is the transport's own rate. Must never: judge results, leave a socket
open, or reach beyond 127.0.0.1.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchmarks.common import median, reference_rates
from elastic_llm.snapshot import exchange
from elastic_llm.snapshot.erasure import ReedSolomon, checksum

HOST = "127.0.0.1"


def exchange_alone(chunk_bytes: int, stage_bytes: int, k: int, rounds: int = 7) -> dict[str, Any]:
    """The medians over ``rounds`` (see the module's docstring) and their ratios to the socket."""
    k = max(1, k)
    sym = max(1, stage_bytes // k)
    member = [np.ones(chunk_bytes, np.uint8)]
    symbols = [[np.full(sym, j + 1, np.uint8)] for j in range(k)]

    def lookup(j: int) -> exchange.Lookup:
        def arrays(version: int, attempt: int, kind: int, index: int, role: str) -> tuple[list[np.ndarray], int]:
            return (member if version == 0 else symbols[j]), 0

        return arrays

    servers = [exchange.PieceServer(HOST, lookup(j)) for j in range(k)]
    rs = ReedSolomon(max(2, k), 1)
    out = np.zeros(chunk_bytes, np.uint8)
    update = rs.updater(0, 0)
    want = checksum(member[0])
    wants = [checksum(s[0]) for s in symbols]
    holder_s, rebuild_s, sock_holder, sock_rebuild = [], [], [], []

    def sink(i: int, pos: int, block: np.ndarray) -> None:
        update(block, out[pos : pos + len(block)])

    def rebuild(pool: ThreadPoolExecutor) -> None:
        deadline = time.monotonic() + 60
        reads = [(j, pool.submit(exchange.fetch, servers[j].address, 1, exchange.ANY_ATTEMPT, exchange.CHUNK, c, "", deadline)) for c in range(k) for j in range(k)]
        for j, f in reads:
            if f.result()[1].sent != [wants[j]]:
                raise RuntimeError("a rebuild's symbol failed its checksum")

    try:
        with ThreadPoolExecutor(max_workers=min(16, k * k)) as pool:
            for _ in range(rounds):
                t0 = time.perf_counter()
                got = exchange.stream(servers[0].address, 0, exchange.ANY_ATTEMPT, exchange.CHUNK, 0, "", sink, time.monotonic() + 60)
                if got.sent != [want]:
                    raise RuntimeError("the holder's chunk failed its checksum")
                holder_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                rebuild(pool)
                rebuild_s.append(time.perf_counter() - t0)
                sock_holder.append(reference_rates(chunk_bytes, rounds=1)["loopback_tcp_gb_s"])
                sock_rebuild.append(reference_rates(sym * k * k, rounds=1)["loopback_tcp_gb_s"])
    finally:
        for s in servers:
            s.close()
    holder = chunk_bytes / median(holder_s) / 1e9
    rebuilt = sym * k * k / median(rebuild_s) / 1e9
    return {
        "chunk_bytes": chunk_bytes,
        "stage_bytes": stage_bytes,
        "k": k,
        "rounds": rounds,
        "holder_GBps": round(holder, 3),
        "holder_socket_GBps": round(median(sock_holder), 3),
        "holder_vs_socket": round(holder / median(sock_holder), 3),
        "rebuild_bytes_moved": sym * k * k,
        "rebuild_GBps": round(rebuilt, 3),
        "rebuild_socket_GBps": round(median(sock_rebuild), 3),
        "rebuild_vs_socket": round(rebuilt / median(sock_rebuild), 3),
        "socket_buffer_bytes": exchange.SOCKET_BUF,
    }
