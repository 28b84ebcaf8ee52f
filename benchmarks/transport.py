"""``elastic-llm bench transport``: the stage-to-stage transport against its candidates.

Two Ray actors play ping-pong with float32 arrays of an activation's size, in one run, taking
turns per system:

* ``sockets``: the product's :class:`~elastic_llm.pipeline.transport.SocketTransport` (what a
  step's activations, gradients and gradient chunks travel over);
* ``gloo``: ``torch.distributed`` ``ProcessGroupGloo`` send / recv between the same two actors
  (what ``torch.distributed.pipelining`` uses on CPU);
* ``actor_call``: the sender calls the receiver with the array (Ray's object store above 100 KiB):
  a mailbox made of actor calls, the other way to move tensors between actors without NCCL;
* ``memcpy``: copying the array once in one process, the floor.

Reports microseconds and CPU milliseconds (both actors) per one-way message, and each system's
ratio to ``sockets``. Then ``kill_mid_step``: real stage actors (4 stages x 2 replicas of a small
model) run a step in which one actor is held at its backward (a planned chaos fault), so its
neighbours block on it; it is SIGKILLed, and the time from the kill until each survivor's report
says it failed, and until the driver raises the failed step, is measured. Owns only the
measurement; never changes product code.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from benchmarks.common import free_port, machine_info, median, ratio

SIZES = (64 << 10, 512 << 10, 4 << 20)  # bytes: a micro model's, tiny's and a larger activation


class _Player:
    """One end of the ping-pong (a Ray actor)."""

    def __init__(self, me: int) -> None:
        from elastic_llm.snapshot.records import ShardKey

        self.me = me
        self.key = ShardKey(me, 0)
        self.peer_key = ShardKey(1 - me, 0)
        self.links: Any = None
        self.pg: Any = None

    def address(self) -> tuple[str, int]:
        from elastic_llm.pipeline.transport import SocketTransport

        self.links = SocketTransport(self.key)
        return self.links.address

    def connect(self, peer: tuple[str, int], port: int) -> bool:
        import datetime

        import torch.distributed as dist

        self.links.connect(1, {self.peer_key: tuple(peer)})
        store = dist.TCPStore("127.0.0.1", port, 2, self.me == 0, timeout=datetime.timedelta(seconds=60))
        self.pg = dist.ProcessGroupGloo(store, self.me, 2, datetime.timedelta(seconds=120))
        return True

    def sockets(self, nbytes: int, n: int) -> float:
        from elastic_llm.pipeline.transport import Msg

        a = np.ones(nbytes // 4, np.float32)
        self.links.begin(1, 120.0)
        c0 = time.process_time()
        for i in range(n):
            if self.me == 0:
                self.links.send(self.peer_key, Msg.ACT, i, 0, a)
                a = self.links.recv(self.peer_key, Msg.ACT, i, 1)
            else:
                b = self.links.recv(self.peer_key, Msg.ACT, i, 0)
                self.links.send(self.peer_key, Msg.ACT, i, 1, b)
        return time.process_time() - c0

    def gloo(self, nbytes: int, n: int) -> float:
        import torch

        t = torch.ones(nbytes // 4)
        c0 = time.process_time()
        for _ in range(n):
            if self.me == 0:
                self.pg.send([t], 1, 0).wait()
                self.pg.recv([t], 1, 0).wait()
            else:
                self.pg.recv([t], 0, 0).wait()
                self.pg.send([t], 0, 0).wait()
        return time.process_time() - c0

    def actor_call(self, peer: Any, nbytes: int, n: int) -> float:
        import ray

        a = np.ones(nbytes // 4, np.float32)
        c0 = time.process_time()
        for _ in range(n):
            a = ray.get(peer.echo.remote(a))
        return time.process_time() - c0

    def echo(self, a: np.ndarray) -> np.ndarray:
        return a

    def cpu(self) -> float:
        return time.process_time()

    def report(self, step: int) -> Any:
        """A stage's step report of the usual size (4 microbatches' losses, 16 ops' timings)."""
        from elastic_llm.pipeline.plan import StepReport

        return StepReport(self.key, step, (1.0,) * 4, 0.5, 1e-3, 0.0, np.zeros(16), {"forward": 0.1, "backward": 0.2, "allreduce": 0.0, "update": 0.0},
                          None, {"act": 1 << 20, "grad": 1 << 20})

    def reports(self, n: int) -> Any:
        """What a replica's stage 0 answers the driver for a step: its ``n`` stages' reports in one value."""
        from elastic_llm.pipeline.relay import ReplicaReports

        return ReplicaReports({i: self.report(i) for i in range(n)})


def _memcpy(nbytes: int, n: int) -> tuple[float, float]:
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    np.copyto(dst, src)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(2 * n):
        np.copyto(dst, src)
    return time.perf_counter() - t0, time.process_time() - c0


def _ping_pong(a: Any, b: Any, system: str, nbytes: int, n: int) -> float:
    """Wall seconds of ``n`` round trips of ``system`` between players ``a`` and ``b``."""
    import ray

    t0 = time.perf_counter()
    if system == "actor_call":
        ray.get(a.actor_call.remote(b, nbytes, n))
    else:
        ray.get([getattr(a, system).remote(nbytes, n), getattr(b, system).remote(nbytes, n)])
    return time.perf_counter() - t0


def _driver_calls(a: Any, b: Any, n: int, stages: int = 64, replicas: int = 16, rounds: int = 5) -> dict[str, Any]:
    """What an actor call costs the driver, as a step's calls are made: ``n`` small calls sent
    at once to two actors, then all their answers awaited; the driver process's CPU (its own and
    Ray's threads in it) per call, beside a ``dict`` copy of the same size as the peer (Python's
    cost for the same bookkeeping, no Ray). And a step's reports at ``stages`` x ``replicas``
    (median of ``rounds``): one call per actor (the peer), against one call per replica answered
    by its stage 0 with the replica's reports in one value (:mod:`elastic_llm.pipeline.relay`),
    and the same calls answering no reports: their difference over the reports is the driver's
    CPU per relayed report."""
    import ray

    ray.get([h.cpu.remote() for h in (a, b) for _ in range(20)])  # warm
    c0, t0 = time.process_time(), time.perf_counter()
    ray.get([(a if i % 2 else b).cpu.remote() for i in range(n)], timeout=120)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    c1 = time.process_time()
    for _ in range(n):
        dict.fromkeys(range(8))
    py = time.process_time() - c1

    def step_cpu(calls: Any) -> float:
        out = []
        for _ in range(rounds):
            time.sleep(0.5)  # the previous round's frees done
            c = time.process_time()
            ray.get(calls(), timeout=300)
            out.append(time.process_time() - c)
        return median(out)

    ray.get([a.reports.remote(stages), b.report.remote(0)])  # warm
    direct = step_cpu(lambda: [(a if i % 2 else b).report.remote(i) for i in range(stages * replicas)])
    relayed = step_cpu(lambda: [(a if r % 2 else b).reports.remote(stages) for r in range(replicas)])
    empty = step_cpu(lambda: [(a if r % 2 else b).reports.remote(0) for r in range(replicas)])
    return {"calls": n, "driver_cpu_us_per_call": 1e6 * cpu / n, "wall_us_per_call": 1e6 * wall / n,
            "python_dict_us_per_call": 1e6 * py / n, "call_vs_dict_cpu": ratio(cpu, py),
            "step": {"stages": stages, "replicas": replicas, "rounds": rounds,
                     "direct_ms": 1e3 * direct, "relayed_ms": 1e3 * relayed, "relay_calls_only_ms": 1e3 * empty,
                     "direct_vs_relayed_cpu": ratio(direct, relayed)},
            "relayed_report_us": max(0.0, 1e6 * (relayed - empty) / (stages * replicas))}


def _kill_mid_step(repeats: int = 3) -> dict[str, Any]:
    """Seconds from SIGKILLing a stage held mid-step until its peers report failure and the
    driver's step fails (median and worst over ``repeats``)."""
    import signal

    import ray

    from elastic_llm.config import load_config
    from elastic_llm.pipeline.executor import RayStepExecutor, StepFailed
    from elastic_llm.pipeline.plan import Fault, FaultAction, Phase
    from elastic_llm.pipeline.stage import CONCURRENCY_GROUPS, StageWorker
    from elastic_llm.snapshot.records import ShardKey

    cfg = load_config(None, ["model.dim=64", "model.n_heads=4", "model.n_layers=4", "model.seq_len=32", "parallel.stages=4", "parallel.dp=2", "parallel.microbatches=4", "train.batch_size=8"])
    Stage = ray.remote(num_cpus=0.1, concurrency_groups=CONCURRENCY_GROUPS)(StageWorker)
    rng = np.random.default_rng(0)
    victim = ShardKey(2, 1)
    peers_s, driver_s = [], []
    for _ in range(repeats):
        actors = [[Stage.remote(cfg.to_dict(), s, r, 2) for s in range(4)] for r in range(2)]
        ex = RayStepExecutor(actors, "1f1b", 4)
        tokens = rng.integers(0, 256, (8, 33))
        ex.finish(ex.start(1, tokens[:, :-1].copy(), tokens[:, 1:].copy()))  # warm: links up, one step done
        pid = ray.get(actors[victim.replica][victim.stage].info.remote()).pid
        pending = ex.start(2, tokens[:, :-1].copy(), tokens[:, 1:].copy(), faults={victim: Fault(Phase.BACKWARD, FaultAction.HOLD)})
        time.sleep(1.0)  # the step runs until everything waits on the held actor
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        try:
            ex.finish(pending)
            raise RuntimeError("the step with a SIGKILLed stage did not fail")
        except StepFailed as e:
            driver_s.append(time.time() - t_kill)
            assert (e.stage, e.replica) == (victim.stage, victim.replica), f"root cause {e.stage}/{e.replica}, not the victim"
        peers_s += [r.failure.at - t_kill for r in pending.reports.values() if r.failure is not None]
        for row in actors:
            for h in row:
                ray.kill(h)
    return {
        "stages": 4, "replicas": 2, "victim": str(victim), "held_at": "backward", "repeats": repeats,
        "peers_failed_s_median": median(peers_s), "peers_failed_s_max": float(max(peers_s)),
        "step_failed_s_median": median(driver_s), "step_failed_s_max": float(max(driver_s)),
        "target_s": 5.0,
    }


def run_transport_bench(rounds: int = 200, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Ping-pong ``rounds`` round trips per size and system; one-way figures per message."""
    import ray

    from elastic_llm.runtime.session import loopback_env

    loopback_env()
    ours = not ray.is_initialized()
    if ours:
        ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        env = {"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}}
        Player = ray.remote(num_cpus=1, runtime_env=env)(_Player)
        a, b = Player.remote(0), Player.remote(1)
        addr = ray.get([a.address.remote(), b.address.remote()])
        port = free_port()
        ray.get([a.connect.remote(addr[1], port), b.connect.remote(addr[0], port)], timeout=120)
        rows = []
        for nbytes in sizes:
            n = max(20, rounds * (512 << 10) // max(nbytes, 64 << 10) // 4) if nbytes > (512 << 10) else rounds
            res: dict[str, dict[str, float]] = {}
            for system in ("sockets", "gloo", "actor_call"):
                _ping_pong(a, b, system, nbytes, max(5, n // 10))  # warm-up
                c0 = ray.get([a.cpu.remote(), b.cpu.remote()])
                wall = _ping_pong(a, b, system, nbytes, n)
                c1 = ray.get([a.cpu.remote(), b.cpu.remote()])
                res[system] = {"us_per_msg": 1e6 * wall / (2 * n), "cpu_ms_per_msg": 1e3 * (sum(c1) - sum(c0)) / (2 * n)}
            wall, cpu = _memcpy(nbytes, n)
            res["memcpy"] = {"us_per_msg": 1e6 * wall / (2 * n), "cpu_ms_per_msg": 1e3 * cpu / (2 * n)}
            rows.append({
                "bytes": nbytes, "round_trips": n, "systems": res,
                "time_vs_sockets": {s: ratio(v["us_per_msg"], res["sockets"]["us_per_msg"]) for s, v in res.items()},
                "cpu_vs_sockets": {s: ratio(v["cpu_ms_per_msg"], res["sockets"]["cpu_ms_per_msg"]) for s, v in res.items()},
            })
        calls = _driver_calls(a, b, max(200, rounds * 5))
        for h in (a, b):
            ray.kill(h)
        kill = _kill_mid_step()
    finally:
        if ours:
            ray.shutdown()
    note = "per one-way message; CPU counts both actors (actor_call: also Ray's threads in them, not the raylet)"
    return {"bench": "transport", "machine": machine_info(), "rows": rows, "driver_calls": calls, "kill_mid_step": kill, "note": note}


if __name__ == "__main__":
    from benchmarks.common import main

    raise SystemExit(main("transport"))
