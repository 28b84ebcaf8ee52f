"""A soak's driver trials: the run's driver is an ``elastic-llm train`` process, SIGKILLed and resumed.

Owns: one driver trial (:func:`driver_trial`): the process started with the run's arguments, killed
once its metrics show each fault's step with a snapshot committed, each time an ``elastic-llm
train --resume RUN_ID`` started in its place (its first step timed from its start), the last one
training to the end; what each new driver resumed from (memory or the durable tier); the run's
losses over all its drivers; and its newest durable checkpoint read back. Never judges the trial
(:mod:`.report` does).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from elastic_llm import events
from elastic_llm.config import RunConfig
from elastic_llm.events import read_lines
from elastic_llm.runtime.failover import published_committed
from elastic_llm.soak.checks import verify_durable_dir
from elastic_llm.soak.plan import TrialPlan
from elastic_llm.soak.report import Injection, TrialRun

log = logging.getLogger("elastic_llm.soak")
POLL_S = 0.05


def driver_trial(plan: TrialPlan, out: Path, driver_argv: list[str], address: str, steps: int, timeout_s: float,
                 durable_sets: list[str], durable_cfg: RunConfig) -> TrialRun:
    """Run ``plan``'s driver faults (see the module's docstring): ``durable_sets`` are the
    ``--set`` overrides of the trial's durable tier, ``durable_cfg`` the config that names it."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sets = [a for o in ["recovery.driver_grace_s=120", *durable_sets] for a in ("--set", o)]
    base = [sys.executable, "-m", "elastic_llm.cli", "train", *driver_argv, *sets, "--address", address,
            "--max-steps", str(steps), "--no-progress"]  # the reference's length and LR schedule
    injections: list[Injection] = []
    failovers: list[dict[str, Any]] = []
    segments: list[Path] = []
    run_id = error = hung = None
    deadline = t0 + timeout_s
    for k in range(len(plan.faults) + 1):
        seg = out / f"metrics-{k}.jsonl"
        segments.append(seg)
        argv = [*base, "--metrics-out", str(seg), *(["--resume", run_id] if run_id else [])]
        started = time.monotonic()
        with open(out / f"driver-{k}.log", "w") as logfile:
            proc = subprocess.Popen(argv, stdout=logfile, stderr=subprocess.STDOUT)
            fault = plan.faults[k] if k < len(plan.faults) else None
            first = None
            while proc.poll() is None and time.monotonic() < deadline:
                lines = read_lines(seg, growing=True)
                seen = [x["step"] for x in lines if "loss" in x]
                if seen and first is None:
                    first = time.monotonic() - started
                if run_id is None:
                    run_id = next((ev.run_id for ev in map(events.parse, lines) if isinstance(ev, events.Start)), None)
                # struck once past its step with a snapshot committed (before the first one a
                # driver's death is beyond what memory can bring back: the durable tier's case)
                if fault is not None and seen and max(seen) >= fault.step and run_id and published_committed(run_id) is not None:
                    break
                time.sleep(POLL_S)
            if proc.poll() is None and time.monotonic() >= deadline:
                proc.kill()
                hung = f"driver {k} not done by the trial's deadline"
                proc.wait()
                break
            if k > 0:
                back = [ev for ev in map(events.parse, read_lines(seg, growing=True)) if isinstance(ev, events.Reattach)]
                failovers[-1].update(source="memory" if back else "durable", step=back[0].step if back else None,
                                     seconds=round(first, 3) if first is not None else None)
            if fault is None or proc.poll() is not None:  # the last driver, or one that ended before its fault
                code = proc.wait()
                if code != 0:
                    error = f"driver {k} exited {code}: {(out / f'driver-{k}.log').read_text()[-400:].strip()}"
                break
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        rec = published_committed(run_id) if run_id else None
        committed = rec.version if rec is not None else None
        trained = max([x["step"] for x in read_lines(seg, growing=True) if "loss" in x], default=0)
        log.info("trial %d: %s (driver pid %d at step %d, committed %s)", plan.trial, fault, proc.pid, trained, committed)
        injections.append(Injection(fault, f"driver pid {proc.pid} (run {run_id}) in step {trained + 1}, step {committed} committed"))
        failovers.append({"fault_step": fault.step, "committed": committed})
    history: dict[int, float] = {}
    for seg in segments:  # a re-run step keeps its last loss
        history.update({x["step"]: x["loss"] for x in read_lines(seg, growing=True) if "loss" in x})
    durable, durable_error = None, None
    if error is None and hung is None:
        durable, durable_error = verify_durable_dir(durable_cfg)
    return TrialRun(plan, injections, history, seconds=time.monotonic() - t0, error=error, hung=hung,
                    durable=durable, durable_error=durable_error, failovers=failovers)
