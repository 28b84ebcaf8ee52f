"""The controller's handlers on fakes: no Ray, milliseconds per test.

The Trainer runs on injected :class:`~elastic_llm.controller.parts.Parts`: a fake actor group
(placement can be refused), a fake step executor (steps fail as scripted), a fake recovery
(observes a lost actor and brings it back) and a fake elastic executor (draining nodes, room to
grow). Everything else is the real controller: its states, transitions, failure budget, data
stream, metrics lines.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from elastic_llm.config import ConfigError, load_config
from elastic_llm.controller.actor_group import CapacityUnavailable
from elastic_llm.controller.drains import Drain
from elastic_llm.controller.elastic import Evacuation, ResizeOutcome
from elastic_llm.controller.parts import Parts
from elastic_llm.controller.recovery import RecoveryOutcome
from elastic_llm.controller.states import Capacity
from elastic_llm.controller.trainer import RunFailed, RunUnrecoverable, Trainer
from elastic_llm.pipeline.executor import StepFailed, StepResult
from elastic_llm.recovery.policy import Member, Observation, UnrecoverableError
from elastic_llm.snapshot.records import ShardKey

from .conftest import REPO

pytestmark = pytest.mark.timeout(30)


class FakeGroup:
    def __init__(self, stages: int, width: int, refuse: int = 0) -> None:
        self.stages, self.width = stages, width
        self.refuse = refuse  # place() refuses this many times, then there is room
        self.actors: list[list[str]] = []
        self.ready: set[ShardKey] = set()
        self.nodes: dict[ShardKey, str] = {}
        self.pids: dict[ShardKey, int] = {}
        self.replaced: list[list[ShardKey]] = []

    def keys(self):
        return [ShardKey(s, r) for r in range(self.width) for s in range(self.stages)]

    def place(self):
        if self.refuse > 0:
            self.refuse -= 1
            raise CapacityUnavailable(self.capacity())

    def placed(self):
        if self.refuse > 0:
            self.refuse -= 1
            return False
        return True

    def capacity(self):
        return Capacity(need=f"{self.stages * self.width} x {{CPU: 0.5}}", have="0 CPUs free on 0 nodes")

    def spawn_all(self):
        self.actors = [[f"actor-{s}-{r}" for s in range(self.stages)] for r in range(self.width)]
        for k in self.keys():
            self.ready.add(k)
            self.nodes[k], self.pids[k] = f"node-{k.replica}", 1000 + k.stage

    def replace(self, keys):
        self.replaced.append(list(keys))
        self.ready |= set(keys)

    def members(self):
        return []

    def shutdown(self):
        pass


class FakeExecutor:
    """Steps succeed unless ``fails`` holds (step -> how many attempts fail, and who fails)."""

    def __init__(self, log: list, fails: dict[int, tuple[int, ShardKey]], width: int) -> None:
        self.log, self.fails, self.width = log, fails, width
        self.settled = 0

    def start(self, step, x, y, snapshot=None, faults=None):
        self.log.append(("start", step, x.copy(), self.width))
        return step

    def finish(self, step):
        left, key = self.fails.get(step, (0, None))
        if left > 0:
            self.fails[step] = (left - 1, key)
            raise StepFailed(RuntimeError(f"boom in step {step}"), key.stage, key.replica, "B1")
        return StepResult(loss=10.0 / step, grad_norms=[0.5, 0.25], lr=1e-3)

    def settle(self):
        self.settled += 1

    def eval_loss(self, x, y):
        return 1.0


class FakeRecovery:
    """Observes the failed actor as lost (the others at the step before) and replaces it."""

    def __init__(self, group: FakeGroup, unrecoverable: bool = False) -> None:
        self.group, self.unrecoverable = group, unrecoverable
        self.observed: list[int] = []

    def observe(self, executor, failed_step):
        executor.settle()
        self.observed.append(failed_step)
        lost = ShardKey(1, 1)
        members = tuple(Member(k.stage, k.replica, self.group.nodes[k], k != lost, None if k == lost else failed_step - 1) for k in self.group.keys())
        return Observation(members, frozenset(), frozenset(), None, min_width=1)

    def execute(self, plan, obs, step):
        if self.unrecoverable:
            raise UnrecoverableError("no copy of stage 1 survives")
        self.group.replace([ShardKey(a.stage, a.replica) for a in plan.actions])
        return RecoveryOutcome(plan, step, 0, tuple((ShardKey(a.stage, a.replica), a.source) for a in plan.actions), 0, None)


class FakeElastic:
    def __init__(self, group: FakeGroup, drain_after: int | None = None, grow_after: int | None = None) -> None:
        self.group = group
        self.drain_after, self.grow_after = drain_after, grow_after
        self.steps_seen = 0
        self.calls: list[str] = []

    def look(self, seen):
        self.steps_seen += 1
        if self.drain_after == self.steps_seen and "node-1" not in seen:
            return (Drain("node-1", None),), None
        if self.grow_after == self.steps_seen:
            return (), self.group.width + 1
        return (), None

    def grow(self):
        self.calls.append("grow")
        self.group.width += 1
        self.group.spawn_all()
        return ResizeOutcome(self.group.width - 1, self.group.width, 0.01, "capacity")

    def evacuate(self, nodes, deadline):
        self.calls.append(f"evacuate {sorted(nodes)}")
        self.group.width -= 1
        self.group.spawn_all()
        return Evacuation(0, 1, 0, self.group.width + 1, self.group.width, 0.01)


def make(corpus_dir, tmp_path, *extra, fails=None, refuse=0, unrecoverable=False, drain_after=None, grow_after=None):
    cfg = load_config(
        os.path.join(REPO, "jobs", "tiny.yaml"),
        [
            "snapshot.enabled=false", "train.eval_every=0", "parallel.stages=2", "parallel.dp=2",
            "train.batch_size=8", "model.seq_len=16", f"data.dir={corpus_dir}", "recovery.capacity_timeout_s=5",
            "checkfree.mirror_every=0",  # mirror refreshes are actor calls of their own (neighbours.py)
            *extra,
        ],
    )
    log: list = []
    group = FakeGroup(2, 2, refuse)
    executors: list[FakeExecutor] = []

    def make_executor(actors, c):
        executors.append(FakeExecutor(log, fails if fails is not None else {}, len(actors)))
        return executors[-1]

    parts = Parts(group, FakeRecovery(group, unrecoverable), FakeElastic(group, drain_after, grow_after), make_executor)
    t = Trainer(cfg, metrics_out=tmp_path / "metrics.jsonl", parts=parts)
    t.wait_poll_s = 0.001
    return t, log, group, executors, parts


def states(tmp_path):
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [(x["old"], x["new"]) for x in lines if x.get("event") == "state"]


def test_a_run_of_five_steps_sends_each_step_once_in_order(corpus_dir, tmp_path):
    t, log, _, executors, _ = make(corpus_dir, tmp_path)
    history = t.fit(5)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert [e[1] for e in log] == [1, 2, 3, 4, 5]
    assert len(executors) == 1  # one executor for an unchanged membership
    assert history[2]["loss"] == pytest.approx(10.0 / 3) and history[0]["grad_norm"] == 0.5
    assert states(tmp_path) == [("starting", "running"), ("running", "finished")]


def test_a_failed_step_is_recovered_and_retried_on_the_same_batch(corpus_dir, tmp_path):
    t, log, group, executors, parts = make(corpus_dir, tmp_path, fails={3: (1, ShardKey(1, 1))})
    history = t.fit(5)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    attempts = [e for e in log if e[1] == 3]
    assert len(attempts) == 2
    np.testing.assert_array_equal(attempts[0][2], attempts[1][2])  # the data stream was rewound
    assert parts.recovery.observed == [3]
    assert group.replaced == [[ShardKey(1, 1)]]
    assert executors[0].settled == 1 and len(executors) == 2  # a new executor over the new membership
    assert ("running", "recovering") in states(tmp_path) and ("recovering", "running") in states(tmp_path)
    rec = t.recoveries[0]
    assert (rec["stage"], rec["replica"], rec["source"]) == (1, 1, "dp_peer")
    assert rec["failure"] == "step 3, stage 1 replica 1 failed: RuntimeError: boom in step 3 (in B1)"


def test_the_same_failure_every_time_stops_after_the_retries_with_exit_4(corpus_dir, tmp_path):
    t, log, _, _, _ = make(corpus_dir, tmp_path, "recovery.max_retries_per_step=2", fails={2: (99, ShardKey(1, 1))})
    with pytest.raises(RunFailed) as err:
        t.fit(5)
    assert err.value.exit_code == 4
    assert "boom in step 2" in str(err.value)
    assert [e[1] for e in log] == [1, 2, 2, 2]  # the first attempt and two retries
    assert t.step == 1


def test_the_failure_budget_stops_the_run(corpus_dir, tmp_path):
    fails = {2: (1, ShardKey(1, 1)), 3: (1, ShardKey(1, 1)), 4: (1, ShardKey(1, 1))}
    t, _, _, _, _ = make(corpus_dir, tmp_path, "recovery.max_failures=2", fails=fails)
    with pytest.raises(RunFailed) as err:
        t.fit(6)
    assert err.value.exit_code == 4 and t.failures == 3 and t.step == 3


def test_an_unrecoverable_loss_fails_with_exit_3(corpus_dir, tmp_path):
    t, _, _, _, _ = make(corpus_dir, tmp_path, fails={2: (1, ShardKey(1, 1))}, unrecoverable=True)
    with pytest.raises(RunUnrecoverable) as err:
        t.fit(4)
    assert err.value.exit_code == 3 and "no copy of stage 1 survives" in str(err.value)


def test_a_source_found_gone_while_a_plan_is_carried_out_re_plans_without_charging_the_budget(corpus_dir, tmp_path):
    """The executor meets a source the plan named and finds it gone (a shard that fails its
    checksums on its node): it raises instead of picking another source itself; the controller
    observes again and plans anew. The run learnt something, it did not fail again: with no
    retries allowed per step, a charge would have stopped it."""
    from elastic_llm.sources import SourceLost

    t, _, group, _, parts = make(corpus_dir, tmp_path, "recovery.max_retries_per_step=1", fails={3: (1, ShardKey(1, 1))})
    carry_out = parts.recovery.execute
    met = []

    def execute(plan, obs, step):
        if len(met) < 2:  # two sources found gone, one after the other
            met.append(plan)
            raise SourceLost(f"source {len(met)} failed to load on its node")
        return carry_out(plan, obs, step)

    parts.recovery.execute = execute
    history = t.fit(5)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert parts.recovery.observed == [3, 3, 3]  # observed again after each
    assert t.budget.total == 1 and t.budget.of_step(3) == 1  # the step's failure alone
    assert group.replaced == [[ShardKey(1, 1)]]


def test_no_capacity_at_start_waits_then_runs(corpus_dir, tmp_path):
    t, _, group, _, _ = make(corpus_dir, tmp_path, refuse=3)
    history = t.fit(2)
    assert [h["step"] for h in history] == [1, 2]
    assert states(tmp_path)[:2] == [("starting", "waiting_for_capacity"), ("waiting_for_capacity", "starting")]


def test_capacity_that_never_comes_fails_at_the_deadline(corpus_dir, tmp_path):
    t, _, group, _, _ = make(corpus_dir, tmp_path, "recovery.capacity_timeout_s=0.05", refuse=10**9)
    with pytest.raises(RunFailed) as err:
        t.fit(2)
    assert "capacity" in str(err.value) and t.step == 0


def test_room_for_another_replica_grows_the_run_and_rebuilds_the_executor(corpus_dir, tmp_path):
    t, log, group, executors, parts = make(corpus_dir, tmp_path, "elastic.max_replicas=3", "train.batch_size=24", grow_after=3)  # looks: at the start, after step 1, after step 2
    t.fit(4)
    assert parts.elastic.calls == ["grow"]
    assert [e[3] for e in log] == [2, 2, 3, 3]  # steps 3 and 4 ran on three replicas
    assert len(executors) == 2
    assert [(r["from_dp"], r["to_dp"]) for r in t.resizes] == [(2, 3)]


def test_a_draining_node_is_evacuated_between_steps_without_rollback(corpus_dir, tmp_path):
    t, log, group, executors, parts = make(corpus_dir, tmp_path, drain_after=3)  # looks: at the start, after step 1, after step 2
    history = t.fit(4)
    assert parts.elastic.calls == ["evacuate ['node-1']"]
    assert [h["step"] for h in history] == [1, 2, 3, 4]  # nothing replayed
    assert [e[3] for e in log] == [2, 2, 1, 1]
    assert t.drains[0]["rollback_steps"] == 0 and len(executors) == 2
    assert ("running", "draining") in states(tmp_path)


def test_injected_parts_refuse_snapshots(corpus_dir, tmp_path):
    cfg = load_config(os.path.join(REPO, "jobs", "tiny.yaml"), [f"data.dir={corpus_dir}"])
    group = FakeGroup(4, 1)
    with pytest.raises(ConfigError, match="snapshot.enabled=false"):
        Trainer(cfg, parts=Parts(group, FakeRecovery(group), FakeElastic(group), lambda a, c: FakeExecutor([], {}, 1)))


def test_an_open_ended_run_shows_its_steps_without_a_total(corpus_dir, tmp_path):
    import io

    from elastic_llm.controller.progress import ProgressBar
    from elastic_llm.controller.trainer import UNTIL_STOPPED

    t, *_ = make(corpus_dir, tmp_path)
    out = io.StringIO()  # not a terminal: plain lines
    t.bar = ProgressBar(True, "tiny", stream=out)
    history = t.fit(UNTIL_STOPPED, on_step=lambda r: t.request_stop() if r["step"] == 3 else None)
    assert [h["step"] for h in history] == [1, 2, 3]
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["tiny: step 1", "tiny: step 3"] and str(UNTIL_STOPPED) not in out.getvalue()
