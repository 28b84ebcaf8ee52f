"""The numpy kernel: the vectorised fallback codec (packed table lookups and XOR).

What this module owns
---------------------
* :class:`NumpyCodec`, the :class:`ErasureCodec` used where ISA-L is not installed (or
  when asked for): bytewise ``outputs[r] = XOR_c matrix[r, c] * inputs[c]`` with
  ``np.take`` on packed product tables and ``np.bitwise_xor``, in cache-sized blocks.
  It produces exactly the bytes ISA-L produces (the test-suite compares them).
* Its plans: packed lookup tables derived from the field's product table
  (:data:`.gf._MUL`) -- 8-bit (256 entries, up to 8 outputs per lookup) and 16-bit
  (64Ki entries, two data bytes and up to 4 outputs per lookup), built lazily.

What this module must never do
------------------------------
* Allocate full-size temporaries or copy whole shards: scratch is per thread, reused,
  and one block long.
* Know the code or validate arguments: the matrices come from the codec, which has
  checked every buffer before ``apply`` runs; the field comes from :mod:`.gf` only.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import numpy as np

from elastic_llm.snapshot.erasure.base import CodeParametersError, ErasureCodec
from elastic_llm.snapshot.erasure.gf import _MUL


_LANE_DTYPES: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def _lane_bytes(nlanes: int, lane_size: int) -> int:
    b = nlanes * lane_size
    for w in (1, 2, 4, 8):
        if b <= w:
            return w
    raise AssertionError(b)


class _Group:
    """Up to ``lanes`` outputs computed together with one packed lookup per input."""

    __slots__ = ("outs", "dtype", "nlanes", "terms")

    def __init__(self, outs: list[int], dtype: np.dtype, terms: list[tuple[int, Optional[np.ndarray]]]):
        self.outs = outs          # output row indices
        self.dtype = dtype        # accumulator entry type
        self.nlanes = len(outs)
        self.terms = terms        # (input index, table or None meaning plain XOR)


def _build_groups(matrix: np.ndarray, wide: bool) -> list[_Group]:
    """Packed lookup tables for a coefficient matrix.

    narrow: 256-entry tables indexed by one data byte; entry = the products of
            that byte with the coefficients of up to 8 outputs, output t in byte t.
    wide:   65536-entry tables indexed by two adjacent data bytes (little-endian
            uint16); entry = up to 4 outputs, output t in uint16 lane t, whose low
            byte is coef*byte0 and high byte is coef*byte1.
    """
    rows, cols = matrix.shape
    per = 4 if wide else 8
    lane = 2 if wide else 1
    groups = []
    for g0 in range(0, rows, per):
        outs = list(range(g0, min(rows, g0 + per)))
        dtype = _LANE_DTYPES[_lane_bytes(len(outs), lane)]
        terms: list[tuple[int, Optional[np.ndarray]]] = []
        for c in range(cols):
            coefs = matrix[outs, c]
            if not coefs.any():
                continue
            if len(outs) == 1 and coefs[0] == 1:
                terms.append((c, None))
                continue
            if wide:
                # index = byte0 | byte1 << 8  ->  2-D [byte1, byte0] flattened
                t: np.ndarray = np.zeros((256, 256), dtype=np.uint64)
                for lane_i, cf in enumerate(coefs):
                    if cf:
                        row = _MUL[cf].astype(np.uint64)
                        sh = np.uint64(16 * lane_i)
                        t |= ((row << np.uint64(8)) << sh)[:, None] | (row << sh)[None, :]
                t = t.reshape(-1)
            else:
                t = np.zeros(256, dtype=np.uint64)
                for lane_i, cf in enumerate(coefs):
                    if cf:
                        t |= _MUL[cf].astype(np.uint64) << np.uint64(8 * lane_i)
            terms.append((c, t.astype(dtype)))
        groups.append(_Group(outs, dtype, terms))
    return groups


class _NumpyPlan:
    __slots__ = ("matrix", "narrow", "_wide", "wide_ok", "_lock")

    def __init__(self, matrix: np.ndarray, wide_budget: int):
        self.matrix = matrix
        self.narrow = _build_groups(matrix, wide=False)
        rows, cols = matrix.shape
        wide_bytes = 0
        for g0 in range(0, rows, 4):
            wide_bytes += 65536 * _lane_bytes(min(4, rows - g0), 2) * cols
        # 16-bit lookups cost ceil(rows/4)/2 lookups per data byte, 8-bit ones
        # ceil(rows/8); use them only where that is fewer and the tables fit.
        fewer = rows > 0 and (-(-rows // 4)) < 2 * (-(-rows // 8))
        self.wide_ok = fewer and wide_bytes <= wide_budget
        self._wide: Optional[list[_Group]] = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        n = self.matrix.nbytes
        for groups in (self.narrow, self._wide or []):
            n += sum(t.nbytes for g in groups for _c, t in g.terms if t is not None)
        return n

    def wide(self) -> list[_Group]:
        if self._wide is None:
            with self._lock:
                if self._wide is None:
                    self._wide = _build_groups(self.matrix, wide=True)
        return self._wide


class NumpyCodec(ErasureCodec):
    """Pure-numpy kernel: packed table lookups (``np.take``) and XOR.

    For each block of ``block_elems`` lookups per shard and each input shard the
    block is widened once to intp indices (``np.copyto`` into scratch), looked up
    in a packed table that yields the products for several outputs at once, and
    XOR-accumulated; the packed accumulator is finally de-interleaved into the
    outputs.  Long shards (>= ``wide_min_len`` bytes) use 16-bit indices (two
    data bytes per lookup, 64Ki-entry tables, at most ``wide_table_budget``
    bytes of tables per matrix); short shards, the odd last byte and codes whose
    tables would exceed the budget use 8-bit indices (256-entry tables).
    Scratch is per thread and reused, so there are no full-size temporaries.
    """

    name = "numpy"

    def __init__(self, block_elems: int = 131072, wide_min_len: int = 256 << 10,
                 wide_table_budget: int = 16 << 20):
        if block_elems < 1:
            raise CodeParametersError(f"block_elems must be >= 1, got {block_elems}")
        self.block_elems = int(block_elems)
        self.wide_min_len = int(wide_min_len)
        self.wide_table_budget = int(wide_table_budget)
        self._tls = threading.local()

    def prepare(self, matrix: np.ndarray) -> _NumpyPlan:
        return _NumpyPlan(np.ascontiguousarray(matrix, dtype=np.uint8), self.wide_table_budget)

    def _scratch(self, ngroups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tls = self._tls
        e = self.block_elems
        if getattr(tls, "idx", None) is None or tls.acc.shape[0] < ngroups:
            tls.idx = np.empty(e, dtype=np.intp)
            tls.tmp = np.empty(e, dtype=np.uint64)
            tls.acc = np.empty((max(ngroups, 1), e), dtype=np.uint64)
        return tls.idx, tls.tmp, tls.acc

    def apply(self, prepared: _NumpyPlan, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        if not outputs:
            return
        length = outputs[0].shape[0]
        if length == 0:
            return
        start = 0
        if prepared.wide_ok and length >= self.wide_min_len:
            body = length & ~1
            self._run(prepared.wide(), inputs, outputs, 0, body, 2)
            start = body
        if start < length:
            self._run(prepared.narrow, inputs, outputs, start, length, 1)

    def _run(self, groups: list[_Group], inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
             start: int, stop: int, elem: int) -> None:
        idx_buf, tmp_buf, acc_buf = self._scratch(len(groups))
        lane_dt = _LANE_DTYPES[elem]
        step = self.block_elems * elem
        take = np.take
        xor = np.bitwise_xor
        copyto = np.copyto
        # Which inputs are used by which group (input-major loop so each input
        # block is widened to intp once for all groups).
        users: dict[int, list[tuple[int, Optional[np.ndarray]]]] = {}
        for gi, g in enumerate(groups):
            for c, t in g.terms:
                users.setdefault(c, []).append((gi, t))
        order = sorted(users)
        for off in range(start, stop, step):
            nb = min(step, stop - off)
            ne = nb // elem
            idx = idx_buf[:ne]
            accs = []
            for gi, g in enumerate(groups):
                if g.nlanes == 1:
                    # single output: accumulate straight into the output block
                    accs.append(outputs[g.outs[0]][off:off + nb].view(g.dtype))
                else:
                    accs.append(acc_buf[gi].view(g.dtype)[:ne])
            first = [True] * len(groups)
            for c in order:
                src = inputs[c][off:off + nb]
                if elem != 1:
                    src = src.view(lane_dt)
                widened = False
                for gi, t in users[c]:
                    acc = accs[gi]
                    if t is None:  # coefficient 1 on a single output: plain XOR
                        if first[gi]:
                            copyto(acc, src)
                        else:
                            xor(acc, src, out=acc)
                    else:
                        if not widened:
                            copyto(idx, src, casting="unsafe")
                            widened = True
                        if first[gi]:
                            take(t, idx, out=acc, mode="clip")
                        else:
                            tmp = tmp_buf.view(t.dtype)[:ne]
                            take(t, idx, out=tmp, mode="clip")
                            xor(acc, tmp, out=acc)
                    first[gi] = False
            for gi, g in enumerate(groups):
                if first[gi]:  # no non-zero coefficient: outputs are zero
                    for o in g.outs:
                        outputs[o][off:off + nb].fill(0)
                    continue
                if g.nlanes == 1:
                    continue
                lanes = accs[gi].view(lane_dt).reshape(ne, -1)
                for lane_i, o in enumerate(g.outs):
                    dst = outputs[o][off:off + nb]
                    if elem != 1:
                        dst = dst.view(lane_dt)
                    copyto(dst, lanes[:, lane_i])
