"""``elastic-llm status``: the runs on a Ray cluster, their stages, replicas, nodes, states,
snapshot versions and last recoveries, from Ray's state API and the actors' ``state()``.

Owns: finding a run's actors by their names (``run-<run>``, ``stage-<run>-<s>-<r>.<gen>``,
``smp-<run>-<node>``; the run id is what keeps two runs on one cluster apart), asking each for its
state with one deadline for all, and printing it as tables or one JSON object.
Never changes anything on the cluster: it only lists actors and calls their read-only ``state()``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, is_dataclass
from typing import Any

STATE_S = 10.0  # longest all actors together may take to answer state()
# run ids are 6 hex digits (the trainer's); stage-<run>-<stage>-<replica>.<generation>,
# standby-<run>-<node>.<n> (warm standbys, idle or adopted), smp-<run>-<node>[-<incarnation>]
NAME = re.compile(r"^(?:(?:stage-(?P<stage_run>[0-9a-f]{6})-\d+-\d+|standby-(?P<standby_run>[0-9a-f]{6})-[0-9a-f]+)\.\d+|smp-(?P<smp_run>[0-9a-f]{6})-[0-9a-f]+(?:-\d+)?|run-(?P<only>[0-9a-f]{6}))$")


class StatusError(RuntimeError):
    """The cluster cannot be asked, or the run asked for is not there; the message says why."""


def parse_name(name: str) -> tuple[str, str] | None:
    """(kind, run id) of one of our actor names: kind is ``stage``, ``standby``, ``smp`` or ``run``. Pure."""
    m = NAME.match(name or "")
    if m is None:
        return None
    if m["stage_run"]:
        return "stage", m["stage_run"]
    if m["standby_run"]:  # a warm standby: a stage actor without a stage until adopted (its state() says which)
        return "standby", m["standby_run"]
    return ("smp", m["smp_run"]) if m["smp_run"] else ("run", m["only"])


def _plain(x: Any) -> Any:
    """A state record as JSON-ready data (``asdict`` recurses into nested records)."""
    return asdict(x) if is_dataclass(x) and not isinstance(x, type) else x


def collect(api: str, run: str | None = None, timeout_s: float = STATE_S) -> dict[str, Any]:
    """Every elastic-llm run on the connected cluster (or only ``run``): its monitor's view, and
    each live actor with Ray's record of it (name, display name, node, pid) and its ``state()``
    (``None`` with ``problem`` when it did not answer within the deadline). ``api``: the
    connected cluster's dashboard (``http://host:port``), whose state API lists the actors."""
    import ray
    from ray.util.state import list_actors

    from elastic_llm.runtime.session import NAMESPACE

    rows = list_actors(address=api, filters=[("state", "=", "ALIVE"), ("ray_namespace", "=", NAMESPACE)], detail=True, limit=10_000, raise_on_missing_output=False)
    runs: dict[str, dict[str, Any]] = {}
    asks: dict[Any, dict[str, Any]] = {}
    for a in rows:
        parsed = parse_name(a.name)
        if parsed is None or (run is not None and parsed[1] != run):
            continue
        kind, rid = parsed
        entry = {"name": a.name, "display_name": a.repr_name or a.class_name, "actor_id": a.actor_id, "node_id": a.node_id, "pid": a.pid, "state": None}
        r = runs.setdefault(rid, {"run": rid, "status": None, "events": [], "stages": [], "standbys": [], "managers": []})
        handle = ray.get_actor(a.name, namespace=NAMESPACE)
        if kind in ("stage", "standby"):
            r["standbys" if kind == "standby" else "stages"].append(entry)
            asks[handle.state.options(concurrency_group="status").remote()] = entry
        elif kind == "smp":
            r["managers"].append(entry)
            asks[handle.state.remote()] = entry
        else:
            r["monitor"] = entry
            asks[handle.state.remote()] = entry
    ray.wait(list(asks), num_returns=len(asks), timeout=timeout_s)
    for ref, entry in asks.items():
        try:
            entry["state"] = _plain(ray.get(ref, timeout=0))
        except Exception as e:  # not answered in time, or the actor died meanwhile
            entry["problem"] = f"no state: {type(e).__name__}"
    for r in runs.values():
        adopted = [e for e in r["standbys"] if (e["state"] or {}).get("role") not in (None, "standby")]
        r["stages"] += adopted  # a standby that became a stage is listed as that stage
        r["standbys"] = [e for e in r["standbys"] if e not in adopted]
        view = r.get("monitor", {}).get("state")
        if view:
            r["status"], r["events"] = view["status"], view["events"]
        r["stages"].sort(key=lambda e: ((e["state"] or {}).get("replica", 0), (e["state"] or {}).get("stage", 0)))
        r["managers"].sort(key=lambda e: e["node_id"] or "")
    if run is not None and run not in runs:
        raise StatusError(f"no run {run} on this cluster: `elastic-llm status` without --run lists the runs there")
    return {"runs": sorted(runs.values(), key=lambda r: r["run"])}


def _mb(n: int | None) -> str:
    return "" if n is None else f"{n / 1e6:.1f} MB"


def render(report: dict[str, Any]) -> str:
    """The report as text: one block per run. Pure."""
    from tabulate import tabulate

    if not report["runs"]:
        return "no elastic-llm runs on this cluster"
    out = []
    for r in report["runs"]:
        s = r["status"]
        if s:
            line = f"run {r['run']}  {s['config']}  {s['state']}  step {s['step']}/{s['max_steps']}  width {s['width']} x {s['stages']} stages"
            if s["loss"] is not None:
                line += f"  loss {s['loss']:.3f}  {s['tokens_per_s']:.0f} tok/s"
            if s["committed_version"] is not None:
                line += f"  snapshot {s['committed_version']} (lag {s['step'] - s['committed_version']})"
                line += f"  erasure groups {s['erasure_groups_protected']}/{s['erasure_groups']} protected"
        else:
            line = f"run {r['run']}  (no monitor: the run is starting or ending)"
        out.append(line)
        stage_rows = []
        for e in r["stages"]:
            st = e["state"] or {}
            idle = st.get("role") == "standby"  # a warm standby: no stage yet
            stage_rows.append([
                "-" if idle else st.get("stage", "?"), "-" if idle else st.get("replica", "?"), st.get("role", ""), (e["node_id"] or "")[:12], e["pid"],
                st.get("step", e.get("problem", "")), st.get("snapshot_version", ""),
                "yes" if st.get("copy_in_flight") else "", _mb(st.get("bytes_held")), e["display_name"],
            ])
        if stage_rows:
            out.append(tabulate(stage_rows, ["stage", "replica", "role", "node", "pid", "step", "snapshot", "copying", "held", "actor"], tablefmt="simple"))
        if r.get("standbys"):
            where = ", ".join(f"{(e['node_id'] or '?')[:12]} (pid {e['pid']})" for e in r["standbys"])
            out.append(f"warm standbys: {len(r['standbys'])}: {where}")
        mgr_rows = []
        for e in r["managers"]:
            st = e["state"] or {}
            mgr_rows.append([
                (e["node_id"] or "")[:12], ",".join(map(str, st.get("versions", []))) or e.get("problem", ""), st.get("committed", ""),
                ",".join(map(str, st.get("pinned", []))), len(st.get("shards", [])), st.get("parity_regions", ""), _mb(st.get("bytes_held")),
            ])
        if mgr_rows:
            out.append(tabulate(mgr_rows, ["node", "versions", "committed", "pinned", "shards", "parity", "held"], tablefmt="simple"))
        recent = [e for e in r["events"] if e["kind"] in ("recovery", "resize", "drain", "failed")][-5:]
        if recent:
            out.append("last events:\n" + "\n".join(f"  step {e['step']}: {e['kind']}: {e['text']}" + (f" ({e['seconds']:.1f} s)" if e["seconds"] else "") for e in recent))
        out.append("")
    return "\n".join(out).rstrip()


def status(args: argparse.Namespace) -> int:
    import ray

    from elastic_llm.runtime.session import NAMESPACE, ClusterUnreachable, check_reachable

    try:
        check_reachable(args.address)
        ctx = ray.init(address=args.address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        err = e if isinstance(e, ClusterUnreachable) else ClusterUnreachable(args.address, str(e).splitlines()[0] if str(e) else type(e).__name__)
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        if not ctx.dashboard_url:
            raise StatusError("this Ray cluster runs no dashboard, whose state API lists the actors: start its head with the dashboard "
                              "(`ray start --head` with ray[default] installed; the default unless --include-dashboard=false)")
        url = ctx.dashboard_url
        report = collect(url if "://" in url else f"http://{url}", args.run)
    except StatusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        ray.shutdown()
    print(json.dumps(report) if args.json else render(report))
    return 0
