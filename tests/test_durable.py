"""The durable checkpoint format without Ray: real stage workers, real files, a real S3 API.

Checkpoints here are written with the product's own pieces (``stage_tensors``, ``write_shard``,
``make_manifest``, ``commit``) from in-process :class:`StageWorker` s after real optimizer steps,
and read back through ``StageWorker.load_durable`` (what a stage actor runs), so a round trip is
checked bit for bit without a cluster; the flush through snapshot managers is in
``test_durable_cluster.py``.
"""

import json
import os
import pickle

import numpy as np
import pytest
import torch

from elastic_llm import cadence
from elastic_llm.config import ConfigError, load_config
from elastic_llm.durable import format as fmt
from elastic_llm.durable.flush import stage_tensors
from elastic_llm.durable.restore import check_fits
from elastic_llm.durable.storage import Storage
from elastic_llm.model import stage_layer_range
from elastic_llm.pipeline.stage import StageWorker
from elastic_llm.recovery.policy import Member, Observation, RecoveryPolicy
from elastic_llm.snapshot.records import ShardKey
from tests.test_data_s3 import s3  # noqa: F401  (moto's S3 server on 127.0.0.1, module scope)

pytestmark = pytest.mark.timeout(120)

SMALL = ["model.dim=64", "model.n_heads=4", "model.n_layers=4", "model.seq_len=16", "train.batch_size=4", "parallel.microbatches=1", "train.warmup_steps=1"]


def config(stages=2, extra=()):
    return load_config("jobs/tiny.yaml", SMALL + [f"parallel.stages={stages}", *extra])


def trained_workers(cfg, steps=2):
    """Every stage of one pipeline after ``steps`` real optimizer steps on random tokens."""
    n = cfg.parallel.stages
    workers = [StageWorker(cfg, s, 0) for s in range(n)]
    g = np.random.default_rng(0)
    for _ in range(steps):
        x = g.integers(0, 256, (4, 16))
        y = g.integers(0, 256, (4, 16))
        for mb in range(1):
            h = x
            for w in workers[:-1]:
                h = w.forward(mb, h)
            workers[-1].forward(mb, h, y)
            grad = None
            for w in reversed(workers):
                grad = w.backward(mb, grad)
        for w in workers:
            w.step()
    return workers


def write_checkpoint(run, cfg, workers, step, position=None):
    """A committed checkpoint of ``workers`` through the product's writer and commit."""
    parts, states = [], []
    for w in workers:
        buf, manifest = w.capture_state({"epoch": 0, "index": 7} if position is None else position)
        layers = list(stage_layer_range(cfg.model.n_layers, cfg.parallel.stages, w.stage))
        tensors = stage_tensors(manifest, layers)
        rel = f"{fmt.checkpoint_dir(step)}/{fmt.shard_file(w.stage, 0)}"
        run.makedirs(fmt.checkpoint_dir(step))
        nbytes, records = fmt.write_shard(run, rel, tensors, lambda lo, hi, buf=buf: iter([buf[lo:hi]]), {"format": "pt"})
        parts.append(fmt.PartResult(w.stage, 0, fmt.shard_file(w.stage, 0), nbytes, 0.0, records))
        states.append((w.stage, 0, manifest))
    fmt.commit(run, fmt.checkpoint_dir(step), fmt.make_manifest(cfg, step, "run", states, parts, None))
    return fmt.checkpoint_dir(step)


def state_bytes(w):
    buf, _ = w.capture_state()
    return buf.copy()


@pytest.fixture(scope="module")
def trained():
    cfg = config()
    return cfg, trained_workers(cfg)


def test_round_trip_local_bit_identical_and_ray_train_compatible(trained, tmp_path):
    cfg, workers = trained
    run = Storage(str(tmp_path / "run"))
    name = write_checkpoint(run, cfg, workers, 2)
    assert fmt.open_checkpoint(str(tmp_path / "run")).name == name
    summary = fmt.open_checkpoint(str(tmp_path / "run" / name)).verify()
    assert summary["ok"] and summary["tensors"] == sum(len(w.arena.layout.entries) for w in workers)
    for w in workers:
        fresh = StageWorker(cfg, w.stage, 0)
        assert not np.array_equal(state_bytes(fresh), state_bytes(w))
        assert fresh.load_durable(run.uri, name) == 2
        np.testing.assert_array_equal(state_bytes(fresh), state_bytes(w))
        assert fresh.scheduler.state_dict()["last_epoch"] == w.scheduler.state_dict()["last_epoch"]
    from safetensors import safe_open  # the shards are plain safetensors files

    with safe_open(str(tmp_path / "run" / name / fmt.shard_file(1, 0)), framework="pt") as f:
        assert "param/layers.3.mlp.w_down.weight" in f.keys() and "param/head.weight" in f.keys()
    import ray.train

    ckpt = ray.train.Checkpoint.from_directory(str(tmp_path / "run" / name))
    with ckpt.as_directory() as d:
        assert sorted(os.listdir(d)) == sorted(os.listdir(tmp_path / "run" / name))


def test_round_trip_through_s3(trained, s3):  # noqa: F811
    cfg, workers = trained
    _, query = s3
    uri = f"s3://corpus/ckpts/run?{query}"
    run = Storage(uri)
    name = write_checkpoint(run, cfg, workers, 2)
    assert [e.step for e in fmt.list_checkpoints(run) if e.committed] == [2]
    assert fmt.open_checkpoint(uri).verify()["ok"]
    for w in workers:
        fresh = StageWorker(cfg, w.stage, 0)
        assert fresh.load_durable(uri, name) == 2
        np.testing.assert_array_equal(state_bytes(fresh), state_bytes(w))


def test_another_stage_count_takes_its_layers_by_global_name(trained, tmp_path):
    cfg, workers = trained  # 2 stages of 2 layers
    run = Storage(str(tmp_path))
    name = write_checkpoint(run, cfg, workers, 2)
    one = config(stages=1)
    whole = StageWorker(one, 0, 0)
    whole.load_durable(run.uri, name)
    theirs = {f"layers.{w.module.layer_ids[int(n.split('.')[1])]}.{n.split('.', 2)[2]}" if n.startswith("layers.") else n: p
              for w in workers for n, p in w.module.named_parameters()}
    mine = dict(whole.module.named_parameters())
    assert set(mine) == set(theirs)
    for n, p in mine.items():
        assert torch.equal(p, theirs[n]), n
        assert torch.equal(whole.optimizer.state[p]["exp_avg"], next(w.optimizer.state[q]["exp_avg"] for w in workers for m, q in w.module.named_parameters() if q is theirs[n]))


def corrupt(path, at=None, flip=True):
    data = bytearray(path.read_bytes())
    i = len(data) - 10 if at is None else at
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_missing_manifest_foreign_and_pickle_are_refused(trained, tmp_path):
    cfg, workers = trained
    run = Storage(str(tmp_path))
    name = write_checkpoint(run, cfg, workers, 2)
    d = tmp_path / name
    fresh = StageWorker(cfg, 1, 0)
    assert fresh.load_durable(run.uri, name) == 2  # a stage holding trained state from here on
    before = state_bytes(fresh)
    new = StageWorker(cfg, 1, 0)

    corrupt(d / fmt.shard_file(1, 0))  # a flipped byte in tensor data
    with pytest.raises(fmt.DurableError, match="fails its CRC-32"):
        fresh.load_durable(run.uri, name)
    np.testing.assert_array_equal(state_bytes(fresh), before)  # nothing loaded
    assert fresh.step_count == 2
    with pytest.raises(fmt.DurableError, match="fails its CRC-32"):
        new.load_durable(run.uri, name)  # a new stage reads straight into its state: refused, it has no step
    assert new.step_count == -1 and new.info().step == -1
    with pytest.raises(fmt.DurableError, match="fails its CRC-32"):
        fmt.open_checkpoint(str(d)).verify()

    crafted = tmp_path / "ran"  # a shard that would run code if it were unpickled

    class Evil:
        def __reduce__(self):
            return (open, (str(crafted), "w"))

    (d / fmt.shard_file(1, 0)).write_bytes(pickle.dumps({"param/head.weight": Evil()}))
    with pytest.raises(fmt.DurableError, match="not a safetensors file.*without running or unpickling"):
        fresh.load_durable(run.uri, name)
    assert not crafted.exists()

    other = config(extra=["model.dim=32"])  # a manifest of another model
    with pytest.raises(fmt.DurableError, match="another model.*model.dim: 64 there, 32 here"):
        check_fits(fmt.open_checkpoint(str(d)), other)
    assert check_fits(fmt.open_checkpoint(str(d)), config(extra=["train.lr=0.1"]))  # other settings: a warning only

    (d / fmt.MANIFEST).unlink()
    with pytest.raises(fmt.DurableError, match="no manifest.json"):
        fmt.open_checkpoint(str(d))
    (d / fmt.MARKER).unlink()
    with pytest.raises(fmt.DurableError, match="holds no committed checkpoint|never committed"):
        fmt.open_checkpoint(str(tmp_path))


def test_a_restore_reads_into_the_stage_only_what_its_header_and_manifest_agree_on(trained, tmp_path):
    """The restore reads tensors from their files straight into the stage's buffer, so the
    safetensors header is checked first: a truncated copy, a header whose offsets point past the
    file and a header that renames a tensor are each refused by name, and nothing is loaded."""
    cfg, workers = trained
    run = Storage(str(tmp_path))
    name = write_checkpoint(run, cfg, workers, 2)
    shard = tmp_path / name / fmt.shard_file(1, 0)
    good = shard.read_bytes()
    fresh = StageWorker(cfg, 1, 0)
    before = state_bytes(fresh)
    n = int(np.frombuffer(good[:8], "<u8")[0])
    header = json.loads(good[8 : 8 + n])

    def with_header(h):
        text = json.dumps(h, separators=(",", ":")).encode().ljust(n)
        assert len(text) == n
        return good[:8] + text + good[8 + n :]

    shard.write_bytes(good[:-100])  # a copy that stopped early
    with pytest.raises(fmt.DurableError, match="bytes, the manifest says .*truncated or replaced"):
        fresh.load_durable(run.uri, name)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    far = json.loads(json.dumps(header))
    far[last]["data_offsets"][1] += 10**6
    shard.write_bytes(with_header(far))
    with pytest.raises(fmt.DurableError, match=r"not a safetensors file \(tensor .*data_offsets .* lie outside the file\)"):
        fresh.load_durable(run.uri, name)
    renamed = {("param/evil" if k == last else k): v for k, v in header.items()}
    shard.write_bytes(with_header(renamed))
    with pytest.raises(fmt.DurableError, match="holds tensor 'param/evil', which the manifest does not list there: foreign file"):
        fresh.load_durable(run.uri, name)
    np.testing.assert_array_equal(state_bytes(fresh), before)  # nothing loaded
    shard.write_bytes(good)
    assert fresh.load_durable(run.uri, name) == 2
    np.testing.assert_array_equal(state_bytes(fresh), state_bytes(workers[1]))


def test_edited_manifest_and_uncommitted_directories_are_not_trusted(trained, tmp_path):
    cfg, workers = trained
    run = Storage(str(tmp_path))
    write_checkpoint(run, cfg, workers, 2)
    name = write_checkpoint(run, cfg, workers, 4)
    m = json.loads((tmp_path / name / fmt.MANIFEST).read_text())
    m["step"] = 40
    (tmp_path / name / fmt.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(fmt.DurableError, match="does not match its commit marker"):
        fmt.Checkpoint(run, name)
    assert fmt.open_checkpoint(str(tmp_path)).step == 2  # the damaged newest one is skipped
    (tmp_path / "checkpoint_00000006").mkdir()  # a flush that never finished
    (tmp_path / "checkpoint_00000006" / fmt.shard_file(0, 0)).write_bytes(b"partial")
    entries = {e.step: e.committed for e in fmt.list_checkpoints(run)}
    assert entries == {2: True, 4: False, 6: False}


def test_prune_keeps_the_newest_committed_and_removes_partials(trained, tmp_path):
    cfg, workers = trained
    run = Storage(str(tmp_path))
    for step in (1, 2, 3):
        write_checkpoint(run, cfg, workers[:1], step)
    (tmp_path / "checkpoint_00000000").mkdir()  # partial, older than the newest committed
    (tmp_path / "checkpoint_00000009").mkdir()  # partial, newer: a flush in progress
    gone = fmt.prune(run, keep_last=1)
    assert sorted(gone) == ["checkpoint_00000000", "checkpoint_00000001", "checkpoint_00000002"]
    assert [e.step for e in fmt.list_checkpoints(run)] == [3, 9]
    assert fmt.prune(run, keep_last=1) == []


def test_cadence_policies():
    assert cadence.snapshot_every(cost_s=0.02, step_s=1.0, max_overhead_pct=2) == 1
    assert cadence.snapshot_every(cost_s=0.5, step_s=0.25, max_overhead_pct=2) == 100
    assert cadence.snapshot_every(cost_s=0.0501, step_s=1.0, max_overhead_pct=2) == 3
    assert cadence.snapshot_every(cost_s=1e9, step_s=1.0, max_overhead_pct=2) == cadence.MAX_SNAPSHOT_EVERY
    assert cadence.young_daly_s(cost_s=2.0, mtbf_s=3600) == pytest.approx(120.0)
    assert cadence.flush_every(interval_s=120.0, snapshot_every=2, step_s=0.5) == 120
    assert cadence.flush_every(interval_s=0.1, snapshot_every=1, step_s=0.5) == 1
    assert cadence.mtbf_s(elapsed_s=600, failures=3, prior_s=86400) == 200
    assert cadence.mtbf_s(elapsed_s=600, failures=0, prior_s=86400) == 86400


def lost_beyond_parity(durable):
    members = tuple(Member(s, 0, f"n{s}", s not in (1, 3), None if s in (1, 3) else 10) for s in range(4))
    return Observation(
        members, frozenset({"n1", "n3"}), frozenset({"n1", "n3"}), committed=10,
        shard_nodes=tuple((ShardKey(s, 0), f"n{s}") for s in range(4)), groups=(("n0", "n1", "n2", "n3"),), parity=1,
        mirrors=True, durable=durable,
    )


def test_policy_rolls_back_to_the_durable_checkpoint_before_checkfree():
    plan = RecoveryPolicy().decide(lost_beyond_parity(durable=6))
    assert plan.rollback_to == 6 and plan.rollback_from == "durable"
    assert [(a.stage, a.source) for a in plan.actions] == [(1, "durable"), (3, "durable")]
    assert "parity covers 1" in plan.reason and "durable checkpoint of step 6" in plan.reason
    plan = RecoveryPolicy().decide(lost_beyond_parity(durable=None))
    assert {a.source for a in plan.actions} == {"checkfree", "checkfree_plus"} and plan.rollback_to is None  # stage 3 is the last: CheckFree+ rule


def test_durable_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="durable.every='often' must be an integer >= 1"):
        load_config("jobs/tiny.yaml", ["durable.every=often"])
    with pytest.raises(ConfigError, match="durable.keep_last=0 must be >= 1"):
        load_config("jobs/tiny.yaml", ["durable.keep_last=0"])
    with pytest.raises(ConfigError, match="durable.storage_path is set but the run takes no snapshots"):
        load_config("jobs/tiny.yaml", ["durable.storage_path=/tmp/x", "recovery.mode=checkfree"])
    with pytest.raises(ConfigError, match="snapshot.every='sometimes' must be an integer >= 1 or auto"):
        load_config("jobs/tiny.yaml", ["snapshot.every=sometimes"])
    assert load_config("jobs/tiny.yaml", ["snapshot.every=auto", "durable.every=auto"]).snapshot.every == "auto"


def test_storage_refuses_an_unknown_scheme():
    from elastic_llm.durable.storage import StorageError

    with pytest.raises(StorageError, match="cannot be opened.*s3://bucket/dir"):
        Storage("nosuchscheme://bucket/x")


def test_cli_checkpoints_list_verify_and_bad_resume(trained, tmp_path, capsys):
    from elastic_llm.cli import main

    cfg, workers = trained
    run = Storage(str(tmp_path / "run"))
    write_checkpoint(run, cfg, workers, 1)
    name = write_checkpoint(run, cfg, workers, 2)
    assert main(["checkpoints", "list", str(tmp_path / "run")]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["step"], e["committed"]) for e in listed] == [(1, True), (2, True)]
    assert main(["checkpoints", "verify", str(tmp_path / "run")]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    corrupt(tmp_path / "run" / name / fmt.shard_file(0, 0))
    assert main(["checkpoints", "verify", str(tmp_path / "run")]) == 2
    assert "fails its CRC-32" in capsys.readouterr().err
    assert main(["checkpoints", "list", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing"), "--max-steps", "1", "--no-progress"]) == 2
    assert "does not exist: give a checkpoint directory or a run directory" in capsys.readouterr().err


def test_cli_refuses_a_truncated_checkpoint_and_resuming_another_model(trained, tmp_path, capsys):
    from elastic_llm.cli import main

    cfg, workers = trained
    run = Storage(str(tmp_path / "run"))
    name = write_checkpoint(run, cfg, workers, 2)
    assert main(["train", "--resume", str(tmp_path / "run"), "--no-progress"]) == 2  # jobs/tiny.yaml: dim 256, seq_len 128
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'run' / name} is a checkpoint of another model (model.dim: 64 there, 256 here, model.seq_len: 16 there, 128 here): resume it with the config it was written with" in err
    shard = tmp_path / "run" / name / fmt.shard_file(1, 0)
    shard.write_bytes(shard.read_bytes()[:-100])  # a copy that stopped early
    assert main(["checkpoints", "verify", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"error: {shard} is not a safetensors file (" in err and "Traceback" not in err


def test_a_stages_checkpoint_refusal_reaches_the_user_without_the_actors_traceback():
    from ray.exceptions import RayTaskError

    from elastic_llm.runtime.stage_calls import checkpoint_refusal

    wrapped = RayTaskError("load_durable", "Traceback (most recent call last):\n  File stage.py", fmt.DurableError("x.safetensors fails its CRC-32")).as_instanceof_cause()
    assert "File stage.py" in str(wrapped)  # what the user saw
    refusal = checkpoint_refusal(wrapped)
    assert isinstance(refusal, fmt.DurableError) and str(refusal) == "x.safetensors fails its CRC-32"
    assert checkpoint_refusal(RayTaskError("load_durable", "Traceback", ValueError("a bug")).as_instanceof_cause()) is None


def test_the_soaks_flipped_byte_check_catches_a_verifier_that_misses_it(trained, tmp_path, monkeypatch):
    from elastic_llm.soak.checks import flip_is_missed

    cfg, workers = trained
    run = Storage(str(tmp_path / "run"))
    name = write_checkpoint(run, cfg, workers, 2)
    assert flip_is_missed(run, name) is None  # the flipped copy is refused with a DurableError
    fmt.Checkpoint(run, name).verify()  # the original is untouched
    monkeypatch.setattr(fmt.Checkpoint, "verify", lambda self: {"ok": True})  # a verifier blind to the flip
    assert "was not detected" in flip_is_missed(run, name)


def test_a_piece_that_changes_in_memory_while_it_is_flushed_is_not_flushed(trained, tmp_path, monkeypatch):
    """The flush streams views of object-store memory: a byte flipped there while the part is
    written (or before), must fail the part (the soak's silent corruption once struck in that
    window: the checkpoint's own checksums, taken as it was written, vouched for the flipped
    byte). The pieces are checked against their records once, while the file is fsynced."""
    from elastic_llm.durable import flush
    from elastic_llm.snapshot.erasure import checksum
    from elastic_llm.snapshot.records import Piece

    cfg, workers = trained
    buf, manifest = workers[0].capture_state({"epoch": 0, "index": 7})
    buf = buf.copy()
    tensors = tuple(stage_tensors(manifest, list(stage_layer_range(cfg.model.n_layers, cfg.parallel.stages, 0))))
    src = flush.SliceSource(ShardKey(0, 0), 0, (Piece(0, len(buf), checksum(buf)),), None, "node")

    def plan(step):
        return flush.FlushPlan(step, str(tmp_path), 0, 0, f"{fmt.checkpoint_dir(step)}/{fmt.shard_file(0, 0)}", tensors, (src,), nice=0)

    assert flush.write_part(plan(3), lambda key: [buf]).nbytes > len(buf) // 2  # untouched: written

    last = max(tensors, key=lambda t: t.src)
    real = flush.write_shard

    def flip_after_the_first_tensor(storage, rel, specs, read, meta, max_mb_s=0.0, verify=None, syncs=None):
        def reading(lo, hi):
            yield from read(lo, hi)
            if lo == specs[0].src:
                buf[last.src + last.nbytes // 2] ^= 0xFF  # silent: after the first tensor, before the last goes out
        return real(storage, rel, specs, reading, meta, max_mb_s, verify, syncs)

    monkeypatch.setattr(flush, "write_shard", flip_after_the_first_tensor)
    with pytest.raises(RuntimeError, match=r"fails its checksum \(damaged in memory\): not flushed"):
        flush.write_part(plan(4), lambda key: [buf])
    monkeypatch.setattr(flush, "write_shard", real)
    with pytest.raises(RuntimeError, match=r"fails its checksum \(damaged in memory\): not flushed"):
        flush.write_part(plan(5), lambda key: [buf])  # damaged before the flush began: refused as well


def test_a_local_write_gathers_small_pieces_writes_large_ones_whole_and_verifies_while_it_syncs(tmp_path):
    """The local writer's bytes equal what it was given, in order, whatever the mix of sizes (small
    ones gathered into writes of many at once, more of them than one writev takes, large ones from
    the caller's memory in calls of KICK bytes); on Linux the device was asked to write all but the
    last KICK bytes before the close; ``during_sync`` runs once, and an error from it fails the
    write (nothing says the file was written)."""
    import numpy as np

    from elastic_llm.durable import storage as stm
    from elastic_llm.durable.storage import GATHER, IOV_MAX, KICK, Storage

    rng = np.random.default_rng(0)
    sizes = [3, GATHER - 1, GATHER, 17, 2 * KICK + 5, 5, KICK - 2, 1] + [7] * (IOV_MAX + 3) + [KICK // 2] * 3
    chunks = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    st = Storage(str(tmp_path))
    seen, kicked = [], []
    with st.writer("f") as w:
        w.during_sync = lambda: seen.append(w.nbytes)
        for c in chunks:
            w.write(c)
        kicked.append(w.kicked)
    assert (tmp_path / "f").read_bytes() == b"".join(c.tobytes() for c in chunks)
    assert seen == [sum(sizes)]
    if stm._writeback is not None:
        assert sum(sizes) - 2 * KICK <= kicked[0] <= sum(sizes)

    def refuse():
        raise RuntimeError("a piece fails its checksum")

    with pytest.raises(RuntimeError, match="fails its checksum"):
        with st.writer("g") as w:
            w.during_sync = refuse
            w.write(chunks[0])


def test_files_written_with_syncs_are_checked_only_when_the_syncs_finish_and_one_refusal_fails_them_all(tmp_path):
    """A node's parts: each file's check waits for :meth:`Syncs.finish` (the fsyncs and checks of
    all files together), runs once per file, and a refusal from any raises there; the descriptors
    are closed either way (as many open files after as before)."""
    from elastic_llm.durable.storage import Storage, Syncs

    st = Storage(str(tmp_path))
    fds_before = len(os.listdir("/proc/self/fd"))
    for refuse_second in (False, True):
        checked: list[str] = []
        syncs = Syncs()
        for name in ("a", "b", "c"):
            with st.writer(f"{refuse_second}-{name}", syncs=syncs) as w:
                w.write(name.encode() * 1000)

                def check(name: str = name, refuse: bool = refuse_second, checked: list[str] = checked) -> None:
                    checked.append(name)
                    if refuse and name == "b":
                        raise RuntimeError("b fails its checksum")
                w.during_sync = check
        assert checked == []  # nothing checked before finish
        if refuse_second:
            with pytest.raises(RuntimeError, match="b fails its checksum"):
                syncs.finish()
        else:
            syncs.finish()
            assert checked == ["a", "b", "c"]
            assert (tmp_path / "False-c").read_bytes() == b"c" * 1000
    abandoned = Syncs()
    with st.writer("d", syncs=abandoned) as w:
        w.write(b"d")
    abandoned.abandon()
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_a_node_writes_its_parts_one_after_the_other_and_a_damaged_piece_in_any_fails_the_node(trained, tmp_path):
    """One call per node (:class:`NodeFlush`): every part's file holds its tensors, each part's
    seconds run until all are durable; a piece damaged in memory in the last part fails the whole
    call (the tier then commits nothing)."""
    from elastic_llm.durable import flush
    from elastic_llm.snapshot.erasure import checksum
    from elastic_llm.snapshot.records import Piece

    cfg, workers = trained
    plans, bufs = [], {}
    for stage in (0, 1):
        buf, manifest = workers[stage].capture_state({"epoch": 0, "index": 7})
        bufs[ShardKey(stage, 0)] = buf = buf.copy()
        tensors = tuple(stage_tensors(manifest, list(stage_layer_range(cfg.model.n_layers, cfg.parallel.stages, stage))))
        src = flush.SliceSource(ShardKey(stage, 0), 0, (Piece(0, len(buf), checksum(buf)),), None, "node")
        plans.append(flush.FlushPlan(3, str(tmp_path), stage, 0, f"{fmt.checkpoint_dir(3)}/{fmt.shard_file(stage, 0)}", tensors, (src,), nice=0))
    batch = flush.by_node([("node", p) for p in plans])["node"]
    written = batch.write(lambda key: [bufs[key]])
    assert [(r.stage, r.part) for r in written] == [(0, 0), (1, 0)]
    assert len({r.seconds for r in written}) == 1
    for r in written:
        assert (tmp_path / fmt.checkpoint_dir(3) / r.file).stat().st_size == r.nbytes
    bufs[ShardKey(1, 0)][5] ^= 0xFF
    with pytest.raises(RuntimeError, match=r"fails its checksum \(damaged in memory\): not flushed"):
        batch.write(lambda key: [bufs[key]])


def test_a_drafted_manifest_is_the_whole_manifest_and_commits_alike(trained, tmp_path):
    """The durable tier drafts a checkpoint's manifest while the managers write and adds the files
    at the end (:class:`format.Draft`): the bytes it commits read back as the manifest
    :func:`format.make_manifest` builds whole, and the checkpoint is committed and restorable.
    :class:`flush.StageTensors` gives each stage's tensors as :func:`stage_tensors` does,
    reading a stage's manifest again only when its state's size differs."""
    from elastic_llm.durable import flush

    cfg, workers = trained
    run = Storage(str(tmp_path))
    step, parts, states = 6, [], []
    reads = []
    layers_of = lambda s: (reads.append(s), list(stage_layer_range(cfg.model.n_layers, cfg.parallel.stages, s)))[1]  # noqa: E731
    tensors_of = flush.StageTensors(layers_of)
    for w in workers:
        buf, manifest = w.capture_state({"epoch": 0, "index": 7})
        tensors = tensors_of(w.stage, len(buf), manifest)
        assert tensors == stage_tensors(manifest, list(stage_layer_range(cfg.model.n_layers, cfg.parallel.stages, w.stage)))
        assert tensors_of(w.stage, len(buf), manifest) is tensors
        tensors_of(w.stage, len(buf) - 8, manifest)  # another size: read again
        rel = f"{fmt.checkpoint_dir(step)}/{fmt.shard_file(w.stage, 0)}"
        run.makedirs(fmt.checkpoint_dir(step))
        nbytes, records = fmt.write_shard(run, rel, tensors, lambda lo, hi, buf=buf: iter([buf[lo:hi]]), {"format": "pt"})
        parts.append(fmt.PartResult(w.stage, 0, fmt.shard_file(w.stage, 0), nbytes, 0.0, records))
        states.append((w.stage, 0, manifest))
    assert reads == [s for w in workers for s in (w.stage, w.stage)]
    data, files = fmt.draft(cfg, step, "run", states, None).finish(parts)
    whole = fmt.make_manifest(cfg, step, "run", states, parts, None)
    assert json.loads(data) == whole and files == whole["files"]
    fmt.commit_bytes(run, fmt.checkpoint_dir(step), step, data)
    assert fmt.read_manifest(run, fmt.checkpoint_dir(step)) == whole
    assert fmt.newest_committed(run).step == step
    fresh = StageWorker(cfg, 1, 0)
    fresh.load_durable(run.uri, fmt.checkpoint_dir(step))
    assert np.array_equal(state_bytes(fresh), state_bytes(workers[1]))


def test_a_flush_writes_nicer_than_its_manager_never_ahead_of_training(trained, tmp_path):
    """Ray starts workers at nice 15: the flush's writer once set an absolute nice 10, which put it
    ahead of the training step on the same cores. It now runs ``durable.flush_nice`` steps nicer
    than the thread that called it, capped at 19."""
    import threading

    from elastic_llm.durable import flush
    from elastic_llm.snapshot.erasure import checksum
    from elastic_llm.snapshot.records import Piece

    cfg, workers = trained
    buf, manifest = workers[0].capture_state({"epoch": 0, "index": 7})
    buf = buf.copy()
    tensors = tuple(stage_tensors(manifest, list(stage_layer_range(cfg.model.n_layers, cfg.parallel.stages, 0))))
    src = flush.SliceSource(ShardKey(0, 0), 0, (Piece(0, len(buf), checksum(buf)),), None, "node")
    seen = []

    def local(key):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))  # called on the writing thread
        return [buf]

    def call(start, nice, step):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), start)  # the manager's thread
        plan = flush.FlushPlan(step, str(tmp_path), 0, 0, f"{fmt.checkpoint_dir(step)}/{fmt.shard_file(0, 0)}", tensors, (src,), nice=nice)
        flush.write_part(plan, local)

    for step, (start, nice) in enumerate(((15, 10), (2, 10), (15, 0)), start=1):
        t = threading.Thread(target=call, args=(start, nice, step))
        t.start()
        t.join()
    assert seen == [19, 12, 15]


def test_the_commit_marker_is_renamed_into_place_only_after_the_manifest_and_it_are_on_disk(tmp_path, monkeypatch):
    """:meth:`Storage.write_then_mark`: both files' bytes are fsynced before the marker's rename
    (a crash in between leaves no marker), no temporary file stays behind, and a failed fsync
    leaves neither the marker nor its temporary file."""
    from elastic_llm.durable.storage import Storage

    st = Storage(str(tmp_path))
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append((len(synced), b)), real_replace(a, b))[1])
    st.write_then_mark("manifest.json", b"{}", "COMMITTED", b"ok")
    assert (tmp_path / "COMMITTED").read_bytes() == b"ok" and (tmp_path / "manifest.json").read_bytes() == b"{}"
    n, target = renamed[0]
    assert target == str(tmp_path / "COMMITTED")
    assert {os.path.basename(p).lstrip(".").split(".")[0] for p in synced[:n]} >= {"manifest", "COMMITTED"}
    assert sorted(os.listdir(tmp_path)) == ["COMMITTED", "manifest.json"]

    def failing(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        st.write_then_mark("sub-manifest.json", b"{}", "SUB", b"ok")
    assert not (tmp_path / "SUB").exists()
    assert sorted(os.listdir(tmp_path)) == ["COMMITTED", "manifest.json", "sub-manifest.json"]
