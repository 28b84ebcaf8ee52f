"""The training controller: Ray session, placement, the step loop, metrics.

Owns: starting (or joining) Ray on loopback, checking that the requested placement can exist
before anything starts, one placement group for all stage actors, the data stream on the
driver, the step loop, validation, JSON-lines metrics and the live progress bar.
Never computes model math itself: stage actors do, driven by :class:`PipelineRunner`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import IO, Any, Callable

import numpy as np

from elastic_llm.config import RunConfig
from elastic_llm.data import DataError, TokenStream, ensure_builtin_corpus, load_split, read_meta
from elastic_llm.model import count_parameters

NAMESPACE = "elastic-llm"


class PlacementError(RuntimeError):
    """The cluster cannot host the requested actors; the message says what is missing."""


def loopback_env() -> None:
    """Keep Ray on 127.0.0.1 and use token authentication (Ray >= 2.60 refuses clients otherwise)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")


def start_ray(cfg: RunConfig, address: str | None = None, dashboard: bool = False) -> bool:
    """Connect to ``address`` or start an embedded single-node Ray. Returns True if we started it."""
    loopback_env()
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        return False
    check_placement(cfg, local_resources(), [])  # refuse before starting anything
    ray.init(
        address="local",  # never join a cluster that another process started on this machine
        num_cpus=os.cpu_count() or 1,
        namespace=NAMESPACE,
        include_dashboard=dashboard,
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=True,
        logging_level="WARNING",
    )
    return True


def local_resources() -> dict[str, float]:
    """What an embedded Ray on this machine would offer."""
    import torch

    return {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}


def check_placement(cfg: RunConfig, resources: dict[str, float], nodes: list[dict[str, Any]]) -> None:
    """Refuse placements the cluster cannot satisfy (pure: resources in, error out)."""
    par = cfg.parallel
    n = par.stages * par.dp
    problems = []
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if n * par.cpus_per_actor > cpus:
        problems.append(
            f"{par.stages} stages x {par.dp} replicas x parallel.cpus_per_actor={par.cpus_per_actor} needs "
            f"{n * par.cpus_per_actor:g} CPUs but the cluster has {cpus:g}: lower parallel.cpus_per_actor "
            "(fractions are allowed), parallel.dp or parallel.stages, or add nodes"
        )
    if par.gpus_per_actor > 0 and n * par.gpus_per_actor > gpus:
        problems.append(
            f"{n} actors x parallel.gpus_per_actor={par.gpus_per_actor} needs {n * par.gpus_per_actor:g} GPUs "
            f"but the cluster has {gpus:g}: set parallel.gpus_per_actor=0 to train on CPUs, or use a fraction to share GPUs"
        )
    alive = [nd for nd in nodes if nd.get("Alive", True)] or [{"Resources": resources}]
    largest = max(nd.get("Resources", {}).get("CPU", 0.0) for nd in alive)
    if par.cpus_per_actor > largest:
        problems.append(
            f"parallel.cpus_per_actor={par.cpus_per_actor} exceeds the largest node's {largest:g} CPUs: no node can host one stage"
        )
    if par.placement_strategy == "STRICT_SPREAD" and n > len(alive):
        problems.append(
            f"parallel.placement_strategy=STRICT_SPREAD puts each of {n} actors on its own node but there are {len(alive)} nodes: use SPREAD or PACK"
        )
    if problems:
        raise PlacementError("impossible placement:\n" + "\n".join(f"  - {p}" for p in problems))


class MetricsWriter:
    """JSON lines: one per step, one per event. Flushed per line so a crash loses nothing."""

    def __init__(self, path: str | Path | None) -> None:
        self.file: IO[str] | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "w")

    def write(self, record: dict[str, Any]) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def event(self, name: str, **fields: Any) -> None:
        self.write({"event": name, "time": time.time(), **fields})

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None


class Trainer:
    """Places the stage actors and runs the step loop; snapshots, injects chaos, recovers.

    >>> trainer = Trainer(cfg); history = trainer.fit(); trainer.shutdown()

    ``cluster`` (a ``ray.cluster_utils.Cluster``) is only for tests and demos: chaos events that
    remove nodes need it.
    """

    def __init__(
        self,
        cfg: RunConfig,
        address: str | None = None,
        metrics_out: str | Path | None = None,
        progress: bool = False,
        dashboard: bool = False,
        cluster: Any = None,
    ) -> None:
        self.cfg = cfg
        self.address = address
        self.metrics = MetricsWriter(metrics_out)
        self.progress = progress
        self.dashboard = dashboard
        self.cluster = cluster
        self.run_id = uuid.uuid4().hex[:6]
        self.owns_ray = False
        self.pg = None
        self.actors: list[list[Any]] = []
        self.nodes: dict[tuple[int, int], str] = {}  # (stage, replica) -> node id
        self.pids: dict[tuple[int, int], int] = {}
        self.runner: Any = None
        self.snapshots: Any = None
        self.step = 0
        self.tokens_seen = 0
        self.history: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self._fired: set[int] = set()
        if any(ev.kill == "node" for ev in cfg.chaos.events) and cluster is None:
            from elastic_llm.config import ConfigError

            raise ConfigError("chaos.events with kill: node need a test cluster (ray.cluster_utils.Cluster): use kill: stage or smp here")
        self._setup_data()

    # ------------------------------------------------------------------ setup
    def _setup_data(self) -> None:
        d = self.cfg.data
        data_dir = d.dir if d.dir else str(ensure_builtin_corpus(d.val_fraction))
        meta = read_meta(data_dir)
        if meta["vocab_size"] > self.cfg.model.vocab_size:
            raise DataError(
                f"data in {data_dir} has vocab_size {meta['vocab_size']} > model.vocab_size={self.cfg.model.vocab_size}: raise model.vocab_size"
            )
        self.data_dir = data_dir
        seq = self.cfg.model.seq_len
        self.train_stream = TokenStream(load_split(data_dir, "train"), seq, self.cfg.train.seed)
        self.val_tokens = load_split(data_dir, "val")

    def setup(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.owns_ray = start_ray(self.cfg, self.address, self.dashboard)
        par = self.cfg.parallel
        check_placement(self.cfg, ray.cluster_resources(), ray.nodes())
        if self.cfg.snapshot.enabled:  # managers first: they outlive any stage
            from elastic_llm.snapshot.coordinator import SnapshotCoordinator

            self.snapshots = SnapshotCoordinator(self.cfg, NAMESPACE)
            self.snapshots.ensure_managers()
        bundle = {"CPU": par.cpus_per_actor}
        if par.gpus_per_actor:
            bundle["GPU"] = par.gpus_per_actor
        self.pg = placement_group([dict(bundle) for _ in range(par.stages * par.dp)], strategy=par.placement_strategy)
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
            raise PlacementError(
                f"placement group of {par.stages * par.dp} x {bundle} ({par.placement_strategy}) was not placed within 120 s: "
                "the cluster lacks free resources; lower the request or add nodes"
            ) from None
        self.actors = [[self._spawn(s, r) for s in range(par.stages)] for r in range(par.dp)]
        infos = self._describe()
        self._new_runner()
        self.metrics.event(
            "start",
            run_id=self.run_id,
            config=self.cfg.to_dict(),
            parameters=count_parameters(self.cfg.model.shape()),
            actors=[{k: i[k] for k in ("stage", "replica", "node_id", "pid", "device")} for i in infos],
            data_dir=str(self.data_dir),
        )

    def _spawn(self, stage: int, replica: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from elastic_llm.pipeline.stage import StageWorker

        par = self.cfg.parallel
        self._generation = getattr(self, "_generation", 0) + 1
        return (
            ray.remote(concurrency_groups={"snapshot": 1})(StageWorker)
            .options(
                name=f"stage-{stage}-dp{replica}-{self.run_id}-{self._generation}",
                num_cpus=par.cpus_per_actor,
                num_gpus=par.gpus_per_actor,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=replica * par.stages + stage),
            )
            .remote(self.cfg.to_dict(), stage, replica)
        )

    def _describe(self) -> list[dict[str, Any]]:
        import ray

        infos = ray.get([a.info.remote() for row in self.actors for a in row])
        for i in infos:
            self.nodes[(i["stage"], i["replica"])] = i["node_id"]
            self.pids[(i["stage"], i["replica"])] = i["pid"]
        return infos

    def _new_runner(self) -> None:
        from elastic_llm.pipeline.runner import PipelineRunner

        self.runner = PipelineRunner(self.actors, self.cfg.parallel.schedule, self.cfg.parallel.microbatches)

    # ------------------------------------------------------------------ loop
    def evaluate(self) -> float:
        stream = TokenStream(self.val_tokens, self.cfg.model.seq_len, seed=0, shuffle=False)
        per_replica = self.cfg.train.batch_size // self.cfg.parallel.dp
        losses = [self.runner.eval_loss(*stream.next_batch(per_replica)) for _ in range(self.cfg.train.eval_batches)]
        return float(np.mean(losses))

    def _snapshot_due(self, step: int) -> bool:
        sn = self.snapshots
        if sn is None or step % self.cfg.snapshot.every:
            return False
        sn.poll()
        if not sn.can_begin():
            lag = step - (sn.committed.version if sn.committed else 0)
            if lag <= self.cfg.snapshot.max_lag:  # let the versions in flight finish meanwhile
                sn.stats["skipped"] += 1
                return False
            t = time.perf_counter()  # too far behind: wait, so a recovery never loses more
            while not sn.can_begin():
                sn.poll(block=True)
            sn.stats["wait_s"] += time.perf_counter() - t
        return True

    def run_step(self) -> Any:
        """One optimizer step (with snapshot and chaos as configured). Raises RayError on failure."""
        step = self.step + 1
        x, y = self.train_stream.next_batch(self.cfg.train.batch_size)
        snap = self._snapshot_due(step)
        loss_refs = self.runner.submit_microbatches(x, y)
        step_refs = self.runner.submit_optimizer_step(snapshot=self.train_stream.state_dict() if snap else None)
        if snap:
            members = [(self.actors[r][s], s, r, self.nodes[(s, r)]) for r in range(len(self.actors)) for s in range(len(self.actors[r]))]
            self.snapshots.begin(step, members)
        self._fire_chaos(step)
        result = self.runner.collect(loss_refs, step_refs)
        if self.snapshots is not None:
            self.snapshots.poll()
        return result

    def fit(self, max_steps: int | None = None, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Train until ``max_steps`` (default ``train.max_steps``); return the per-step records
        (after a rollback, replayed steps appear again with their new values)."""
        import ray

        if self.runner is None:
            self.setup()
        train = self.cfg.train
        end = max_steps if max_steps is not None else train.max_steps
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=end, initial=self.step, unit="step", desc=self.cfg.name, dynamic_ncols=True, file=sys.stderr)
        t0 = time.perf_counter()
        tokens_per_step = self.cfg.tokens_per_step()
        try:
            while self.step < end:
                ts = time.perf_counter()
                position = self.train_stream.state_dict()
                try:
                    result = self.run_step()
                except (ray.exceptions.RayError, TimeoutError) as err:
                    self.recover(err, position)
                    if bar is not None:
                        bar.n = self.step
                        bar.refresh()
                    continue
                self.step += 1
                self.tokens_seen = self.step * tokens_per_step
                now = time.perf_counter()
                record: dict[str, Any] = {
                    "step": self.step,
                    "loss": result.loss,
                    "tokens": self.tokens_seen,
                    "tokens_per_s": tokens_per_step / (now - ts),
                    "elapsed_s": now - t0,
                    "lr": result.lr,
                    "grad_norm": max(result.grad_norms),
                }
                if train.eval_every and (self.step % train.eval_every == 0 or self.step == end):
                    record["val_loss"] = self.evaluate()
                self.history.append(record)
                self.metrics.write(record)
                if on_step:
                    on_step(record)
                if bar is not None:
                    post = {"loss": f"{result.loss:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
                    if "val_loss" in record:
                        post["val"] = f"{record['val_loss']:.3f}"
                    bar.set_postfix(post, refresh=False)
                    bar.update(1)
            if self.snapshots is not None:
                self.snapshots.poll(block=True)
        finally:
            if bar is not None:
                bar.close()
        self.metrics.event("end", step=self.step, tokens=self.tokens_seen, elapsed_s=time.perf_counter() - t0)
        return self.history

    # ------------------------------------------------------------------ chaos
    def _fire_chaos(self, step: int) -> None:
        import os
        import signal

        import ray

        for i, ev in enumerate(self.cfg.chaos.events):
            if ev.step != step or i in self._fired:
                continue
            self._fired.add(i)
            # mid-step, reproducibly: after the victim ran its first operation of this step
            ray.wait([self.runner.first_op[(ev.replica, ev.stage)]], timeout=60)
            self.metrics.event("chaos", step=step, kill=ev.kill, stage=ev.stage, replica=ev.replica, how=ev.how, corrupt=ev.corrupt)
            if ev.kill == "stage":
                actor = self.actors[ev.replica][ev.stage]
                if ev.how == "sigkill":
                    os.kill(self.pids[(ev.stage, ev.replica)], signal.SIGKILL)
                else:
                    ray.kill(actor, no_restart=True)
            elif ev.kill == "smp":
                node = self._chaos_node(ev)
                smp = self.snapshots.managers[node]
                if ev.corrupt:
                    ray.get(smp.corrupt_shard.remote(f"{ev.stage}/{ev.replica}"))
                else:
                    ray.kill(smp, no_restart=True)
            elif ev.kill == "node":
                node_id = self._chaos_node(ev)
                victim = next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)
                if victim is None:
                    raise RuntimeError(f"chaos: node {node_id[:12]} is not a worker node of the test cluster: it cannot be removed")
                self.cluster.remove_node(victim, allow_graceful=False)
                deadline = time.monotonic() + 60  # the event is over once Ray has seen the node die
                while time.monotonic() < deadline and any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
                    time.sleep(0.1)

    def _chaos_node(self, ev: Any) -> str:
        """The node a chaos event hits: ``node`` (index into the live nodes with CPUs, sorted by
        node id) or else the node hosting the event's stage/replica."""
        import ray

        if ev.node is None:
            return self.nodes[(ev.stage, ev.replica)]
        alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0)
        if ev.node >= len(alive):
            from elastic_llm.config import ConfigError

            raise ConfigError(f"chaos event node={ev.node}: the cluster has {len(alive)} live nodes with CPUs (0..{len(alive) - 1})")
        return alive[ev.node]

    # ------------------------------------------------------------------ recovery
    def _observe(self) -> Any:
        import ray

        from elastic_llm.recovery.policy import Member, Observation

        alive_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        members = []
        for r, row in enumerate(self.actors):
            for s, actor in enumerate(row):
                node = self.nodes[(s, r)]
                step = None
                if node in alive_nodes:
                    try:
                        step = ray.get(actor.reset_step.remote(), timeout=60)
                    except Exception:
                        step = None
                members.append(Member(s, r, node, step is not None, step))
        dead_nodes = frozenset(n for n in set(self.nodes.values()) if n not in alive_nodes)
        sn = self.snapshots
        rec = sn.committed if sn is not None else None
        dead_managers: set[str] = set(dead_nodes)
        if sn is not None:
            before = dict(sn.managers)
            sn.ensure_managers()
            dead_managers |= {n for n, h in before.items() if sn.managers.get(n) is not h}
            if rec is not None:
                dead_managers |= {s["node_id"] for s in rec.shards.values() if s["node_id"] not in sn.managers}
        return Observation(
            members=tuple(members),
            dead_nodes=dead_nodes,
            dead_managers=frozenset(dead_managers),
            committed=rec.version if rec else None,
            shard_nodes=tuple((k, v["node_id"]) for k, v in sorted(rec.shards.items())) if rec else (),
            groups=tuple(tuple(g) for g in rec.groups) if rec else (),
            parity=self.cfg.snapshot.parity,
        )

    def recover(self, err: BaseException, position: dict[str, int]) -> None:
        """Observe what died, let the policy decide, carry the plan out."""
        import json as _json

        import ray

        from elastic_llm.recovery.policy import RecoveryPolicy

        t0 = time.perf_counter()
        failed_step = self.step + 1
        log_line = f"step {failed_step} failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        print(f"[elastic-llm] {log_line}", file=sys.stderr)
        self.runner.settle()
        obs = self._observe()  # resets the survivors: pending snapshot calls of the aborted step give up
        if self.snapshots is not None:
            self.snapshots.poll(block=True)  # commit what completed before the failure
            self.snapshots.abandon_pending()
        obs = self._observe() if self.snapshots is not None else obs
        plan = RecoveryPolicy().decide(obs)
        print(f"[elastic-llm] {plan}", file=sys.stderr)
        dp = self.cfg.parallel.dp
        for a in plan.actions:  # replacements, on the same placement-group bundle
            try:
                ray.kill(self.actors[a.replica][a.stage], no_restart=True)
            except Exception:
                pass
            self.actors[a.replica][a.stage] = self._spawn(a.stage, a.replica)
        self._describe()
        local = 0
        if plan.rollback_to is not None:
            loads, sources = [], {}
            rec = self.snapshots.committed
            replaced = {(a.stage, a.replica) for a in plan.actions}
            survivors = [(s, r) for r in range(dp) for s in range(self.cfg.parallel.stages) if (s, r) not in replaced]
            own = {}
            if dp == 1 and survivors:  # survivors whose own copy is the committed step skip the managers
                oks = ray.get([self.actors[r][s].restore_own_copy.remote(rec.version, rec.shards[f"{s}/{r}"]["pieces"]) for s, r in survivors])
                own = {sr for sr, ok in zip(survivors, oks) if ok}
                local = len(own)
            for r in range(dp):
                for s in range(self.cfg.parallel.stages):
                    if (s, r) in own:
                        if s == 0 and r == 0:
                            position = _json.loads(rec.shards["0/0"]["manifest"])["data_position"]
                        continue
                    offsets, refs, manifest, used = self.snapshots.fetch_stage_state(s, r, dp, set(obs.dead_managers))
                    sources[(s, r)] = "parity" if "parity" in used else "local_smp"
                    loads.append(self.actors[r][s].load_parts.remote(manifest, offsets, *refs))
                    if s == 0 and r == 0:
                        position = _json.loads(manifest)["data_position"]
            ray.get(loads)
            rollback = self.step - plan.rollback_to
            self.step = plan.rollback_to
        else:
            loads = []
            for a in plan.actions:
                buf, manifest = ray.get(self.actors[a.peer][a.stage].capture_state.remote())
                loads.append(self.actors[a.replica][a.stage].load_state.remote(buf, manifest))
            ray.get(loads)
            sources, rollback = {}, 0
        self.train_stream.load_state_dict(position)
        self._new_runner()
        seconds = time.perf_counter() - t0
        for a in plan.actions:
            rec = {
                "event": "recovery",
                "step": failed_step,
                "stage": a.stage,
                "replica": a.replica,
                "source": sources.get((a.stage, a.replica), a.source),
                "rollback_steps": rollback,
                "seconds": seconds,
                "reason": plan.reason,
                "survivors_restored_from_own_copy": local,
            }
            self.recoveries.append(rec)
            self.metrics.write(rec)
        if not plan.actions:
            self.metrics.write({"event": "recovery", "step": failed_step, "stage": None, "replica": None, "source": "none", "rollback_steps": rollback, "seconds": seconds, "reason": plan.reason})

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            for row in self.actors:
                for a in row:
                    try:
                        ray.kill(a)
                    except Exception:
                        pass
            if self.snapshots is not None:
                for m in self.snapshots.managers.values():
                    try:
                        ray.kill(m)
                    except Exception:
                        pass
            if self.pg is not None:
                ray.util.remove_placement_group(self.pg)
        self.actors, self.pg, self.runner = [], None, None
        self.metrics.close()
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False
