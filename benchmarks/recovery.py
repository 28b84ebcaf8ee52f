"""Recovery: the time a failure (or a drain notice) costs a run, per recovery path, against a full
restart of the same run from a ``torch.save`` checkpoint.

For each config (default ``jobs/tiny.yaml`` and ``jobs/llama-25m.yaml``), on one loopback
``ray.cluster_utils.Cluster`` (a head without CPUs + 1-CPU worker nodes, fast health checks as
in the tests), live :class:`~elastic_llm.controller.Trainer` runs (snapshots every step,
``train.eval_every=0``, warm standbys as shipped: ``recovery.standby`` 1 per node) warm up for
``warmup`` steps. After the first step the benchmark waits (between steps, at most
:data:`STANDBY_WAIT_S`) until every node hosting the run's stages has a started standby (the
product starts them ahead of time: that is their point; waiting there also keeps their start out
of the steady steps, which start at step :data:`STEADY_FROM`), notes their pids, and trains on;
then, during step ``warmup + 1``:

* ``local_smp``: dp=1, stage 0's process is SIGKILLed as it starts the step's first forward
  (chaos ``kill: stage``, its node lives; stage 0 so that the chaos line, written as the step is
  planned, is the moment of the kill): the stage is restored from its node's snapshot manager;
* ``dp_peer``: dp=2, stage 0 of replica 1 is SIGKILLed the same way: its replacement copies the
  state of stage 0 of replica 0 (no rollback);
* ``parity``: dp=1, the node hosting a stage is removed (chaos ``kill: node``, which calls
  ``Cluster.remove_node`` and waits until Ray sees the node dead) while other nodes have room: the
  stage is rebuilt from the erasure group's parity on another node;
* ``drain``: dp=1, the node hosting stage 0 is drained for preemption with a deadline
  (:func:`elastic_llm.runtime.drains.request_drain`, what ``ray drain-node --reason
  DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` does), half a step into the step;
  the controller moves the stages off it (per stage or as a whole replica: the drain line's
  ``how``); timed from the request, the run stops one step after the move;
* ``shrink``: dp=2, ``elastic.min_replicas=1``, placement PACK on nodes the two replicas fill: a node
  of replica 1 is removed for good; its lost stages cannot be placed, replica 1 is dropped.

Measured per path, from the run's own metrics lines (``chaos``, ``state``, ``recovery``,
``drain``, ``resize``) and the step completions it reports to ``fit(on_step=...)``:
``lost_s`` = seconds from the failure (the victim's death, or the drain request) to the completion
of the next step after the controller went back to ``running``, minus one steady step for that
step and for every step completed meanwhile (they were useful); ``lost_from_step_start_s`` the
same from the chaos line (written as the failed step is planned: it adds the step's work before
the strike, lost whatever recovers it, and left out of the full restart's measure too);
its breakdown ``strike_s`` (the chaos line until the victim's process ended, seen from outside the
product by a pidfd: :class:`DeathWitness`; for a node removal its raylet's end), ``detect_s`` (from that end, or from the drain request,
until the controller entered recovering / draining / resizing),
``plan_s`` / ``actor_s`` / ``state_s`` (the product's own spans on its recovery / drain / resize
lines: observe + decide; adopting a standby or starting actor processes until they answer; state
transfer), ``first_step_s`` (back in running until the next step completed); ``adopted``: whether
the replacement actor runs in a standby process seen before the failure (pids compared). For the
drain also the training pause (the draining state plus the first step after it, minus one steady
step). local_smp, dp_peer and parity fail ``shots`` times (3; a run of their own each): single
shots on the shared 2-core VM moved 2x between runs, so the shot with the median ``lost_s`` stands
for the path, every shot's figures beside it. The benchmark changes nothing in the product's
objects: it only reads what the product writes and calls public methods.

The full restart (the peer): a Trainer of the same config (dp=1, ``recovery.standby=0``: a plain
restart starts no standbys) warms up, every stage actor writes its whole state (the product's
state buffer + manifest: parameters, AdamW moments, LR schedule, RNG, step, data position) with
``torch.save`` (+ fsync) to a file, the driver its step and data position; the trainer shuts
down. Then, timed with ``perf_counter`` around the public calls: a new Trainer (``ray_trainer(cfg)``:
the driver opens the data), its ``setup()`` (new snapshot managers and stage actors on the running
Ray), every stage actor ``torch.load(weights_only=True)``s its file and loads it into its state
(``load_state``), the driver ``torch.load``s its own, and the first step completes (its loss is
checked against the undisturbed run's next step); ``lost_s`` = that minus one steady step.
Failure detection and the teardown of the old run are not counted, and the file is in the page
cache: a lower bound of a real restart. Also timed on the idle cluster: how long a new Ray actor
takes to answer when it does nothing, imports torch, or builds a stage (``StageWorker``), one at a
time and ``stages`` at once; timed inside the actor: its ``import torch``, the stage module import
and the stage's construction.

Everything runs on the same 2 cores (all "nodes" are processes of one machine): compare ratios,
not absolute numbers, and treat single-shot path times as noisy. Ray reads
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported: unless it was ``0`` then, the nodes would
take the machine's network address instead of 127.0.0.1, so the benchmark refuses to start (export
it, and ``RAY_AUTH_MODE=token``, before running).

Why it is this long (~1,000 lines): five recovery paths need five cluster shapes, fault injections
and checks, plus the restart peer and the actor-start probes; the pure helpers that turn metrics
lines into seconds come first (tested in ``tests/test_bench_recovery.py``).

Must never: copy or patch product code (recoveries, restores, drains and the step loop are the
product's own; the benchmark only triggers failures, calls public methods and reads metrics
lines), judge its results beyond reporting whether the issue's targets hold (conclusions live in
BENCHMARKS.md), leave Ray, clusters or files behind (torn down in ``finally``), or reach anything
but 127.0.0.1.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


from benchmarks.common import load_at_end, machine_info, median, ratio, reference_rates, stdout_to_stderr
from elastic_llm import events

DEFAULT_CONFIGS = ("jobs/tiny.yaml", "jobs/llama-25m.yaml")
PATHS = ("dp_peer", "local_smp", "parity", "drain", "shrink")
RUN_ORDER = ("local_smp", "dp_peer", "parity", "drain", "shrink")  # node removals last: fewer top-ups
TARGET_SPEEDUP = 15.0  # stated by the issue: local_smp, dp_peer, parity lose >= 15x less than a full restart
IN_MEMORY = ("local_smp", "dp_peer", "parity")
STANDBY_WAIT_S = 120.0  # before the failure: every node hosting stages has a warm standby
HANDLING = ("recovering", "draining", "resizing", "waiting_for_capacity")
DRAIN_DEADLINE_S = 60.0
DRAIN_AT = 0.5  # the drain notice arrives this fraction of a step into the step
DRAIN_MAX_STEPS = 30  # a drain run stops one step after the move; this is only a bound
# the steady step is the median of the steps from this one on, before the failure: step 1 builds
# the links and faults in memory; step 2 runs while the warm standbys' processes start (Python,
# torch, the warm-up: seconds of CPU on the 2 cores the loopback nodes share), measured 1.5-1.8x
# a steady step on llama-25m
STEADY_FROM = 3
COMMON = ["train.eval_every=0", "snapshot.enabled=true", "snapshot.every=1", "recovery.capacity_report_s=1"]
EXPECTED = {"local_smp": "local_smp", "dp_peer": "dp_peer", "parity": "parity"}
VICTIM = {"local_smp": (0, 0), "dp_peer": (0, 1), "parity": (1, 0), "shrink": (0, 1)}  # (stage, replica) path_overrides strikes
WAIT_S = 120.0


# --------------------------------------------------------------------------- pure helpers


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def cluster_plan(stages: int, cpus_per_actor: float) -> dict[str, int]:
    """Worker nodes (1 CPU each) per path for ``stages`` stage actors of ``cpus_per_actor`` CPUs:
    one stage per node at dp=1 (SPREAD; a node's spare slot is where a lost stage goes), every
    slot filled at dp=2, and for the drain one node more than needed to move a whole replica
    off a draining node. Raises ValueError when the shape does not leave the room the paths need."""
    if cpus_per_actor <= 0 or cpus_per_actor > 0.5 + 1e-9:
        raise ValueError(
            f"parallel.cpus_per_actor={cpus_per_actor}: bench recovery places stages on 1-CPU nodes and needs "
            "room for a second actor per node (parity, drain): use --set parallel.cpus_per_actor=0.5 (or less)"
        )
    slots = int(1.0 / cpus_per_actor + 1e-9)  # actors per node
    full = math.ceil(2 * stages / slots)  # dp=2 fills these exactly (shrink: no room left)
    if 2 * stages % slots:
        raise ValueError(f"{2 * stages} stage actors do not fill nodes of {slots} slots: shrink needs a cluster without room")
    return {
        "restart": stages,
        "local_smp": stages,
        "parity": stages,
        "dp_peer": max(full, 2),
        "drain": max(stages, math.ceil((2 * stages + slots - 1) / slots)),  # a replica fits beside the draining node
        "shrink": max(full, 2),
        "slots_per_node": slots,
    }


def path_overrides(path: str, fail_step: int, plan: dict[str, int]) -> list[str]:
    """Config overrides (``--set`` syntax) that make a run take ``path`` at ``fail_step``."""
    n = plan[path]
    group = [f"snapshot.group_size={n}"]
    # the stage kills strike stage 0, whose first op starts as its plan arrives: the chaos line
    # (written as the step is planned) is then the moment of the kill, not a forward earlier
    if path == "local_smp":
        chaos = f"{{step: {fail_step}, kill: stage, stage: 0, how: sigkill}}"
        return ["parallel.dp=1", "parallel.placement_strategy=SPREAD", *group, f"chaos.events=[{chaos}]"]
    if path == "dp_peer":
        chaos = f"{{step: {fail_step}, kill: stage, stage: 0, replica: 1, how: sigkill}}"
        return ["parallel.dp=2", "parallel.placement_strategy=SPREAD", *group, f"chaos.events=[{chaos}]"]
    if path == "parity":
        chaos = f"{{step: {fail_step}, kill: node, stage: 1}}"
        return ["parallel.dp=1", "parallel.placement_strategy=SPREAD", *group, f"chaos.events=[{chaos}]"]
    if path == "drain":
        return ["parallel.dp=1", "parallel.placement_strategy=SPREAD", "elastic.max_replicas=1", *group]
    if path == "shrink":
        chaos = f"{{step: {fail_step}, kill: node, stage: 0, replica: 1}}"
        return ["parallel.dp=2", "parallel.placement_strategy=PACK", "elastic.min_replicas=1", *group, f"chaos.events=[{chaos}]"]
    if path == "restart":  # a plain restart: no warm standbys started beside it
        return ["parallel.dp=1", "parallel.placement_strategy=SPREAD", "recovery.standby=0", *group]
    raise ValueError(f"unknown path {path!r}: one of {PATHS}")


def timeline(lines: Sequence[dict[str, Any]], steps: Sequence[dict[str, Any]], t0: float | None = None, steady_from: int = 2,
             died_at: float | None = None) -> dict[str, Any]:
    """Seconds from a failure to the next completed step, from one run's metrics lines (in file
    order) and its step completions ``steps`` (``{"step", "t": wall time done, "step_s"}`` in
    order). ``t0``: when the failure (or drain request) happened; default the first ``chaos``
    line's time. ``died_at``: when the victim's process ended (a :class:`DeathWitness`; the chaos
    line is written as the step is planned, the strike lands when the victim starts its op or
    its node's processes are killed). Returns the total and its parts: ``strike_s`` (chaos line
    to the victim's death), ``to_handler_s`` (from the death, else from ``t0``, until the
    controller entered recovering / draining / resizing), ``handler_s`` (until it was back in ``running``),
    ``next_step_s`` (until the next step completed), the product's ``seconds`` and spans
    (:func:`product_spans`) of its recovery / drain / resize lines, what those lines say, and the
    steady step time before the failure (the median of the steps from ``steady_from`` on)."""
    typed = [events.parse(x) for x in lines]
    states = [(i, ev) for i, ev in enumerate(typed) if isinstance(ev, events.StateChange)]
    if t0 is None:
        chaos = [ev for ev in typed if isinstance(ev, events.Chaos)]
        if not chaos:
            raise ValueError("no chaos line in the metrics and no t0 given: nothing to time from")
        t0 = float(chaos[0].time)
    enter = next((i for i, ev in states if ev.time >= t0 and ev.new in HANDLING), None)
    if enter is None:
        raise ValueError("the controller never left running after the failure")
    back = next((i for i, ev in states if i > enter and ev.new == "running"), None)
    if back is None:
        raise ValueError(f"the controller never came back to running (last state: {states[-1][1].new})")
    t_enter, t_back = float(typed[enter].time), float(typed[back].time)
    after = [s for s in steps if s["t"] > t_back]
    if not after:
        raise ValueError("no step completed after the recovery")
    nxt = after[0]
    window = typed[enter : back + 1]
    recov = [ev for ev in window if isinstance(ev, events.Recovery)]
    drains = [ev for ev in window if isinstance(ev, events.Drain)]
    resizes = [ev for ev in window if isinstance(ev, events.Resize)]
    product = [float(ev.seconds) for ev in (*recov, *drains, *resizes) if ev.seconds is not None]
    steady = [s["step_s"] for s in steps if s["t"] < t0 and s["step"] >= steady_from]
    steady_s = median(steady, or_none=True)
    out: dict[str, Any] = {
        "seconds": _r(nxt["t"] - t0),
        "strike_s": _r(died_at - t0) if died_at is not None else None,
        "to_handler_s": _r(t_enter - (died_at if died_at is not None else t0)),
        "handler_s": _r(t_back - t_enter),
        "next_step_s": _r(nxt["t"] - t_back),
        "product_seconds": _r(max(product)) if product else None,
        "next_step": nxt["step"],
        "steps_before_handler": sum(1 for s in steps if t0 < s["t"] < t_enter),  # trained on after the failure / notice
        "next_step_compute_s": _r(nxt.get("step_s")),
        "steady_step_s": _r(steady_s),
        # wall time not spent training at the steady pace: the window minus its completed steps at steady_step_s
        "lost_vs_steady_s": _r(nxt["t"] - t0 - steady_s * (1 + sum(1 for s in steps if t0 < s["t"] < t_enter))) if steady_s else None,
        # the same from the victim's death: the failed step's work before it is lost whatever recovers
        # (a full restart too, whose measure starts at the restart), so the paths are compared from there
        "lost_from_death_s": _r(nxt["t"] - died_at - steady_s * (1 + sum(1 for s in steps if died_at < s["t"] < t_enter)))
        if steady_s and died_at is not None else None,
        **product_spans([ev for ev in window if ev is not None]),
        "states": [f"{ev.old}->{ev.new}" for _, ev in states if t0 <= ev.time <= t_back],
        "window": (t0, nxt["t"]),
    }
    if recov:
        out["sources"] = sorted({str(ev.source) for ev in recov})
        streamed = [(int(ev.state_bytes), float(ev.transfer_s)) for ev in recov if ev.state_bytes and ev.transfer_s]
        if streamed:  # a peer's state over a socket: the largest copy
            out["transfer"] = {"bytes": max(streamed)[0], "seconds": _r(max(streamed)[1], 4)}
        out["rollback_steps"] = max(int(ev.rollback_steps or 0) for ev in recov)
        out["restored"] = [(ev.stage, ev.replica) for ev in recov if ev.stage is not None]
    if drains:
        out["drain"] = {k: drains[0].get(k) for k in ("moved", "dropped", "stayed", "deadline_s", "rollback_steps", "how")}
    if resizes:
        out["resize"] = [(ev.from_dp, ev.to_dp, ev.reason) for ev in resizes]
    return out


def product_spans(lines: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """The product's own timing spans of one recovery / drain / resize, from its metrics lines
    (``plan_s``: observe + decide, ``managers_s``: a snapshot manager on every node before the
    new actors start, ``actor_s``: adopting a standby or starting actor processes
    until they answer, ``state_s``: restore, peer or drain copy): the max over the lines, which
    repeat the same spans once per restored actor. None where no line carries the span."""
    out: dict[str, float | None] = {}
    for key in ("plan_s", "managers_s", "actor_s", "state_s"):
        vals = [float(ev.spans[key]) for ev in map(events.parse, lines)
                if isinstance(ev, (events.Recovery, events.Drain, events.Resize)) and ev.spans.get(key) is not None]
        out[key] = _r(max(vals)) if vals else None
    return out


def adopted_standby(before: dict[Any, int], after: dict[Any, int], standby_pids: set[int]) -> bool | None:
    """Whether an actor that is new after the run (a key whose pid changed, or a new key) runs in
    the process of a warm standby seen before (``standby_pids``); None when no actor is new (a
    shrink only drops actors)."""
    new = [pid for key, pid in after.items() if before.get(key) != pid]
    if not new:
        return None
    return any(pid in standby_pids for pid in new)


def path_result(t: dict[str, Any], adopted: bool | None) -> dict[str, Any]:
    """One path's lost time and breakdown from its :func:`timeline`: ``lost_s`` (failure to the
    next completed step, minus one steady step per step completed meanwhile and the next one),
    ``detect_s`` (until the controller left running), the product's ``plan_s``/``actor_s``/
    ``state_s``, ``first_step_s`` (back to running until the next step completed); for a drain
    also ``pause_s`` (the draining state plus the first step after it, minus one steady step)."""
    out = {
        "lost_s": t["lost_from_death_s"] if t.get("lost_from_death_s") is not None else t["lost_vs_steady_s"],
        "lost_from_step_start_s": t["lost_vs_steady_s"],
        "detect_s": t["to_handler_s"],
        "strike_s": t.get("strike_s"),
        "plan_s": t.get("plan_s"),
        "managers_s": t.get("managers_s"),
        "actor_s": t.get("actor_s"),
        "state_s": t.get("state_s"),
        "first_step_s": t["next_step_s"],
        "handler_s": t["handler_s"],
        "seconds": t["seconds"],
        "steady_step_s": t["steady_step_s"],
        "adopted": adopted,
        "rollback_steps": t.get("rollback_steps", 0),
    }
    if "transfer" in t:  # bytes and rate of a state streamed from a peer (target's seconds: connection, bytes, restore) or rebuilt from parity
        tr = t["transfer"]
        out["transfer"] = {**tr, "gb_s": _r(tr["bytes"] / tr["seconds"] / 1e9) if tr["seconds"] else None}
    # the steps rolled back are trained again: lost too, beyond the measure
    out["lost_incl_rollback_s"] = _r(out["lost_s"] + out["rollback_steps"] * t["steady_step_s"]) if out["lost_s"] is not None else None
    if "drain" in t:
        out["pause_s"] = _r(t["handler_s"] + t["next_step_s"] - t["steady_step_s"]) if t["steady_step_s"] else None
        out["how"] = t["drain"].get("how")
        out["rollback_steps"] = t["drain"].get("rollback_steps") or 0
        out["steps_trained_before_move"] = t["steps_before_handler"]
    return out


def median_shot(lost: Sequence[float | None]) -> int:
    """Which of a path's shots stands for it: the one with the median ``lost_s`` (the lower middle
    of an even count; shots without a figure sort last)."""
    order = sorted(range(len(lost)), key=lambda i: (lost[i] is None, lost[i] if lost[i] is not None else 0.0, i))
    measured = sum(1 for x in lost if x is not None) or len(lost)
    return order[(measured - 1) // 2]




class DeathWitness:
    """When a process ended, seen from outside the product: a pidfd (``os.pidfd_open``, Linux
    5.3+) turns readable as the process exits, a thread waits on it and notes the wall time.
    :meth:`close` stops the thread (joined) and closes the descriptors; ``at`` is None if the
    process outlived the watch."""

    def __init__(self, pid: int) -> None:
        import select

        self.at: float | None = None
        self._fd = os.pidfd_open(pid)
        self._stop_r, self._stop_w = os.pipe()

        def wait() -> None:
            ready, _, _ = select.select([self._fd, self._stop_r], [], [])
            if self._fd in ready:
                self.at = time.time()

        self._thread = threading.Thread(target=wait, name="bench-death-witness", daemon=True)
        self._thread.start()

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join()
        for fd in (self._fd, self._stop_r, self._stop_w):
            os.close(fd)


def full_restart_lost(parts: dict[str, float | None], steady_s: float | None) -> dict[str, Any]:
    """The full restart's lost time and breakdown from its timed phases (``total_s``,
    ``trainer_init_s``, ``setup_s``, ``load_wall_s``, ``first_step_s``): ``lost_s`` = total minus
    one steady step; detection is not part of the restart's measure (``detect_s`` None)."""
    total = parts["total_s"]
    return {
        "lost_s": _r(total - steady_s) if total is not None and steady_s else None,
        "detect_s": None,
        "plan_s": parts.get("trainer_init_s"),  # the driver's new Trainer: config, data
        "actor_s": parts.get("setup_s"),  # setup(): snapshot managers and stage actors started until they answer
        "state_s": parts.get("load_wall_s"),  # every stage's torch.load + load_state, the driver's
        "first_step_s": parts.get("first_step_s"),
        "seconds": total,
        "steady_step_s": _r(steady_s),
    }


def target_check(full_lost_s: float | None, paths: dict[str, dict[str, Any]], target: float = TARGET_SPEEDUP) -> dict[str, Any]:
    """The issue's targets, per path: local_smp, dp_peer and parity lose at least ``target`` x
    less than the full restart; the drain pauses training at most one steady step and rolls back
    nothing; the shrink loses at most its detection plus one steady step. A path that was not
    measured does not meet its target. Returns ``{path: {"met", ...}}`` and ``all_met``."""
    out: dict[str, Any] = {}
    for p in IN_MEMORY:
        lost = (paths.get(p) or {}).get("lost_s")
        sp = ratio(full_lost_s, lost, 2) if lost is not None and lost > 0 else None  # none at or below 0: no loss the steps' noise shows
        met = lost is not None and full_lost_s is not None and lost * target <= full_lost_s
        out[p] = {"met": met, "lost_s": lost, "speedup_lost": sp, "bound_s": _r(full_lost_s / target) if full_lost_s is not None else None,
                  "target": f"lost_s <= the full restart's / {target:g}"}
    d = paths.get("drain") or {}
    pause, steady = d.get("pause_s"), d.get("steady_step_s")
    out["drain"] = {"met": pause is not None and steady is not None and pause <= steady and d.get("rollback_steps") == 0,
                    "pause_s": pause, "steady_step_s": steady, "rollback_steps": d.get("rollback_steps"),
                    "target": "pause <= one steady step, rollback 0"}
    sh = paths.get("shrink") or {}
    bound = sh["detect_s"] + sh["steady_step_s"] if sh.get("detect_s") is not None and sh.get("steady_step_s") else None
    out["shrink"] = {"met": bound is not None and sh.get("lost_s") is not None and sh["lost_s"] <= bound,
                     "lost_s": sh.get("lost_s"), "bound_s": _r(bound), "target": "lost_s <= detect_s + one steady step"}
    out["all_met"] = all(v["met"] for v in out.values())
    return out


# --------------------------------------------------------------------------- cluster helpers


def _loadavg() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _alive_workers() -> list[str]:
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0)


def _wait_until(pred: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {seconds:.0f} s")
        time.sleep(0.2)


def _set_workers(cluster: Any, n: int, node_args: dict[str, Any]) -> None:
    """Exactly ``n`` live worker nodes, none draining, all their CPUs free (nothing of an
    earlier run left): removes draining or surplus nodes, adds fresh ones."""
    import ray

    from elastic_llm.runtime.drains import draining_nodes
    from elastic_llm.runtime.session import add_loopback_node

    draining = set(draining_nodes())
    for node in list(cluster.worker_nodes):
        if node.node_id in draining:
            cluster.remove_node(node)
    while len(cluster.worker_nodes) > n:
        cluster.remove_node(max(cluster.worker_nodes, key=lambda x: x.node_id))
    while len(cluster.worker_nodes) < n:
        add_loopback_node(cluster, node_args["num_cpus"], node_args["object_store_memory"])
    cluster.wait_for_nodes()
    _wait_until(lambda: len(_alive_workers()) == n, WAIT_S, f"{n} live worker nodes")
    total = n * float(node_args["num_cpus"])
    _wait_until(lambda: ray.available_resources().get("CPU", 0.0) >= total - 1e-6, WAIT_S, "the cluster's CPUs freed")


def _actor_fns() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(save, load) run inside a stage actor through ``__ray_call__`` (defined here, so they
    travel by value: the workers cannot import ``benchmarks``)."""

    def save(worker: Any, path: str, position: dict[str, int]) -> dict[str, Any]:
        import os
        import time
        import warnings

        import torch

        t = time.perf_counter()
        buf, manifest = worker.capture_state(position)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.from_numpy(buf)
        with open(path, "wb") as f:
            torch.save({"state": state, "manifest": manifest}, f)
            f.flush()
            os.fsync(f.fileno())
        return {"save_s": time.perf_counter() - t, "bytes": os.path.getsize(path), "state_bytes": int(buf.nbytes)}

    def load(worker: Any, path: str) -> dict[str, Any]:
        import time

        import torch

        t0 = time.perf_counter()
        ckpt = torch.load(path, weights_only=True)
        t1 = time.perf_counter()
        step = worker.load_state(ckpt["state"].numpy(), ckpt["manifest"])
        return {"torch_load_s": t1 - t0, "load_state_s": time.perf_counter() - t1, "step": int(step)}

    return save, load


# --------------------------------------------------------------------------- the peer: full restart


def _full_restart(cluster: Any, cfg: Any, warmup: int, rounds: int, workdir: str, workers: int, node_args: dict[str, Any]) -> dict[str, Any]:
    import ray
    import torch

    from elastic_llm.runtime.ray_runtime import ray_trainer

    save, load = _actor_fns()
    _set_workers(cluster, workers, node_args)
    old = ray_trainer(cfg, cluster=cluster)
    try:
        old.fit(warmup)
        step, position = old.step, dict(old.stream.state_dict())
        keys = old.group.keys()
        files = {k: os.path.join(workdir, f"ckpt-stage{k.stage}-replica{k.replica}.pt") for k in keys}
        saved = ray.get([old.group.actors[k.replica][k.stage].__ray_call__.remote(save, files[k], position) for k in keys], timeout=600)
        driver_file = os.path.join(workdir, "ckpt-driver.pt")
        torch.save({"step": step, "data_position": position}, driver_file)
        expected_loss = old.run_step()["loss"]  # the undisturbed run's next step
        steady = median([cfg.tokens_per_step() / h["tokens_per_s"] for h in old.history[STEADY_FROM - 1 :]], or_none=True)
    finally:
        old.shutdown()
    out_rounds = []
    for _ in range(rounds):
        _set_workers(cluster, workers, node_args)  # the old actors' CPUs are back
        time.sleep(1.0)  # let killed processes exit
        load0 = _loadavg()
        t0 = time.perf_counter()
        new = ray_trainer(cfg, cluster=cluster)
        try:
            t1 = time.perf_counter()
            new.setup()
            t2 = time.perf_counter()
            loads = new.group.keys()
            refs = [new.group.actors[k.replica][k.stage].__ray_call__.remote(load, files[k]) for k in loads]
            drv = torch.load(driver_file, weights_only=True)
            got = ray.get(refs, timeout=600)
            t3 = time.perf_counter()
            new.progress = new.progress.resumed(int(drv["step"]))
            new.stream.load_state_dict(drv["data_position"])
            rec = new.run_step()
            t4 = time.perf_counter()
        finally:
            new.shutdown()
        out_rounds.append({
            "total_s": t4 - t0,
            "trainer_init_s": t1 - t0,
            "setup_s": t2 - t1,
            "load_wall_s": t3 - t2,
            "torch_load_max_s": max(g["torch_load_s"] for g in got),
            "load_state_max_s": max(g["load_state_s"] for g in got),
            "first_step_s": t4 - t3,
            "first_step_loss_matches": rec["loss"] == expected_loss,
            "steps_restored": sorted({g["step"] for g in got}),
            "loadavg_1m": [load0, _loadavg()],
        })
    med = {k: _r(median([r[k] for r in out_rounds], or_none=True)) for k in out_rounds[0] if k.endswith("_s")}
    return {
        **full_restart_lost(med, steady),
        "full_restart_s": med["total_s"],
        "parts_s": {k: v for k, v in med.items() if k != "total_s"},
        "rounds": [{k: (_r(v) if isinstance(v, float) else v) for k, v in r.items()} for r in out_rounds],
        "first_step_loss_matches": all(r["first_step_loss_matches"] for r in out_rounds),
        "checkpoint_bytes": int(sum(s["bytes"] for s in saved)),
        "state_bytes": int(sum(s["state_bytes"] for s in saved)),
        "torch_save_max_s": _r(max(s["save_s"] for s in saved)),
        "stage_actors": len(keys),
        "steady_step_s": _r(steady),
        "restart_from_step": step,
    }


# --------------------------------------------------------------------------- actor start probes


def _probe_actor_starts(cfg: Any, rounds: int) -> dict[str, Any]:
    """How long a new Ray actor on a worker node takes to answer: doing nothing, importing torch,
    building a stage (timed inside), and the product's stage actor (``ray.remote(StageWorker)``
    as the actor group starts it, until ``info()`` answers) one at a time and ``stages`` at once."""
    import ray

    from elastic_llm.pipeline.stage import StageWorker

    cpus = cfg.parallel.cpus_per_actor
    config = cfg.to_dict()

    def age() -> float | None:
        """Seconds since this process started (None off Linux): a pre-started worker is older."""
        import os
        import time

        try:
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/stat") as f:
                btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        except (OSError, ValueError, StopIteration):
            return None
        return time.time() - (btime + ticks / os.sysconf("SC_CLK_TCK"))

    class Bare:
        def __init__(self) -> None:
            self.info = {"process_age_at_init_s": age()}

        def ping(self) -> dict[str, Any]:
            return self.info

    class TorchImport:
        def __init__(self) -> None:
            import time

            a = age()
            t = time.perf_counter()
            import torch  # noqa: F401

            self.info = {"process_age_at_init_s": a, "import_torch_s": time.perf_counter() - t}

        def ping(self) -> dict[str, Any]:
            return self.info

    class StageBuild:
        def __init__(self, config: dict[str, Any]) -> None:
            import time

            a = age()
            t0 = time.perf_counter()
            import torch  # noqa: F401

            t1 = time.perf_counter()
            from elastic_llm.pipeline.stage import StageWorker

            t2 = time.perf_counter()
            StageWorker(config, 0, 0)
            t3 = time.perf_counter()
            self.info = {"process_age_at_init_s": a, "import_torch_s": t1 - t0, "import_stage_module_s": t2 - t1, "build_stage_s": t3 - t2}

        def ping(self) -> dict[str, Any]:
            return self.info

    Product = ray.remote(concurrency_groups={"snapshot": 1})(StageWorker)

    def timed(make: Callable[[], Any], call: str, n: int = 1) -> tuple[float, list[Any]]:
        t = time.perf_counter()
        actors = [make() for _ in range(n)]
        try:
            got = ray.get([getattr(a, call).remote() for a in actors], timeout=600)
            return time.perf_counter() - t, got
        finally:
            for a in actors:
                ray.kill(a)

    stages = cfg.parallel.stages
    kinds: dict[str, list[tuple[float, list[Any]]]] = {"bare": [], "import_torch": [], "build_stage": [], "stage_actor": [], f"stage_actors_x{stages}": []}
    for _ in range(rounds):
        kinds["bare"].append(timed(lambda: ray.remote(Bare).options(num_cpus=cpus).remote(), "ping"))
        kinds["import_torch"].append(timed(lambda: ray.remote(TorchImport).options(num_cpus=cpus).remote(), "ping"))
        kinds["build_stage"].append(timed(lambda: ray.remote(StageBuild).options(num_cpus=cpus).remote(config), "ping"))
        kinds["stage_actor"].append(timed(lambda: Product.options(num_cpus=cpus, max_restarts=0).remote(config, 0, 0, 1), "info"))
        kinds[f"stage_actors_x{stages}"].append(timed(lambda: Product.options(num_cpus=cpus, max_restarts=0).remote(config, 0, 0, 1), "info", stages))
        time.sleep(0.5)
    out: dict[str, Any] = {k: _r(median([t for t, _ in v], or_none=True)) for k, v in kinds.items()}
    inside: dict[str, Any] = {}
    for kind in ("import_torch", "build_stage"):
        infos = [i for _, got in kinds[kind] for i in got]
        for key in ("import_torch_s", "import_stage_module_s", "build_stage_s"):
            vals = [i[key] for i in infos if key in i]
            if vals:
                inside[f"{kind}.{key}"] = _r(median(vals))
    ages = [i.get("process_age_at_init_s") for _, got in kinds["bare"] for i in got]
    inside["bare.process_age_at_init_s"] = [_r(a) for a in ages]
    out["inside_actor_s"] = inside
    out["rounds"] = rounds
    return out


# --------------------------------------------------------------------------- one recovery path


def _wait_for_standbys(trainer: Any) -> float | None:
    """Block (between steps) until every node hosting the run's stages has a started warm standby,
    at most :data:`STANDBY_WAIT_S`; returns the seconds waited (None: the run keeps no standbys).
    Raises TimeoutError when they do not start in time."""
    pool = trainer.parts.standbys if trainer.parts is not None else None
    if pool is None or not pool.enabled:
        return None
    t = time.perf_counter()
    _wait_until(lambda: all(pool.ready().get(n, 0) >= 1 for n in set(trainer.group.nodes.values())), STANDBY_WAIT_S,
                "a warm standby on every node hosting stages")
    return time.perf_counter() - t


def _victim_pid(cluster: Any, trainer: Any, path: str) -> int:
    """The process whose end is the failure of ``path``: the killed stage's, or for a node removal
    the raylet of the stage's node (``Cluster.remove_node`` kills it first; Ray then takes the
    node for dead, while its workers exit a moment later)."""
    from ray._private import ray_constants

    from elastic_llm.snapshot.records import ShardKey

    key = ShardKey(*VICTIM[path])
    if path not in ("parity", "shrink"):
        return int(trainer.group.pids[key])
    node = next(n for n in cluster.worker_nodes if n.node_id == trainer.group.nodes[key])
    return int(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)


def _run_path(
    cluster: Any, path: str, config_path: str, overrides: Sequence[str], plan: dict[str, int], warmup: int, after: int, workdir: str, node_args: dict[str, Any],
    shot: int = 0,
) -> dict[str, Any]:
    from elastic_llm.config import load_config
    from elastic_llm.runtime.ray_runtime import ray_trainer
    from elastic_llm.runtime.drains import request_drain
    from elastic_llm.snapshot.records import ShardKey

    _set_workers(cluster, plan[path], node_args)
    fail_step = warmup + 1
    cfg = load_config(config_path, [*overrides, *COMMON, *path_overrides(path, fail_step, plan)])
    metrics = os.path.join(workdir, f"metrics-{path}-{shot}.jsonl")
    trainer = ray_trainer(cfg, cluster=cluster, metrics_out=metrics)
    steps: list[dict[str, Any]] = []
    drain: dict[str, Any] = {}
    seen: dict[str, Any] = {"standby_pids": set()}
    timer: threading.Timer | None = None
    tokens = cfg.tokens_per_step()

    def request(victim: str) -> None:
        drain["t0"] = time.time()
        try:
            request_drain(victim, DRAIN_DEADLINE_S, "bench recovery: preemption notice")
        except Exception as e:  # reported below: the path then has no time
            drain["error"] = repr(e)
        drain["request_s"] = time.time() - drain["t0"]

    def on_step(rec: dict[str, Any]) -> None:
        nonlocal timer
        steps.append({"step": rec["step"], "t": time.time(), "step_s": tokens / rec["tokens_per_s"], "dp": rec.get("dp")})
        pool = trainer.parts.standbys if trainer.parts is not None else None
        if rec["step"] == 1 and "standby_wait_s" not in seen:
            # before the failure (the point of standbys), and before the steady steps: standbys starting
            # beside the warm-up (importing torch on the same cores) would slow the steps taken as steady
            seen["standby_wait_s"] = _wait_for_standbys(trainer)
        if rec["step"] == warmup and "pids_before" not in seen:
            seen["pids_before"] = dict(trainer.group.pids)
            if path in VICTIM:  # the victim's process (a removed node's: its raylet, killed first): its end is the failure's moment
                seen["witness"] = DeathWitness(_victim_pid(cluster, trainer, path))
            seen["standby_ready"] = dict(pool.ready()) if pool is not None else None
        if pool is not None:
            for node in set(trainer.group.nodes.values()) | set(pool.ready()):
                seen["standby_pids"].update(pool.pids(node))
        if path == "drain" and drain.get("node") in trainer.drains_seen:
            trainer.request_stop()  # a step completed after the move: that is the one timed
        elif path == "drain" and rec["step"] == warmup and timer is None:
            victim = trainer.group.nodes[ShardKey(0, 0)]
            drain["node"] = victim
            delay = DRAIN_AT * (median([s["step_s"] for s in steps[1:]], or_none=True) or steps[-1]["step_s"])
            timer = threading.Timer(delay, request, args=(victim,))
            timer.daemon = True
            timer.start()

    load0 = _loadavg()
    t_setup = time.perf_counter()
    try:
        trainer.setup()
        setup_s = time.perf_counter() - t_setup
        nodes_before = sorted(set(trainer.group.nodes.values()))
        # the drain trains on while spare actors start, then moves, then stops itself (on_step)
        trainer.fit(fail_step + (DRAIN_MAX_STEPS if path == "drain" else after), on_step=on_step)
        width_after = trainer.group.width
        pids_after = dict(trainer.group.pids)
        nodes_after = sorted(set(trainer.group.nodes.values()))
    finally:
        if timer is not None:
            timer.join(timeout=30)
        if "witness" in seen:
            seen["witness"].close()
        trainer.shutdown()
    lines = events.read_lines(metrics)
    if path == "drain" and ("t0" not in drain or "error" in drain):
        raise RuntimeError(f"the drain was not requested: {drain.get('error', 'the timer did not fire')}")
    died_at = seen["witness"].at if "witness" in seen else None
    if path in VICTIM and died_at is None:
        raise RuntimeError(f"{path}: the victim {VICTIM[path]}'s process outlived the run: the fault did not strike it")
    out = timeline(lines, steps, drain.get("t0"), STEADY_FROM, died_at)
    out.pop("window")
    out["adopted"] = adopted_standby(seen.get("pids_before", {}), pids_after, seen["standby_pids"])
    out["standby_ready_before"] = seen.get("standby_ready")
    out["standby_wait_s"] = _r(seen.get("standby_wait_s"))
    out["setup_s"] = _r(setup_s)
    out["width_after"] = width_after
    out["nodes_hosting_before"] = len(nodes_before)
    out["nodes_hosting_after"] = len(nodes_after)
    out["worker_nodes"] = plan[path]
    out["loadavg_1m"] = [load0, _loadavg()]  # at setup and at the end: the machine is shared
    out["stage_actors"] = cfg.parallel.stages * cfg.parallel.dp
    if path == "drain":
        out["drain_request_call_s"] = _r(drain.get("request_s"))
    out["check"] = _check(path, out)
    return out


def _check(path: str, t: dict[str, Any]) -> dict[str, Any]:
    """Did the run take the path it was set up for?"""
    if path in EXPECTED:
        ok = t.get("sources") == [EXPECTED[path]]
        if path == "dp_peer":
            ok = ok and t.get("rollback_steps") == 0
        return {"ok": ok, "sources": t.get("sources"), "rollback_steps": t.get("rollback_steps")}
    if path == "drain":
        d = t.get("drain") or {}
        return {"ok": bool(d.get("moved")) and "sources" not in t, **d}
    if path == "shrink":
        return {"ok": bool(t.get("resize")) and t["resize"][0][:2] == (2, 1) and t.get("rollback_steps", 0) == 0, "resize": t.get("resize")}
    return {"ok": False}


# --------------------------------------------------------------------------- one config


def _bench_config(config_path: str, overrides: Sequence[str], warmup: int, after: int, restarts: int, probe_rounds: int, shots: int) -> dict[str, Any]:
    import ray
    from ray._private import ray_constants

    from elastic_llm.config import load_config
    from elastic_llm.runtime.session import FAST_HEALTH, loopback_cluster
    from elastic_llm.shape import count_parameters

    started = time.perf_counter()
    machine = machine_info()
    base = load_config(config_path, list(overrides))
    par = base.parallel
    plan = cluster_plan(par.stages, par.cpus_per_actor)
    params = count_parameters(base.model.shape())
    est_state = 12 * params  # fp32 parameters + two AdamW moments
    node_args = {"num_cpus": 1, "object_store_memory": int(max(1 << 30, 4 * est_state))}
    restart_cfg = load_config(config_path, [*overrides, *COMMON, *path_overrides("restart", 0, plan)])
    result: dict[str, Any] = {"benchmark": "recovery", "config": base.name, "config_path": str(config_path), "overrides": list(overrides)}
    details: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {}  # per path, every shot's timeline in run order
    errors: dict[str, str] = {}
    if ray.is_initialized():
        raise RuntimeError("bench recovery starts its own Ray: shut down the running one first")
    if ray_constants.ENABLE_RAY_CLUSTER:  # read once, when ray was imported
        raise RuntimeError(
            "Ray would put the loopback cluster's nodes on this machine's network address, not 127.0.0.1: "
            "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (and RAY_AUTH_MODE=token) before starting the benchmark"
        )
    addresses: list[str] = []
    cluster = None
    with tempfile.TemporaryDirectory(prefix="elastic-llm-recbench-") as workdir:
        try:
            cluster = loopback_cluster(0, 1, node_args["object_store_memory"], head_store_bytes=512 << 20, log_to_driver=False)
            addresses = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
            if probe_rounds:
                _set_workers(cluster, plan["restart"], node_args)
                details["actor_start_probe_s"] = _probe_actor_starts(restart_cfg, probe_rounds)
            full = _full_restart(cluster, restart_cfg, warmup, restarts, workdir, plan["restart"], node_args)
            for path in RUN_ORDER:
                for shot in range(shots if path in IN_MEMORY else 1):
                    try:
                        runs.setdefault(path, []).append(_run_path(cluster, path, config_path, overrides, plan, warmup, after, workdir, node_args, shot))
                    except Exception as e:  # one path's failure must not hide the others
                        errors[path if shot == 0 else f"{path}#{shot}"] = f"{type(e).__name__}: {e}"
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
    paths = {}
    for p, shots_of_p in runs.items():
        results = [path_result(d, d["adopted"]) for d in shots_of_p]
        mid = median_shot([r["lost_s"] for r in results])
        details[p] = shots_of_p[mid]
        paths[p] = {**results[mid], "shots_lost_s": [r["lost_s"] for r in results], "shots_detect_s": [r["detect_s"] for r in results],
                    "shots_state_s": [r["state_s"] for r in results], "shots_ok": [d["check"].get("ok") for d in shots_of_p]}
    streamed = [r["transfer"] for r in paths.values() if "transfer" in r]
    if streamed:  # the same bytes moved by memcpy and by a bare loopback socket, in this run
        ref = reference_rates(max(x["bytes"] for x in streamed))
        for r in paths.values():
            if "transfer" in r and r["transfer"]["gb_s"]:
                r["transfer"]["vs_memcpy"] = ratio(r["transfer"]["gb_s"], ref["memcpy_gb_s"], 3)
                r["transfer"]["vs_loopback_tcp"] = ratio(r["transfer"]["gb_s"], ref["loopback_tcp_gb_s"], 3)
        details["transfer_reference"] = ref
    for r in paths.values():
        r["speedup_lost"] = ratio(full["lost_s"], r["lost_s"], 2) if r["lost_s"] and r["lost_s"] > 0 else None
    result.update(
        parameters=params,
        stages=par.stages,
        tokens_per_step=base.tokens_per_step(),
        steady_step_s=full["steady_step_s"],  # dp=1, the undisturbed warm-up of the restart peer
        full_restart={k: full[k] for k in ("lost_s", "detect_s", "plan_s", "actor_s", "state_s", "first_step_s", "seconds", "steady_step_s")},
        paths=paths,
        targets=target_check(full["lost_s"], paths),
        standby={p: details[p]["standby_ready_before"] for p in RUN_ORDER if p in details},
        full_restart_parts_s=full["parts_s"],
        full_restart_details=full,
        breakdown={p: details[p] for p in PATHS if p in details},
        actor_start_probe_s=details.get("actor_start_probe_s"),
        transfer_reference=details.get("transfer_reference"),
        errors=errors,
        cluster={
            "head_cpus": 0,
            "worker_cpus": 1,
            "worker_nodes_per_path": {k: v for k, v in plan.items() if k != "slots_per_node"},
            "object_store_bytes_per_worker": node_args["object_store_memory"],
            "health_checks": FAST_HEALTH,
            "node_addresses": addresses,
        },
        settings={"warmup_steps": warmup, "steps_after": after, "fail_step": warmup + 1, "restart_rounds": restarts, "shots_per_in_memory_path": shots,
                  "drain_deadline_s": DRAIN_DEADLINE_S, "drain_at_fraction_of_step": DRAIN_AT},
    )
    result["notes"] = _notes(result)
    load_at_end(machine)
    result["machine"] = machine
    result["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def _notes(r: dict[str, Any]) -> list[str]:
    notes = [
        (
            "transfer (dp_peer): the peer's whole state streamed over one TCP connection from its memory into the new actor's "
            "(bytes, the target's seconds: connection, bytes and restore; GB/s); transfer_reference: the same bytes moved in this "
            "run by a warm memcpy and by a bare loopback TCP connection (medians of 5). transfer (parity): the lost stage's state "
            "rebuilt by the new stage itself, decoded straight into its state (bytes rebuilt; seconds from asking the group's "
            "members for their piece servers, the reads of their chunks and parity over those links, the decode and the checksums, until the last decoded byte is in place)."
        ),
        (
            "lost_s per path: seconds from the failure (the victim's death, seen by a pidfd; drain: the drain request) to the "
            "completion of the next step after the controller returned to running, minus one steady step for that step and for "
            "every step completed meanwhile; local_smp, dp_peer and parity fail `shots` times (a run each) and the shot with the "
            "median lost_s stands for the path (shots_*: every shot's figures, in run order); drain and shrink are single shots. "
            "lost_from_step_start_s counts from the chaos line "
            "instead (the failed step's plan): it adds the step's work before the strike (strike_s), lost whatever recovers it "
            "(the full restart's measure leaves it out too). At or below 0 the loss is within the steps' noise: no speedup is "
            "given and the target (lost_s <= the full restart's / 15) holds."
        ),
        (
            "breakdown: strike_s = the chaos line (written as the failed step is planned) until the victim's process ended (seen "
            "from outside by a pidfd: the kill lands when the victim starts its first op; a removed node ends with its raylet, "
            "killed first); detect_s = that end until the controller left running (for the drain: the request until then, i.e. the wait for the step boundary and "
            "the spare's start, training on); plan_s / actor_s / state_s = the product's own spans on its recovery/drain/resize "
            "lines (max over the lines of one recovery); first_step_s = back to running until the next step completed. "
            "detect + handling + first step = seconds; plan/actor/state are parts of the handling."
        ),
        (
            "full_restart: median of the restart rounds: new Trainer (plan_s slot) + setup() (actor_s) + torch.load/load_state "
            "of every stage (state_s) + first step; lost_s = that minus one steady step; no failure detection, no teardown, "
            "page-cached files, and no warm standbys (recovery.standby=0): a lower bound of a real restart."
        ),
        (
            "adopted: whether the actor that replaced the lost one runs in a warm standby process seen before the failure "
            "(pids compared); after step 1 the run waited until every node hosting stages had a ready standby, so the failure "
            "finds them started; the steady step is the median of steps 3..warmup (step 2 runs beside the standbys' starts). lost_incl_rollback_s adds the rolled-back steps (trained again)."
        ),
        (
            "drain: pause_s = the draining state plus the first step after it, minus one steady step; how = stages (per-stage "
            "move) or replica (whole-replica move)."
        ),
        (
            "dp_peer and shrink run at dp=2 (8 stage actors), the others and the full restart at dp=1: a dp=2 full restart would "
            "start twice the actors, so their speedups are understated."
        ),
    ]
    bad = {p: d["check"] for p, d in r["breakdown"].items() if not d["check"].get("ok")}
    bad.update({f"{p} (shot {i})": "did not take its path" for p, v in r["paths"].items() for i, ok in enumerate(v.get("shots_ok", [])) if ok is False})
    if bad:
        notes.append(f"paths that did not go as set up: {bad}")
    if not r["full_restart_details"]["first_step_loss_matches"]:
        notes.append("the restarted run's first loss differs from the undisturbed run's: the restart did not restore the state exactly")
    return notes


# --------------------------------------------------------------------------- the benchmark


def run_recovery_bench(
    config_paths: Sequence[str] | None = None,
    overrides: Sequence[str] = (),
    *,
    warmup: int = 5,
    after: int = 2,
    restarts: int = 2,
    probe_rounds: int = 2,
    shots: int = 3,
) -> list[dict[str, Any]]:
    """Per config (default :data:`DEFAULT_CONFIGS`): every recovery path's lost time and its
    breakdown, the full restart's, their ratios and the target checks (see the module doc).
    ``warmup``: steps before the failure (which hits step ``warmup + 1``); ``after``: steps run
    after it; ``restarts``: full restart rounds (median); ``probe_rounds``: rounds of actor start
    probes (0: skip); ``shots``: failures per in-memory path (local_smp, dp_peer, parity), each in
    a run of its own, the one with the median ``lost_s`` standing for the path (every shot's
    ``lost_s``, ``detect_s`` and ``state_s`` listed beside it). Returns one JSON-serializable dict
    per config; every Ray instance, cluster and file it started is gone when it returns."""
    from elastic_llm.runtime.session import loopback_env

    if warmup < STEADY_FROM or after < 1 or restarts < 1 or shots < 1:
        raise ValueError(f"warmup must be >= {STEADY_FROM} (the steps before it are not steady), after >= 1, restarts >= 1, shots >= 1")
    loopback_env()
    configs = list(config_paths) if config_paths else list(DEFAULT_CONFIGS)
    with stdout_to_stderr():  # Ray prints worker and raylet deaths on stdout; --json prints one line
        return [_bench_config(c, overrides, warmup, after, restarts, probe_rounds, shots) for c in configs]


if __name__ == "__main__":
    from benchmarks.common import main

    raise SystemExit(main("recovery"))
