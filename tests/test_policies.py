"""The named recovery policies (``recovery.policy``): the anchors' behaviour as settings of the one
controller, their plans, their runs on the simulated runtime, and the cost a report gives.

Pure tests of the registry, the config, the plans and the price table, then each policy run by
the real controller on the same scripted simulated fleet (no Ray: seconds per test). The same
policies on a loopback Ray cluster are in tests/test_policies_cluster.py.
"""

from __future__ import annotations

import importlib
import json
import os

import pytest

from elastic_llm.cli import main
from elastic_llm.config import ConfigError, load_config
from elastic_llm.controller.states import Recovering, Resizing, check_transition, restart_after_resize
from elastic_llm.policies import POLICIES, names, named
from elastic_llm.recovery.failure import During
from elastic_llm.recovery.policy import Member, Observation, RecoveryPolicy, RollbackFrom, Source, restart_drops
from elastic_llm.replay.cost import PriceError, cost_fields, load_prices, node_hours, price_for, spot_dollars
from elastic_llm.replay.trace import ReplayAction, ReplayPlan
from elastic_llm.shape import count_parameters
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.sim.costs import load_costs
from elastic_llm.sim.runner import SimOptions, Simulation

from .conftest import REPO, events

pytestmark = pytest.mark.timeout(120)
MODULES = {"elastic-llm": "elastic_llm", "restart": "restart", "ray-train-elastic": "ray_train_elastic", "replica-group": "replica_group", "redundant": "redundant"}


def test_every_policy_module_says_what_it_models_what_it_leaves_out_and_where_its_parameters_come_from():
    assert set(names()) == set(MODULES)
    for name, module in MODULES.items():
        mod = importlib.import_module(f"elastic_llm.policies.{module}")
        assert mod.POLICY is POLICIES[name] and mod.POLICY.name == name
        doc = mod.__doc__ or ""
        for part in ("Models", "Leaves out", "Parameters"):
            assert part in doc, f"{module}: its opening does not say {part}"


def test_a_policy_puts_its_settings_into_the_config_and_the_default_changes_nothing():
    tiny = os.path.join(REPO, "jobs", "tiny.yaml")
    plain = load_config(tiny, ["parallel.dp=2", "elastic.min_replicas=1", "elastic.max_replicas=4"])
    assert load_config(tiny, ["parallel.dp=2", "elastic.min_replicas=1", "elastic.max_replicas=4", "recovery.policy=elastic-llm"]) == plain
    fixed = load_config(tiny, ["parallel.dp=2", "elastic.min_replicas=1", "elastic.max_replicas=4", "recovery.policy=restart"])
    assert (fixed.elastic.min_replicas, fixed.elastic.max_replicas, fixed.elastic.drains, fixed.recovery.standby) == (2, 2, False, 0)
    ray = load_config(tiny, ["parallel.dp=2", "elastic.min_replicas=1", "elastic.max_replicas=4", "recovery.policy=ray-train-elastic"])
    assert (ray.elastic.min_replicas, ray.elastic.max_replicas, ray.elastic.grow_check_s, ray.elastic.drains) == (1, 4, 60.0, False)
    assert named("ray-train-elastic").restart_all and named("ray-train-elastic").restart_on_resize
    assert named("replica-group").whole_replicas and not named("replica-group").restart_all
    assert load_config(tiny, ["parallel.stages=4", "recovery.policy=redundant"]).recovery.mode == "redundant"


def test_an_unknown_policy_is_refused_naming_the_known_ones(tmp_path, capsys):
    with pytest.raises(ConfigError, match="recovery.policy='bamboo' is unknown: use one of elastic-llm, restart, ray-train-elastic"):
        load_config(os.path.join(REPO, "jobs", "tiny.yaml"), ["recovery.policy=bamboo"])
    code = main(["simulate", "--config", os.path.join(REPO, "jobs", "tiny.yaml"), "--set", "recovery.policy=bamboo", "--nodes", "2", "--stages", "2",
                 "--replicas", "1", "--steps", "2", "--out", str(tmp_path)])
    assert code == 2 and "recovery.policy='bamboo' is unknown" in capsys.readouterr().err


def obs(dead=(), replicas=2, stages=2, durable=None, min_width=1, free_slots=None, restart_all=False, whole=False):
    """Members (stage, replica) on node n{replica}; ``dead`` lists (stage, replica) lost with node n{replica}."""
    members = tuple(Member(s, r, f"n{r}", (s, r) not in dead, None if (s, r) in dead else 5) for r in range(replicas) for s in range(stages))
    gone = frozenset(f"n{r}" for _, r in dead)
    return Observation(members, gone, gone, committed=None, min_width=min_width, free_slots=free_slots, durable=durable,
                       restart_all=restart_all, whole_replicas=whole)


def test_a_restart_policy_restarts_every_process_from_the_newest_durable_checkpoint_or_the_initial_state():
    plan = RecoveryPolicy().decide(obs(dead=[(1, 0)], durable=3, restart_all=True))
    assert plan.restart and plan.rollback_to == 3 and plan.rollback_from is RollbackFrom.DURABLE
    assert [(a.stage, a.replica, a.source) for a in plan.actions] == [(s, r, Source.DURABLE) for r in range(2) for s in range(2)]  # survivors too
    first = RecoveryPolicy().decide(obs(dead=[(1, 0)], restart_all=True))
    assert first.restart and first.rollback_to == 0 and first.rollback_from is RollbackFrom.INITIAL
    resize = RecoveryPolicy().decide(obs(durable=4, restart_all=True))  # nothing lost: a restart after a grow
    assert resize.restart and resize.rollback_to == 4 and len(resize.actions) == 4
    ladder = RecoveryPolicy().decide(obs(dead=[(1, 0)], durable=3))  # the default repairs the stage from its peer
    assert not ladder.restart and ladder.rollback_to is None and ladder.actions[0].source is Source.DP_PEER


def test_a_restart_in_a_width_range_drops_what_does_not_fit_and_a_fixed_width_waits_for_its_nodes():
    ranged = obs(dead=[(0, 1), (1, 1)], replicas=3, durable=2, free_slots=0, restart_all=True)
    assert restart_drops(ranged) == (1,)
    plan = RecoveryPolicy().decide(ranged)
    assert plan.drop_replicas == (1,) and plan.width == (3, 2) and plan.restart and plan.rollback_to == 2
    fixed = obs(dead=[(0, 1), (1, 1)], replicas=3, durable=2, free_slots=0, min_width=3, restart_all=True)
    assert restart_drops(fixed) == () and RecoveryPolicy().decide(fixed).drop_replicas == ()


def test_replica_group_takes_a_replica_with_a_lost_stage_out_whole_and_restarts_only_when_none_is_whole():
    plan = RecoveryPolicy().decide(obs(dead=[(0, 1)], replicas=3, durable=2, whole=True))
    assert plan.drop_replicas == (1,) and plan.width == (3, 2) and plan.rollback_to is None and plan.actions == () and not plan.restart
    assert "replica(s) [1] lost a stage and go out whole, 3 -> 2 replicas" in plan.reason and "replica-group" in plan.why_width
    every = RecoveryPolicy().decide(obs(dead=[(0, 0), (1, 1)], replicas=2, durable=2, whole=True))
    assert every.restart and every.rollback_to == 2 and every.rollback_from is RollbackFrom.DURABLE and every.drop_replicas == ()


def test_a_grow_under_ray_train_elastic_is_followed_by_a_restart_that_is_not_charged():
    state = restart_after_resize(7, 2, 3)
    check_transition(Resizing(6, 2, 3, "capacity"), state)
    assert isinstance(state, Recovering) and state.failure.during is During.RESIZE and state.failure.step == 7
    assert "2 -> 3" in state.failure.error and "not charged" in state.reason


def test_the_cost_counts_every_node_held_and_compares_with_an_on_demand_fleet_of_the_full_width():
    alive = ((0.0, 4), (1800.0, 2), (3600.0, 2))
    assert node_hours(alive, 3600.0) == pytest.approx(3.0)
    price = price_for(load_prices(), "gpu-a100")
    c = cost_fields(price, alive, 3600.0, committed_steps=100, tokens_per_step=1000, full_width_steps_per_s=0.05, full_width_nodes=4)
    assert c["spot_usd"] == pytest.approx(3.0 * price.spot_per_h, abs=0.01) and c["tokens"] == 100_000
    assert c["on_demand"]["usd"] == pytest.approx(4 * price.on_demand_per_h, abs=0.01) and c["on_demand"]["tokens"] == 180_000
    assert c["vs_on_demand"] == pytest.approx((100_000 / c["spot_usd"]) / (180_000 / c["on_demand"]["usd"]), rel=1e-3)


def test_a_traces_prices_replace_the_tables_spot_price_from_the_first_of_them_on():
    alive = ((0.0, 4), (1800.0, 2), (3600.0, 2))
    price = price_for(load_prices(), "gpu-a100")
    assert spot_dollars(price, alive, 3600.0, ((900.0, 10.0), (2700.0, 1.0))) == pytest.approx(
        (900 * 4 * price.spot_per_h + 900 * 4 * 10.0 + 900 * 2 * 10.0 + 900 * 2 * 1.0) / 3600)
    c = cost_fields(price, alive, 3600.0, 100, 1000, 0.05, 4, ((0.0, 2.0),))
    assert c["spot_usd"] == pytest.approx(3.0 * 2.0) and c["spot_price"] == "the trace's price column"
    assert cost_fields(price, alive, 3600.0, 100, 1000, 0.05, 4)["spot_price"] == "the price table"


def test_simulate_pays_a_priced_traces_spot_prices_and_refuses_a_negative_one(corpus_dir, tmp_path, capsys):
    """8 one-slot nodes for 600 s; the trace says 0.02 $/h, then 0.08 from 300 s on (and one node
    goes at 300 s): the fleet pays 8 x 300 s x 0.02 + 7 x 300 s x 0.08 (the table says 0.0315)."""
    lines = ["time_ms,event,node,price"] + [f"0,add,n{i},{'0.02' if i == 0 else ''}" for i in range(8)] + ["300000,remove,n7,0.08", "600000,add,n7,"]
    (tmp_path / "priced.csv").write_text("\n".join(lines) + "\n")
    args = ["simulate", "--config", os.path.join(REPO, "jobs", "spot-tiny.yaml"), "--set", f"data.dir={corpus_dir}", "--nodes", "8", "--stages", "4",
            "--replicas", "2", "--slots-per-node", "1", "--trace", str(tmp_path / "priced.csv"), "--cost", "cpu-2core"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    cost = json.loads((tmp_path / "out" / "replay.json").read_text())["cost"]
    assert cost["spot_price"] == "the trace's price column"
    assert cost["spot_usd"] == pytest.approx((8 * 300 * 0.02 + 7 * 300 * 0.08) / 3600, abs=0.005)
    (tmp_path / "neg.csv").write_text("\n".join(lines[:-1] + ["600000,add,n7,-0.08"]) + "\n")
    capsys.readouterr()
    assert main([*args, "--trace", str(tmp_path / "neg.csv"), "--out", str(tmp_path / "neg")]) == 2
    assert "neg.csv line 11: price '-0.08' is not a number of dollars per node-hour >= 0" in capsys.readouterr().err


def test_simulate_refuses_a_mode_it_does_not_model_naming_the_ones_it_does(tmp_path, capsys):
    args = ["simulate", "--config", os.path.join(REPO, "jobs", "spot-tiny.yaml"), "--nodes", "8", "--stages", "4", "--replicas", "2", "--steps", "2",
            "--set", "recovery.mode=checkfree", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "recovery.mode=checkfree: simulate models the lossless and redundant modes only" in capsys.readouterr().err


@pytest.mark.parametrize("table, message", [
    ("gpu-a100: {spot_per_h: -1, on_demand_per_h: 3}\n", "gpu-a100.spot_per_h=-1 is negative"),
    ("gpu-a100: {spot_per_h: 1, on_demand_per_h: cheap}\n", "gpu-a100.on_demand_per_h='cheap' must be a number"),
    ("gpu-a100: {spot_per_h: 1, on_demand_per_h: 2, zone: a}\n", "unknown field(s) ['zone']"),
    ("[1, 2]\n", "must map node types"),
    ("gpu-a100: {spot_per_h: 1\n", "is not valid YAML"),
])
def test_a_bad_price_table_is_refused_naming_the_entry(tmp_path, table, message):
    path = tmp_path / "prices.yaml"
    path.write_text(table)
    with pytest.raises(PriceError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_prices(path)


def test_a_price_table_without_the_runs_node_type_or_with_a_negative_price_exits_2_naming_it(tmp_path, capsys):
    (tmp_path / "cpu.yaml").write_text("cpu-2core: {spot_per_h: 0.03, on_demand_per_h: 0.1}\n")
    (tmp_path / "neg.yaml").write_text("gpu-a100: {spot_per_h: 1, on_demand_per_h: -2}\n")
    base = ["simulate", "--config", os.path.join(REPO, "jobs", "sim-fleet.yaml"), "--nodes", "16", "--stages", "64", "--replicas", "1", "--steps", "2",
            "--cost", "gpu-a100", "--out", str(tmp_path / "out")]
    assert main([*base, "--prices", str(tmp_path / "cpu.yaml")]) == 2
    assert "has no prices for node type 'gpu-a100' (it has cpu-2core)" in capsys.readouterr().err
    assert main([*base, "--prices", str(tmp_path / "neg.yaml")]) == 2
    assert "gpu-a100.on_demand_per_h=-2 is negative" in capsys.readouterr().err
    assert main(["bench", "anchors", "--prices", str(tmp_path / "neg.yaml")]) == 2
    assert "gpu-a100.on_demand_per_h=-2 is negative" in capsys.readouterr().err


# ---------------------------------------------------------------------- on the simulated runtime

NODES = [f"r{i}" for i in range(8)]
# r3 is reclaimed at 60 s with no notice; two nodes join at 200 s (room for the lost replica again)
ACTIONS = (ReplayAction(60.0, "remove", "r3"), ReplayAction(200.0, "add", "r8"), ReplayAction(200.0, "add", "r9"))


def simulate(corpus_dir, tmp_path, policy):
    cfg = load_config(os.path.join(REPO, "jobs", "spot-tiny.yaml"),
                      [f"data.dir={corpus_dir}", "parallel.dp=4", "elastic.max_replicas=4", "elastic.grow_check_s=2", f"recovery.policy={policy}"])
    alive = ((0.0, 8), (60.0, 7), (200.0, 9), (400.0, 9))
    plan = ReplayPlan(tuple(NODES), ACTIONS, 400.0, alive, alive)
    price = price_for(load_prices(), "cpu-2core")
    options = SimOptions(nodes=len(NODES), stages=4, replicas=4, slots_per_node=2, durable_every=1, price=price)
    report = Simulation(cfg, options, load_costs("cpu-2core"), plan).run(tmp_path)
    return report, events(tmp_path, "recovery"), events(tmp_path, "resize")


def test_each_policy_recovers_the_same_node_loss_as_the_system_it_models(corpus_dir, tmp_path):
    """One fleet of 8 two-slot nodes (4 stages x 4 replicas fill it), r3 reclaimed at 60 s, two
    nodes back at 200 s; a durable flush of every committed snapshot for every policy."""
    ours, ours_rec, ours_resize = simulate(corpus_dir, tmp_path / "ours", "elastic-llm")
    assert ours["failed"] is None and ours["committed_steps_lost"] == 0
    assert {r["source"] for r in ours_rec} <= {"dp_peer", "parity", "local_smp", "none"} and all(r["rollback_steps"] == 0 for r in ours_rec)

    restart, restart_rec, restart_resize = simulate(corpus_dir, tmp_path / "restart", "restart")
    assert restart["failed"] is None and restart_resize == []  # fixed width: it waited for its nodes
    assert restart_rec and {r["source"] for r in restart_rec} == {"durable"}
    assert restart["seconds_by_state"].get("waiting_for_capacity", 0) > 100  # 60 s -> 200 s without full width

    group, group_rec, group_resize = simulate(corpus_dir, tmp_path / "group", "replica-group")
    assert group["failed"] is None and group["committed_steps_lost"] == 0
    assert [(e["from_dp"], e["to_dp"]) for e in group_resize] == [(4, 3), (3, 4)]  # out whole, back by a peer copy once it fits
    assert all(r["source"] != "durable" and r["rollback_steps"] == 0 for r in group_rec)

    ray, ray_rec, ray_resize = simulate(corpus_dir, tmp_path / "ray", "ray-train-elastic")
    assert ray["failed"] is None
    assert [(e["from_dp"], e["to_dp"]) for e in ray_resize] == [(4, 3), (3, 4)]
    assert {r["source"] for r in ray_rec} == {"durable"}  # the failure restarted every process from the durable checkpoint ...
    grown = [r for r in ray_rec if "resize 3 -> 4" in r["failure"]]  # ... and so did the grow, all 16 of them
    assert len(grown) == 16 and len([r for r in ray_rec if "resize" not in r["failure"]]) == 12  # 3 replicas kept after the failure

    red, red_rec, red_resize = simulate(corpus_dir, tmp_path / "red", "redundant")
    assert red["failed"] is None and red["committed_steps_lost"] == 0 and all(r["rollback_steps"] == 0 for r in red_rec)
    assert [(e["from_dp"], e["to_dp"]) for e in red_resize] == [(4, 3), (3, 4)]  # no room for r3's two stages: out, back once it fits
    assert red["full_width_steps_per_s"] < ours["full_width_steps_per_s"] / 1.5  # every stage also trains its successor's copy

    for report in (ours, restart, group, ray, red):
        cost = report["cost"]
        assert cost["node_type"] == "cpu-2core" and cost["tokens"] == report["committed_steps"] * 16 * 128
        assert cost["node_hours"] == pytest.approx((60 * 8 + 140 * 7 + 200 * 9) / 3600, abs=1e-3)  # the same fleet bill for every policy
    assert ours["liveput"] > max(restart["liveput"], ray["liveput"])


def test_a_simulated_redundant_run_promotes_the_copy_where_a_node_held_one_stage(corpus_dir, tmp_path):
    """17 one-slot nodes (4 x 4 and one free): r3's stage is promoted from its predecessor's copy
    onto the free node, no rollback, at two stage states over the link."""
    cfg = load_config(os.path.join(REPO, "jobs", "spot-tiny.yaml"), [f"data.dir={corpus_dir}", "parallel.dp=4", "elastic.max_replicas=4", "recovery.policy=redundant"])
    nodes = tuple(f"r{i}" for i in range(17))
    alive = ((0.0, 17), (60.0, 16), (120.0, 16))
    plan = ReplayPlan(nodes, (ReplayAction(60.0, "remove", "r3"),), 120.0, alive, alive)
    costs = load_costs("cpu-2core")
    report = Simulation(cfg, SimOptions(nodes=17, stages=4, replicas=4, slots_per_node=1), costs, plan).run(tmp_path)
    rec = events(tmp_path, "recovery")
    assert report["failed"] is None and [(r["source"], r["rollback_steps"], r["lossless"]) for r in rec] == [("redundant", 0, True)]
    assert rec[0]["state_s"] == pytest.approx(2 * costs.stage_mb(count_parameters(cfg.model.shape()), 4) / costs.network_mb_s, rel=1e-3)


def test_elastic_llm_rolling_back_to_the_durable_checkpoint_drops_the_replicas_that_do_not_fit_instead_of_waiting():
    """Found by bench anchors (4 x 4 on one-slot nodes, the synthetic trace, no notice): a burst took
    stage 1 of both replicas and more nodes of an erasure group than parity covers. The plan rolled
    everyone back to the durable checkpoint at width 2 and waited for 3 slots that never came,
    while ray-train-elastic restarted at width 1. Every state comes from the checkpoint then, so
    the width shrinks to what fits."""
    members = tuple(Member(s, r, f"n{r}{s}", (s, r) not in {(1, 0), (0, 1), (1, 1)}, None if (s, r) in {(1, 0), (0, 1), (1, 1)} else 5)
                    for r in range(2) for s in range(2))
    gone = frozenset({"n01", "n10", "n11"})
    o = Observation(members, gone, gone, committed=5, shard_nodes=tuple((ShardKey(m.stage, m.replica), m.node) for m in members),
                    groups=(tuple(m.node for m in members),), parity=1, min_width=1, free_slots=1, free_nodes=(("x", 1),), durable=4)
    plan = RecoveryPolicy().decide(o)
    assert plan.rollback_from is RollbackFrom.DURABLE and plan.rollback_to == 4
    assert plan.drop_replicas == (1,) and plan.width == (2, 1) and [(a.stage, a.replica) for a in plan.actions] == [(1, 0)]
