"""``elastic-llm simulate``: the real controller on a simulated fleet, in simulated time.

Owns: turning a config, a fleet size, a trace (optional) and a cost model into one simulated run
(:func:`simulate`): the world (:mod:`elastic_llm.sim.world`), the simulated executors
(:mod:`elastic_llm.sim.runtime`) injected into the real :class:`~elastic_llm.controller.Trainer`
(its states, failure budget, recovery and elastic policies, snapshot coordinator, data stream),
the stage-process fault schedule (seeded), the timeline, and the report in the replay's format
(``replay.json``, ``replay.png``) plus what the controller's own code cost: process CPU seconds
per step and per recovery plan, the run's handlers' CPU less the simulation's own bookkeeping.
Never sleeps and never reads the machine's clock for anything simulated (only to say how long
the simulation took); never starts Ray.
"""

from __future__ import annotations

import gc
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from elastic_llm.config import ConfigError, RunConfig, config_from_dict
from elastic_llm.replay.cost import Price, cost_fields
from elastic_llm.replay.report import liveput_fields, oracle_widths, seconds_with_room, useful_fraction, write_report
from elastic_llm.replay.trace import ReplayPlan, load_trace, plan_replay
from elastic_llm.sim.costs import CostModel
from elastic_llm.sim.world import Charged, Fleet, SimClock, World
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.sources import Mode

SAMPLE_S = 1.0  # timeline resolution (simulated seconds)


class SimulationOver(BaseException):
    """The simulated clock reached the end of the trace: the run stops where it is (a
    BaseException, so no handler of the controller takes it for a failure of the run)."""


@dataclass(frozen=True)
class SimOptions:
    nodes: int
    stages: int
    replicas: int
    trace: str | None = None
    window: tuple[float, float] | None = None
    notice_s: float = 0.0
    time_scale: float = 1.0
    steps: int | None = None
    slots_per_node: int | None = None  # stage actors a node holds (None: stages x replicas / nodes, rounded up)
    process_failures_per_hour: float = 0.0  # per stage actor: stage processes that die on live nodes
    seed: int = 0
    durable_every: int = 0  # flush every N-th committed snapshot to a simulated durable tier (0: none)
    price: Price | None = None  # dollars per node-hour of the fleet's node type: the report's cost (None: none)


log = logging.getLogger("elastic_llm.sim")


def sim_config(cfg: RunConfig, o: SimOptions) -> RunConfig:
    """``cfg`` at the simulated shape: ``--stages`` and ``--replicas``, no validation batches,
    no chaos; refused (naming the field) where the simulation does not model a setting."""
    if cfg.recovery.mode not in (Mode.LOSSLESS, Mode.REDUNDANT):
        raise ConfigError(f"recovery.mode={cfg.recovery.mode}: simulate models the lossless and redundant modes only; set recovery.mode=lossless")
    if cfg.durable.storage_path:
        raise ConfigError("durable.storage_path is set: simulate writes nothing; unset it (--set durable.storage_path=null) and "
                          "pass --durable-every N for a simulated durable tier")
    el = cfg.elastic
    lo = min(el.min_replicas if el.min_replicas is not None else o.replicas, o.replicas)
    hi = max(el.max_replicas if el.max_replicas is not None else o.replicas, o.replicas)
    d = cfg.to_dict()
    d["parallel"].update(stages=o.stages, dp=o.replicas)
    d["train"].update(eval_every=0)
    d["recovery"].update(driver_grace_s=0.0)  # one driver: nothing is kept for a next one
    d["elastic"].update(min_replicas=lo, max_replicas=hi)
    d["chaos"] = {}
    if o.steps is not None:
        d["train"]["max_steps"] = o.steps
    return config_from_dict(d)


def fleet_plan(o: SimOptions) -> ReplayPlan:
    """The fleet over time: the trace scaled to ``--nodes`` nodes at its window's start, or a
    steady fleet of ``--nodes`` (no actions; the run ends after ``--steps``)."""
    if o.trace is None:
        return ReplayPlan(tuple(f"n{i:04d}" for i in range(o.nodes)), (), math.inf, ((0.0, o.nodes),), ((0.0, o.nodes),))
    events = load_trace(o.trace)
    at_start = len(plan_replay(events, window=o.window, time_scale=o.time_scale).initial_nodes)
    return plan_replay(events, window=o.window, time_scale=o.time_scale, node_scale=o.nodes / max(at_start, 1), notice_s=o.notice_s, seed=o.seed)


class Simulation:
    def __init__(self, cfg: RunConfig, options: SimOptions, costs: CostModel, plan: ReplayPlan | None = None) -> None:
        self.options, self.costs = options, costs
        self.cfg = sim_config(cfg, options)
        self.plan = plan if plan is not None else fleet_plan(options)  # a test may script the fleet itself
        n0 = max(1, len(self.plan.initial_nodes))
        self.slots = options.slots_per_node or math.ceil(options.stages * options.replicas / n0)
        self.clock = SimClock()
        self.fleet = Fleet(self.clock, self.plan.initial_nodes, self.plan.actions, self.slots, dict(self.plan.zones))
        self.charged = Charged()
        self.world = World(self.clock, self.fleet, costs, self.charged)
        self.timeline: list[tuple[float, int, int, int]] = []  # (second, nodes alive, steps committed, width)
        self.trainer: Any = None
        self.error: BaseException | None = None
        self.runtime: Any = None  # the SimRuntime (its durable tier counts flushes)
        self.t0 = 0.0  # simulated second the trace starts (after the run's start)
        self._next_sample = 0.0
        self._fault_schedule()

    def _fault_schedule(self) -> None:
        """Stage processes that die on live nodes: a seeded Poisson schedule over the run's
        actors at their starting shape (an actor renumbered later inherits its slot's fate)."""
        o = self.options
        rate = o.process_failures_per_hour / 3600.0 * o.stages * o.replicas
        if rate <= 0:
            return
        rng = random.Random(o.seed + 1)
        end = self.plan.duration_s if math.isfinite(self.plan.duration_s) else (o.steps or 0) * 3600.0
        t = rng.expovariate(rate)
        while t < end:
            self.fleet.process_deaths.append((t, ShardKey(rng.randrange(o.stages), rng.randrange(o.replicas))))
            t += rng.expovariate(rate)

    def _tick(self, now: float) -> None:
        self.fleet.apply_until(now)
        t = now - self.t0
        while self._next_sample <= min(t, self.plan.duration_s):
            self._sample(self._next_sample)
            self._next_sample += SAMPLE_S
        if now >= self.clock.end:  # the clock stops there: compared as read (t0 + duration - t0 may round below duration)
            raise SimulationOver()

    def _sample(self, t: float) -> None:
        t_ = self.trainer
        self.timeline.append((round(t, 3), len(self.fleet.alive()), t_.committed_step if t_ is not None else 0,
                              t_.group.width if t_ is not None and t_.group is not None else 0))

    def build(self) -> Any:
        from elastic_llm.controller.ports import Runtime
        from elastic_llm.controller.trainer import Trainer
        from elastic_llm.sim.runtime import SimRuntime

        standbys = int(self.cfg.recovery.standby) if self.cfg.recovery.standby != "auto" else 1
        runtime: Runtime = SimRuntime(self.world, self.options.seed, self.options.durable_every, standbys)  # the ports, checked by the type checker
        self.runtime = runtime
        self.trainer = Trainer(self.cfg, runtime, metrics_out=self.out / "metrics.jsonl")
        self.charged.state_of = lambda: self.trainer.state.name
        return self.trainer

    def run(self, out_dir: str | Path) -> dict[str, Any]:
        from elastic_llm.controller.trainer import UNTIL_STOPPED, RunFailed

        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        gc.collect()  # garbage of earlier simulations in this process (a benchmark's) is not this controller's to collect
        real0 = time.perf_counter()  # only to say how long the simulation took
        trainer = self.build()
        trainer.setup()  # the run's start is not part of the trace (as in a replay)
        self.t0 = self.clock.now
        self.fleet.shift(self.t0)
        self.clock.end = self.t0 + self.plan.duration_s
        self.clock.on_advance = self._tick
        gc.callbacks.append(self.charged.gc)
        try:
            trainer.fit(self.options.steps if self.options.steps is not None else UNTIL_STOPPED)
        except SimulationOver:
            pass
        except RunFailed as e:
            self.error = e
            log.info(f"the run stopped: {str(e).splitlines()[0]}")
        finally:
            gc.callbacks.remove(self.charged.gc)
            trainer.metrics.close()
        self.clock.on_advance = self.fleet.apply_until
        self.clock.end = float("inf")
        end = min(self.clock.now - self.t0, self.plan.duration_s)
        self._sample(end)
        report = self._report(end, time.perf_counter() - real0)
        write_report(self.out, report, self.timeline, self._oracle_widths())
        return report

    def _alive(self) -> tuple[tuple[float, int], ...]:
        """The alive curve the room and the oracle are measured on (a steady fleet without a trace)."""
        return tuple(self.plan.replay_alive) if math.isfinite(self.plan.duration_s) else ((0.0, self.options.nodes),)

    def _max_width(self) -> int:
        return self.cfg.elastic.bounds(self.cfg.parallel.dp)[1]

    def _oracle_widths(self) -> list[tuple[float, int]]:
        return oracle_widths(self._alive(), self.slots, self.options.stages, self._max_width())

    def _report(self, sim_s: float, real_s: float) -> dict[str, Any]:
        t, o = self.trainer, self.options
        per_replica = math.ceil(o.stages / self.slots)
        duration = self.plan.duration_s if math.isfinite(self.plan.duration_s) else sim_s
        alive = self._alive()
        room_s = seconds_with_room(alive, duration, per_replica)
        lost_all = getattr(self.error, "exit_code", None) == 3  # nothing lossless survived: every committed step is lost
        training_s = t.seconds_by_state.get("running", 0.0)
        recoveries = [r for r in t.recoveries if r.source != "none"]
        steps_run = len(t.history)
        calls_stage = sum(h["dp"] for h in t.history) / steps_run if steps_run else 0.0  # one per replica: its stage 0 relays the step
        relayed = calls_stage * o.stages  # the stages' reports, answered through the relays
        calls_manager = self.charged.calls / steps_run if steps_run else 0.0
        running_cpu = t.cpu_by_state.get("running", 0.0)  # the controller's own: the runtime leaves the simulation's bookkeeping out
        plans = t.plan_cpu_s
        return {
            "title": f"simulation of {self.cfg.name}: {o.stages} stages x {o.replicas} replicas on {len(self.plan.initial_nodes)} nodes, "
                     f"{len(self.plan.actions)} actions over {duration:.0f} s ({self.costs.name})",
            "config": self.cfg.name,
            "simulated": True,
            "cost_model": {"name": self.costs.name, "provenance": self.costs.provenance},
            "shape": {"stages": o.stages, "replicas": o.replicas, "nodes": len(self.plan.initial_nodes), "slots_per_node": self.slots,
                      "actors": o.stages * o.replicas},
            "steps": t.step,
            "committed_steps": t.committed_step,
            "committed_steps_lost": t.committed_step if lost_all else t.committed_steps_lost,
            "seconds_by_state": {k: round(v, 3) for k, v in sorted(t.seconds_by_state.items())},
            "wall_s": round(sim_s, 3),
            "duration_s": duration,
            "seconds_with_room": round(room_s, 3),
            "useful_fraction": useful_fraction(training_s, room_s),
            **(lf := liveput_fields(t.history, alive, duration, self.slots, o.stages, self._max_width(), 0 if lost_all else t.committed_step)),
            "cost": cost_fields(o.price, alive, duration, 0 if lost_all else t.committed_step, self.cfg.train.batch_size * (self.costs.sequence_tokens or self.cfg.model.seq_len),
                                lf["full_width_steps_per_s"], math.ceil(o.stages * self._max_width() / self.slots), self.plan.spot_prices) if o.price is not None else None,
            "events": {
                "recoveries": dict(sorted(Counter(str(r.source) for r in recoveries).items())),
                "resizes": dict(sorted(Counter(f"{e.from_dp}->{e.to_dp}" for e in t.resizes).items())),
                "drains": len(t.drains),
                "replay_actions": dict(sorted(Counter(a.kind for a in self.plan.actions).items())),
                "process_failures": len(self.fleet.process_deaths),
                "durable_flushes": self.runtime.tier.flushes if self.runtime.tier is not None else 0,
            },
            "final_width": t.group.width if t.group is not None else 0,
            "failed": None if self.error is None else str(self.error).splitlines()[0],
            "exit_code": getattr(self.error, "exit_code", 1) if self.error is not None else 0,
            "controller_cpu": {  # the machine's process CPU (not simulated): the real controller's code at this scale
                "steps_measured": steps_run,
                "per_step_ms": round(1e3 * running_cpu / steps_run, 3) if steps_run else None,
                "plans": len(plans),
                "per_plan_ms_median": round(1e3 * sorted(plans)[len(plans) // 2], 3) if plans else None,
                "per_plan_ms_max": round(1e3 * max(plans), 3) if plans else None,
                "simulation_own_s": round(self.charged.seconds, 3),
                # actor calls a real run makes that the CPU above leaves out (Ray's own cost per call):
                # one per replica per step (its stage 0 relays it to the replica's stages and answers with their reports),
                # and the snapshot managers' (one per erasure group to begin, one per 16 managers to commit; census,
                # restore) and the monitor feed's
                "stage_calls_per_step": round(calls_stage, 1) if steps_run else None,
                "relayed_reports_per_step": round(relayed, 1) if steps_run else None,
                "manager_calls_per_step": round(calls_manager, 1) if steps_run else None,
                # the CPU above plus each of those calls at the cost model's driver CPU per call, and each relayed
                # report at its driver CPU per relayed report (bench transport)
                "call_cpu_us": round(1e6 * self.costs.call_cpu_s, 1),
                "relayed_cpu_us": round(1e6 * self.costs.relayed_cpu_s, 1),
                "driver_per_step_ms": (round(1e3 * running_cpu / steps_run + 1e3 * self.costs.call_cpu_s * (calls_stage + calls_manager)
                                             + 1e3 * self.costs.relayed_cpu_s * relayed, 3) if steps_run else None),
            },
            "real_s": round(real_s, 3),  # machine seconds the simulation took (not deterministic; every other field is)
        }


def simulate(cfg: RunConfig, options: SimOptions, costs: CostModel, out_dir: str | Path) -> dict[str, Any]:
    """Run one simulation; writes ``replay.json``, ``replay.png`` and ``metrics.jsonl`` into ``out_dir``."""
    if options.trace is None and options.steps is None:
        raise ValueError("--steps: a simulation without --trace needs --steps K (how many steps to run)")
    sim = Simulation(cfg, replace(options), costs)
    log.info(f"{costs.describe()}; {len(sim.plan.initial_nodes)} nodes x {sim.slots} actor slots, {options.stages} stages x {options.replicas} replicas")
    return sim.run(out_dir)
