"""Helpers shared by the benchmarks: CPU accounting from /proc, the machine, a free loopback port,
ratios, stdout kept for the result, and the ``python -m benchmarks.<name>`` entry point.

Owns: reading per-process and whole-machine CPU time on Linux (None elsewhere), describing the
machine (the filesystem a path is on included), picking a free TCP port on 127.0.0.1, the median
every benchmark reports. Never measures anything itself and never copies product code.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Any, Literal, overload

MID_RUN = "train.max_steps=1000000"  # a trainer's timed steps are a run's middle: past train.max_steps every step is its last (and snapshots)


def main(name: str) -> int:
    """``python -m benchmarks.<name> [options]``: exactly ``elastic-llm bench <name> [options]``."""
    from benchmarks.run import main as run

    return run(name, sys.argv[1:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ratio(a: float | None, b: float | None, nd: int = 3) -> float | None:
    """``a / b`` rounded to ``nd`` digits; None when either is missing or ``b`` is zero."""
    return round(a / b, nd) if a is not None and b else None


@overload
def median(xs: Iterable[float], *, or_none: Literal[False] = False) -> float: ...
@overload
def median(xs: Iterable[float], *, or_none: Literal[True]) -> float | None: ...
def median(xs: Iterable[float], *, or_none: bool = False) -> float | None:
    """The median of ``xs`` as a float (of an even count, the mean of the middle two). Of no
    values: None with ``or_none``, else ValueError (a figure that must exist)."""
    values = [float(x) for x in xs]
    if values:
        return float(statistics.median(values))
    if or_none:
        return None
    raise ValueError("the median of no values: nothing was measured")


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (all cores, all processes), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def outside_share(busy_s: float | None, ours_s: float | None, wall_s: float) -> float | None:
    """Share of the machine's capacity that processes other than ours took over ``wall_s``
    seconds, given the machine's busy CPU seconds (:func:`machine_busy_s` difference) and ours."""
    if busy_s is None or ours_s is None or wall_s <= 0:
        return None
    return max(0.0, (busy_s - ours_s) / (wall_s * (os.cpu_count() or 1)))


def process_tree_cpu(root: int, exclude: Collection[int] = ()) -> dict[int, float] | None:
    """{pid: CPU seconds (user + system) used so far} of ``root`` and its live descendants,
    skipping the subtrees of ``exclude``. Reads /proc (Linux); None elsewhere."""
    if not os.path.isdir("/proc/self"):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry))
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    out: dict[int, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        if pid in cpu:
            out[pid] = cpu[pid]
        todo.extend(children.get(pid, ()))
    return out


def tree_cpu_s(root: int, exclude: Collection[int] = ()) -> float | None:
    """Total CPU seconds of :func:`process_tree_cpu` (None where /proc is missing)."""
    tree = process_tree_cpu(root, exclude)
    return None if tree is None else sum(tree.values())


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict[str, Any]:
    """What a benchmark ran on: platform, CPU, cores, memory, Python/torch/Ray versions, load."""
    import ray
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
    }
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    if hasattr(os, "getloadavg"):
        info["loadavg_1m_at_start"] = round(os.getloadavg()[0], 2)
    return info


def fs_type(path: str) -> str | None:
    """The filesystem type (``ext4``, ``tmpfs``, ...) of the mount holding ``path`` (its real
    path), from /proc/self/mountinfo (:func:`mount_fs_type`); None where there is none (not Linux)."""
    try:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    except OSError:
        return None
    return mount_fs_type(os.path.realpath(path), mountinfo)


def mount_fs_type(path: str, mountinfo: str) -> str | None:
    """Pure: the filesystem type of the longest mount point in ``mountinfo`` (the text of
    /proc/self/mountinfo) that is the absolute ``path`` or a directory above it: ``/tmp`` holds
    ``/tmp/x``, not ``/tmpfoo``; of two mounts on one point, the later (it hides the earlier)."""
    longest, kind = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()  # ID parent major:minor root point options [optional fields...] - type source super-options
        sep = fields.index("-", 6) if "-" in fields[6:] else len(fields)
        if sep + 1 >= len(fields):
            continue  # not a mount line
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # a space in a path is written \040
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= longest:
            longest, kind = len(point), fields[sep + 1]
    return kind


def load_at_end(machine: dict[str, Any]) -> None:
    """Add the 1-minute load average at the end of a run to ``machine`` (where the OS has one)."""
    if hasattr(os, "getloadavg"):
        machine["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr meanwhile (Python and C writers alike: Ray's raylets and
    workers print on the driver's stdout), so that ``--json`` leaves the result alone on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def torch_adamw(optimizer: Any) -> Any:
    """``torch.optim.AdamW`` over a stage's parameter groups holding the very state tensors of its
    :class:`~elastic_llm.pipeline.optim.StageAdamW` (no copy): what the ``torch.save`` / DCP peers
    save and load, as a trainer built on ``torch.optim`` holds it. Build it outside any timing
    (its first use imports torch's compiler stack)."""
    import torch

    fields = ("lr", "betas", "eps", "weight_decay")
    opt = torch.optim.AdamW([{"params": g["params"], **{k: g[k] for k in fields}} for g in optimizer.param_groups], foreach=True)
    for g, mine in zip(opt.param_groups, optimizer.param_groups):
        g["initial_lr"] = mine.get("initial_lr", mine["lr"])
    for p, state in optimizer.state.items():
        opt.state[p] = state
    return opt


def reference_rates(nbytes: int, rounds: int = 5) -> dict[str, Any]:
    """What moving ``nbytes`` costs on this machine without the product, measured now: a warm
    ``memcpy`` (numpy ``copyto`` between two touched buffers) and one loopback TCP connection
    (``sendall`` from a thread into ``recv_into`` a touched buffer): the medians of ``rounds``,
    in GB/s."""
    import threading

    import numpy as np

    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    copy_s, tcp_s = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copy_s.append(time.perf_counter() - t0)
    with socket.create_server(("127.0.0.1", 0)) as server:
        for _ in range(rounds):
            sender = socket.create_connection(server.getsockname())
            conn, _ = server.accept()
            view, got = memoryview(dst), 0
            thread = threading.Thread(target=sender.sendall, args=(memoryview(src),))
            t0 = time.perf_counter()
            thread.start()
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)
            tcp_s.append(time.perf_counter() - t0)
            thread.join()
            sender.close()
            conn.close()
    gbs = lambda xs: round(nbytes / median(xs) / 1e9, 3)  # noqa: E731
    return {"bytes": nbytes, "memcpy_gb_s": gbs(copy_s), "loopback_tcp_gb_s": gbs(tcp_s), "rounds": rounds}
