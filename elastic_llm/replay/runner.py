"""Replay a spot availability trace on a loopback Ray cluster while a real run trains on it.

Owns: the loopback ``ray.cluster_utils.Cluster`` of a replay (a head without CPUs plus one Ray
node per replay node), carrying out a :class:`ReplayPlan`'s actions at their times (add a node,
ask Ray to drain one with the notice's deadline, remove one), sampling the timeline, and the
numbers of ``replay.json`` (what the run kept, where its time went, how much of the time with
room for a replica it spent training).
Never decides anything about the run: the trainer reacts to the cluster as it would to a real
autoscaler and real preemptions. Never sends traffic off loopback. Nodes are added and removed
from the calling (main) thread, which ``Cluster`` requires; the run trains in another thread.

Ray start and the run's first placement happen before the replay clock starts: the trace
replays availability during a run, not its launch.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.replay.cost import Price, cost_fields
from elastic_llm.replay.report import liveput_fields, oracle_widths, seconds_with_room, useful_fraction, write_report
from elastic_llm.replay.trace import ReplayAction, ReplayPlan

SAMPLE_S = 1.0  # timeline resolution
JOIN_S = 300.0  # longest the run may take to stop at a step boundary once the replay is over


@dataclass(frozen=True)
class ReplayOptions:
    cpus_per_node: float = 1.0
    seed: int = 0
    progress: bool = True
    price: Price | None = None  # dollars per node-hour of the replay's node type: the report's cost (None: none)


def nodes_per_replica(cfg: RunConfig, cpus_per_node: float) -> int:
    """Replay nodes one data-parallel replica needs (its stages' bundles packed onto nodes)."""
    per_node = int(cpus_per_node // cfg.parallel.cpus_per_actor + 1e-9)
    if per_node < 1:
        raise ValueError(
            f"--cpus-per-node={cpus_per_node:g} cannot hold one stage actor (parallel.cpus_per_actor="
            f"{cfg.parallel.cpus_per_actor:g}): give each node at least {cfg.parallel.cpus_per_actor:g} CPUs"
        )
    return math.ceil(cfg.parallel.stages / per_node)


log = logging.getLogger("elastic_llm.replay")


class Replay:
    """One replay: ``Replay(cfg, plan, options).run(out_dir) -> report``."""

    def __init__(self, cfg: RunConfig, plan: ReplayPlan, options: ReplayOptions) -> None:
        self.cfg, self.plan, self.options = cfg, plan, options
        self.nodes: dict[str, Any] = {}  # replay label -> Ray node handle
        self.timeline: list[tuple[float, int, int, int]] = []  # (second, nodes alive, steps committed, width)
        self.cluster: Any = None
        self.trainer: Any = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ the cluster
    def _start_cluster(self) -> None:
        from elastic_llm.runtime.session import loopback_cluster

        self.cluster = loopback_cluster(0, self.options.cpus_per_node)
        for label in self.plan.initial_nodes:
            self._add(label)
        self.cluster.wait_for_nodes()

    def _add(self, label: str) -> None:
        from elastic_llm.runtime.session import add_loopback_node, node_store_bytes
        from elastic_llm.snapshot.groups import DOMAIN_LABELS

        fewest = max(1, min((n for _, n in self.plan.replay_alive if n > 0), default=1))  # the most a node holds
        store = node_store_bytes(self.cfg, fewest)
        zone = dict(self.plan.zones).get(label)
        labels = {DOMAIN_LABELS[0]: zone} if zone else None  # the trace's zone: the node's failure domain
        self.nodes[label] = add_loopback_node(self.cluster, self.options.cpus_per_node, store, labels)

    def _act(self, action: ReplayAction) -> None:
        from elastic_llm.runtime.drains import request_drain

        if action.kind == "add":
            self._add(action.node)
        elif action.kind == "drain":
            request_drain(self.nodes[action.node].node_id, action.deadline_s, f"spot interruption (replay of {action.node})")
        else:
            self.cluster.remove_node(self.nodes.pop(action.node))
        log.info(f"t={action.at_s:6.1f} s {action.kind} {action.node}" + (f" (deadline {action.deadline_s:.0f} s)" if action.deadline_s else "")
            + f"; {len(self.nodes)} nodes")

    # ------------------------------------------------------------------ the run
    def run(self, out_dir: str | Path) -> dict[str, Any]:
        from elastic_llm.runtime.ray_runtime import ray_trainer

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._start_cluster()
        try:
            self.trainer = ray_trainer(self.cfg, cluster=self.cluster, metrics_out=out / "metrics.jsonl", progress=self.options.progress)
            self.trainer.setup()  # Ray start and first placement are not part of the trace
            t0 = time.monotonic()
            thread = threading.Thread(target=self._fit, daemon=True)
            thread.start()
            self._play(t0, thread)
            self.trainer.request_stop()
            thread.join(timeout=JOIN_S)
            if thread.is_alive():
                self.error = self._hung(thread)
            self._sample(time.monotonic() - t0)
            report = self._report(time.monotonic() - t0)
        finally:
            if self.trainer is not None:
                self.trainer.shutdown()
            self._stop_cluster()
        write_report(out, report, self.timeline, oracle_widths(self.plan.replay_alive, self._slots(), self.cfg.parallel.stages, self._max_width()))
        return report

    def _slots(self) -> float:
        return self.options.cpus_per_node // self.cfg.parallel.cpus_per_actor  # stage actors a node holds

    def _max_width(self) -> int:
        return self.cfg.elastic.bounds(self.cfg.parallel.dp)[1]

    def _fit(self) -> None:
        from elastic_llm.controller.trainer import UNTIL_STOPPED

        try:
            self.trainer.fit(UNTIL_STOPPED)
        except BaseException as e:  # reported in replay.json; the replay goes on to its end
            self.error = e
            log.warning("the run stopped: %s", str(e).splitlines()[0], exc_info=True)  # the whole traceback: a replay's stop is diagnosed from its log

    def _hung(self, thread: threading.Thread) -> TimeoutError:
        """The run's thread did not stop within JOIN_S: where it waits (its stack, logged; its
        innermost frame in elastic-llm's code, in the error the report names). The run is shut
        down next."""
        frame = sys._current_frames().get(thread.ident or -1)
        stack = traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()
        ours = [f for f in stack if "elastic_llm" in f.filename] or list(stack)
        at = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} ({ours[-1].name})" if ours else "an unknown place"
        log.warning("the run did not stop within %.0f s after the replay ended; its thread waits in:\n%s", JOIN_S, "".join(stack.format()))
        return TimeoutError(f"the run did not stop within {JOIN_S:.0f} s after the replay ended (state {self.trainer.state.name}): it waits in {at}")

    def _play(self, t0: float, thread: threading.Thread) -> None:
        pending = list(self.plan.actions)
        next_sample = 0.0
        while True:
            now = time.monotonic() - t0
            while pending and pending[0].at_s <= now:
                self._act(pending.pop(0))
            if now >= next_sample:
                self._sample(now)
                next_sample += SAMPLE_S
            if now >= self.plan.duration_s or not thread.is_alive():
                return
            wake = min([next_sample, self.plan.duration_s] + ([pending[0].at_s] if pending else []))
            time.sleep(max(0.0, min(wake - now, SAMPLE_S)))

    def _sample(self, t: float) -> None:
        t_ = self.trainer
        self.timeline.append((round(t, 3), len(self.nodes), t_.committed_step, t_.group.width if t_.group is not None else 0))

    def _stop_cluster(self) -> None:
        import ray

        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()

    # ------------------------------------------------------------------ the numbers
    def _report(self, wall_s: float) -> dict[str, Any]:
        t = self.trainer
        room_s = seconds_with_room(self.plan.replay_alive, self.plan.duration_s, nodes_per_replica(self.cfg, self.options.cpus_per_node))
        training_s = t.seconds_by_state.get("running", 0.0)
        recoveries = [r for r in t.recoveries if r.source != "none"]
        lost_all = getattr(self.error, "exit_code", None) == 3  # nothing lossless survived: every committed step is lost
        return {
            "title": f"replay of {self.cfg.name}: {len(self.plan.actions)} actions over {self.plan.duration_s:.0f} s",
            "config": self.cfg.name,
            "steps": t.step,
            "committed_steps": t.committed_step,
            # a run that found nothing lossless lost every committed step (no durable tier yet)
            "committed_steps_lost": t.committed_step if lost_all else t.committed_steps_lost,
            "seconds_by_state": {k: round(v, 3) for k, v in t.seconds_by_state.items()},
            "wall_s": round(wall_s, 3),
            "duration_s": self.plan.duration_s,
            "seconds_with_room": round(room_s, 3),
            "useful_fraction": useful_fraction(training_s, room_s),
            **(lf := liveput_fields(t.history, self.plan.replay_alive, self.plan.duration_s, self._slots(), self.cfg.parallel.stages, self._max_width(),
                                    0 if lost_all else t.committed_step)),
            "cost": cost_fields(self.options.price, self.plan.replay_alive, self.plan.duration_s, 0 if lost_all else t.committed_step, self.cfg.tokens_per_step(),
                                lf["full_width_steps_per_s"], nodes_per_replica(self.cfg, self.options.cpus_per_node) * self._max_width(), self.plan.spot_prices)
            if self.options.price is not None else None,
            "events": {
                "recoveries": dict(Counter(str(r.source) for r in recoveries)),
                "resizes": dict(Counter(f"{e.from_dp}->{e.to_dp}" for e in t.resizes)),
                "drains": len(t.drains),
                "replay_actions": dict(Counter(a.kind for a in self.plan.actions)),
            },
            "final_width": t.group.width if t.group is not None else 0,
            "failed": None if self.error is None else str(self.error).splitlines()[0],
            "exit_code": getattr(self.error, "exit_code", 1) if self.error is not None else 0,
        }
