"""``elastic-llm bench partitions``: a node cut off from the network against a node that dies, on
the multi-host harness (:mod:`elastic_llm.hosts`: a Ray head, three 1-CPU worker nodes and the
driver, each on a host of its own in a network namespace, one bridge between them).

Per shot, tiny trains with every-step snapshots (parity 1) through the real command line on the
driver's host, and at step ``AT`` the node hosting stage 1 either loses its link both ways
(``chaos kill: partition``: the node and every process on it live on, silent; the link heals
before step ``HEAL_AT``, and what its zombies send is fenced) or dies (``kill:
node``: every process of its host SIGKILLed, so its raylet's port refuses at once). From the run's
own metrics lines, per shot:

- ``detect_s``: from the fault's line to the run's ``running -> recovering`` line;
- ``lost_s``: from the fault's line to the first step finished after the recovery, less one
  steady step (the median step of the undisturbed run of the same cluster): the time the
  fault cost beyond the step it hit;
- whether the losses equal the undisturbed run's, step for step, and the committed steps lost;
- recoveries from the fault on (1: none after the heal) and what of the old generation was
  refused (``fenced`` lines: a healed partition's zombies), in all and by who refused it.

A third shot cuts only the link between stage 1's node and stage 2's (``kill: isolate``: both
still reach the head, the driver and every other host), with the same figures and the run's
``link_cut`` lines. A fourth slows stage 1's node's link to ``SLOW_MBIT`` Mbit/s each way at step
``SLOW_AT`` (``kill: slow``), with snapshots every ``SLOW_EVERY`` steps (every-step parity pieces
would cross the slowed link too): the median step time before (the undisturbed run's), while
slow (from the fault to the ``straggler`` line), after its stages moved off it (from the
``drain`` line on), when the straggler was named and what the move cost.

The side-by-side peer is the kill: the same run, cluster and step, a fault the run has always
survived. Ray's health checks run with the settings ``cluster.yaml`` gives the head (read from the
file), so the partition's figure is what a cluster of the shipped settings sees. After each shot
the struck host is replaced by a new one (the cut node's raylet was declared dead by Ray). Needs
root and iproute2 (``elastic_llm.hosts.lab.unavailable`` says why not); judges nothing:
BENCHMARKS.md does.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from benchmarks.common import machine_info, median

AT = 5  # the step a fault strikes
HEAL_AT = 9  # a partition heals before this step (its node's zombies then meet the run's fence)
STEPS = 12
OVERRIDES = ("snapshot.every=1", "train.eval_every=1000")
SLOW_AT, SLOW_MBIT, SLOW_EVERY = 2, 20, 4
KILLS = {"partition": "partition", "kill": "node", "isolate": "isolate"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shot_figures(lines: list[dict[str, Any]], steady_s: float) -> dict[str, Any]:
    """``detect_s`` and ``lost_s`` of one faulted run from its metrics lines (see the module)."""
    fault = next(ln["time"] for ln in lines if ln.get("event") == "chaos")
    recovering = next(ln["time"] for ln in lines if ln.get("event") == "state" and ln.get("new") == "recovering" and ln["time"] >= fault)
    resumed = next(ln["time"] for ln in lines if ln.get("event") == "state" and ln.get("old") == "recovering" and ln["time"] >= recovering)
    first = next((t for t in step_times(lines) if t > resumed), None)
    recoveries = [ln for ln in lines if ln.get("event") == "recovery"]
    return {
        "detect_s": round(recovering - fault, 3),
        "recovering_s": round(resumed - recovering, 3),
        "lost_s": round(first - fault - steady_s, 3) if first is not None else None,
        "sources": sorted({r["source"] for r in recoveries}),
        "committed_steps_lost": sum(r["committed_steps_lost"] for r in recoveries),
        "recoveries_after_fault": sum(1 for ln in lines if ln.get("event") == "state" and ln.get("new") == "recovering" and ln["time"] >= fault),
        "fenced": sum(ln["count"] for ln in lines if ln.get("event") == "fenced"),
        "fenced_by": fenced_by(lines),
        "recovery_spans": {k: round(v, 3) for k, v in recoveries[0].items() if k.endswith("_s") and isinstance(v, float)} if recoveries else {},
    }


def fenced_by(lines: list[dict[str, Any]]) -> dict[str, int]:
    """What the run refused as a zombie's, by who refused it: the stages (plans and links of an
    older link generation), the snapshot managers (offers, plans and driver calls below their
    floor) and the durable tier (shard files of an older attempt beside a checkpoint's own)."""
    fenced = [ln for ln in lines if ln.get("event") == "fenced"]
    return {"stages": sum(ln["count"] for ln in fenced if ln.get("stage") is not None),
            "managers": sum(ln["count"] for ln in fenced if ln.get("node")),
            "durable": sum(ln["count"] for ln in fenced if ln.get("stage") is None and not ln.get("node"))}


def slow_figures(lines: list[dict[str, Any]], steady_s: float) -> dict[str, Any]:
    """The slow-link shot's figures from its metrics lines (see the module)."""
    fault = next(ln["time"] for ln in lines if ln.get("event") == "chaos")
    named = next((ln for ln in lines if ln.get("event") == "straggler"), None)
    drain = next((ln for ln in lines if ln.get("event") == "drain"), None)
    times = step_times(lines)
    gaps = list(zip(times, times[1:]))
    slow = [b - a for a, b in gaps if a >= fault and (named is None or b <= named["time"])]
    after = [b - a for a, b in gaps if drain is not None and a >= drain["time"]]
    return {
        "step_s_before": round(steady_s, 3),
        "step_s_slow": _round(median(slow, or_none=True)),
        "step_s_after": _round(median(after, or_none=True)),
        "slow_vs_before": round(median(slow) / steady_s, 2) if slow else None,
        "after_vs_before": round(median(after) / steady_s, 2) if after else None,
        "named_after_s": round(named["time"] - fault, 3) if named else None,
        "link_share_slow": named["share"] if named else None,
        "node_mb_s": named["node_mb_s"] if named else None,
        "fastest_mb_s": named["fastest_mb_s"] if named else None,
        "move_s": drain["seconds"] if drain else None,
        "moved": drain["moved"] if drain else 0,
        "recoveries": sum(1 for ln in lines if ln.get("event") == "recovery"),
    }


def losses(lines: list[dict[str, Any]]) -> dict[int, float]:
    return {ln["step"]: ln["loss"] for ln in lines if "loss" in ln and ln.get("event") is None}


def step_times(lines: list[dict[str, Any]]) -> list[float]:
    """The wall time each step line was written at: a step line carries the seconds since the
    run's first step (``elapsed_s``), the end line both clocks."""
    end = next(ln for ln in lines if ln.get("event") == "end")
    start = end["time"] - end["elapsed_s"]
    return [start + ln["elapsed_s"] for ln in lines if ln.get("event") is None and "loss" in ln]


def steady_step_s(lines: list[dict[str, Any]]) -> float:
    times = step_times(lines)
    return median(b - a for a, b in zip(times[2:], times[3:]))


def run_partitions_bench(shots: int = 2, out_dir: str | None = None) -> dict[str, Any]:
    """The benchmark (see the module); ``out_dir``: keep each run's metrics and driver log there."""
    from benchmarks.detect import cluster_yaml_health
    from elastic_llm.hosts.lab import Lab, LabUnavailable, unavailable
    from elastic_llm.runtime.lab_cluster import RayHosts

    why = unavailable()
    if why:
        raise LabUnavailable(f"bench partitions needs the multi-host harness: {why}")
    t0 = time.monotonic()
    health = cluster_yaml_health(os.path.join(REPO, "cluster.yaml"))
    out: dict[str, Any] = {"benchmark": "partitions", "config": "jobs/tiny.yaml", "at_step": AT, "steps": STEPS, "overrides": list(OVERRIDES),
                           "ray_health": health, "slow": {"at_step": SLOW_AT, "mbit": SLOW_MBIT, "snapshot_every": SLOW_EVERY}, "shots": {}}
    with Lab.create() as lab:
        hosts = RayHosts(lab, system_config=health).start(workers=3, cpus_per_node=1)
        clean = hosts.train("clean", "jobs/tiny.yaml", STEPS, OVERRIDES, cwd=REPO)
        steady = steady_step_s(clean)
        out["steady_step_s"] = round(steady, 3)
        for i in range(shots):
            for kind in (*KILLS, "slow"):
                heal = f", {{step: {HEAL_AT}, kill: heal}}" if kind == "partition" else ""
                event = (f"chaos.events=[{{step: {SLOW_AT}, kill: slow, stage: 1, mbit: {SLOW_MBIT}}}]" if kind == "slow" else
                         f"chaos.events=[{{step: {AT}, kill: {KILLS[kind]}, stage: 1}}{heal}]")
                sets = (*OVERRIDES, f"snapshot.every={SLOW_EVERY}", event) if kind == "slow" else (*OVERRIDES, event)
                try:
                    lines = hosts.train(f"{kind}-{i}", "jobs/tiny.yaml", STEPS, sets, cwd=REPO)
                finally:
                    for name in hosts.workers:  # a cut or slowed link heals: the next shot starts on a whole switch
                        lab.heal(name)
                    if out_dir:
                        os.makedirs(out_dir, exist_ok=True)
                        for ext in ("jsonl", "log"):
                            if (lab.tmp / f"{kind}-{i}.{ext}").exists():
                                shutil.copy(lab.tmp / f"{kind}-{i}.{ext}", os.path.join(out_dir, f"{kind}-{i}.{ext}"))
                shot = slow_figures(lines, steady) if kind == "slow" else shot_figures(lines, steady)
                shot["bit_identical"] = losses(lines) == losses(clean)
                if kind == "isolate":
                    shot["link_cuts"] = sum(1 for ln in lines if ln.get("event") == "link_cut")
                out["shots"].setdefault(kind, []).append(shot)
                for name in hosts.dead_workers():
                    hosts.replace(name, 1)
    for kind in KILLS:
        out[kind] = {k: _round(median([s[k] for s in out["shots"][kind] if s[k] is not None], or_none=True)) for k in ("detect_s", "recovering_s", "lost_s")}
    out["slow"] = {k: _round(median([s[k] for s in out["shots"]["slow"] if s[k] is not None], or_none=True))
                   for k in ("step_s_before", "step_s_slow", "step_s_after", "slow_vs_before", "after_vs_before", "named_after_s", "move_s")}
    k = out["kill"]
    for kind in ("partition", "isolate"):
        p = out[kind]
        out[f"{kind}_vs_kill"] = {f: round(p[f] / k[f], 2) if p[f] and k[f] else None for f in ("detect_s", "lost_s")}
    out["all_bit_identical"] = all(s["bit_identical"] for v in out["shots"].values() for s in v)
    out["machine"] = machine_info()
    out["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
