"""The verdict of a soak: each fault matched to its outcome, the invariants checked per trial,
the numbers per fault kind, and ``report.json`` / ``report.md``.

Owns: :func:`judge_trial` (pure: a trial's injections, metrics lines and losses in, its faults'
outcomes and failed invariants out), :func:`build_report` (pure aggregation) and writing the
two report files. Never runs anything and never reads a clock: the runner hands in what it saw.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastic_llm.soak.plan import Fault, FaultKind, Moment, TrialPlan

WIDTH_RTOL = 1e-3  # after a width change losses match the reference within this (relative), not bit for bit
INVARIANTS = ("finished", "no_committed_step_lost", "bit_identical", "fault_outcome", "corrupt_detected", "durable_verifies")


@dataclass(frozen=True)
class Injection:
    """A fault as the runner carried it out: what it hit (``target``: one line for the report),
    or why it could not (``error``); ``manager_replaced``: a killed manager had a successor
    holding a newer committed version by the end of the fault's window (manager faults only)."""

    fault: Fault
    target: str
    node: str | None = None
    error: str | None = None
    manager_replaced: bool | None = None
    moment: Moment = Moment.STEP  # when it really struck (a snapshot or flush may not have come)
    primer: bool = False  # a stage killed to start the recovery the next fault strikes during (not planned)


@dataclass
class TrialRun:
    """What the runner saw of one soaked run (metrics lines as the trainer keeps them)."""

    plan: TrialPlan
    injections: list[Injection]
    losses: dict[int, float]
    recoveries: Sequence[Mapping[str, Any]] = field(default_factory=list)  # the run's events (events.Recovery), or their lines
    drains: Sequence[Mapping[str, Any]] = field(default_factory=list)
    resizes: Sequence[Mapping[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # the run stopped with this error
    hung: str | None = None  # the trial's deadline passed: what the run was doing
    durable: str | None = None  # the run's newest durable checkpoint, verified (None: the run has no durable tier)
    durable_error: str | None = None  # why it did not verify (or was missing)
    failovers: list[dict[str, Any]] = field(default_factory=list)  # driver faults: fault_step, committed, source, step, seconds
    links: Sequence[Mapping[str, Any]] = field(default_factory=list)  # on the harness: the run's link_cut and straggler lines
    fenced: int = 0  # on the harness: calls and links of an older generation the stages refused (a healed partition's zombies)


@dataclass(frozen=True)
class Outcome:
    """What followed one fault: ``matched`` when it is what that kind of fault must cause."""

    matched: bool
    what: str
    sources: tuple[str, ...] = ()
    seconds: tuple[float, ...] = ()  # one per recovery (or drain) it caused
    committed_steps_lost: int = 0


def _window(fault: Fault, nxt: Fault | None, lines: Sequence[Mapping[str, Any]], first: int) -> list[Mapping[str, Any]]:
    """Lines whose step falls between ``fault`` and the next fault: recoveries name the failed
    step (``first`` = 1: after the fault's step), drains the step they followed (``first`` = 0)."""
    hi = nxt.step + first - 1 if nxt is not None else float("inf")
    return [x for x in lines if fault.step + first <= x["step"] <= hi]


def _per_recovery_seconds(recs: Sequence[Mapping[str, Any]]) -> tuple[float, ...]:
    """One duration per recovery (its lines, one per restored actor, share ``seconds``)."""
    by_step: dict[int, float] = {}
    for r in recs:
        by_step[r["step"]] = max(by_step.get(r["step"], 0.0), float(r["seconds"]))
    return tuple(round(s, 3) for s in by_step.values())


def judge_fault(inj: Injection, nxt: Fault | None, run: TrialRun) -> Outcome:
    """Match one injected fault with what the run did before the next fault. Pure."""
    f = inj.fault
    if inj.error is not None:
        return Outcome(False, f"not injected: {inj.error}")
    recs = [r for r in _window(f, nxt, run.recoveries, 1) if r.get("source") != "none"]
    lost = sum(int(r.get("committed_steps_lost", 0)) for r in recs if not fallback(r))
    mine = [r for r in recs if r.get("stage") == f.stage]
    sources = tuple(sorted({str(r["source"]) for r in recs}))
    secs = _per_recovery_seconds(recs)
    if f.kind is FaultKind.DRIVER:
        fo = next((x for x in run.failovers if x.get("fault_step") == f.step), None)
        if fo is None or "source" not in fo:
            return Outcome(False, "no driver was started in its place")
        secs = (fo["seconds"],) if fo.get("seconds") is not None else ()
        lost = max(0, int(fo["committed"] or 0) - int(fo["step"] or 0)) if fo["source"] == "memory" else int(fo["committed"] or 0)
        if fo["source"] != "memory":
            return Outcome(False, f"the new driver found no in-memory snapshot (step {fo['committed']} was committed): it went back to the durable tier",
                           ("durable",), secs, lost)
        if lost:
            return Outcome(False, f"resumed from step {fo['step']}, but step {fo['committed']} was committed", ("memory",), secs, lost)
        return Outcome(True, f"resumed from its committed in-memory snapshot of step {fo['step']}", ("memory",), secs)
    if f.kind is FaultKind.PAUSE:
        if recs:
            return Outcome(False, f"the paused stage was recovered as a death ({', '.join(sources)})", sources, secs, lost)
        return Outcome(True, "no recovery: the run waited for the straggler")
    if f.kind in (FaultKind.MANAGER, FaultKind.FLUSH):
        if not inj.manager_replaced:
            return Outcome(False, "no successor manager on the node held a newer committed snapshot", sources, secs, lost)
        return Outcome(True, "manager replaced, later snapshots committed" + (f"; recoveries: {', '.join(sources)}" if recs else ""), sources, secs, lost)
    if f.kind is FaultKind.DRAIN:  # node ids are never reused: its line may follow a rollback to before the fault's step
        drains = [d for d in run.drains if d.get("node") == inj.node]
        if not drains:
            return Outcome(False, "no drain line for the drained node", sources, secs, lost)
        d = drains[0]
        return Outcome(True, f"drained ({d.get('how')}: {d.get('moved')} moved, {d.get('dropped')} dropped)", sources,
                       tuple(round(float(x["seconds"]), 3) for x in drains) + secs, lost)
    if f.kind is FaultKind.ISOLATE_PAIR:
        cuts = [x for x in _window(f, nxt, run.links, 1) if x.get("event") == "link_cut"]
        if not cuts:
            return Outcome(False, "no link_cut line: the cut pair was not found", sources, secs, lost)
        if not recs:
            return Outcome(False, f"node {str(cuts[0]['set_aside'])[:12]} was set aside, but no stage was recovered", sources, secs, lost)
        return Outcome(True, f"node {str(cuts[0]['set_aside'])[:12]} set aside, its stages recovered from {', '.join(sources)}", sources, secs, lost)
    if f.kind is FaultKind.SLOW_LINK:  # the slow link stays to the trial's end: its straggler may be named after the next fault
        slow = [x for x in run.links if x.get("event") == "straggler" and x["step"] > f.step]
        if not slow:
            return Outcome(False, "no straggler line: the slow link was not told apart", sources, secs, lost)
        moved = [d for d in run.drains if d.get("node") == slow[0]["node"]]
        if not moved and nxt is not None and nxt.kind in (FaultKind.NODE, FaultKind.PARTITION, FaultKind.PARTITION_HEAL) and nxt.stage == f.stage \
                and nxt.step >= slow[0]["step"]:  # named, then the next fault took the same stage's node before the move's look
            return Outcome(True, f"straggler named at step {slow[0]['step']}; the next fault ({nxt.kind.value} of stage {f.stage}) took its node "
                                 "before its stages moved", sources, secs, lost)
        if not moved:
            return Outcome(False, f"straggler {str(slow[0]['node'])[:12]} named, but its stages were not moved off it", sources, secs, lost)
        return Outcome(True, f"straggler named at step {slow[0]['step']} (its links cost {slow[0]['share']:.0%} of a step), "
                             f"{moved[0].get('moved')} stages moved off it", sources, tuple(round(float(d["seconds"]), 3) for d in moved) + secs, lost)
    shrinks = [r for r in _window(f, nxt, run.resizes, 0) if r.get("to_dp", 0) < r.get("from_dp", 0)]
    if not mine and shrinks and f.kind in (FaultKind.STAGE, FaultKind.NODE):  # its replica was dropped, not restored
        return Outcome(True, f"its replica was dropped (width {shrinks[0]['from_dp']} -> {shrinks[0]['to_dp']})", sources, secs, lost)
    if not mine:
        return Outcome(False, f"no recovery line for stage {f.stage}" + (f" (recoveries of other stages: {', '.join(sources)})" if recs else ""), sources, secs, lost)
    if f.kind is FaultKind.CORRUPT and any(r["source"] == "local_smp" for r in mine):
        return Outcome(False, f"stage {f.stage} was restored from its corrupted local shard (source local_smp), not rebuilt", sources, secs, lost)
    lossy = " (lossy)" if any(r.get("lossless") is False for r in mine) else ""
    return Outcome(True, f"recovered from {', '.join(sorted({str(r['source']) for r in mine}))}{lossy}", sources, secs, lost)


def loss_diff(got: dict[int, float], want: dict[int, float], exact_until: int | None = None) -> str | None:
    """None when ``got`` equals ``want`` bit for bit (after step ``exact_until``, the first width
    change: within :data:`WIDTH_RTOL`); else the first difference. Pure."""
    missing = sorted(set(want) - set(got))
    if missing:
        return f"steps {missing[:5]} have no loss"
    for step in sorted(want):
        if exact_until is not None and step > exact_until:
            if abs(got[step] - want[step]) > WIDTH_RTOL * abs(want[step]):
                return (f"step {step} (after the width changed at step {exact_until}): loss {got[step]!r} vs {want[step]!r} "
                        f"in the reference, more than {WIDTH_RTOL:g} apart")
        elif got[step] != want[step]:
            return f"step {step}: loss {got[step]!r} vs {want[step]!r} in the reference"
    return None


def first_width_change(run: "TrialRun") -> int | None:
    """The step at which the run's data-parallel width first changed, if it did: from the next
    step on the global batch is summed over other replicas, in another order. Pure."""
    return min((int(r["step"]) for r in run.resizes if r.get("from_dp") != r.get("to_dp")), default=None)


def after_width_change(got: dict[int, float], want: dict[int, float], since: int | None) -> float | None:
    """The largest relative loss difference after step ``since`` (None: the width never changed). Pure."""
    if since is None:
        return None
    return max((abs(got[s] - want[s]) / abs(want[s]) for s in want if s > since and s in got and want[s]), default=0.0)


FALLBACKS = ("durable", "checkfree", "checkfree_plus")  # what serves beyond the parity budget


def fallback(recovery: Mapping[str, Any]) -> bool:
    """Whether a recovery line is a fall-back beyond the parity budget (the durable tier or a
    CheckFree rebuild: no in-memory copy survived, the line says why); the committed steps it
    undoes are counted apart from the budget's. Pure."""
    return str(recovery.get("source")) in FALLBACKS


def first_lossy(run: TrialRun) -> int | None:
    """The step of the run's first lossy (CheckFree) recovery, if any. Pure."""
    return min((int(r["step"]) for r in run.recoveries if r.get("lossless") is False), default=None)


def trim(reference: dict[int, float], run: TrialRun) -> dict[int, float]:
    """The reference's steps a trial must match: its planned steps and any it was lengthened by
    (a drain under way at its end), up to its first lossy recovery (beyond the parity budget a
    CheckFree rebuild is the right fall-back, and from then on its losses are its own); the
    reference may be longer. Pure."""
    last = max([run.plan.steps, *run.losses])
    lossy = first_lossy(run)
    if lossy is not None:
        last = min(last, lossy - 1)
    return {s: v for s, v in reference.items() if s <= last}


def judge_trial(run: TrialRun, reference: dict[int, float]) -> tuple[list[Outcome], list[dict[str, str]]]:
    """Each fault's outcome and the trial's failed invariants (``invariant`` and ``diagnosis``). Pure."""
    faults = [i.fault for i in run.injections]
    # a fault's window ends at the next fault struck after a later step (a fault struck during a
    # recovery shares its step, and its window, with the stage killed to start that recovery)
    later = [next((g for g in faults[k + 1 :] if g.step > f.step), None) for k, f in enumerate(faults)]
    outcomes = [judge_fault(inj, later[k], run) for k, inj in enumerate(run.injections)]
    failed: list[dict[str, str]] = []

    def fail(invariant: str, diagnosis: str) -> None:
        failed.append({"invariant": invariant, "diagnosis": diagnosis})

    if run.hung is not None:
        fail("finished", f"no end within the trial's deadline: {run.hung}")
    elif run.error is not None:
        fail("finished", f"the run stopped: {run.error}")
    lost = sum(int(r.get("committed_steps_lost", 0)) for r in run.recoveries if not fallback(r))
    lost += sum(o.committed_steps_lost for inj, o in zip(run.injections, outcomes) if inj.fault.kind is FaultKind.DRIVER)
    if lost:
        fail("no_committed_step_lost", f"recoveries undid {lost} committed steps")
    if run.hung is None and run.error is None:
        diff = loss_diff(run.losses, trim(reference, run), first_width_change(run))
        if diff is not None:
            fail("bit_identical", diff)
    for inj, out in zip(run.injections, outcomes):
        if not out.matched:
            fail("corrupt_detected" if inj.fault.kind is FaultKind.CORRUPT and inj.error is None else "fault_outcome", f"{inj.fault}: {out.what}")
    if run.durable_error is not None:
        fail("durable_verifies", run.durable_error)
    planned = len(run.plan.faults)
    struck = sum(1 for i in run.injections if not i.primer)
    if struck < planned and run.hung is None and run.error is None:
        fail("fault_outcome", f"{planned - struck} of {planned} planned faults were never injected")
    return outcomes, failed


def _seconds(values: list[float]) -> dict[str, float | None]:
    return {"median": round(statistics.median(values), 3) if values else None, "max": round(max(values), 3) if values else None}


def build_report(meta: dict[str, Any], reference: dict[int, float], runs: list[TrialRun]) -> dict[str, Any]:
    """``report.json``: per fault kind, overall totals, per trial its faults and outcomes, and
    every failed invariant with its diagnosis. ``meta``: the command's settings. Pure."""
    trials: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    kinds: dict[str, dict[str, Any]] = {}
    moments: dict[str, dict[str, int]] = {}
    if meta.get("aborted"):
        failures.append({"trial": runs[-1].plan.trial if runs else -1, "invariant": "finished", "diagnosis": f"the soak stopped: {meta['aborted']}"})
    for run in runs:
        outcomes, failed = judge_trial(run, reference)
        want = trim(reference, run)
        resized = first_width_change(run)
        identical = run.hung is None and run.error is None and loss_diff(run.losses, want, resized) is None
        failures += [{"trial": run.plan.trial, **x} for x in failed]
        faults = []
        for inj, out in zip(run.injections, outcomes):
            f = inj.fault
            faults.append({"kind": f.kind.value, "step": f.step, "stage": f.stage, "moment": inj.moment.value, "target": inj.target, "outcome": asdict(out)})
            k = kinds.setdefault(f.kind.value, {"injected": 0, "survived": 0, "sources": Counter(), "seconds": [], "committed_steps_lost": 0, "bit_identical": True})
            k["injected"] += inj.error is None
            k["survived"] += out.matched and run.hung is None and run.error is None
            k["sources"].update(out.sources)
            k["seconds"] += list(out.seconds)
            k["committed_steps_lost"] += out.committed_steps_lost
            k["bit_identical"] &= identical
            m = moments.setdefault(inj.moment.value, {"injected": 0, "survived": 0})
            m["injected"] += inj.error is None
            m["survived"] += out.matched and run.hung is None and run.error is None
        trials.append({
            "trial": run.plan.trial, "steps": run.plan.steps, "seconds": round(run.seconds, 3), "faults": faults,
            "recoveries": len({r["step"] for r in run.recoveries if r.get("source") != "none"}), "drains": len(run.drains), "resizes": len(run.resizes),
            "failovers": run.failovers, "fenced": run.fenced,
            "fallbacks": [{"step": r["step"], "source": r["source"], "reason": r.get("reason", "")} for r in run.recoveries if fallback(r)],
            "committed_steps_lost": sum(int(r.get("committed_steps_lost", 0)) for r in run.recoveries if not fallback(r))
            + sum(o.committed_steps_lost for inj, o in zip(run.injections, outcomes) if inj.fault.kind is FaultKind.DRIVER),
            "bit_identical": identical, "width_changed_at": resized,
            "rel_diff_after_width_change": after_width_change(run.losses, want, resized), "error": run.error, "hung": run.hung, "durable": run.durable, "durable_error": run.durable_error,
            "failed": [x["invariant"] for x in failed],
        })
    by_kind = {
        name: {"injected": k["injected"], "survived": k["survived"], "recovery_sources": dict(sorted(k["sources"].items())),
               "recover_s": _seconds(k["seconds"]), "committed_steps_lost": k["committed_steps_lost"], "bit_identical": k["bit_identical"]}
        for name, k in kinds.items()
    }
    totals = {
        "trials": len(runs),
        "trials_ok": sum(1 for t in trials if not t["failed"]),
        "injected": sum(k["injected"] for k in by_kind.values()),
        "survived": sum(k["survived"] for k in by_kind.values()),
        "committed_steps_lost": sum(t["committed_steps_lost"] for t in trials),
        "bit_identical_trials": sum(1 for t in trials if t["bit_identical"]),
        "lossy_recoveries": sum(1 for run in runs for r in run.recoveries if r.get("lossless") is False),
        "fallbacks": sum(len({r["step"] for r in run.recoveries if fallback(r)}) for run in runs),
        "fallback_committed_steps_lost": sum(int(r.get("committed_steps_lost", 0)) for run in runs for r in run.recoveries if fallback(r)),
    }
    diffs = [t["rel_diff_after_width_change"] for t in trials if t["rel_diff_after_width_change"] is not None]
    totals["rel_diff_after_width_change"] = max(diffs) if diffs else None
    totals["durable_verified_trials"] = sum(1 for t in trials if t["durable"] is not None and t["durable_error"] is None)
    totals["fenced"] = sum(run.fenced for run in runs)
    return {**meta, "ok": not failures, "failures": failures, "by_kind": by_kind, "by_moment": moments, "totals": totals, "trials": trials}


def _md_seconds(s: dict[str, float | None]) -> str:
    return "-" if s["median"] is None else f"{s['median']:.2f} / {s['max']:.2f}"


def render_markdown(report: dict[str, Any]) -> str:
    """``report.md``: the verdict, the per-kind table, totals, failures, then each trial. Pure."""
    t = report["totals"]
    lines = [
        f"# chaos soak of {report['config']}: {'all invariants held' if report['ok'] else 'INVARIANTS FAILED'}",
        "",
        f"seed {report['seed']}, {t['trials']} trials x {report['faults_per_trial']} faults of {', '.join(report['kinds'])}; "
        f"{t['injected']} injected, {t['survived']} survived, {t['committed_steps_lost']} committed steps lost, "
        f"{t['bit_identical_trials']}/{t['trials']} trials bit-identical to the reference"
        + (f" (up to their first width change, then within {WIDTH_RTOL:g}: largest difference {t['rel_diff_after_width_change']:.2g})"
           if t.get("rel_diff_after_width_change") is not None else "") + "; "
        f"{t.get('fallbacks', 0)} fall-backs beyond the parity budget (durable tier or CheckFree, "
        f"{t.get('fallback_committed_steps_lost', 0)} committed steps undone by them), {t.get('lossy_recoveries', 0)} lossy recoveries",
        "",
        "| fault | injected | survived | recovery sources | recover s (median / max) | committed steps lost | bit-identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, k in report["by_kind"].items():
        src = ", ".join(f"{s} x{n}" for s, n in k["recovery_sources"].items()) or "-"
        lines.append(f"| {name} | {k['injected']} | {k['survived']} | {src} | {_md_seconds(k['recover_s'])} | {k['committed_steps_lost']} | {'yes' if k['bit_identical'] else 'NO'} |")
    if report.get("by_moment"):
        lines += ["", "| struck during | injected | survived |", "|---|---|---|"]
        lines += [f"| {name} | {m['injected']} | {m['survived']} |" for name, m in report["by_moment"].items()]
    lines += ["", f"final durable checkpoint verified in {t.get('durable_verified_trials', 0)}/{t['trials']} trials; "
              f"{t.get('fenced', 0)} calls and links of an older generation refused (fenced)"]
    if report["failures"]:
        lines += ["", "## Failed invariants", ""] + [f"- trial {f['trial']}: **{f['invariant']}**: {f['diagnosis']}" for f in report["failures"]]
    lines += ["", "## Trials", ""]
    for tr in report["trials"]:
        state = "ok" if not tr["failed"] else "FAILED " + ", ".join(tr["failed"])
        lines.append(f"### trial {tr['trial']} ({tr['steps']} steps, {tr['seconds']:.1f} s): {state}")
        lines.append("")
        for f in tr["faults"]:
            at = f" (during a {f['moment']})" if f.get("moment", "step") != "step" else ""
            lines.append(f"- after step {f['step']}{at}: {f['kind']} -> {f['target']}: {f['outcome']['what']}")
        lines.append("")
    return "\n".join(lines)


def write_report(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))
