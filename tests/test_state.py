"""Stage state packs into a flat buffer + JSON manifest and restores bit for bit (no Ray, no pickle)."""

import dataclasses
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from elastic_llm.config import config_from_dict
from elastic_llm.pipeline.stage import StageWorker
from elastic_llm.pipeline.transport import HELLO, STATE_COPY, STATE_HEADER, Aborted, PeerLost
from elastic_llm.snapshot.records import ShardKey
from elastic_llm.snapshot.state import SnapshotFormatError


def cfg(norm_eps=1e-5, **train):
    return config_from_dict(
        {
            "model": {"dim": 32, "n_heads": 2, "n_layers": 2, "seq_len": 8, "norm_eps": norm_eps},
            "parallel": {"stages": 1, "microbatches": 2},
            "train": {"batch_size": 4, "warmup_steps": 2, "max_steps": 20, **train},
        }
    )


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        t = rng.integers(0, 256, size=(4, 9))
        yield t[:, :-1].copy(), t[:, 1:].copy()


def run_steps(worker, data):
    losses = []
    for x, y in data:
        for mb in range(2):
            losses.append(worker.forward(mb, x[mb * 2 : mb * 2 + 2], y[mb * 2 : mb * 2 + 2]))
            worker.backward(mb)
        worker.step()
        losses.append(float(torch.rand(())))  # consumes the torch RNG: restored RNG must match too
    return losses


def test_restore_continues_bit_identically():
    c = cfg()
    data = list(batches(8))
    a = StageWorker(c, 0, 0)
    run_steps(a, data[:3])
    buf, manifest = a.capture_state({"epoch": 0, "index": 12})
    saved = buf.copy()
    expected = run_steps(a, data[3:])

    b = StageWorker(c, 0, 0)  # fresh: different RNG position, no optimizer state
    run_steps(b, data[:1])
    assert b.load_state(saved, manifest) == 3
    assert json.loads(manifest)["data_position"] == {"epoch": 0, "index": 12}
    got = run_steps(b, data[3:])
    assert got == expected
    for (n, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), n
    assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]


def test_capture_reuses_one_buffer_and_replica_slices_tile_it():
    c = config_from_dict({**cfg().to_dict(), "parallel": {"stages": 1, "dp": 3, "microbatches": 1}, "train": {"batch_size": 3}})
    workers = [StageWorker(c, 0, r) for r in range(3)]
    for w in workers:
        x, y = next(batches(1))
        w.forward(0, x[:1], y[:1])
        w.backward(0)
        w.step()
    full, _ = workers[0].capture_state()
    buf1, _ = workers[0].capture_state()
    assert buf1 is workers[0].copies.buffer(2) and full is buf1
    bounds = [json.loads(w.capture_state(replica_slice=True)[1])["slice"] for w in workers]
    assert bounds[0][0] == 0 and bounds[-1][1] == len(full)
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(2))


def test_foreign_and_mismatched_snapshots_are_refused_without_changes():
    a = StageWorker(cfg(), 0, 0)
    run_steps(a, batches(1))
    buf, manifest = a.capture_state()
    before = {n: p.clone() for n, p in a.module.named_parameters()}
    other = StageWorker(cfg(norm_eps=1e-6), 0, 0)  # the same layout, another model
    with pytest.raises(SnapshotFormatError, match="taken with config"):
        other.load_state(buf.copy(), manifest)
    StageWorker(cfg(lr=5e-4), 0, 0).load_state(buf.copy(), manifest)  # another learning rate: the same state, restored
    with pytest.raises(SnapshotFormatError, match="not JSON"):
        a.load_state(buf, "\x80garbage")
    with pytest.raises(SnapshotFormatError, match="not an elastic-llm stage snapshot"):
        a.load_state(buf, json.dumps({"hello": 1}))
    with pytest.raises(SnapshotFormatError, match="truncated"):
        a.load_state(buf[:100].copy(), manifest)
    m = json.loads(manifest)
    m["entries"][0][2] = [999]
    with pytest.raises(SnapshotFormatError, match="snapshot has float32\\[999\\]"):
        a.load_state(buf, json.dumps(m))
    m = json.loads(manifest)
    m["entries"][1][3] += 64  # an entry moved: the bytes would land in the wrong tensor
    with pytest.raises(SnapshotFormatError, match="corrupted manifest"):
        a.load_state(buf, json.dumps(m))
    m = json.loads(manifest)
    m["entries"] = "nope"
    with pytest.raises(SnapshotFormatError, match="malformed"):
        a.load_state(buf, json.dumps(m))
    half = len(buf) // 2 // 64 * 64
    with pytest.raises(SnapshotFormatError, match="missing or given twice"):  # a gap between pieces
        a.load_parts(manifest, [0, half + 64], buf[:half].copy(), buf[half + 64 :].copy())
    with pytest.raises(SnapshotFormatError, match="missing or given twice"):  # overlapping pieces
        a.load_parts(manifest, [0, half - 64], buf[:half].copy(), buf[half - 64 :].copy())
    for broken in ({"base_lrs": "x", "last_epoch": 1}, {"last_epoch": 1}, {"base_lrs": [1e-3], "last_epoch": 1}):
        m = json.loads(manifest)
        m["scheduler"] = broken  # the LR schedule's part: refused before any state is touched
        with pytest.raises(SnapshotFormatError, match="LR schedule is unreadable"):
            a.load_state(buf, json.dumps(m))
    assert a.scheduler.last_epoch == 1
    for n, p in a.module.named_parameters():
        assert torch.equal(p, before[n])


def test_pieces_restore_like_one_buffer_and_state_lives_in_one_block():
    a = StageWorker(cfg(), 0, 0)
    run_steps(a, batches(2))
    # parameters and AdamW moments are views into the arena: the optimizer updates them in place
    block = a.arena.blocks[0][3]
    base = block.untyped_storage().data_ptr()
    for p in a.module.parameters():
        assert p.untyped_storage().data_ptr() == base
        for v in a.optimizer.state[p].values():
            assert v.untyped_storage().data_ptr() == base
    buf, manifest = a.capture_state({"epoch": 1, "index": 3})
    saved = buf.copy()
    expected = run_steps(a, list(batches(3, seed=5)))
    b = StageWorker(cfg(), 0, 0)
    cuts = [0, 64 * 7, len(saved) // 3 // 64 * 64, len(saved)]
    parts = [saved[x:y].copy() for x, y in zip(cuts, cuts[1:])]
    order = [2, 0, 1]  # pieces may arrive in any order
    assert b.load_parts(manifest, [cuts[i] for i in order], *[parts[i] for i in order]) == 2
    assert run_steps(b, list(batches(3, seed=5))) == expected


def test_rollback_from_own_copy_checks_the_committed_checksums():
    from dataclasses import replace

    from elastic_llm.snapshot.erasure import checksum

    a = StageWorker(cfg(), 0, 0)
    data = list(batches(5, seed=9))
    for i, (x, y) in enumerate(data[:3]):
        for mb in range(2):
            a.forward(mb, x[mb * 2 : mb * 2 + 2], y[mb * 2 : mb * 2 + 2])
            a.backward(mb)
        a.step(snapshot={"epoch": 0, "index": i})  # background copies of steps 1, 2, 3 (two buffers)
    info, *pieces = a.snapshot_pieces(3, 2)
    record = info.pieces
    assert [checksum(p) for p in pieces] == [p.crc for p in record]
    after3 = {n: p.clone() for n, p in a.module.named_parameters()}
    expected = run_steps(a, data[3:])
    assert not a.restore_own_copy(1, record)  # step 1's buffer was reused by step 3
    bad = tuple(replace(p, crc=p.crc ^ 1) for p in record)
    assert not a.restore_own_copy(3, bad)  # bytes that are not the committed snapshot: refused
    assert a.step_count == 5
    assert a.restore_own_copy(3, record) and a.step_count == 3
    for n, p in a.module.named_parameters():
        assert torch.equal(p, after3[n]), n
    assert run_steps(a, data[3:]) == expected


def test_a_version_record_survives_its_json_form():
    from elastic_llm.snapshot.records import Piece, ShardInfo, ShardKey, VersionRecord, record_from_json, record_json

    rec = VersionRecord(7, (("n1", "n2"),), (
        ShardInfo(ShardKey(0, 0), 7, 0, 10, (Piece(0, 6, 123), Piece(6, 4, 9)), '{"data_position": {"i": 3}}', 0.5, "n1"),
        ShardInfo(ShardKey(1, 0), 7, 0, 8, (Piece(0, 8, 5),), "{}", 0.1, "n2"),
    ))
    back = record_from_json(record_json(rec))
    assert back == dataclasses.replace(rec, shards=tuple(dataclasses.replace(s, copy_s=0.0) for s in rec.shards))  # copy time is not kept
    assert back.shard(ShardKey(0, 0)).data_position() == {"i": 3}
    with pytest.raises(ValueError, match="not a snapshot version record"):
        record_from_json('{"version": 1}')


def _stream(src, dst):
    """``src`` streams its state to ``dst`` (both in this process, as two actors would)."""
    address = dst.link_address()  # first, as the driver asks (an actor's calls do not overlap)
    with ThreadPoolExecutor(2) as pool:
        got = pool.submit(dst.receive_state, ShardKey(src.stage, src.replica))
        sent = pool.submit(src.send_state, address)
        return sent, got


def test_a_state_streamed_over_a_socket_lands_in_the_arena_and_continues_bit_identically():
    c = cfg()
    data = list(batches(6))
    a = StageWorker(c, 0, 0)
    run_steps(a, data[:3])
    before = a.capture_state()[0].copy()
    b = StageWorker(c, 0, 1)  # a fresh actor (another replica's RNG): takes a's state, RNG included
    arena = b.arena.host_view()
    sent, got = _stream(a, b)
    nbytes, seconds = got.result(timeout=60)
    assert sent.result(timeout=60) == nbytes == a.arena.layout.nbytes and seconds > 0
    assert b.arena.host_view().ctypes.data == arena.ctypes.data  # read into the arena itself: no buffer between
    assert b.step_count == 3 and np.array_equal(b.capture_state()[0], before)
    rng = torch.get_rng_state()  # one process here: each actor's own torch RNG, in turn
    expected = run_steps(a, data[3:])
    torch.set_rng_state(rng)
    assert run_steps(b, data[3:]) == expected
    for (n, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), n


def test_a_streamed_state_of_another_shape_is_refused_and_a_lost_sender_fails_the_receiver():
    a = StageWorker(cfg(), 0, 0)
    wider = {"model": {"dim": 64, "n_heads": 2, "n_layers": 2, "seq_len": 8}, "parallel": {"stages": 1, "microbatches": 2}, "train": {"batch_size": 4}}
    other = StageWorker(config_from_dict(wider), 0, 0)
    run_steps(a, list(batches(1)))
    sent, got = _stream(other, a)
    with pytest.raises(SnapshotFormatError, match="not the same stage"):
        got.result(timeout=60)
    with pytest.raises(PeerLost, match="closed the connection before it had the state"):
        sent.result(timeout=60)
    assert a.step_count == 1  # refused before a byte landed: its state is untouched
    # a sender that dies midway: the receiver's read ends at once, naming it, and holds no step
    b = StageWorker(cfg(), 0, 1)
    address = b.link_address()
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(b.receive_state, ShardKey(0, 0))
        sock = socket.create_connection(address)
        sock.sendall(HELLO.pack(STATE_COPY, 0, 0) + STATE_HEADER.pack(2, a.arena.layout.nbytes) + b"{}" + b"\0" * 100)
        sock.close()
        with pytest.raises(PeerLost, match=r"stage 0 replica 0"):
            got.result(timeout=60)
    assert b.step_count == -1


def test_a_receive_whose_sender_never_connects_is_cancelled():
    b = StageWorker(cfg(), 0, 1)
    b.link_address()
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(b.receive_state, ShardKey(0, 0))
        b.cancel_receive()  # whether it already waits for its sender or is about to: either way it ends
        with pytest.raises(Aborted, match="cancelled"):
            got.result(timeout=10)
