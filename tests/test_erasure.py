"""Tests for elastic_llm.snapshot.erasure (systematic RS(k, m) over GF(2^8))."""

from __future__ import annotations

import itertools
import threading
import zlib

import numpy as np
import pytest
import reedsolo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_llm.snapshot.erasure import (
    BackendUnavailableError,
    BufferOverlapError,
    ChecksumFormatError,
    CodeParametersError,
    ErasureError,
    IsalCodec,
    NumpyCodec,
    ReedSolomon,
    ShardCountError,
    ShardDtypeError,
    ShardLengthError,
    TooManyErasuresError,
    checksum,
    checksum_impl,
    gf_invert_matrix,
    isal_available,
    parity_matrix,
)
from elastic_llm.snapshot.erasure import gf
from elastic_llm.snapshot.erasure import isal as isal_binding

BACKENDS = ["numpy", "isal"]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_rs(backend: str, k: int, m: int, small_blocks: bool = True) -> ReedSolomon:
    """A codec whose block / chunk sizes are tiny, so short shards span many blocks
    and both the 8-bit and the 16-bit lookup paths of the numpy kernel run."""
    if not small_blocks:
        return ReedSolomon(k, m, backend=backend)
    if backend == "numpy":
        return ReedSolomon(k, m, codec=NumpyCodec(block_elems=48, wide_min_len=64))
    return ReedSolomon(k, m, codec=IsalCodec(chunk=64))


def random_shards(k: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(k)]


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == np.uint8 and a.shape == b.shape, i
        assert np.array_equal(a, b), f"shard {i} differs"


def erase(shards: list[np.ndarray], lost) -> list:
    lost = set(lost)
    return [None if i in lost else s for i, s in enumerate(shards)]


lengths = st.one_of(st.sampled_from([0, 1, 2, 3, 47, 48, 95, 96, 97]), st.integers(0, 700))


# ---------------------------------------------------------------------------
# the code itself
# ---------------------------------------------------------------------------


def _rows_invertible(g: np.ndarray, rows) -> bool:
    try:
        gf_invert_matrix(g[list(rows)])
    except ZeroDivisionError:
        return False
    return True


@pytest.mark.parametrize("n", range(2, 12))
def test_generator_matrix_is_mds_exhaustively(n):
    """Every k x k submatrix of [I; P] is invertible, for every k + m = n <= 11."""
    for k in range(1, n):
        g = ReedSolomon(k, n - k, backend="numpy").generator_matrix
        bad = [rows for rows in itertools.combinations(range(n), k) if not _rows_invertible(g, rows)]
        assert not bad, f"RS({k},{n - k}) not MDS for rows {bad[:3]}"


@pytest.mark.parametrize("m", [1, 2])
def test_generator_matrix_is_mds_for_all_k_small_m(m):
    """For m <= 2, [I; P] is MDS iff every entry of P and (m = 2) every 2 x 2
    minor of P is non-zero; check that for every k allowed."""
    mul = gf._MUL
    for k in range(1, 256 - m):
        p = parity_matrix(k, m)
        assert p.all(), f"RS({k},{m}) has a zero parity coefficient"
        if m == 2:
            a, b = np.triu_indices(k, 1)
            minors = mul[p[0, a], p[1, b]] ^ mul[p[0, b], p[1, a]]
            assert minors.all(), f"RS({k},2) has a singular 2x2 minor"


def test_singular_matrix_is_detected():
    with pytest.raises(ZeroDivisionError):
        gf_invert_matrix(np.array([[1, 2], [2, 4]], dtype=np.uint8))  # row 2 = 2 * row 1


@pytest.mark.parametrize("k,m", [(1, 1), (1, 2), (2, 1), (4, 2), (8, 2), (10, 4), (3, 7),
                                 (200, 10), (254, 1), (1, 254), (128, 127)])
def test_parity_matrix_is_reedsolo_parity_of_unit_vectors(k, m):
    codec = reedsolo.RSCodec(nsym=m, nsize=k + m)
    p = parity_matrix(k, m)
    assert p.shape == (m, k)
    for i in sorted({0, k - 1, k // 2, 1 % k}):
        e = bytearray(k)
        e[i] = 1
        cw = codec.encode(e)
        assert bytes(cw[:k]) == bytes(e)
        assert bytes(cw[k:]) == p[:, i].tobytes(), f"column {i}"


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(k=st.integers(1, 5), m=st.integers(1, 3), length=lengths, seed=st.integers(0, 2**32 - 1))
def test_roundtrip_every_erasure_pattern_small_codes(backend, k, m, length, seed):
    rs = make_rs(backend, k, m)
    data = random_shards(k, length, seed)
    parity = rs.encode(data)
    assert len(parity) == m and all(p.shape == (length,) and p.dtype == np.uint8 for p in parity)
    shards = data + parity
    for r in range(m + 1):
        for lost in itertools.combinations(range(k + m), r):
            assert_same(rs.decode(erase(shards, lost)), data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_roundtrip_every_pattern_of_m_losses_k6_m4(backend):
    rs = make_rs(backend, 6, 4)
    data = random_shards(6, 333, 7)
    shards = data + rs.encode(data)
    for lost in itertools.combinations(range(10), 4):
        assert_same(rs.decode(erase(shards, lost)), data)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12, deadline=None)
@given(km=st.sampled_from([(200, 10), (245, 10), (254, 1), (1, 254), (64, 32), (30, 9)]),
       length=lengths, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_roundtrip_random_patterns_big_codes(backend, km, length, seed, data):
    k, m = km
    rs = make_rs(backend, k, m)
    d = random_shards(k, length, seed)
    shards = d + rs.encode(d)
    for _ in range(3):
        r = data.draw(st.integers(0, m), label="losses")
        lost = data.draw(st.lists(st.integers(0, k + m - 1), min_size=r, max_size=r, unique=True), label="lost")
        assert_same(rs.decode(erase(shards, lost)), d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_instance_long_odd_shards(backend):
    """Default block sizes: multi-block shards on the 16-bit lookup path with an odd tail byte."""
    k, m = 8, 2
    rs = make_rs(backend, k, m, small_blocks=False)
    assert rs.backend == backend
    length = 3 * 131072 * 2 + 12345  # > 3 default blocks, odd
    data = random_shards(k, length, 3)
    parity = rs.encode(data)
    ref = ReedSolomon(k, m, codec=NumpyCodec(wide_min_len=1 << 62))  # 8-bit path only
    assert_same(parity, ref.encode(data))
    assert_same(rs.decode(erase(data + parity, [0, 5])), data)
    assert_same(rs.decode(erase(data + parity, [3, 9])), data)


# ---------------------------------------------------------------------------
# reedsolo compatibility
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None)
@given(k=st.integers(1, 12), m=st.integers(1, 6), length=st.integers(0, 24), data=st.data())
def test_reedsolo_decodes_our_shards(backend, k, m, length, data):
    rs = make_rs(backend, k, m)
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    d = random_shards(k, length, seed)
    shards = d + rs.encode(d)
    codec = reedsolo.RSCodec(nsym=m, nsize=k + m)
    for j in range(length):
        column = bytearray(int(s[j]) for s in shards)
        r = data.draw(st.integers(0, m), label="erasures")
        pos = data.draw(st.lists(st.integers(0, k + m - 1), min_size=r, max_size=r, unique=True), label="pos")
        for p in pos:
            column[p] ^= 0x5A  # garble the erased symbols
        msg = codec.decode(column, erase_pos=pos)[0]
        assert bytes(msg) == bytes(int(s[j]) for s in d), f"column {j}"


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None)
@given(k=st.integers(1, 12), m=st.integers(1, 6), length=st.integers(0, 24), data=st.data())
def test_we_decode_reedsolo_codewords(backend, k, m, length, data):
    rs = make_rs(backend, k, m)
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    d = random_shards(k, length, seed)
    codec = reedsolo.RSCodec(nsym=m, nsize=k + m)
    shards = [np.empty(length, dtype=np.uint8) for _ in range(k + m)]
    for j in range(length):
        cw = codec.encode(bytearray(int(s[j]) for s in d))
        for i in range(k + m):
            shards[i][j] = cw[i]
    assert_same(rs.encode(d), shards[k:])
    r = data.draw(st.integers(0, m), label="losses")
    lost = data.draw(st.lists(st.integers(0, k + m - 1), min_size=r, max_size=r, unique=True), label="lost")
    assert_same(rs.decode(erase(shards, lost)), d)


# ---------------------------------------------------------------------------
# backend equivalence
# ---------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 40), m=st.integers(1, 12), length=lengths, seed=st.integers(0, 2**32 - 1),
       data=st.data())
def test_isal_and_numpy_identical(k, m, length, seed, data):
    variants = [
        ReedSolomon(k, m, backend="isal"),
        ReedSolomon(k, m, codec=IsalCodec(chunk=64)),
        ReedSolomon(k, m, backend="numpy"),
        ReedSolomon(k, m, codec=NumpyCodec(block_elems=48, wide_min_len=64)),
        ReedSolomon(k, m, codec=NumpyCodec(block_elems=48, wide_min_len=0, wide_table_budget=1 << 40)),
    ]
    d = random_shards(k, length, seed)
    parities = [rs.encode(d) for rs in variants]
    for p in parities[1:]:
        assert_same(p, parities[0])
    shards = d + parities[0]
    r = data.draw(st.integers(0, m), label="losses")
    lost = data.draw(st.lists(st.integers(0, k + m - 1), min_size=r, max_size=r, unique=True), label="lost")
    decodes = [rs.decode(erase(shards, lost)) for rs in variants]
    for got in decodes:
        assert_same(got, d)


def test_isal_and_numpy_identical_long_shards():
    for k, m in [(4, 2), (10, 4), (16, 5), (3, 9)]:
        d = random_shards(k, 300001, k * 100 + m)
        a = ReedSolomon(k, m, backend="isal")
        b = ReedSolomon(k, m, backend="numpy")
        pa, pb = a.encode(d), b.encode(d)
        assert_same(pa, pb)
        lost = list(range(0, k + m, 2))[:m]
        assert_same(a.decode(erase(d + pa, lost)), b.decode(erase(d + pb, lost)))


def test_isal_loads_and_is_the_default():
    """ISA-L is the default backend and half of every backend test: a machine without it
    must fail here (with the fix), not skip."""
    assert isal_available(), (
        f"Intel ISA-L could not be loaded ({isal_binding.isal_error()}): "
        "install it with `apt-get install -y libisal2` (the README's test command does)"
    )
    assert ReedSolomon(4, 2).backend == "isal"
    assert checksum_impl() == "isal"


# ---------------------------------------------------------------------------
# out= buffers, aliasing, threads
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_and_decode_into_out(backend):
    rs = make_rs(backend, 5, 3)
    d = random_shards(5, 1001, 11)
    parity = [np.full(1001, 0xEE, dtype=np.uint8) for _ in range(3)]
    ret = rs.encode(d, out=parity)
    assert all(a is b for a, b in zip(ret, parity))
    assert_same(parity, rs.encode(d))
    shards = erase(d + parity, [1, 3, 6])
    out = [np.full(1001, 0xEE, dtype=np.uint8) for _ in range(5)]
    ret = rs.decode(shards, out=out)
    assert all(a is b for a, b in zip(ret, out))
    assert_same(out, d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_row_is_one_row_of_decode_for_every_erasure_pattern(backend):
    rs = make_rs(backend, 4, 2)
    d = random_shards(4, 513, 17)
    full = d + rs.encode(d)
    for lost in itertools.combinations(range(6), 2):
        shards = erase(full, list(lost))
        for row in range(4):
            out = np.full(513, 0xEE, dtype=np.uint8)
            assert rs.decode_row(shards, row, out) is out
            assert np.array_equal(out, d[row]), (lost, row)
            seg = np.full(200, 0xEE, dtype=np.uint8)  # segments of the shards (views) decode to that segment
            rs.decode_row([None if x is None else x[100:300] for x in shards], row, seg)
            assert np.array_equal(seg, d[row][100:300])
    with pytest.raises(TooManyErasuresError):
        rs.decode_row(erase(full, [0, 1, 2]), 0, np.zeros(513, dtype=np.uint8))
    with pytest.raises(CodeParametersError, match="data row"):
        rs.decode_row(full, 4, np.zeros(513, dtype=np.uint8))
    with pytest.raises(ShardLengthError):
        rs.decode_row(erase(full, [0]), 0, np.zeros(10, dtype=np.uint8))
    with pytest.raises(BufferOverlapError):
        rs.decode_row(erase(full, [0]), 0, full[4])


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_row_is_one_row_of_encode(backend):
    rs = make_rs(backend, 5, 3)
    d = random_shards(5, 777, 13)
    full = rs.encode(d)
    for row in range(3):
        out = np.full(777, 0xEE, dtype=np.uint8)
        assert rs.encode_row(d, row, out=out) is out
        assert np.array_equal(out, full[row])
        assert np.array_equal(rs.encode_row([x[100:300] for x in d], row), full[row][100:300])  # segments: views
    with pytest.raises(CodeParametersError, match="parity row"):
        rs.encode_row(d, 3)
    with pytest.raises(ShardLengthError):
        rs.encode_row(d, 0, out=np.zeros(10, dtype=np.uint8))
    with pytest.raises(BufferOverlapError):
        rs.encode_row(d, 0, out=d[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_survivors_in_place(backend):
    rs = make_rs(backend, 4, 2)
    d = random_shards(4, 500, 12)
    shards = d + rs.encode(d)
    originals = [s.copy() for s in d]
    received = erase(shards, [0, 2])
    got = rs.decode(received)
    assert got[1] is d[1] and got[3] is d[3]  # survivors are not copied
    assert_same(got, originals)
    # out[i] may be the surviving shard itself (decode in place)
    out = [np.zeros(500, np.uint8), d[1], np.zeros(500, np.uint8), d[3][:]]
    rs.decode(received, out=out)
    assert_same(out, originals)


@pytest.mark.parametrize("backend", BACKENDS)
def test_length_zero_and_one(backend):
    for length in (0, 1):
        rs = make_rs(backend, 3, 2, small_blocks=False)
        d = random_shards(3, length, length)
        p = rs.encode(d)
        assert [x.shape for x in p] == [(length,)] * 2
        assert_same(rs.decode(erase(d + p, [0, 1])), d)
        assert_same(rs.decode(erase(d + p, [2, 4]), checksums=rs.checksums(d + p)), d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_use_of_one_instance(backend):
    rs = make_rs(backend, 6, 3)
    errors = []

    def work(seed):
        try:
            for it in range(10):
                d = random_shards(6, 700 + seed, seed * 100 + it)
                shards = d + rs.encode(d)
                assert_same(rs.decode(erase(shards, [it % 9, (it + 4) % 9])), d)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_decode_cache_is_bounded():
    rs = ReedSolomon(4, 3, backend="numpy", decode_cache_size=3)
    d = random_shards(4, 64, 1)
    shards = d + rs.encode(d)
    for lost in itertools.combinations(range(7), 3):
        assert_same(rs.decode(erase(shards, lost)), d)
    assert len(rs._cache) <= 3
    tiny = ReedSolomon(4, 3, backend="numpy", decode_cache_bytes=1)
    for lost in itertools.combinations(range(7), 3):
        assert_same(tiny.decode(erase(shards, lost)), d)
    assert len(tiny._cache) == 1


# ---------------------------------------------------------------------------
# checksums
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 7, 4096, 100003])
def test_checksum_is_zlib_crc32(length):
    a = random_shards(1, length, length)[0]
    assert checksum(a) == zlib.crc32(a.tobytes())
    assert checksum(a.tobytes()) == zlib.crc32(a.tobytes())


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 6), m=st.integers(1, 4), length=st.integers(1, 400), data=st.data())
def test_corrupted_shards_are_erasures(backend, k, m, length, data):
    rs = make_rs(backend, k, m)
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    d = random_shards(k, length, seed)
    shards = [s.copy() for s in d] + rs.encode(d)
    sums = rs.checksums(shards)
    nbad = data.draw(st.integers(1, m), label="corrupted")
    nmissing = data.draw(st.integers(0, m - nbad), label="missing")
    idx = data.draw(st.permutations(range(k + m)), label="order")
    bad, missing = idx[:nbad], idx[nbad:nbad + nmissing]
    for i in bad:
        pos = data.draw(st.integers(0, length - 1), label="pos")
        shards[i][pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    received = erase(shards, missing)
    ok = rs.verify(received, sums)
    assert ok == [i not in bad and i not in missing for i in range(k + m)]
    assert_same(rs.decode(received, checksums=sums), d)
    # one more loss than the parity can cover -> refuse, never guess
    extra = idx[nbad + nmissing:][: m + 1 - nbad - nmissing]
    out = [np.full(length, 0xA5, dtype=np.uint8) for _ in range(k)]
    if len(extra) + nbad + nmissing == m + 1:
        with pytest.raises(TooManyErasuresError):
            rs.decode(erase(shards, list(missing) + list(extra)), out=out, checksums=sums)
        assert all((o == 0xA5).all() for o in out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_data_shard_is_not_returned(backend):
    rs = make_rs(backend, 4, 2)
    d = random_shards(4, 256, 5)
    shards = [s.copy() for s in d] + rs.encode(d)
    sums = rs.checksums(shards)
    shards[2][100] ^= 0xFF
    assert not np.array_equal(rs.decode(shards)[2], d[2])  # without checksums the flip goes through
    got = rs.decode(shards, checksums=sums)
    assert_same(got, d)
    assert got[2] is not shards[2]
    # a shard without a recorded checksum is not trusted
    sums2 = list(sums)
    sums2[0] = None
    assert_same(rs.decode(shards, checksums=sums2), d)  # 0 and 2 are out, 2 parity cover them


def test_too_many_erasures_message():
    rs = ReedSolomon(4, 2, backend="numpy")
    d = random_shards(4, 16, 9)
    shards = [s.copy() for s in d] + rs.encode(d)
    sums = rs.checksums(shards)
    shards[5][0] ^= 1
    with pytest.raises(TooManyErasuresError) as ei:
        rs.decode(erase(shards, [0, 3]), checksums=sums)
    e = ei.value
    assert isinstance(e, ErasureError) and isinstance(e, ValueError)
    assert e.lost == 3 and e.missing == (0, 3) and e.corrupted == (5,)
    msg = str(e)
    assert "3 of 6 shards lost" in msg and "at most 2" in msg and "another source" in msg
    with pytest.raises(TooManyErasuresError):
        rs.decode([None] * 6)


def test_checksum_format_errors():
    rs = ReedSolomon(2, 1, backend="numpy")
    d = random_shards(2, 8, 1)
    shards = d + rs.encode(d)
    for bad in ([1, 2], [1, 2, -1], [1, 2, 2**32], [1, 2, "x"], [1, 2, 1.5]):
        with pytest.raises((ChecksumFormatError, ShardCountError)):
            rs.decode(shards, checksums=bad)
    with pytest.raises(ShardCountError):
        rs.decode(shards, checksums=[1, 2])
    with pytest.raises(ChecksumFormatError):
        rs.decode(shards, checksums=[1, 2, -1])


# ---------------------------------------------------------------------------
# errors, and out= untouched on error
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("k,m", [(0, 1), (1, 0), (-1, 2), (250, 6), (255, 1), (1, 255), (True, 1), (2.0, 1)])
def test_bad_code_parameters(k, m):
    with pytest.raises(CodeParametersError):
        ReedSolomon(k, m)


def test_max_code_size_ok():
    rs = ReedSolomon(254, 1)
    d = random_shards(254, 3, 0)
    assert_same(rs.decode(erase(d + rs.encode(d), [100])), d)


def test_isal_missing_gives_clear_error(monkeypatch):
    monkeypatch.setattr(isal_binding, "_load_isal", lambda: None)
    monkeypatch.setattr(isal_binding, "_isal_error", "libisal.so.2: cannot open shared object file")
    with pytest.raises(BackendUnavailableError, match="apt-get install -y libisal2"):
        ReedSolomon(4, 2, backend="isal")
    assert ReedSolomon(4, 2).backend == "numpy"
    assert checksum_impl() == "zlib"
    a = np.arange(1000, dtype=np.uint8)
    assert checksum(a) == zlib.crc32(a.tobytes())


def _sentinel(n, length):
    return [np.full(length, 0xC3, dtype=np.uint8) for _ in range(n)]


def _untouched(bufs):
    return all((b == 0xC3).all() for b in bufs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_validation_leaves_out_untouched(backend):
    rs = make_rs(backend, 3, 2)
    d = random_shards(3, 100, 2)
    cases = [
        (ShardLengthError, [d[0], d[1], d[2][:99]], _sentinel(2, 100)),
        (ShardDtypeError, [d[0], d[1], d[2].astype(np.int16)], _sentinel(2, 100)),
        (ShardDtypeError, [d[0], d[1], d[2].astype(np.float32)], _sentinel(2, 100)),
        (ShardDtypeError, [d[0], d[1], np.zeros((10, 10), np.uint8)], _sentinel(2, 100)),
        (ShardDtypeError, [d[0], d[1], np.zeros(200, np.uint8)[::2]], _sentinel(2, 100)),
        (ShardDtypeError, [d[0], d[1], bytes(100)], _sentinel(2, 100)),
        (ShardCountError, [d[0], d[1]], _sentinel(2, 100)),
        (ShardCountError, d, _sentinel(3, 100)),
        (ShardLengthError, d, _sentinel(1, 100) + _sentinel(1, 101)),
    ]
    for exc, data, out in cases:
        with pytest.raises(exc) as ei:
            rs.encode(data, out=out)
        assert isinstance(ei.value, ErasureError)
        assert _untouched(out), exc
    ro = _sentinel(2, 100)
    ro[1].setflags(write=False)
    with pytest.raises(ShardDtypeError):
        rs.encode(d, out=ro)
    assert _untouched(ro)
    out = _sentinel(2, 100)
    with pytest.raises(BufferOverlapError):
        rs.encode(d, out=[out[0], d[1]])
    assert _untouched(out[:1])
    with pytest.raises(BufferOverlapError):
        rs.encode(d, out=[out[0], out[0]])
    with pytest.raises(ShardCountError):
        rs.encode(np.stack(d))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_validation_leaves_out_untouched(backend):
    rs = make_rs(backend, 3, 2)
    d = random_shards(3, 100, 4)
    shards = d + rs.encode(d)
    cases = [
        (ShardLengthError, [None, d[1], d[2][:50], shards[3], shards[4]]),
        (ShardDtypeError, [None, d[1], d[2].astype(np.uint16), shards[3], shards[4]]),
        (ShardDtypeError, [None, d[1], list(d[2]), shards[3], shards[4]]),
        (ShardCountError, [None, d[1], d[2], shards[3]]),
        (TooManyErasuresError, [None, None, None, shards[3], shards[4]]),
    ]
    for exc, received in cases:
        out = _sentinel(3, 100)
        with pytest.raises(exc):
            rs.decode(received, out=out)
        assert _untouched(out), exc
    out = _sentinel(3, 100)
    with pytest.raises(ShardLengthError):
        rs.decode(erase(shards, [0]), out=out[:2] + [np.zeros(99, np.uint8)])
    assert _untouched(out[:2])
    with pytest.raises(ShardCountError):
        rs.decode(erase(shards, [0]), out=out[:2])
    assert _untouched(out)
    # an out buffer for a lost shard that overlaps a surviving shard
    with pytest.raises(BufferOverlapError):
        rs.decode(erase(shards, [0]), out=[shards[3], out[1], out[2]])
    assert _untouched(out) and np.array_equal(shards[3], rs.encode(d)[0])


def _strided(n):
    return np.zeros(2 * n, np.uint8)[::2]


def _read_only(n):
    a = np.zeros(n, np.uint8)
    a.setflags(write=False)
    return a


_Z = np.zeros  # fresh buffers per call: lambdas below build their own
BAD_INPUT = [  # (what, call(rs, data, shards), error, message pattern); RS(3, 2), shards of 100 bytes
    ("too few data shards", lambda rs, d, s: rs.encode(d[:2]), ShardCountError, r"expected 3 data shards, got 2"),
    ("2-D array as shard list", lambda rs, d, s: rs.encode(np.stack(d)), ShardCountError,
     r"data shards must be a list of 3 arrays, got ndarray"),
    ("unequal lengths", lambda rs, d, s: rs.encode([d[0], d[1], d[2][:99]]), ShardLengthError,
     r"data shard 2 has 99 bytes, shard 0 has 100"),
    ("wrong dtype", lambda rs, d, s: rs.encode([d[0], d[1].astype(np.int16), d[2]]), ShardDtypeError,
     r"data shard 1 must have dtype uint8, got int16 \(a\.view\(np\.uint8\)"),
    ("2-D shard", lambda rs, d, s: rs.encode([d[0], d[1], _Z((10, 10), np.uint8)]), ShardDtypeError,
     r"data shard 2 must be 1-D, got shape \(10, 10\)"),
    ("strided shard", lambda rs, d, s: rs.encode([_strided(100), d[1], d[2]]), ShardDtypeError,
     r"data shard 0 must be C-contiguous, got strides \(2,\): pass np\.ascontiguousarray"),
    ("bytes shard", lambda rs, d, s: rs.encode([d[0], bytes(100), d[2]]), ShardDtypeError,
     r"data shard 1 must be a numpy uint8 array, got bytes"),
    ("read-only out", lambda rs, d, s: rs.encode(d, out=[_Z(100, np.uint8), _read_only(100)]), ShardDtypeError,
     r"parity out buffer 1 is read-only"),
    ("out too short", lambda rs, d, s: rs.encode(d, out=[_Z(100, np.uint8), _Z(99, np.uint8)]), ShardLengthError,
     r"parity out buffer 1 has 99 bytes, data shards have 100"),
    ("out is an input", lambda rs, d, s: rs.encode(d, out=[_Z(100, np.uint8), d[1]]), BufferOverlapError,
     r"parity out buffer 1 overlaps data shard 1: out buffers must not share memory"),
    ("outs overlap", lambda rs, d, s: (lambda b: rs.encode(d, out=[b[:100], b[60:160]]))(_Z(160, np.uint8)),
     BufferOverlapError, r"parity out buffer [01] overlaps parity out buffer [01]"),
    ("decode: too few shards", lambda rs, d, s: rs.decode(s[:4]), ShardCountError, r"expected 5 shards, got 4"),
    ("decode: unequal lengths", lambda rs, d, s: rs.decode([None, s[1], s[2][:50], s[3], s[4]]), ShardLengthError,
     r"shard 2 has 50 bytes, shard 1 has 100"),
    ("decode: out too short", lambda rs, d, s: rs.decode(erase(s, [0]), out=[_Z(100, np.uint8), _Z(100, np.uint8),
                                                                             _Z(99, np.uint8)]),
     ShardLengthError, r"data out buffer 2 has 99 bytes, shards have 100"),
    ("decode: out overlaps a survivor", lambda rs, d, s: rs.decode(erase(s, [0]), out=[s[3], _Z(100, np.uint8),
                                                                                       _Z(100, np.uint8)]),
     BufferOverlapError, r"data out buffer 0 overlaps shard 3"),
    ("decode: too many erasures", lambda rs, d, s: rs.decode(erase(s, [0, 2, 4])), TooManyErasuresError,
     r"3 of 5 shards lost \(3 missing \[0, 2, 4\], 0 failed checksum \[\]\); .* at most 2 lost"),
    ("decode: checksum count", lambda rs, d, s: rs.decode(s, checksums=[0] * 4), ShardCountError,
     r"expected 5 checksums, got 4"),
    ("verify: bad checksum", lambda rs, d, s: rs.verify(s, [0, 0, -1, 0, 0]), ChecksumFormatError,
     r"checksum 2 must be an int in \[0, 2\*\*32\), got -1"),
    ("encode_row: bad row", lambda rs, d, s: rs.encode_row(d, 2), CodeParametersError,
     r"parity row must be an int in \[0, 2\), got 2"),
    ("k + m > 255", lambda rs, d, s: ReedSolomon(250, 6), CodeParametersError, r"k \+ m = 256 > 255"),
    ("k = 0", lambda rs, d, s: ReedSolomon(0, 1), CodeParametersError,
     r"need k >= 1 data and m >= 1 parity shards, got k=0, m=1"),
    ("float k", lambda rs, d, s: ReedSolomon(2.0, 1), CodeParametersError, r"k must be an int, got 2\.0"),
    ("unknown backend", lambda rs, d, s: ReedSolomon(4, 2, backend="cuda"), CodeParametersError,
     r"unknown backend 'cuda'; use 'auto', 'isal' or 'numpy'"),
    ("checksum of strided array", lambda rs, d, s: checksum(_strided(10)), ShardDtypeError,
     r"checksum needs a C-contiguous array"),
]


@pytest.mark.parametrize("what,call,error,message", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_raises_the_specific_error_with_a_helpful_message(what, call, error, message):
    rs = ReedSolomon(3, 2)
    d = random_shards(3, 100, 2)
    shards = d + rs.encode(d)
    with pytest.raises(error, match=message) as ei:
        call(rs, d, shards)
    assert type(ei.value) is error  # the specific class, not a sibling or the base
    assert isinstance(ei.value, ErasureError) and isinstance(ei.value, ValueError)


# ---------------------------------------------------------------------------
# the field comes from reedsolo
# ---------------------------------------------------------------------------


def test_field_tables_are_reedsolos():
    log_t, exp_t, _ = reedsolo.init_tables(prim=0x11D, generator=2, c_exp=8)
    assert gf._EXP.tobytes() == bytes(exp_t)
    assert np.array_equal(gf._LOG[1:], np.frombuffer(bytes(log_t), np.uint8)[1:])
    want = np.array([[reedsolo.gf_mul(a, b) for b in range(256)] for a in range(256)], dtype=np.uint8)
    assert np.array_equal(gf._MUL, want)
    assert [int(x) for x in gf._INV[1:]] == [reedsolo.gf_inverse(a) for a in range(1, 256)]
    for m in (1, 2, 5, 32, 254):
        assert gf.generator_poly(m).tobytes() == bytes(reedsolo.RSCodec(nsym=m, nsize=255).gen[m])


def test_parity_matrix_survives_reedsolo_switching_its_field():
    """reedsolo keeps its tables in module globals that any other user may re-initialise;
    the parity matrix must still be built over our field."""
    want = parity_matrix(7, 3).copy()
    gf._parity_matrix.cache_clear()
    try:
        reedsolo.init_tables(prim=0x11B, generator=3, c_exp=8)  # the AES field
        assert np.array_equal(parity_matrix(7, 3), want)
        reedsolo.init_tables(prim=0x11B, generator=3, c_exp=8)
        assert gf.generator_poly(3).tobytes() == bytes(reedsolo.RSCodec(nsym=3, nsize=10).gen[3])
    finally:
        reedsolo.init_tables()
