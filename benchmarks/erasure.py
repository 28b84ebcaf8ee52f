"""Erasure codec throughput: our Reed-Solomon codec against memcpy, reedsolo and zfec.

Measures, single-threaded and in one run on ``size_mib`` MiB of random data: memcpy
(``np.copyto``) as the memory-speed yardstick, reedsolo and zfec as reference encoders, encode and
decode of the product's :class:`~elastic_llm.snapshot.erasure.ReedSolomon` for every available
backend and (k, m) in (4, 2), (8, 2), (10, 4), and the product's ``checksum`` (CRC-32).

Conventions: MB = 1e6 bytes; every rate is *data* bytes / second (the k data shards, not parity);
every number is the best of ``repeats`` timed runs after a warm-up run, into preallocated,
already-touched output buffers.

Must never: copy product code (it calls the codec and checksum it measures), or judge its results
(targets and conclusions live in BENCHMARKS.md).
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from functools import partial
from typing import Any, Callable, Optional

import numpy as np

from benchmarks.common import cpu_model
from elastic_llm.snapshot.erasure import ReedSolomon, checksum, checksum_impl, isal_available

CODES = ((4, 2), (8, 2), (10, 4))
REEDSOLO_BYTES = 64 << 10


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (page faults, table building, caches)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _mbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e6, 1) if seconds > 0 else float("nan")


def _reedsolo_encode_mbps(k: int, m: int, data: np.ndarray, repeats: int) -> Optional[float]:
    try:
        import reedsolo
    except ImportError:
        return None
    codec = reedsolo.RSCodec(nsym=m, nsize=k + m)
    msg = bytearray(data[: (REEDSOLO_BYTES // k) * k].tobytes())  # chunked by reedsolo into k-byte messages
    return _mbps(len(msg), _best(lambda: codec.encode(msg), max(1, min(repeats, 3))))


def _zfec_encode_mbps(k: int, m: int, shards: list, repeats: int) -> Optional[float]:
    try:
        import zfec
    except ImportError:
        return None
    enc = zfec.Encoder(k, k + m)
    blocks = tuple(shards)
    wanted = tuple(range(k, k + m))
    nbytes = sum(s.nbytes for s in shards)
    return _mbps(nbytes, _best(lambda: enc.encode(blocks, wanted), repeats))


def run_erasure_bench(size_mib: int = 64, seed: int = 0, *, repeats: int = 5) -> dict:
    """Run the benchmark once; returns a JSON-serialisable dict (see module doc)."""
    if size_mib < 1:
        raise ValueError("size_mib must be >= 1")
    size = int(size_mib) << 20
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size, dtype=np.uint8)

    dst = np.empty_like(data)
    np.copyto(dst, data)
    memcpy = _mbps(size, _best(partial(np.copyto, dst, data), repeats))
    del dst

    backends = ["isal", "numpy"] if isal_available() else ["numpy"]
    codecs = []
    zfec_mbps = None
    for k, m in CODES:
        length = size // k
        shards = [data[i * length:(i + 1) * length] for i in range(k)]
        nbytes = k * length
        if (k, m) == (8, 2):
            zfec_mbps = _zfec_encode_mbps(k, m, shards, repeats)
        reference = None
        for backend in backends:
            rs = ReedSolomon(k, m, backend=backend)
            parity = [np.zeros(length, dtype=np.uint8) for _ in range(m)]
            t_enc = _best(partial(rs.encode, shards, out=parity), repeats)
            if reference is None:
                reference = [p.copy() for p in parity]
            elif not all(np.array_equal(a, b) for a, b in zip(reference, parity)):
                raise AssertionError(f"backend {backend} parity differs for ({k},{m})")
            # lose the first m data shards; survivors are decoded in place
            lost = list(range(m))
            received = [None if i in lost else s for i, s in enumerate(shards)] + parity
            out = [np.zeros(length, dtype=np.uint8) if i in lost else shards[i] for i in range(k)]
            t_dec = _best(partial(rs.decode, received, out=out), repeats)
            if not all(np.array_equal(out[i], shards[i]) for i in lost):
                raise AssertionError(f"backend {backend} decoded wrong data for ({k},{m})")
            codecs.append({
                "backend": backend, "k": k, "m": m,
                "encode_MBps": _mbps(nbytes, t_enc),
                "decode_MBps": _mbps(nbytes, t_dec),
            })
            del parity, out, received

    result: dict = {
        "size_mib": int(size_mib),
        "seed": int(seed),
        "repeats": int(repeats),
        "memcpy_MBps": memcpy,
        "reedsolo_encode_MBps": _reedsolo_encode_mbps(8, 2, data, repeats),
        "zfec_encode_MBps": zfec_mbps,
        "codecs": codecs,
    }
    isal82 = next((c for c in codecs if c["backend"] == "isal" and (c["k"], c["m"]) == (8, 2)), None)
    if isal82 is not None:
        result["ratio_isal_encode_vs_memcpy"] = round(isal82["encode_MBps"] / memcpy, 3)
        result["ratio_isal_decode_vs_memcpy"] = round(isal82["decode_MBps"] / memcpy, 3)
    result["checksum_impl"] = checksum_impl()
    result["checksum_MBps"] = _mbps(size, _best(lambda: checksum(data), repeats))
    result["machine"] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads_used": 1,
    }
    result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["notes"] = (
        "MB = 1e6 bytes; rates are data bytes / s, best of %d after a warm-up, single thread, "
        "preallocated warmed outputs. memcpy = np.copyto of the same %d MiB. "
        "reedsolo_encode_MBps is RS(8,2) (RSCodec(nsym=2, nsize=10)) on a %d KiB input, "
        "extrapolated (pure Python, linear in size). zfec_encode_MBps = zfec.Encoder(8, 10) "
        "producing the 2 parity blocks. decode rebuilds the first m data shards into "
        "preallocated buffers from the other k-m data shards and the m parity shards "
        "(survivors passed in place, no copy). checksum_MBps = checksum() (CRC-32) over the %d MiB."
        % (repeats, size_mib, REEDSOLO_BYTES >> 10, size_mib)
    )
    return result


if __name__ == "__main__":
    from benchmarks.common import main

    raise SystemExit(main("erasure"))
