"""Parity a holder encodes as each member's bytes arrive over its piece server equals parity of
the zero-padded, concatenated chunks (the rotating layout's codewords), and decodes back to every
piece; a member's bytes cut mid-piece or corrupted leave no parity behind (real sockets on
127.0.0.1, no Ray)."""

import numpy as np
import pytest

from elastic_llm.snapshot import exchange
from elastic_llm.snapshot.erasure import ReedSolomon, checksum
from elastic_llm.snapshot.layout import ParityLayout
from elastic_llm.snapshot.records import Piece, ShardInfo, ShardKey, chunk_pieces

pytestmark = pytest.mark.timeout(60)
NOWHERE = ("127.0.0.1", 9)  # an offer's source where no bytes are read


def pieces(rng, sizes):
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def padded(symbols, length):
    out = []
    for s in symbols:
        flat = np.zeros(length, dtype=np.uint8)
        cat = np.concatenate(s) if s else np.zeros(0, dtype=np.uint8)
        flat[: len(cat)] = cat
        out.append(flat)
    return out


@pytest.mark.parametrize("via", ["encode_update", "updater"])
@pytest.mark.parametrize("k,m", [(2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_parity_added_up_from_blocks_in_any_order_matches_padded_chunks(k, m, seed, via):
    """``encode_update`` of every symbol's pieces (or the unchecked ``updater`` a holder calls per
    block), cut in blocks of any size, in any order of the symbols, gives ``encode``'s parity of
    the padded chunks; the parity decodes lost chunks back."""
    rng = np.random.default_rng(seed)
    symbols = [pieces(rng, rng.integers(0, 3000, rng.integers(0, 4))) for _ in range(k)]
    length = max(sum(len(p) for p in s) for s in symbols) + int(rng.integers(0, 2)) * 64
    full = padded(symbols, length)
    rs = ReedSolomon(k, m)
    expected = rs.encode(full) if length else [np.zeros(0, dtype=np.uint8)] * m
    for row in range(m):
        out = np.zeros(length, dtype=np.uint8)
        for sym in rng.permutation(k):
            pos = 0
            for arr in symbols[sym]:
                cuts = sorted({0, len(arr), *rng.integers(0, len(arr) + 1, 3).tolist()})
                for a, b in zip(cuts, cuts[1:]):
                    if via == "updater":
                        rs.updater(int(sym), row)(arr[a:b], out[pos + a : pos + b])
                    else:
                        rs.encode_update(arr[a:b], int(sym), row, out[pos + a : pos + b])
                pos += len(arr)
        assert np.array_equal(out, expected[row])
    if length:  # losing up to m data symbols, parity brings the pieces back
        lost = list(rng.choice(k, size=min(m, k), replace=False))
        got = rs.decode([None if i in lost else full[i] for i in range(k)] + expected)
        for i in lost:
            assert np.array_equal(got[i], full[i])


class Member:
    """A group member's piece server serving its chunks of version 7 (attempt 100)."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.server = exchange.PieceServer("127.0.0.1", self.lookup)

    def lookup(self, version, attempt, kind, index, role):
        if (version, attempt, kind) != (7, 100, exchange.CHUNK):
            raise LookupError(f"step {version}, attempt {attempt} is not held here")
        return self.chunks[index], 0


def holder_and_members(rng, n=4, m=2):
    """A holder manager of a group of ``n`` and real piece servers for the other members, each
    with 2-3 pieces per chunk; returns (manager, layout, members, offers per region)."""
    layout = ParityLayout(n, m)
    chunks = [{c: pieces(rng, rng.integers(1, 300_000, rng.integers(2, 4))) for c in range(layout.k)} for _ in range(n)]
    members = [Member(chunks[j]) for j in range(n)]
    mgr = _manager_holding()
    return mgr, layout, members, chunks


def offer_all(mgr, layout, members, chunks, region):
    for j in layout.data_nodes(region):
        c = layout.chunk_of(j, region)
        arrs = chunks[j][c]
        mgr.offer(7, region, j, members[j].server.address, [Piece(0, len(a), checksum(a)) for a in arrs], attempt=100)


def test_an_updater_checks_its_row_and_symbol_once_when_made():
    from elastic_llm.snapshot.erasure import CodeParametersError

    rs = ReedSolomon(3, 2)
    for sym, row in [(3, 0), (0, 2), (-1, 0), (True, 0)]:
        with pytest.raises(CodeParametersError):
            rs.updater(sym, row)


def test_a_server_sends_each_arrays_crc_as_it_read_it_and_an_answer_cut_before_it_is_refused():
    """The trailer carries each array's CRC-32 as the server read the bytes (what a holder and a
    rebuild compare with the recorded ones), the server counts the CPU its CRC-32s took, and an
    answer cut after its last body byte but before its trailer raises: a reader never takes bytes
    whose checksums it did not get."""
    import time

    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (3, exchange.BLOCK + 17, 0, 5000)]
    server = exchange.PieceServer("127.0.0.1", lambda *a: (arrays, 1234))
    try:
        seen = []
        got = exchange.stream(server.address, 1, exchange.ANY_ATTEMPT, exchange.CHUNK, 0, "", lambda i, pos, b: seen.append((i, pos, b.copy())), time.monotonic() + 10)
        assert got == exchange.Answer([len(a) for a in arrays], 1234, [checksum(a) for a in arrays])
        for i, a in enumerate(arrays):
            assert np.array_equal(np.concatenate([b for j, _, b in seen if j == i] or [np.zeros(0, np.uint8)]), a)
        buf, answer = exchange.fetch(server.address, 1, exchange.ANY_ATTEMPT, exchange.CHUNK, 0, "", time.monotonic() + 10)
        assert answer == got and np.array_equal(buf, np.concatenate(arrays))
        assert server.take_crc_s() > 0 and server.take_crc_s() == 0.0
        server.cut_after = sum(len(a) for a in arrays)  # the whole body, not the trailer
        with pytest.raises(exchange.ExchangeError, match="checksums|closed"):
            exchange.fetch(server.address, 1, exchange.ANY_ATTEMPT, exchange.CHUNK, 0, "", time.monotonic() + 10)
    finally:
        server.close()


def test_a_holder_encodes_each_members_bytes_as_they_arrive_and_gets_encodes_parity():
    rng = np.random.default_rng(1)
    mgr, layout, members, chunks = holder_and_members(rng)
    with mgr.lock:
        v = mgr._claim(7, 100)
    rs = ReedSolomon(layout.k, layout.m)
    for region, row in layout.parity_regions(0):
        offer_all(mgr, layout, members, chunks, region)
        info, exchanged = mgr._encode(v, 7, layout, region, row)
        symbols = [chunks[j][layout.chunk_of(j, region)] for j in layout.data_nodes(region)]
        length = max(sum(len(a) for a in s) for s in symbols)
        want = rs.encode_row(padded(symbols, length), row)
        assert info.length == length and info.crc == checksum(want)
        assert np.array_equal(v.parity[region][0], want)
        assert region not in v.offers  # the offers are dropped once encoded
        assert exchanged.received == sum(len(a) for s in symbols for a in s) and exchanged.wall_s > 0


@pytest.mark.parametrize("fault", ["cut", "corrupt", "refused"])
def test_a_member_whose_bytes_are_cut_corrupted_or_refused_leaves_no_parity_behind(fault):
    """A transfer cut mid-piece, a flipped byte, or a member that no longer holds the attempt:
    the holder's part fails naming the member, keeps no parity of the region (nothing a version
    could commit), and its buffer goes back to the pool; the next attempt encodes whole."""
    from elastic_llm.snapshot.manager import SnapshotMissingError

    rng = np.random.default_rng(2)
    mgr, layout, members, chunks = holder_and_members(rng)
    region, row = layout.parity_regions(0)[0]
    victim = layout.data_nodes(region)[1]
    with mgr.lock:
        v = mgr._claim(7, 100)
    offer_all(mgr, layout, members, chunks, region)
    if fault == "cut":
        members[victim].server.cut_after = len(chunks[victim][layout.chunk_of(victim, region)][0]) + 1000  # inside its second piece
    elif fault == "corrupt":
        members[victim].chunks = {c: [a.copy() for a in arrs] for c, arrs in chunks[victim].items()}
        members[victim].chunks[layout.chunk_of(victim, region)][-1][5] ^= 0xFF
    else:
        members[victim].server.lookup = lambda *a: (_ for _ in ()).throw(LookupError("step 7, attempt 100 is not held here"))
    pooled = sum(len(b) for b in mgr._pool.values())
    with pytest.raises(SnapshotMissingError, match=f"group member {victim}") as err:
        mgr._encode(v, 7, layout, region, row)
    assert {"cut": "did not arrive whole", "corrupt": "fails its checksum", "refused": "not held here"}[fault] in str(err.value)
    assert region not in v.parity
    assert sum(len(b) for b in mgr._pool.values()) > pooled  # the partly encoded buffer is back in the pool, never kept
    members[victim].chunks = chunks[victim]
    members[victim].server.lookup = members[victim].lookup
    offer_all(mgr, layout, members, chunks, region)
    assert mgr._encode(v, 7, layout, region, row)[0].region == region and region in v.parity


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
    m.offer(46, 0, 1, NOWHERE, [Piece(0, 1, 2)], attempt=200)
    m.discard(46, attempt=100)  # the first attempt's discard, delivered late
    assert m.versions[46].attempt == 200 and 1 in m.versions[46].offers[0]
    m.discard(46, attempt=200)
    assert 46 not in m.versions


def test_a_late_offer_of_an_earlier_attempt_is_dropped_and_a_newer_one_replaces_it():
    m = _manager_holding()
    m.offer(46, 0, 1, NOWHERE, [Piece(0, 1, 2)], attempt=200)
    m.offer(46, 0, 2, NOWHERE, [Piece(0, 1, 3)], attempt=100)
    assert set(m.versions[46].offers[0]) == {1}
    m.offer(46, 0, 2, NOWHERE, [Piece(0, 1, 4)], attempt=300)
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
    m.offer(7, region, layout.data_nodes(region)[0], NOWHERE, [], attempt=200)  # the re-run's first offer
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
    assert time.perf_counter() - t < 60  # at once, not after the request path's WAIT_S (600 s)


def test_the_exchange_threads_yield_relative_to_their_process_never_ahead_of_training():
    """Ray starts workers at nice 15: an absolute nice of 5 once put the exchange ahead of the
    training step. The exchange's threads go NICE steps nicer than they were, capped at 19."""
    import os
    import threading

    seen = []

    def run(start):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, start)
        exchange.yield_to_training()
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))

    for start in (15, 2):
        t = threading.Thread(target=run, args=(start,))
        t.start()
        t.join()
    assert seen == [19, 2 + exchange.NICE]


def test_a_piece_server_gives_way_for_a_version_in_flight_but_not_for_a_rebuild():
    """A holder's read of a version in flight runs beside training: its sending thread yields.
    A rebuild's read (of a committed version, ``ANY_ATTEMPT``) is what the stalled step waits
    for: it is sent at the process's own priority."""
    import os
    import threading
    import time

    seen = {}

    def lookup(version, attempt, kind, index, role):
        seen[attempt] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return [np.zeros(8, dtype=np.uint8)], 0

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    server = exchange.PieceServer("127.0.0.1", lookup)
    try:
        for attempt in (0, exchange.ANY_ATTEMPT):
            exchange.fetch(server.address, 1, attempt, exchange.CHUNK, 0, "", time.monotonic() + 10)
    finally:
        server.close()
    assert seen == {0: min(19, own + exchange.NICE), exchange.ANY_ATTEMPT: own}


# Fencing (issue 51): a node cut off while the run went on comes back with its snapshot manager
# (a zombie of an older membership generation), or a driver replaced by --resume goes on calling.
# Whatever they send that would change what a manager holds is refused by generation and named.


def _gen(epoch, n):
    from elastic_llm.snapshot.records import ATTEMPT_BITS

    return (epoch << ATTEMPT_BITS) + n


def test_a_zombie_managers_offer_and_plan_of_an_older_generation_are_refused_and_named():
    from elastic_llm.snapshot.manager import SnapshotMissingError
    from elastic_llm.snapshot.records import ManagerPlan

    m = _manager_holding()
    m.commit(3, floor=_gen(1, 9))  # the run's driver, after a node was lost: its generation began at attempt 9
    m.offer(4, 0, 1, NOWHERE, [Piece(0, 1, 2)], attempt=_gen(1, 8))  # the cut node's manager, healed, offers its old version
    assert 4 not in m.versions  # no version claimed for it (it would hold memory until a discard)
    with pytest.raises(SnapshotMissingError, match="older membership generation"):
        m.snapshot_version(ManagerPlan(4, (), attempt=_gen(1, 8), floor=_gen(1, 5)))  # a zombie relay's plan
    m.offer(4, 0, 1, NOWHERE, [Piece(0, 1, 2)], attempt=_gen(1, 9))  # the current generation's
    assert m.versions[4].attempt == _gen(1, 9)
    refused = m.fence.take()
    assert len(refused) == 2 and "a parity offer of step 4 from member 1 of attempt 1.8" in refused[0] and "a plan of step 4" in refused[1]
    assert all("membership at 1.9" in w for w in refused) and m.fence.take() == ()  # reported once


def test_a_replaced_drivers_commit_discard_and_flush_change_nothing_once_the_new_driver_spoke():
    """After ``--resume`` (driver epoch 2) the old driver, still alive, sends what it had queued:
    a commit that would free the version the new driver restored from, a discard of that
    version, a discard of everything and a flush. Each is refused; the new driver's go through."""
    from elastic_llm.durable.flush import NodeFlush
    from elastic_llm.snapshot.manager import SnapshotMissingError

    m = _manager_holding(6, 8)
    m.versions[6].committed = True
    m.versions[6].attempt = _gen(1, 6)
    m.versions[8].attempt = _gen(2, 1)  # the new driver's version in flight
    m.commit(6, floor=_gen(2, 0))  # the new driver adopts the committed version
    m.commit(8, floor=_gen(1, 3))  # the old driver: would mark 8 committed and free 6
    m.discard(6, _gen(1, 6), floor=_gen(1, 3))
    m.discard_all(floor=_gen(1, 3))
    with pytest.raises(SnapshotMissingError, match="older membership generation"):
        m.flush_part(NodeFlush(6, (), floor=_gen(1, 3)))
    assert sorted(m.versions) == [6, 8] and m.versions[6].committed and not m.versions[8].committed
    refused = m.fence.take()
    assert [w.split(" from ")[0] for w in refused] == ["a commit of step 8", "a discard of step 6", "a discard of every version", "a flush of step 6"]
    assert all("a driver at generation 1.3 (membership at 2.0)" in w for w in refused)
    m.commit(8, floor=_gen(2, 0))
    assert sorted(m.versions) == [8] and m.fence.take() == ()
