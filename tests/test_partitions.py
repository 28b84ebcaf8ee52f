"""Ray on the multi-host harness (elastic_llm.hosts): a cluster whose head, three worker nodes
and the driver each live on a host of their own, and a run whose node loses its link while it
trains, then gets it back. The driver is the real command line (``elastic-llm train``) on the
driver's host; its metrics file is the record. Skipped with the reason where namespaces cannot
be made here."""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time

import pytest

from elastic_llm.hosts.lab import Lab, unavailable

from .conftest import written_lines

WHY = unavailable(directional=True)
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"the multi-host harness cannot run here: {WHY}"), pytest.mark.timeout(400)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10
RUN_S = 300.0  # longest one training run on the lab may take
BASE = ("snapshot.every=1", "train.eval_every=1000")
# Ray's health checks declare a silent node dead after about 9 s (8 checks a second apart, each
# timing out after 1 s): the run's node watch suspects it after 3 probes timed out (about 2 s).
SLOW_HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 8, "health_check_timeout_ms": 1000}


@pytest.fixture(scope="module")
def hosts():
    from elastic_llm.runtime.lab_cluster import RayHosts

    with Lab.create() as lab:
        yield RayHosts(lab, system_config=SLOW_HEALTH).start(workers=3, cpus_per_node=1)


@pytest.fixture(scope="module")
def clean(hosts):
    """The losses of an undisturbed run on the same cluster."""
    return losses(train(hosts, "clean"))


def train(hosts, name: str, *overrides: str) -> list[dict]:
    return hosts.train(name, "jobs/tiny.yaml", STEPS, (*BASE, *overrides), timeout=RUN_S, cwd=REPO)


def train_healed(hosts, name: str, *overrides: str) -> tuple[list[dict], dict[tuple[int, int], str]]:
    """``train``, every link of the lab healed when it ends; its lines and where each actor started (node id)."""
    try:
        lines = train(hosts, name, *overrides)
    finally:
        for host in hosts.workers:
            hosts.lab.heal(host)
    start = next(ln for ln in lines if ln.get("event") == "start")
    return lines, {(a["stage"], a["replica"]): a["node_id"] for a in start["actors"]}


def losses(lines: list[dict]) -> dict[int, float]:
    """Each step's loss as the run ended with it (a replayed step's last line)."""
    return {ln["step"]: ln["loss"] for ln in lines if "loss" in ln and ln.get("event") is None}


RAY_CHECK = textwrap.dedent("""
    import json, os, ray
    import numpy as np
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
    from elastic_llm.runtime.session import start_ray
    from elastic_llm.config import load_config
    start_ray(load_config("jobs/tiny.yaml"), os.environ["ELASTIC_LLM_RAY"])

    @ray.remote(num_cpus=0)
    def where():
        return ray.util.get_node_ip_address()

    @ray.remote(num_cpus=0)
    def make(n):
        return np.full(n, 7, dtype=np.uint8)

    @ray.remote(num_cpus=0)
    def total(a):
        return int(a.sum())

    nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    on = lambda ip: {"scheduling_strategy": On(nodes[ip], soft=False)}
    ips = sorted(nodes)
    moved = ray.get(total.options(**on(ips[2])).remote(make.options(**on(ips[1])).remote(3_000_000)), timeout=60)
    print(json.dumps({"driver": ray.util.get_node_ip_address(), "ran_on": [ray.get(where.options(**on(ip)).remote(), timeout=60) for ip in ips],
                      "moved": moved, "fetched": int(ray.get(make.options(**on(ips[1])).remote(2_000_000), timeout=60).sum())}))
""")


def test_a_ray_head_and_workers_in_their_own_namespaces_form_one_cluster_and_a_stopped_node_takes_only_its_own(hosts):
    """The harness's own check: the head, the workers and the driver's node (each on a host of
    its own) are one cluster; tasks run on every node, objects move between hosts and to the
    driver; stopping a node kills its host's processes and no other's."""
    got = hosts.python(RAY_CHECK, timeout=150)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    ips = sorted(h.addr for h in hosts.lab.hosts.values())  # head, three workers, the driver's node
    assert out == {"driver": hosts.lab.hosts["d"].addr, "ran_on": ips, "moved": 3_000_000 * 7, "fetched": 2_000_000 * 7}
    before = {h: hosts.lab.pids(h) for h in hosts.lab.hosts}
    assert all(before.values())
    hosts.stop_node("w1")
    assert hosts.lab.pids("w1") == [] and all(set(before[h]) <= set(hosts.lab.pids(h)) for h in hosts.lab.hosts if h != "w1")
    hosts.replace("w1", 1)  # three workers again for the runs below


@pytest.mark.slow  # 2 minutes: its rule is tested without the harness (test_links) and the harness soak strikes isolate-pair
def test_two_workers_cut_from_each_other_only_set_one_side_aside_and_recover_once_without_flapping(hosts, clean):
    """The link between stage 1's node and stage 2's is cut both ways while step 5 runs; both
    nodes still reach the head, the driver and every other host (neither is a suspect). The
    stalled step has its nodes' links probed, the run sets one side of the cut aside (a
    ``link_cut`` line naming the pair) and recovers its stages elsewhere. The cut stays until the
    run ends: the side set aside gets nothing placed on it, so there is one recovery and no
    other (no flapping), the losses of an undisturbed run and no committed step lost."""
    lines, node = train_healed(hosts, "pair", "chaos.events=[{step: 5, kill: isolate, stage: 1}]")
    assert losses(lines) == clean
    [cut] = [ln for ln in lines if ln.get("event") == "link_cut"]
    assert cut["step"] == 5 and cut["pairs"] == [sorted([node[1, 0], node[2, 0]])] and cut["set_aside"] in (node[1, 0], node[2, 0]), (cut, node)
    assert not [ln for ln in lines if ln.get("event") == "node_suspect"]
    states = [ln for ln in lines if ln.get("event") == "state" and ln["new"] == "recovering"]
    assert len(states) == 1 and "NodeLost" in states[0]["reason"], states
    recoveries = [ln for ln in lines if ln.get("event") == "recovery"]
    moved = {s for s, n in node.items() if n == cut["set_aside"]}
    assert {(r["stage"], r["replica"]) for r in recoveries} == moved and all(r["committed_steps_lost"] == 0 and r["lossless"] for r in recoveries), recoveries


def test_a_partitioned_worker_is_rebuilt_elsewhere_bit_identically_and_its_zombies_are_refused_when_it_heals(hosts, clean):
    """Stage 1's node loses its link both ways while step 5 runs (the node and its processes
    live on). The run's node watch suspects it (a ``node_suspect`` line) before Ray's health
    checks declare it dead; the run rebuilds the stages of that node elsewhere from the last
    committed snapshot at a new link generation. The link heals while step 8 runs: the cut
    node's processes come back as zombies of the old generation, and its relay's step-5 plans
    reach the surviving stages, which refuse them (named in ``fenced`` lines) without touching
    their links (before the fence such a plan failed a survivor's next step). One recovery, none
    after the heal, the losses of an undisturbed run, no committed step lost."""
    metrics = hosts.lab.tmp / "cut.jsonl"
    seen: dict[str, object] = {}
    run_over = threading.Event()

    def heal_at_step_7() -> None:
        """Looks at the run's metrics every 0.1 s until step 7 is written (then heals), the run
        ends, or the run's own deadline passes."""
        deadline = time.monotonic() + RUN_S
        while not run_over.wait(0.1) and time.monotonic() < deadline:
            lines = written_lines(metrics)
            if any(json.loads(ln).get("step") == 7 and "loss" in ln for ln in lines):
                seen["cut"] = hosts.dead_workers()
                seen["pids"] = {h: hosts.lab.pids(h) for h in seen["cut"]}
                for name in hosts.workers:
                    hosts.lab.heal(name)
                return

    watcher = threading.Thread(target=heal_at_step_7, daemon=True)
    watcher.start()
    try:
        lines = train(hosts, "cut", "chaos.events=[{step: 5, kill: partition, stage: 1}]")
    finally:
        run_over.set()
        watcher.join(RUN_S)
    assert losses(lines) == clean and len(clean) == STEPS
    [cut_host] = seen["cut"]  # Ray declared the cut node dead by step 7 ...
    assert seen["pids"][cut_host]  # ... while its processes still ran, cut off
    cut = [ln for ln in lines if ln.get("event") == "chaos"]
    suspect = [ln for ln in lines if ln.get("event") == "node_suspect"]
    states = [ln for ln in lines if ln.get("event") == "state" and ln["new"] == "recovering"]
    assert [c["kill"] for c in cut] == ["partition"] and len(states) == 1 and states[0]["step"] < 7, states  # none after the heal
    assert len(suspect) == 1 and cut[0]["time"] < suspect[0]["time"] < states[0]["time"], (suspect, states)
    recoveries = [ln for ln in lines if ln.get("event") == "recovery"]
    assert {r["stage"] for r in recoveries} >= {1} and all(r["committed_steps_lost"] == 0 and r["lossless"] for r in recoveries)
    assert all(r["source"] in ("parity", "local_smp") for r in recoveries), recoveries
    fenced = [ln for ln in lines if ln.get("event") == "fenced"]
    assert all(ln["count"] == len(ln["what"]) for ln in fenced), fenced
    assert all("of link generation" in w for ln in fenced if ln.get("stage") is not None for w in ln["what"]), fenced  # a stage's: calls and links
    assert all("(membership at " in w for ln in fenced if ln.get("node") for w in ln["what"]), fenced  # a snapshot manager's: offers and plans


GROWS = ("model.n_layers=4", "parallel.stages=2", "parallel.dp=3", "elastic.min_replicas=1", "elastic.max_replicas=3", "elastic.grow_check_s=2",
         "parallel.cpus_per_actor=0.5", "snapshot.group_size=3", "recovery.standby=0")


@pytest.mark.slow  # 2-3 minutes: the partition and its fencing stay in the suite (above); this adds the heal, the rejoin and the growth
def test_a_healed_node_whose_zombies_ray_ended_rejoins_as_a_new_node_and_the_run_grows_back_onto_it(hosts):
    """Three replicas of two stages fill the three 1-CPU workers. Stage 1's node loses its link
    while step 4 runs: the run recovers on the two others at a smaller width. The link heals at
    step 8: Ray, which declared the node dead meanwhile, ends its processes (the zombies), and the
    host's Ray node starts again, a new node at the same address. The run grows back to three
    replicas, the new one on that node (the only one with room), with no committed step lost."""
    for name in hosts.dead_workers():
        hosts.replace(name, 1)
    metrics = hosts.lab.tmp / "grow.jsonl"
    seen: dict[str, object] = {}
    run_over = threading.Event()

    def heal_and_rejoin_at_step_8() -> None:
        deadline = time.monotonic() + RUN_S
        while not run_over.wait(0.2) and time.monotonic() < deadline:
            lines = written_lines(metrics)
            if any(json.loads(ln).get("step") == 8 and "loss" in ln for ln in lines):
                seen["cut"] = cut = hosts.dead_workers()
                for name in hosts.workers:
                    hosts.lab.heal(name)
                seen["healed_at"] = time.time()
                seen["left"] = [p for name in cut for p in hosts.rejoin(name, 1)]
                seen["rejoined_at"] = time.time()
                return

    watcher = threading.Thread(target=heal_and_rejoin_at_step_8, daemon=True)
    watcher.start()
    try:
        lines = hosts.train("grow", "jobs/tiny.yaml", 40, (*BASE, *GROWS, "chaos.events=[{step: 4, kill: partition, stage: 1}]"), timeout=RUN_S, cwd=REPO)
    finally:
        run_over.set()
        watcher.join(RUN_S)
    zombies = [p for p in seen.get("left", ["none seen"]) if "log_monitor.py" not in p]  # Ray leaves a dead node's log monitor running
    assert len(seen.get("cut", [])) == 1 and zombies == [], seen  # Ray ended the healed node's raylet, workers and actors itself
    recoveries = [ln for ln in lines if ln.get("event") == "recovery"]
    assert recoveries and all(r["committed_steps_lost"] == 0 for r in recoveries), recoveries
    resizes = [ln for ln in lines if ln.get("event") == "resize"]
    grown = [r for r in resizes if r["to_dp"] > r["from_dp"] and r["time"] > seen["rejoined_at"]]
    assert grown and grown[-1]["to_dp"] == 3, resizes
    widths = [ln["dp"] for ln in lines if ln.get("event") is None and "loss" in ln and "dp" in ln]
    assert widths and min(widths) < 3 and widths[-1] == 3, widths


@pytest.mark.slow  # 1.5 minutes: its rule and figures are also tested without the harness (test_links, test_bench_common)
def test_a_node_on_a_slow_link_is_reported_as_a_straggler_and_its_stages_move_off_it_like_a_drain(hosts, clean):
    """Stage 1's node gets a link of 20 Mbit/s each way while step 2 runs (the others keep the
    switch's full rate). Its links cost the slowest actor more than ``straggler_share`` of the
    step for ``straggler_steps`` steps: the measured rates name that node (a ``straggler`` line),
    and its stages move off it like a drain (state copied, nothing rolled back, no recovery).
    Afterwards the links cost the steps little again; the losses are an undisturbed run's."""
    for name in hosts.dead_workers():  # the partition test's cut node, ended by Ray once it healed: a new host takes its place
        hosts.replace(name, 1)
    lines, node = train_healed(hosts, "slow", "snapshot.every=4", "chaos.events=[{step: 2, kill: slow, stage: 1, mbit: 20}]")
    assert losses(lines) == clean
    [slow] = [ln for ln in lines if ln.get("event") == "straggler"]
    assert slow["node"] == node[1, 0] and slow["share"] > 0.25 and slow["node_mb_s"] < slow["fastest_mb_s"] / 2, slow
    [drain] = [ln for ln in lines if ln.get("event") == "drain"]
    assert drain["node"] == node[1, 0] and drain["moved"] == sum(1 for n in node.values() if n == node[1, 0]) and drain["rollback_steps"] == 0, drain
    assert not [ln for ln in lines if ln.get("event") == "recovery"]
    after = [ln for ln in lines[lines.index(drain):] if ln.get("event") is None]
    assert after and all(ln["link_share"] < 0.25 for ln in after), after
