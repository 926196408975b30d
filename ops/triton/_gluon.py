"""Gluon pieces the two fp8 decode kernels share (``fp8_decode_gluon``, ``fp8_decode_wgmma``): a program's
key range and its final LSE / output rows. Imports Triton's Gluon, so only the kernels import it."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, BLOCK_N: gl.constexpr):
    """``(pid_s, b, seq_len, start, end, n_tiles, bt_row)`` of a program of grid ``(head blocks, n_splits, B)``:
    split ``pid_s`` of sequence ``b`` covers positions ``[start, end)`` in ``n_tiles`` tiles of ``BLOCK_N``."""
    pid_s = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
    per_split = gl.cdiv(gl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    start = pid_s * per_split
    end = gl.minimum(start + per_split, seq_len)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    return pid_s, b, seq_len, start, end, n_tiles, bt_ptr + b * stride_bt


@gluon.jit
def finish_rows(l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC: gl.constexpr, DIRECT: gl.constexpr):
    """Store the rows' LSE (natural log when ``DIRECT``, one split; else base 2 into the split's workspace
    slot) from the running max ``m_i`` and sum ``l_i`` (base 2); returns ``(1 / l, first output element)``
    per row, ``1 / l`` = 1 where a row saw no key (its accumulator is 0, its LSE -inf)."""
    empty = l_i == 0.0
    inv = 1.0 / gl.where(empty, 1.0, l_i)
    lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
    if DIRECT:  # one split: the final result
        slot = b * M + rows
        lse = lse2 * 0.6931471805599453
    else:
        slot = (b * M + rows) * n_splits + pid_s
        lse = lse2
    gl.store(lse_ptr + slot, lse, mask=row_ok)
    return inv, slot * DC
