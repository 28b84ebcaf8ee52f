"""A soak on the multi-host harness: its trials' faults are link faults (and the kinds that run
there too), struck by each run's own chaos events, its driver on a host of the harness.

Owns: the harness's cluster of a soak (:class:`LabSoak`: a :class:`~elastic_llm.hosts.lab.Lab`
with a Ray head, ``workers`` worker nodes and the driver's host, each a network namespace of its
own), the reference run on it, and each trial: one ``elastic-llm train`` on the driver's host
whose ``chaos.events`` strike the plan's faults (:func:`harness_events`: a stage SIGKILLed, a
snapshot manager killed, a node's host SIGKILLed, a node's link cut for good or healed two steps
later, the link between two stages' nodes cut, a node's link slowed to :data:`SLOW_MBIT` Mbit/s)
while the step after the fault's runs (every run, the reference's too, trains :data:`SLOW_TAIL`
steps more when a slow link is planned, so that its straggler is named and moved). Every link heals when a trial ends, and a host Ray
declared dead (a partition's, a killed one's) is replaced by a new one before the next trial.
The trial's run is then judged from its metrics lines like any soak's (:mod:`.report`), with its
``link_cut`` and ``straggler`` lines and the calls its stages refused as a zombie's (``fenced``),
and its newest durable checkpoint read back; a killed manager counts as replaced once a later
version was flushed to the durable tier (every node's manager writes its part of a flush). Never judges (report does); nothing a lab runs
reaches the machine's network.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from elastic_llm.hosts.lab import LabError
from elastic_llm.soak.checks import verify_durable_dir
from elastic_llm.soak.plan import FaultKind, TrialPlan
from elastic_llm.soak.report import Injection, TrialRun, build_report, write_report

log = logging.getLogger("elastic_llm.soak")
SLOW_MBIT = 20  # a slow-link fault's rate, each way (the switch's own: several Gbit/s)
HEAL_AFTER = 2  # a partition-heal heals (every cut link) this many steps after its cut
SLOW_TAIL = 6  # steps every run trains beyond the longest plan when one has a slow link: its straggler is named after 3 slow steps, then moved
KILLS = {FaultKind.STAGE: "stage", FaultKind.MANAGER: "smp", FaultKind.NODE: "node", FaultKind.PARTITION: "partition",
         FaultKind.PARTITION_HEAL: "partition", FaultKind.ISOLATE_PAIR: "isolate", FaultKind.SLOW_LINK: "slow"}
DURABLE_EVERY = 2  # each trial flushes every 2nd committed snapshot, so its newest durable checkpoint can be verified


def harness_events(plan: TrialPlan) -> list[str]:
    """The chaos events (YAML flow mappings) that strike ``plan``'s faults, each while the step
    after its own runs. Pure."""
    out = []
    for f in plan.faults:
        step = f.step + 1
        extra = ", how: sigkill" if f.kind is FaultKind.STAGE else f", mbit: {SLOW_MBIT}" if f.kind is FaultKind.SLOW_LINK else ""
        out.append(f"{{step: {step}, kill: {KILLS[f.kind]}, stage: {f.stage}{extra}}}")
        if f.kind is FaultKind.PARTITION_HEAL:
            out.append(f"{{step: {step + HEAL_AFTER}, kill: heal}}")
    return out


def losses_of(lines: list[dict[str, Any]]) -> dict[int, float]:
    """Each step's loss as the run ended with it (a replayed step keeps its last). Pure."""
    return {int(ln["step"]): float(ln["loss"]) for ln in lines if ln.get("event") is None and "loss" in ln}


def trial_run(plan: TrialPlan, lines: list[dict[str, Any]], seconds: float, error: str | None) -> TrialRun:
    """What a harness trial's metrics lines say (its faults matched to their ``chaos`` lines in
    order: an event that never fired was never injected). Pure."""
    struck = [i for i, ln in enumerate(lines) if ln.get("event") == "chaos" and ln.get("kill") != "heal"]
    injections = []
    for k, f in enumerate(plan.faults):
        at = struck[k] if k < len(struck) else None
        target = f"{KILLS[f.kind]} of stage {f.stage}'s node" if f.kind not in (FaultKind.STAGE, FaultKind.MANAGER) else f"{KILLS[f.kind]} of stage {f.stage}"
        # a killed manager's successor: a later version flushed to the durable tier (every node's manager wrote its part of it)
        replaced = any(ln.get("event") == "durable" and ln["step"] > f.step + 1 for ln in lines[at:]) if at is not None and f.kind is FaultKind.MANAGER else None
        injections.append(Injection(f, f"{target} in step {lines[at]['step']}" if at is not None else target, error=None if at is not None else "its chaos event never fired",
                                    manager_replaced=replaced))
    of = lambda *kinds: [ln for ln in lines if ln.get("event") in kinds]  # noqa: E731
    return TrialRun(plan, injections, losses_of(lines),
                    of("recovery"), of("drain"), of("resize"), seconds, error, links=of("link_cut", "straggler"),
                    fenced=sum(int(ln["count"]) for ln in of("fenced")))


class LabSoak:
    """``LabSoak(config, overrides, plans, workers, cpus_per_node, trial_timeout_s, seed).run(out) -> report``."""

    def __init__(self, config: str, overrides: list[str], plans: list[TrialPlan], workers: int, cpus_per_node: float, trial_timeout_s: float,
                 seed: int) -> None:
        self.config, self.overrides, self.plans = os.path.abspath(config), list(overrides), plans
        self.workers, self.cpus, self.timeout_s, self.seed = workers, cpus_per_node, trial_timeout_s, seed

    def run(self, out_dir: str | Path) -> dict[str, Any]:
        from elastic_llm.config import load_config
        from elastic_llm.hosts.lab import Lab
        from elastic_llm.runtime.lab_cluster import RayHosts

        out = Path(out_dir).resolve()
        out.mkdir(parents=True, exist_ok=True)
        cfg = load_config(self.config, self.overrides)
        steps = max(p.steps for p in self.plans) + (SLOW_TAIL if any(f.kind is FaultKind.SLOW_LINK for p in self.plans for f in p.faults) else 0)
        runs: list[TrialRun] = []
        aborted = None
        with Lab.create() as lab:
            hosts = RayHosts(lab).start(workers=self.workers, cpus_per_node=self.cpus)
            log.info("reference run: %d steps of %s on the harness", steps, cfg.name)
            reference = losses_of(hosts.train("reference", self.config, steps, self.overrides, timeout=self.timeout_s))
            (out / "reference").mkdir(exist_ok=True)
            (out / "reference" / "metrics.jsonl").write_bytes((lab.tmp / "reference.jsonl").read_bytes())
            for plan in self.plans:
                try:
                    for name in hosts.dead_workers():  # a partition's node (Ray ended it when it healed), a killed one: a new host
                        hosts.replace(name, self.cpus)
                except Exception as e:  # noqa: BLE001 - the harness itself failed: the report keeps the trials run so far
                    aborted = f"before trial {plan.trial} the harness could not replace its dead hosts: {type(e).__name__}: {e}"
                    log.error("soak stopped: %s", aborted)
                    break
                runs.append(self._trial(hosts, plan, steps, out / f"trial-{plan.trial}"))
        meta = {"config": cfg.name, "seed": self.seed, "faults_per_trial": len(self.plans[0].faults), "harness": True,
                "kinds": sorted({f.kind.value for p in self.plans for f in p.faults}), "reference_steps": len(reference),
                "trials_planned": len(self.plans), "aborted": aborted}
        report = build_report(meta, reference, runs)
        write_report(out, report)
        return report

    def _trial(self, hosts: Any, plan: TrialPlan, steps: int, out: Path) -> TrialRun:
        from elastic_llm.config import load_config

        out.mkdir(parents=True, exist_ok=True)
        durable = [f"durable.storage_path={out / 'durable'}", f"durable.every={DURABLE_EVERY}"]
        sets = [*self.overrides, *durable, f"chaos.events=[{', '.join(harness_events(plan))}]"]
        name = f"trial-{plan.trial}"
        t0, error = time.monotonic(), None
        try:
            lines = hosts.train(name, self.config, steps, sets, timeout=self.timeout_s)
        except LabError as e:
            error = str(e).splitlines()[-1][:400]
            metrics = hosts.lab.tmp / f"{name}.jsonl"
            lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        finally:
            for host in hosts.workers:
                hosts.lab.heal(host)
            for ext in ("jsonl", "log"):
                src = hosts.lab.tmp / f"{name}.{ext}"
                if src.exists():
                    (out / f"metrics.{ext}" if ext == "jsonl" else out / "driver.log").write_bytes(src.read_bytes())
        run = trial_run(plan, lines, time.monotonic() - t0, error)
        if error is None:
            run.durable, run.durable_error = verify_durable_dir(load_config(self.config, [*self.overrides, *durable]))
        log.info("trial %d: %s", plan.trial, "ok" if error is None else error)
        return run
