"""A lost shard rebuilt by the stage being restored, from its erasure group's survivors, straight
into its own state (an embedded Ray; the group's members are actors that hold real pieces and the
parity of their zero-padded chunks, and are killed for real).

A new stage decodes into its arena (no staging buffer) and continues bit for bit; a member that
dies before its symbols are read, serves a corrupted piece or is cut off mid-symbol, is one more erasure; more than the
parity covers fails the rebuild: a new stage then says it holds no step (-1), a trained one keeps
its state.
"""

import time

import numpy as np
import pytest
import ray

from elastic_llm.pipeline.stage import StageWorker
from elastic_llm.snapshot import exchange
from elastic_llm.snapshot.erasure import ReedSolomon, TooManyErasuresError, checksum
from elastic_llm.snapshot.layout import ParityLayout
from elastic_llm.snapshot.records import Piece, ParityRebuild, ShardInfo, ShardKey, chunk_pieces

from .test_state import batches, cfg, run_steps

pytestmark = pytest.mark.timeout(120)
N, M = 4, 2  # group of 4 nodes, parity 2: k = 2 data chunks per node
VERSION = 3


@ray.remote(num_cpus=0)
class Member:
    """A group member as a rebuild asks it: a real piece server serving its data chunks' pieces
    (held in the object store) and its parity."""

    def __init__(self, chunks: dict[int, list[np.ndarray]], parity: dict[int, np.ndarray], corrupt: bool) -> None:
        if corrupt:  # silent corruption: the recorded checksums stay
            chunks = {c: [a.copy() for a in arrs] for c, arrs in chunks.items()}
            for arrs in chunks.values():
                for a in arrs:
                    if len(a):
                        a[len(a) // 2] ^= 0xFF
        self.refs = {c: [ray.put(a) for a in arrs] for c, arrs in chunks.items()}
        self.parity = {r: (p, checksum(p)) for r, p in parity.items()}
        self.server = exchange.PieceServer("127.0.0.1", self.lookup)

    def lookup(self, version, attempt, kind, index, role):
        if kind == exchange.PARITY:
            return [self.parity[index][0]], self.parity[index][1]
        return [np.asarray(a) for a in ray.get(self.refs[index])], 0

    def endpoint(self) -> tuple[str, int]:
        return self.server.address

    def cut(self, nbytes: int) -> None:
        self.server.cut_after = nbytes  # its next answer stops after nbytes


def split(key: ShardKey, data: np.ndarray, manifest: str, k: int) -> tuple[ShardInfo, list[np.ndarray]]:
    """A shard of ``data`` cut into k pieces (the last ones shorter), as a stage reports it."""
    cuts = np.linspace(0, len(data), k + 1).astype(int)
    arrays = [data[a:b] for a, b in zip(cuts, cuts[1:])]
    pieces = tuple(Piece(int(a), len(arr), checksum(arr)) for a, arr in zip(cuts, arrays))
    return ShardInfo(key, VERSION, 0, len(data), pieces, manifest), arrays


@pytest.fixture(scope="module")
def group(ray_local):
    """Member 0 holds stage 0's whole state after VERSION steps; members 1-3 other stages' shards
    of other sizes. Returns (infos, pieces per member, parity per member, the state, its manifest,
    the losses of the steps after it)."""
    c = cfg()
    data = list(batches(8))
    a = StageWorker(c, 0, 0)
    run_steps(a, data[:VERSION])
    buf, manifest = a.capture_state()
    state = buf.copy()
    after = run_steps(a, data[VERSION:])
    rng = np.random.default_rng(0)
    layout = ParityLayout(N, M)
    shards = [split(ShardKey(0, 0), state, manifest, layout.k)]
    shards += [split(ShardKey(j, 0), rng.integers(0, 256, len(state) // j + 7 * j, dtype=np.uint8), "{}", layout.k) for j in range(1, N)]
    infos = [(info,) for info, _ in shards]
    pieces = [{ch: [arrays[ch]] for ch in range(layout.k)} for _, arrays in shards]
    for j, (info,) in enumerate(infos):
        assert [p.length for p in chunk_pieces((info,), 0)] == [len(pieces[j][0][0])]
    rs = ReedSolomon(layout.k, M)
    parity: list[dict[int, np.ndarray]] = [{} for _ in range(N)]
    for region in range(N):
        symbols = [pieces[j][layout.chunk_of(j, region)] for j in layout.data_nodes(region)]
        length = max(sum(len(x) for x in s) for s in symbols)
        for row, holder in enumerate(layout.holders(region)):
            parity[holder][region] = rs.encode_row([np.concatenate([*s, np.zeros(length - sum(len(x) for x in s), dtype=np.uint8)]) for s in symbols], row)
    return infos, pieces, parity, state, manifest, after


def gone(actor, within_s: float = 30.0) -> None:
    """Wait until a killed member answers no more: ``ray.kill`` returns before the process is
    gone, and a member still answering would serve the rebuild (one erasure fewer than meant)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.endpoint.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"a killed member still answers after {within_s:g} s")


def recipe(group, *, dead=(), corrupt=(), cut=()) -> ParityRebuild:
    """Rebuild member 0's shard (member 0 lost); members in ``dead`` are killed before the
    rebuild asks them (the plan still names them), those in ``corrupt`` serve a flipped byte."""
    infos, pieces, parity, _, _, _ = group
    peers = [None] + [Member.remote(pieces[j], parity[j], j in corrupt) for j in range(1, N)]
    ray.get([p.endpoint.remote() for p in peers[1:]])  # every member is up
    for j in dead:
        ray.kill(peers[j])
        gone(peers[j])
    ray.get([peers[j].cut.remote(1000) for j in cut])
    return ParityRebuild(VERSION, ShardKey(0, 0), N, M, (0,), 0, tuple(peers), tuple(infos))


def test_a_new_stage_decodes_a_lost_shard_into_its_own_state_and_continues_bit_identically(group):
    _, _, _, state, manifest, after = group
    b = StageWorker(cfg(), 0, 0)  # a new stage: no step trained or restored
    step, nbytes, seconds = b.load_rebuilt(manifest, [], [recipe(group)])
    assert (step, nbytes) == (VERSION, len(state)) and seconds > 0
    assert np.array_equal(b.arena.host_view(), state)
    assert 2 not in b.copies.buffers  # decoded in place: no staging buffer was made
    assert run_steps(b, list(batches(8))[VERSION:]) == after


def test_a_member_that_died_one_serving_a_corrupted_chunk_and_one_cut_off_mid_symbol_are_one_more_erasure_each(group):
    _, _, _, state, manifest, after = group
    b = StageWorker(cfg(), 0, 0)
    assert b.load_rebuilt(manifest, [], [recipe(group, dead=(1,))])[0] == VERSION  # erasures: 0 (lost), 1 (dead)
    assert np.array_equal(b.arena.host_view(), state)
    c = StageWorker(cfg(), 0, 0)
    assert c.load_rebuilt(manifest, [], [recipe(group, corrupt=(2,))])[0] == VERSION  # 0 (lost), 2 (corrupted)
    assert run_steps(c, list(batches(8))[VERSION:]) == after
    d = StageWorker(cfg(), 0, 0)
    assert d.load_rebuilt(manifest, [], [recipe(group, cut=(3,))])[0] == VERSION  # 0 (lost), 3 (cut mid-symbol)
    assert np.array_equal(d.arena.host_view(), state)


def test_more_erasures_than_parity_fail_the_rebuild_a_new_stage_holds_no_step_a_trained_one_keeps_its_state(group):
    _, _, _, _, manifest, _ = group
    fresh = StageWorker(cfg(), 0, 0)
    with pytest.raises(TooManyErasuresError):
        fresh.load_rebuilt(manifest, [], [recipe(group, dead=(1,), corrupt=(3,))])
    assert fresh.step_count == -1  # neither its initial state nor the snapshot's: any plan restores it again
    trained = StageWorker(cfg(), 0, 0)
    run_steps(trained, list(batches(1, seed=5)))
    before = trained.arena.host_view().copy()
    with pytest.raises(TooManyErasuresError):
        trained.load_rebuilt(manifest, [], [recipe(group, dead=(2, 3))])
    assert trained.step_count == 1 and np.array_equal(trained.arena.host_view(), before)

