"""Pure helpers every benchmark shares (`benchmarks/common.py`: the filesystem a path is on, the median) and the pure figures of single benchmarks."""

import pytest

from benchmarks.common import fs_type, median, mount_fs_type

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 259:1 / / rw,relatime shared:1 - ext4 /dev/root rw
30 27 0:30 / /tmp rw,nosuid shared:5 - tmpfs tmpfs rw,size=1024k
31 27 0:31 / /tmp/scratch rw master:7 - xfs /dev/sdb1 rw
32 27 0:32 / /mnt/my\\040disk rw - btrfs /dev/sdc1 rw
33 27 0:33 / /tmp rw - overlay overlay rw
"""


def test_the_longest_mount_above_a_path_names_its_filesystem_and_a_prefix_is_not_a_parent():
    assert mount_fs_type("/tmpfoo/x", MOUNTINFO) == "ext4"  # /tmp is not above /tmpfoo
    assert mount_fs_type("/tmp/scratch/run", MOUNTINFO) == "xfs"
    assert mount_fs_type("/tmp/scratchy", MOUNTINFO) == "overlay"
    assert mount_fs_type("/proc", MOUNTINFO) == "proc"
    assert mount_fs_type("/home", MOUNTINFO) == "ext4"


def test_a_later_mount_on_the_same_point_hides_the_earlier_and_escaped_spaces_are_read():
    assert mount_fs_type("/tmp/x", MOUNTINFO) == "overlay"
    assert mount_fs_type("/mnt/my disk/a", MOUNTINFO) == "btrfs"
    assert mount_fs_type("/x", "not a mount line\n") is None


def test_the_probe_reads_this_machines_mounts(tmp_path):
    kind = fs_type(str(tmp_path))
    assert kind is None or (isinstance(kind, str) and kind)


def test_one_median_for_every_benchmark_and_no_values_are_refused_unless_none_is_asked_for():
    assert median([3, 1, 2]) == 2.0 and median([4.0, 1.0, 3.0, 2.0]) == 2.5 and median(x for x in (5.0,)) == 5.0
    assert median([], or_none=True) is None
    with pytest.raises(ValueError, match="no values"):
        median([])


def test_the_peers_torch_optimizer_holds_the_stages_own_state_tensors_and_round_trips_through_torch_save(tmp_path):
    """``torch_adamw``: what the torch.save / DCP peers save is the stage's state itself (the same
    tensors, not a copy), and torch's load brings it back into another stage's view bit for bit."""
    import torch

    from benchmarks.common import torch_adamw
    from elastic_llm.config import load_config
    from elastic_llm.pipeline.optim import build_optimizer

    cfg = load_config("jobs/tiny.yaml", [])
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
    opt, sched = build_optimizer(a, cfg.train)
    a(torch.randn(3, 6)).sum().backward()
    opt.step()
    sched.step()
    view = torch_adamw(opt)
    for p in a.parameters():
        assert all(view.state[p][k] is opt.state[p][k] for k in ("step", "exp_avg", "exp_avg_sq"))
    assert [g["lr"] for g in view.param_groups] == [g["lr"] for g in opt.param_groups]
    torch.save({"optim": view.state_dict()}, tmp_path / "o.pt")
    theirs, _ = build_optimizer(b, cfg.train)
    other = torch_adamw(theirs)
    other.load_state_dict(torch.load(tmp_path / "o.pt", weights_only=True)["optim"])
    for p, q in zip(a.parameters(), b.parameters()):
        assert all(torch.equal(opt.state[p][k], other.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_the_exchange_alone_moves_a_holders_chunk_and_a_rebuilds_symbols_over_real_piece_servers_and_reports_ratios_to_its_socket():
    from benchmarks.exchange import exchange_alone
    from elastic_llm.snapshot import exchange

    r = exchange_alone(3_000_001, 2_000_000, 3, rounds=2)
    assert r["rebuild_bytes_moved"] == 9 * (2_000_000 // 3) and r["socket_buffer_bytes"] == exchange.SOCKET_BUF
    for what in ("holder", "rebuild"):
        assert r[f"{what}_GBps"] > 0 and r[f"{what}_socket_GBps"] > 0
        assert r[f"{what}_vs_socket"] == pytest.approx(r[f"{what}_GBps"] / r[f"{what}_socket_GBps"], rel=0.01)


def test_partitions_shot_figures_come_from_the_runs_own_lines():
    """bench partitions: detection from the fault's line to ``recovering``, lost time to the first
    step after the recovery less one steady step, step lines timed by the end line's clocks."""
    from benchmarks.partitions import shot_figures, steady_step_s

    t0 = 1000.0
    lines = [{"step": s, "loss": 1.0, "elapsed_s": float(s)} for s in range(1, 5)]  # steps 1..4 a second apart
    lines += [{"event": "chaos", "time": t0 + 4.2}, {"event": "state", "time": t0 + 7.2, "old": "running", "new": "recovering"},
              {"event": "recovery", "time": t0 + 9.0, "source": "parity", "committed_steps_lost": 0, "plan_s": 0.25, "actor_s": 1.5},
              {"event": "state", "time": t0 + 9.2, "old": "recovering", "new": "running"},
              {"event": "fenced", "time": t0 + 11.0, "count": 2, "what": ["a", "b"], "stage": 1, "replica": 0, "node": None},
              {"event": "fenced", "time": t0 + 11.5, "count": 3, "what": ["c", "d", "e"], "stage": None, "replica": None, "node": "n1"}]
    lines += [{"step": s, "loss": 1.0, "elapsed_s": float(s + 6)} for s in range(5, 8)]  # resumed: step 5 ends at 11 s
    lines.append({"event": "end", "time": t0 + 13.0, "elapsed_s": 13.0})
    assert steady_step_s(lines) == 1.0
    got = shot_figures(lines, 1.0)
    assert got == {"detect_s": 3.0, "recovering_s": 2.0, "lost_s": 5.8, "sources": ["parity"], "committed_steps_lost": 0,
                   "recoveries_after_fault": 1, "fenced": 5, "fenced_by": {"stages": 2, "managers": 3, "durable": 0},
                   "recovery_spans": {"plan_s": 0.25, "actor_s": 1.5}}


def test_partitions_slow_link_figures_split_the_steps_at_the_fault_the_straggler_line_and_the_drain():
    """bench partitions' slow-link shot: steps while slow run from the fault to the ``straggler``
    line, steps after from the ``drain`` line on; ratios against the steady step."""
    from benchmarks.partitions import slow_figures

    t0 = 1000.0
    ends = [1, 2, 4, 6, 8, 12, 13, 14, 15]  # steps 3-5 take 2 s (slow), step 6 holds the move, then 1 s again
    lines = [{"step": s + 1, "loss": 1.0, "elapsed_s": float(e)} for s, e in enumerate(ends)]
    lines += [{"event": "chaos", "time": t0 + 2.1}, {"event": "straggler", "time": t0 + 8.5, "share": 0.6, "node_mb_s": 2.0, "fastest_mb_s": 40.0},
              {"event": "drain", "time": t0 + 11.9, "seconds": 3.0, "moved": 2}, {"event": "end", "time": t0 + 15.0, "elapsed_s": 15.0}]
    got = slow_figures(lines, 1.0)
    assert got["step_s_slow"] == 2.0 and got["step_s_after"] == 1.0 and got["slow_vs_before"] == 2.0 and got["after_vs_before"] == 1.0
    assert got["named_after_s"] == 6.4 and got["move_s"] == 3.0 and got["moved"] == 2 and got["recoveries"] == 0 and got["node_mb_s"] == 2.0
