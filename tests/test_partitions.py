"""Faults of the network on the multi-host harness (elastic_llm.hosts): a Ray cluster whose head,
three worker nodes and the driver each live on a host of their own, and a run whose node loses
its link while it trains. The driver is the real command line (``elastic-llm train``) on the
driver's host; its metrics file is the record. Skipped with the reason where namespaces cannot
be made here."""

from __future__ import annotations

import json
import os

import pytest

from elastic_llm.hosts.lab import Lab, unavailable

WHY = unavailable(directional=True)
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"the multi-host harness cannot run here: {WHY}"), pytest.mark.timeout(400)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10
BASE = ("snapshot.every=1", "train.eval_every=1000")
# Ray's health checks declare a silent node dead after about 9 s (8 checks a second apart, each
# timing out after 1 s): the run's node watch suspects it after 3 probes timed out (about 2 s).
SLOW_HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 8, "health_check_timeout_ms": 1000}


@pytest.fixture(scope="module")
def hosts():
    from elastic_llm.hosts.raynodes import RayHosts

    with Lab.create() as lab:
        yield RayHosts(lab, system_config=SLOW_HEALTH).start(workers=3, cpus_per_node=1)


def train(hosts, name: str, *overrides: str) -> list[dict]:
    return hosts.train(name, "jobs/tiny.yaml", STEPS, (*BASE, *overrides), cwd=REPO)


def losses(lines: list[dict]) -> dict[int, float]:
    """Each step's loss as the run ended with it (a replayed step's last line)."""
    return {ln["step"]: ln["loss"] for ln in lines if "loss" in ln and ln.get("event") is None}


def test_a_partitioned_worker_is_declared_dead_and_its_stages_rebuilt_elsewhere_bit_identically(hosts):
    """Stage 1's node loses its link both ways while step 5 runs (the node and its processes
    live on). The run's node watch suspects it (a ``node_suspect`` line) before Ray's health
    checks declare it dead; the run then rebuilds the stages of that node elsewhere from the
    snapshot of step 4, and ends with the losses of an undisturbed run, no committed step lost."""
    clean = losses(train(hosts, "clean"))
    lines = train(hosts, "cut", "chaos.events=[{step: 5, kill: partition, stage: 1}]")
    assert losses(lines) == clean and len(clean) == STEPS
    cut = [ln for ln in lines if ln.get("event") == "chaos"]
    suspect = [ln for ln in lines if ln.get("event") == "node_suspect"]
    recovering = next(ln for ln in lines if ln.get("event") == "state" and ln["new"] == "recovering")
    assert len(suspect) == 1 and cut[0]["time"] < suspect[0]["time"] < recovering["time"], (suspect, recovering)
    recoveries = [ln for ln in lines if ln.get("event") == "recovery"]
    assert [c["kill"] for c in cut] == ["partition"] and recoveries
    assert {r["stage"] for r in recoveries} >= {1} and all(r["committed_steps_lost"] == 0 and r["lossless"] for r in recoveries)
    assert all(r["source"] in ("parity", "local_smp") for r in recoveries), recoveries
    alive = json.loads(hosts.python("import ray, os, json; ray.init(address=os.environ['ELASTIC_LLM_RAY'], logging_level='ERROR');"
                                    "print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))", 60).stdout.splitlines()[-1])
    cut_host = next(h for h in hosts.workers if hosts.lab.hosts[h].addr not in alive)  # Ray declared the cut node dead
    assert len(alive) == 4 and hosts.lab.pids(cut_host)  # ... while its processes still run, cut off
