"""Warm standby stage processes: started ahead of time, adopted by a recovery, a grow or a drain.

Owns: the run's pool of standbys, ``recovery.standby`` per node (alive, with CPUs, not draining):
each a :class:`~elastic_llm.pipeline.stage.StageWorker` actor started without a stage (torch and
the model code imported and warmed up), holding no CPU or GPU reservation (``num_cpus=0``) and one
thread, pinned to its node, named ``standby-<run>-<node>.<n>``. It starts standbys in the
background where some are missing, hands a ready one on a given node to whoever adopts it
(:meth:`StandbyPool.take`), forgets the ones that died, and says how many are warm where
(:meth:`StandbyPool.ready`: the capacity view counts them). ``auto`` sizes the pool from the
observed failure rate (:func:`standby_target`, pure).

An adopted standby runs in its process the stage whose placement-group bundle (the reservation of
the dead actor, or a new one) is on the same node: the bundle keeps the node's CPUs (and GPU)
reserved for the run; the process itself was never scheduled into it.

GPUs (unmeasured: no GPU is lent to this project): a standby holds no device unless
``recovery.standby_gpus`` is set. Without it, a standby adopted for a GPU stage takes the dead
actor's devices on the same node (their ids travel with the adoption and are made visible before
CUDA is first touched); a replacement on another node (its node died) starts a new process in the
re-placed bundle, and the recovery plan says so. With it, each standby reserves
``parallel.gpus_per_actor`` of its own and can be adopted on any node.

Never decides: which actor adopts which standby comes from the recovery plan or the elastic
executor's pure assignment; this module only keeps the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from elastic_llm.clock import SYSTEM, Clock
from elastic_llm.config import RunConfig

AUTO_MAX = 4  # recovery.standby: auto never keeps more than this many per node
CHECK_S = 2.0  # how often idle standbys are asked whether they live
READY_S = 300.0  # a standby that has not started in this long is given up (its node is overloaded or gone)


@dataclass(frozen=True, eq=False)
class Standby:
    """One warm standby: its actor, node, the ``info`` call that answers once it has started."""

    actor: Any
    node: str
    name: str
    ready_ref: Any
    started: float  # self.clock.monotonic()


def standby_target(setting: int | str, failures: int, elapsed_s: float, nodes: int, start_s: float) -> int:
    """Standbys per node for ``recovery.standby``: the number itself, or for ``auto`` enough that
    the failures expected on a node while a used standby is replaced (one start, ``start_s``) are
    covered twice over: at least 1, at most :data:`AUTO_MAX`. Pure."""
    if setting != "auto":
        return int(setting)
    if failures <= 0 or elapsed_s <= 0 or nodes <= 0:
        return 1
    per_node_per_s = failures / elapsed_s / nodes
    return max(1, min(AUTO_MAX, math.ceil(2 * per_node_per_s * start_s + 1e-9)))


class StandbyPool:
    def __init__(self, cfg: RunConfig, run_id: str, namespace: str, clock: Clock = SYSTEM,
                 on_gone: Callable[[frozenset[str], str], None] | None = None) -> None:
        """``on_gone``: told of a node where Ray's scheduler refused a standby (the node is gone:
        the refusal is the declaration)."""
        self.clock = clock
        self.on_gone = on_gone
        self.cfg = cfg
        self.run_id = run_id
        self.namespace = namespace
        self.per_node = standby_target(cfg.recovery.standby, 0, 0.0, 0, 0.0)
        self.standbys: dict[str, list[Standby]] = {}  # node -> standbys on it (ready or starting)
        self.started = 0  # standbys started in total (names are unique per run)
        self.adopted = 0
        self.start_s: list[float] = []  # seconds from start to ready, of the standbys seen ready
        self._ready: set[Standby] = set()
        self._info: dict[Standby, Any] = {}  # a started standby's StageInfo (its pid)
        self._pings: dict[Any, Standby] = {}  # liveness calls in flight (see check)
        self._pinged = float("-inf")
        self.grace_s = cfg.recovery.driver_grace_s if cfg.outlives_driver else 0.0  # > 0: detached standbys that outlive the driver this long (elastic_llm.lease)

    @property
    def enabled(self) -> bool:
        return self.cfg.recovery.standby != 0

    @property
    def starts_take_step_cpu(self) -> bool:
        """Stages on CPUs: a standby's start competes with the steps (on GPUs it does not)."""
        return not self.cfg.parallel.gpus_per_actor

    def resize(self, failures: int, elapsed_s: float) -> None:
        """``auto``: re-size the pool from the failures seen so far."""
        nodes = max(1, len(self.standbys))
        start = sorted(self.start_s)[len(self.start_s) // 2] if self.start_s else 5.0
        self.per_node = standby_target(self.cfg.recovery.standby, failures, elapsed_s, nodes, start)

    def ensure(self, nodes: Iterable[str]) -> int:
        """Start standbys (in the background, nothing waits) on ``nodes`` until each has
        ``per_node``; forget standbys on other nodes (dead or draining: killed). Returns how many
        were started."""
        import ray

        want = set(nodes)
        for node in [n for n in self.standbys if n not in want]:
            for sb in self.standbys.pop(node):
                self._kill(sb)
        self._forget_dead()
        n = 0
        for node in sorted(want):
            have = self.standbys.setdefault(node, [])
            while len(have) < self.per_node:
                have.append(self._start(node, ray))
                n += 1
        return n

    def _start(self, node: str, ray: Any) -> Standby:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from elastic_llm.pipeline.stage_actor import remote_stage_class

        par = self.cfg.parallel
        gpus = par.gpus_per_actor if self.cfg.recovery.standby_gpus else 0
        self.started += 1
        name = f"standby-{self.run_id}-{node[:12]}.{self.started}"
        actor = remote_stage_class().options(  # the stage actors' class: an adopted standby is one of them
            name=name,
            namespace=self.namespace,
            num_cpus=0,
            num_gpus=gpus,
            max_restarts=0,
            lifetime="detached" if self.grace_s > 0 else None,  # outlives a dead driver: the next one takes it over
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(self.cfg, None, run_id=self.run_id, grace_s=self.grace_s)
        return Standby(actor, node, name, actor.info.remote(), self.clock.monotonic())

    def _forget_dead(self) -> None:
        """Drop standbys whose process died (their ``info`` call failed) or never started; a node
        where Ray's scheduler refused one is gone: its standbys are dropped and ``on_gone`` told."""
        import ray

        now = self.clock.monotonic()
        refused: dict[str, str] = {}
        for node, sbs in self.standbys.items():
            keep = []
            for sb in sbs:
                if sb in self._ready:
                    keep.append(sb)
                    continue
                done, _ = ray.wait([sb.ready_ref], timeout=0)
                if done:
                    try:
                        self._info[sb] = ray.get(sb.ready_ref, timeout=0)
                    except ray.exceptions.RayActorError:
                        continue  # died before it started
                    except ray.exceptions.ActorUnschedulableError as e:
                        refused[node] = f"Ray's scheduler refused a warm standby there ({str(e).splitlines()[0]})"
                        continue
                    self._ready.add(sb)
                    self.start_s.append(now - sb.started)
                    keep.append(sb)
                elif now - sb.started > READY_S:
                    self._kill(sb)
                else:
                    keep.append(sb)
            sbs[:] = keep
        for node, why in refused.items():
            for sb in self.standbys.pop(node, []):
                self._kill(sb)
            if self.on_gone is not None:
                self.on_gone(frozenset({node}), why)

    def ready(self) -> dict[str, int]:
        """Warm standbys per node that have started (no waiting). A standby that died while
        idle is noticed by :meth:`check`, or when it is adopted (the adoption fails and the
        recovery is planned again)."""
        self._forget_dead()
        return {node: sum(1 for sb in sbs if sb in self._ready) for node, sbs in self.standbys.items() if sbs}

    def check(self, every_s: float = CHECK_S) -> int:
        """Notice standbys that died while idle, without waiting: collects the answers to the
        liveness calls sent by the previous check (a failed one: forgotten), and every ``every_s``
        sends new ones. Returns how many were forgotten."""
        import ray

        gone = 0
        if self._pings:
            done, _ = ray.wait(list(self._pings), num_returns=len(self._pings), timeout=0)
            for ref in done:
                sb = self._pings.pop(ref)
                try:
                    ray.get(ref, timeout=0)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError):
                    if sb in self._ready:
                        self._remove(sb)
                        gone += 1
        now = self.clock.monotonic()
        if not self._pings and now - self._pinged >= every_s:
            self._pinged = now
            for sbs in self.standbys.values():
                for sb in sbs:
                    if sb in self._ready:
                        self._pings[sb.actor.info.options(concurrency_group="status").remote()] = sb
        return gone

    def pids(self, node: str) -> list[int]:
        """Process ids of the started standbys on ``node``."""
        self._forget_dead()
        return [self._info[sb].pid for sb in self.standbys.get(node, []) if sb in self._ready and sb in self._info]

    def take(self, node: str) -> Standby | None:
        """A started standby on ``node``, removed from the pool (the caller adopts it); None if
        there is none."""
        self._forget_dead()
        for sb in self.standbys.get(node, []):
            if sb in self._ready:
                self._remove(sb)
                self.adopted += 1
                return sb
        return None

    def actors(self) -> list[Any]:
        """Every standby's actor handle (ready or starting)."""
        return [sb.actor for sbs in list(self.standbys.values()) for sb in list(sbs)]

    def take_over(self) -> int:
        """The standbys a dead driver of this run left (detached, found by name) join this pool
        once they answer (within :data:`~elastic_llm.runtime.handover.ANSWER_S`: one still starting
        then is ended); returns how many. Standbys started later get later names."""
        import ray

        from elastic_llm.runtime.handover import ANSWER_S, name_generation

        prefix = f"standby-{self.run_id}-"
        found = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == self.namespace and entry["name"].startswith(prefix):
                self.started = max(self.started, name_generation(entry["name"]))
                try:
                    found[entry["name"]] = ray.get_actor(entry["name"], namespace=self.namespace)
                except ValueError:  # gone since it was listed
                    continue
        asks = {actor.info.options(concurrency_group="status").remote(): (name, actor) for name, actor in found.items()}
        ray.wait(list(asks), num_returns=len(asks), timeout=ANSWER_S)
        n = 0
        for ref, (name, actor) in asks.items():
            try:
                info = ray.get(ref, timeout=0)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError, ray.exceptions.GetTimeoutError):
                self._kill(Standby(actor, "", name, ref, self.clock.monotonic()))
                continue
            sb = Standby(actor, info.node_id, name, ref, self.clock.monotonic())
            self.standbys.setdefault(info.node_id, []).append(sb)
            self._ready.add(sb)
            self._info[sb] = info
            n += 1
        return n

    def count(self) -> tuple[int, int]:
        """(ready, starting) standbys of the run."""
        ready = sum(1 for sbs in self.standbys.values() for sb in sbs if sb in self._ready)
        total = sum(len(sbs) for sbs in self.standbys.values())
        return ready, total - ready

    def _remove(self, sb: Standby) -> None:
        self._ready.discard(sb)
        self._info.pop(sb, None)
        sbs = self.standbys.get(sb.node, [])
        if sb in sbs:
            sbs.remove(sb)

    def _kill(self, sb: Standby) -> None:
        from elastic_llm.runtime.placement import kill_actor

        self._remove(sb)
        kill_actor(sb.actor)

    def shutdown(self) -> None:
        for sbs in list(self.standbys.values()):
            for sb in list(sbs):
                self._kill(sb)
        self.standbys.clear()
