"""Parity encoded straight from snapshot pieces equals parity of the zero-padded, concatenated
chunks (the rotating layout's codewords), and decodes back to every piece (no Ray)."""

import numpy as np
import pytest

from elastic_llm.snapshot.erasure import ReedSolomon
from elastic_llm.snapshot.manager import encode_pieces
from elastic_llm.snapshot.records import Piece, ShardInfo, ShardKey, chunk_pieces


def pieces(rng, sizes):
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


@pytest.mark.parametrize("k,m", [(2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_parity_from_pieces_matches_padded_chunks(k, m, seed):
    rng = np.random.default_rng(seed)
    # each data symbol: several pieces of varied length (some empty), some symbols shorter
    symbols = [pieces(rng, rng.integers(0, 3000, rng.integers(0, 4))) for _ in range(k)]
    length = max(sum(len(p) for p in s) for s in symbols) + int(rng.integers(0, 2)) * 64
    padded = []
    for s in symbols:
        flat = np.zeros(length, dtype=np.uint8)
        cat = np.concatenate(s) if s else np.zeros(0, dtype=np.uint8)
        flat[: len(cat)] = cat
        padded.append(flat)
    rs = ReedSolomon(k, m)
    expected = rs.encode(padded) if length else [np.zeros(0, dtype=np.uint8)] * m
    for row in range(m):
        out = np.full(length, 0xAB, dtype=np.uint8)
        assert np.array_equal(encode_pieces(rs, symbols, row, out), expected[row])
    if length:  # losing up to m data symbols, parity brings the pieces back
        lost = list(rng.choice(k, size=min(m, k), replace=False))
        got = rs.decode([None if i in lost else padded[i] for i in range(k)] + expected)
        for i in lost:
            assert np.array_equal(got[i], padded[i])


def test_chunk_pieces_take_one_piece_of_each_shard_in_key_order():
    def info(stage, replica, pieces):
        return ShardInfo(ShardKey(stage, replica), 1, 0, 0, tuple(Piece(*p) for p in pieces), "{}")

    # stage 10 sorts after stage 2 (numeric, not "10/0" < "2/0" as strings would)
    infos = (info(10, 0, [[0, 10, 1], [10, 5, 2]]), info(2, 0, [[0, 8, 3], [8, 8, 4]]), info(2, 1, [[0, 1, 5], [1, 1, 6]]))
    assert chunk_pieces(infos, 0) == [Piece(0, 8, 3), Piece(0, 1, 5), Piece(0, 10, 1)]
    assert chunk_pieces(infos, 1) == [Piece(8, 8, 4), Piece(1, 1, 6), Piece(10, 5, 2)]


def _manager_holding(*versions):
    from elastic_llm.snapshot.manager import SnapshotManager, Version

    m = SnapshotManager("node")
    m.state = lambda: None  # no metrics export outside Ray
    m.versions = {v: Version() for v in versions}
    return m


def test_a_commit_frees_older_versions_but_not_one_being_flushed():
    m = _manager_holding(1, 2, 3)
    # commit(2) runs before the (earlier sent) commit(1, pin=True): the driver named 1 as flushing
    m.commit(2, keep=(1,))
    assert sorted(m.versions) == [1, 2, 3]
    m.commit(1, pin=True)  # late: pinned, kept for its flush
    assert sorted(m.versions) == [1, 2, 3] and m.versions[1].pinned
    m.commit(3)
    assert sorted(m.versions) == [1, 3]  # 2 freed; 1 stays until its flush ends
    m.unpin(1)
    assert sorted(m.versions) == [3]


def test_a_late_commit_of_an_older_version_frees_it():
    m = _manager_holding(4, 5)
    m.commit(5)
    assert sorted(m.versions) == [5]
    m2 = _manager_holding(4, 5)
    m2.versions[5].committed = True
    m2.commit(4)  # arrives after commit(5) ran, not pinned: a newer version is committed
    assert sorted(m2.versions) == [5]


# A step re-run after a rollback snapshots the same version number again (a new attempt). The
# messages of the earlier attempt (offers, discards) are fire-and-forget and run on the manager's
# threads in any order: found by the chaos soak, where a late discard of step 46's first attempt
# wiped the second attempt's offers and its parity holder waited 600 s at the end of the run.


def test_a_late_discard_of_an_earlier_attempt_keeps_the_newer_attempts_offers():
    m = _manager_holding()
    m.offer(46, 0, 1, ["ref"], [Piece(0, 1, 2)], attempt=200)
    m.discard(46, attempt=100)  # the first attempt's discard, delivered late
    assert m.versions[46].attempt == 200 and 1 in m.versions[46].offers[0]
    m.discard(46, attempt=200)
    assert 46 not in m.versions


def test_a_late_offer_of_an_earlier_attempt_is_dropped_and_a_newer_one_replaces_it():
    m = _manager_holding()
    m.offer(46, 0, 1, ["new"], [Piece(0, 1, 2)], attempt=200)
    m.offer(46, 0, 2, ["old"], [Piece(0, 1, 3)], attempt=100)
    assert set(m.versions[46].offers[0]) == {1}
    m.offer(46, 0, 2, ["newer"], [Piece(0, 1, 4)], attempt=300)
    assert m.versions[46].attempt == 300 and set(m.versions[46].offers[0]) == {2}


def test_an_encode_waiting_for_offers_gives_up_when_a_newer_attempt_takes_its_version():
    import threading

    from elastic_llm.snapshot.layout import ParityLayout
    from elastic_llm.snapshot.manager import SnapshotMissingError

    m = _manager_holding()
    layout = ParityLayout(3, 1)
    region, row = layout.parity_regions(0)[0]
    with m.lock:
        v = m._claim(7, 100)
    raised = []

    def encode():
        try:
            m._encode(v, 7, layout, region, row)
        except SnapshotMissingError as e:
            raised.append(str(e))

    t = threading.Thread(target=encode, daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive() and not raised  # waiting for its group's data
    m.offer(7, region, layout.data_nodes(region)[0], [], [], attempt=200)  # the re-run's first offer
    t.join(10)
    assert not t.is_alive() and raised and "superseded" in raised[0]


def test_a_stage_refuses_at_once_a_copy_asked_for_before_a_rollback():
    """Found by the chaos soak: a manager's request for the copy of step 5, made before a
    rollback to step 2, reached the stage after it; waiting for a step 5 that the steps run again
    never snapshotted held the stage's snapshot thread, so the re-run's requests for steps 3 and
    4 queued behind it and the run stopped at step 7 waiting for them (600 s)."""
    import time

    from elastic_llm.pipeline.copies import BackgroundCopies

    copies = BackgroundCopies.__new__(BackgroundCopies)  # the request path only: no arena, no copy thread
    import threading

    copies.changed, copies.held, copies.resets = threading.Condition(), {}, 0
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="step 5 was asked for before a rollback to step 2"):
        copies.take(5, "stage 0 replica 0", newest=3)
    assert time.perf_counter() - t < 1.0
