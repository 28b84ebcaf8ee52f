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
    """Places the stage actors and runs the step loop.

    >>> trainer = Trainer(cfg); history = trainer.fit(); trainer.shutdown()
    """

    def __init__(
        self,
        cfg: RunConfig,
        address: str | None = None,
        metrics_out: str | Path | None = None,
        progress: bool = False,
        dashboard: bool = False,
    ) -> None:
        self.cfg = cfg
        self.address = address
        self.metrics = MetricsWriter(metrics_out)
        self.progress = progress
        self.dashboard = dashboard
        self.run_id = uuid.uuid4().hex[:6]
        self.owns_ray = False
        self.pg = None
        self.actors: list[list[Any]] = []
        self.runner: Any = None
        self.step = 0
        self.tokens_seen = 0
        self.history: list[dict[str, Any]] = []
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
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from elastic_llm.pipeline.runner import PipelineRunner
        from elastic_llm.pipeline.stage import StageWorker

        self.owns_ray = start_ray(self.cfg, self.address, self.dashboard)
        par = self.cfg.parallel
        check_placement(self.cfg, ray.cluster_resources(), ray.nodes())
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
        Actor = ray.remote(StageWorker)
        cfg_dict = self.cfg.to_dict()
        self.actors = []
        for r in range(par.dp):
            row = []
            for s in range(par.stages):
                row.append(
                    Actor.options(
                        name=f"stage-{s}-dp{r}-{self.run_id}",
                        num_cpus=par.cpus_per_actor,
                        num_gpus=par.gpus_per_actor,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r * par.stages + s),
                    ).remote(cfg_dict, s, r)
                )
            self.actors.append(row)
        infos = ray.get([a.info.remote() for row in self.actors for a in row])
        self.runner = PipelineRunner(self.actors, par.schedule, par.microbatches)
        self.metrics.event(
            "start",
            run_id=self.run_id,
            config=self.cfg.to_dict(),
            parameters=count_parameters(self.cfg.model.shape()),
            actors=[{k: i[k] for k in ("stage", "replica", "node_id", "pid", "device")} for i in infos],
            data_dir=str(self.data_dir),
        )

    # ------------------------------------------------------------------ loop
    def evaluate(self) -> float:
        stream = TokenStream(self.val_tokens, self.cfg.model.seq_len, seed=0, shuffle=False)
        per_replica = self.cfg.train.batch_size // self.cfg.parallel.dp
        losses = [self.runner.eval_loss(*stream.next_batch(per_replica)) for _ in range(self.cfg.train.eval_batches)]
        return float(np.mean(losses))

    def fit(self, max_steps: int | None = None, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Train until ``max_steps`` (default ``train.max_steps``); return the per-step records."""
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
                x, y = self.train_stream.next_batch(train.batch_size)
                result = self.runner.train_step(x, y)
                self.step += 1
                self.tokens_seen += tokens_per_step
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
        finally:
            if bar is not None:
                bar.close()
        self.metrics.event("end", step=self.step, tokens=self.tokens_seen, elapsed_s=time.perf_counter() - t0)
        return self.history

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            for row in self.actors:
                for a in row:
                    ray.kill(a)
            if self.pg is not None:
                ray.util.remove_placement_group(self.pg)
        self.actors, self.pg, self.runner = [], None, None
        self.metrics.close()
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False
