"""Triton ``mla::fp4_block_linear``: a tiled GEMM over DeepSeek-V4's packed-fp4 weights (e2m1 + ue8m0 per 32).

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y = x @ W.T`` for one group (expert); the accumulator is
float32. bf16 ``x`` (the model's case, :data:`TILED_WORDS`): the K loop loads ``BLOCK_K`` values a step as int32
words (8 codes each) and one ue8m0 byte per row and 32-block, and decodes them straight into bfloat16 operands
(:func:`e2m1_bf16_tile`: two codes per 32-bit operation, their bits placed in bfloat16's fields, one bfloat16
multiply by the block's power of two; the weights times 2^-32, the accumulator scaled back), one dot a step.
float32 and float16 ``x`` (and bf16 with :data:`TILED_WORDS` off): the packed bytes as ``[BLOCK_N, BLOCK_K / 32,
16]``, both nibbles and the scale decoded into float32 bit patterns (exact: every ``e2m1 * 2^(s-127)`` is a
float32), two dots, the low nibbles against x's even columns and the high nibbles against its odd columns (x split
in registers), IEEE float32 for float32 / float16 ``x``, bf16 operands for bf16 ``x``.

Few rows per weight (decode: one token per expert, or a handful) take the GEMV kernel instead: one program per
row and ``BLOCK_N`` output columns, no ``tl.dot`` (whose 16-row minimum and operand shuffles cost more than the
math). There the decode, not memory, bounds the time, so it reads the packed codes as int32 words (8 codes each,
a 32-block is 4 words, one 16-byte load) and decodes two codes per 32-bit operation (:func:`fp4_block_sums`:
each code's bits moved into float16's, the word's two halves at once); each 32-block's products are summed in
float32 in one thread, then scaled by its ue8m0 power of two. Sorted groups map rows to groups with
``torch.searchsorted`` on the device (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.fp4_block_linear import as_bytes, validate
from mla_compile.ops.triton._common import last_dim_contiguous, num_sms, tiles_started

BLOCK_K = 128  # K values per loop step: 64 packed bytes, 4 scales per weight row


@triton.jit
def _e2m1(code):
    """e2m1 codes (uint32 in [0, 16)) -> float32 values, built as bit patterns: ``e == 0`` is 0 or 0.5,
    otherwise exponent ``e - 1`` with the mantissa bit as float32's top fraction bit; bit 3 the sign."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    bits = bits | ((code >> 3) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0(s):
    """ue8m0 bytes (uint32) -> ``2^(s - 127)`` float32 (byte 0: the subnormal 2^-127; byte 255: NaN)."""
    bits = tl.where(s == 0, 1 << 22, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


F16_UNIT = tl.constexpr(16384.0)  # 2^14: a code's bits placed in float16's fields give its value / 2^14 (see e2m1_pair)
SIGN_BITS = tl.constexpr(-2147450880)  # 0x80008000 as int32: the sign bit of both float16 halves


@triton.jit
def _f16_bits(bits):
    """The low 16 bits of int32 ``bits`` as a float16's bit pattern, widened to float32 (exact)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_pair(w, I: tl.constexpr):
    """Codes ``I`` and ``I + 4`` (``I`` in 0..3) of int32 words ``w`` holding 8 e2m1 codes each (code i in bits
    4i..4i+3, i.e. the word's 8 consecutive weights) -> two float32 tensors shaped like ``w``: each code's value
    / 2^14. The code's exponent and mantissa bits land in float16's lowest exponent bits and top mantissa bit and
    its sign bit in float16's sign: ``2^(e - 15) * (1 + m/2)``, and for e = 0 float16's subnormal ``m * 2^-15``,
    both exactly the e2m1 value / 2^14. Codes I and I + 4 sit 16 bits apart, so one shift-and-mask places both
    halves of the word."""
    if I == 0:
        both = ((w << 9) & 0x0E000E00) | ((w << 12) & SIGN_BITS)
    elif I == 1:
        both = ((w << 5) & 0x0E000E00) | ((w << 8) & SIGN_BITS)
    elif I == 2:
        both = ((w << 1) & 0x0E000E00) | ((w << 4) & SIGN_BITS)
    else:
        both = ((w >> 3) & 0x0E000E00) | (w & SIGN_BITS)
    return _f16_bits(both), _f16_bits(both >> 16)


@triton.jit
def columns8(x):
    """The 8 columns of ``x [..., 8]``, each shaped ``x.shape[:-1]`` (register renames where the 8 are in one
    thread)."""
    even, odd = tl.split(tl.reshape(x, x.shape[:-1] + (4, 2)))  # columns 0 2 4 6, 1 3 5 7
    e04, e26 = tl.split(tl.reshape(even, even.shape[:-1] + (2, 2)))
    o15, o37 = tl.split(tl.reshape(odd, odd.shape[:-1] + (2, 2)))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def fp4_block_sums(w, s, x):
    """One step of a packed-fp4 GEMV: int32 words ``w [R, G, 4]`` (rows' 32-blocks g, 8 codes a word), their ue8m0
    bytes ``s [R, G]`` and float32 ``x [G, 4, 8]`` (the same columns: word j's code i is column 8j + i) -> float32
    ``[R, G]``, each block's ``sum(W * x)``: the products summed in float32 within the thread, then times 2^14 and
    the block's power of two."""
    x0, x1, x2, x3, x4, x5, x6, x7 = columns8(x)
    v0, v4 = e2m1_pair(w, 0)
    p = v0 * x0[None, :, :]
    p += v4 * x4[None, :, :]
    v1, v5 = e2m1_pair(w, 1)
    p += v1 * x1[None, :, :]
    p += v5 * x5[None, :, :]
    v2, v6 = e2m1_pair(w, 2)
    p += v2 * x2[None, :, :]
    p += v6 * x6[None, :, :]
    v3, v7 = e2m1_pair(w, 3)
    p += v3 * x3[None, :, :]
    p += v7 * x7[None, :, :]
    return tl.sum(p, axis=2) * F16_UNIT * _ue8m0(s.to(tl.uint32))


# The tiled kernels' bf16 word decode gives W * 2^-TILE_SHIFT; the accumulator is scaled back by 2^TILE_SHIFT
TILE_SHIFT = tl.constexpr(32)
TILE_UNIT = tl.constexpr(4294967296.0)  # 2^TILE_SHIFT
BF16_NAN = tl.constexpr(0x7FC0)


@triton.jit
def bf16_pair_bits(w, I: tl.constexpr):
    """Codes ``I`` and ``I + 4`` of int32 words ``w`` (as :func:`e2m1_pair`) placed in bfloat16's fields, code I in
    the low half and code I + 4 in the high half of each int32: exponent and mantissa bits in bfloat16's lowest
    exponent bits and top mantissa bit, the sign in its sign (each half the code's value * 2^-126, see
    :func:`_bf16_pair`). Also called from the Gluon fp4 kernels."""
    if I == 0:
        both = ((w << 6) & 0x01C001C0) | ((w << 12) & SIGN_BITS)
    elif I == 1:
        both = ((w << 2) & 0x01C001C0) | ((w << 8) & SIGN_BITS)
    elif I == 2:
        both = ((w >> 2) & 0x01C001C0) | ((w << 4) & SIGN_BITS)
    else:
        both = ((w >> 6) & 0x01C001C0) | (w & SIGN_BITS)
    return both


@triton.jit
def _bf16_pair(w, I: tl.constexpr, F32: tl.constexpr):
    """Codes ``I`` and ``I + 4`` of int32 words ``w`` (as :func:`e2m1_pair`) -> two bfloat16 tensors: each code's
    value * 2^-126. Exponent and mantissa bits land in bfloat16's lowest exponent bits and top mantissa bit, the
    sign in its sign: ``2^(e - 127) * (1 + m/2)``, and for e = 0 the subnormal ``m * 2^-127``. ``F32``: the same
    values as float32 (the bit patterns shifted up 16: Triton's CPU interpreter flushes bfloat16 subnormals)."""
    both = bf16_pair_bits(w, I)
    if F32:
        lo = (both << 16).to(tl.float32, bitcast=True)
        hi = (both & -65536).to(tl.float32, bitcast=True)
    else:
        lo = both.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (both >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def bf16_scale_bits(s):
    """ue8m0 bytes ``s`` (int32) -> the bfloat16 bits (low 16 of an int32) of ``2^(s - 1 - TILE_SHIFT)``, the factor
    that turns :func:`bf16_pair_bits`' values into the weights times 2^-TILE_SHIFT (byte 255: NaN; the exact range in
    :func:`e2m1_bf16_tile`). Also called from the Gluon fp4 kernels."""
    return tl.where(s == 255, BF16_NAN, tl.minimum(s + (126 - TILE_SHIFT), 255) << 7)


@triton.jit
def e2m1_bf16_tile(w, sbyte, F32: tl.constexpr):
    """int32 words ``w [R, W]`` (8 codes each) and their 32-blocks' ue8m0 bytes ``sbyte [R, W / 4]`` (int32) ->
    bfloat16 ``[R, 8 W]`` in column order (word j's code i at column 8j + i): the weights times 2^-TILE_SHIFT,
    decoded in bfloat16 pairs (:func:`_bf16_pair`) and scaled by one bfloat16 multiply each (``2^(s - 1 -
    TILE_SHIFT)``): the tiled ``tl.dot`` kernels' decode for bf16 x, without the float32 round trip. Exact for
    scale bytes 34..160, where every scaled weight is a normal bfloat16 (|W| in [2^-94, 6 * 2^33]); below,
    subnormal or 0; above, the factor is inf; byte 255 (NaN) gives NaN. ``F32``: decoded and scaled in float32
    (the same exact products, for Triton's CPU interpreter: it flushes bfloat16 subnormals and multiplies bfloat16
    tensors wrongly)."""
    c0, c4 = _bf16_pair(w, 0, F32)
    c1, c5 = _bf16_pair(w, 1, F32)
    c2, c6 = _bf16_pair(w, 2, F32)
    c3, c7 = _bf16_pair(w, 3, F32)
    r = tl.join(tl.join(tl.join(c0, c1), tl.join(c2, c3)), tl.join(tl.join(c4, c5), tl.join(c6, c7)))
    R: tl.constexpr = w.shape[0]
    W: tl.constexpr = w.shape[1]
    r = tl.reshape(tl.permute(r, (0, 1, 4, 3, 2)), (R, 8 * W))  # the joins' last axis is code bit 2: reverse them
    bits = bf16_scale_bits(sbyte)
    if F32:
        f = (bits << 16).to(tl.float32, bitcast=True)
    else:
        f = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return (r * tl.reshape(tl.broadcast_to(f[:, :, None], (R, W // 4, 32)), (R, 8 * W))).to(tl.bfloat16)


@triton.jit
def load_x_blocks(x_row, k0, n_blocks, G: tl.constexpr):
    """float32 ``[G, 4, 8]``: columns ``k0 + [0, 32 G)`` of the row at ``x_row`` (any float dtype) as ``G`` 32-blocks
    of 4 words of 8 (the layout :func:`fp4_block_sums` takes); blocks past ``n_blocks`` read 0."""
    g = k0 // 32 + tl.arange(0, G)
    col = (g[:, None] * 32 + tl.arange(0, 4)[None, :] * 8)[:, :, None] + tl.arange(0, 8)[None, None, :]
    return tl.load(x_row + col, mask=(g < n_blocks)[:, None, None], other=0.0).to(tl.float32)


@triton.jit
def load_blocks(w_rows, s_rows, n_ok, k0, n_blocks, G: tl.constexpr):
    """The same ``G`` 32-blocks of rows ``w_rows [R]`` (int32 word pointers) and their ue8m0 bytes at ``s_rows
    [R]``: ``(words [R, G, 4], bytes [R, G])``; rows off ``n_ok`` and blocks past ``n_blocks`` read code 0."""
    g = k0 // 32 + tl.arange(0, G)
    g_ok = g < n_blocks
    word = g[:, None] * 4 + tl.arange(0, 4)[None, :]
    w = tl.load(w_rows[:, None, None] + word[None, :, :], mask=n_ok[:, None, None] & g_ok[None, :, None], other=0)
    s = tl.load(s_rows[:, None] + g[None, :], mask=n_ok[:, None] & g_ok[None, :], other=127)
    return w, s


def as_words(t: Tensor) -> Tensor:
    """Packed codes ``[..., K/2]`` (bytes, last dim contiguous) viewed as int32 words ``[..., K/8]`` (copied first
    where a stride or the offset is not a whole number of words)."""
    t = as_bytes(t)
    if t.storage_offset() % 4 or any(st % 4 for st in t.stride()[:-1]):
        t = t.contiguous()
    return t.view(torch.int32)


@triton.jit
def _fp4_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K,
    s_xe, s_xm, s_we, s_wn, s_se, s_sn, s_ye, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WORDS: tl.constexpr,
    F32: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = _tile(x_ptr + e * s_xe, w_ptr + e * s_we, s_ptr + e * s_se, offs_m, offs_m < M, pid_n, N, K,
                s_xm, s_wn, s_sn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, WORDS, F32, EVEN_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y = y_ptr + e * s_ye + offs_m.to(tl.int64)[:, None] * s_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _fp4_sorted_kernel(
    x_ptr, w_ptr, s_ptr, cu_ptr, y_ptr,
    R, N, K, E,
    s_xm, s_we, s_wn, s_se, s_sn, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    CHUNK: tl.constexpr, WORDS: tl.constexpr, F32: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Rows sorted by group; ``cu [E + 1]`` = ``[0, offs...]``. Program slot -> (group, row tile) by
    ``tiles_started``; slots past ``cu[E]`` write zeros (as the fp8 kernel)."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = -1
    for c in range(0, E + 1, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        e += tiles_started(tl.load(cu_ptr + idx, mask=idx <= E, other=0), idx, E, slot, BLOCK_M)
    start = tl.load(cu_ptr + e).to(tl.int32)
    m0 = (slot - (start // BLOCK_M + e)) * BLOCK_M
    offs_m = start + m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * s_ym + offs_n[None, :]
    n_ok = (offs_n < N)[None, :]
    if e == E:  # rows past cu[E]
        tl.store(y, tl.zeros([BLOCK_M, BLOCK_N], dtype=y_ptr.dtype.element_ty), mask=(offs_m < R)[:, None] & n_ok)
        return
    end = tl.load(cu_ptr + e + 1).to(tl.int32)
    if start + m0 >= end:  # an unused slot between two groups' tiles
        return
    m_ok = offs_m < end
    e64 = e.to(tl.int64)
    acc = _tile(x_ptr, w_ptr + e64 * s_we, s_ptr + e64 * s_se, offs_m, m_ok, pid_n, N, K,
                s_xm, s_wn, s_sn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, WORDS, F32, EVEN_K)
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok)


@triton.jit
def _tile(x_base, w_base, s_base, offs_m, m_ok, pid_n, N, K, s_xm, s_wn, s_sn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
          WORDS: tl.constexpr, F32: tl.constexpr, EVEN_K: tl.constexpr):
    """float32 ``[BLOCK_M, BLOCK_N]`` tile of ``x @ W.T`` for rows ``offs_m`` and column tile ``pid_n``. A step
    loads x ``[BLOCK_M, BLOCK_K]`` (split into even / odd columns in registers), the packed bytes as
    ``[BLOCK_N, BLOCK_K / 32, 16]`` and one scale per row and 32-block, broadcast over the block's 16 bytes.
    ``WORDS`` (bf16 x, :data:`TILED_WORDS`): ``w_base`` / ``s_wn`` in int32 words instead, the tile decoded
    by :func:`e2m1_bf16_tile` and one dot over x as loaded."""
    if WORDS:
        return _tile_words(x_base, w_base, s_base, offs_m, m_ok, pid_n, N, K, s_xm, s_wn, s_sn,
                           BLOCK_M, BLOCK_N, BLOCK_K, F32, EVEN_K)
    G: tl.constexpr = BLOCK_K // 32
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, G)
    offs_i = tl.arange(0, 16)
    n_ok = offs_n < N
    n_blocks = K // 32
    x_rows = x_base + offs_m.to(tl.int64) * s_xm
    w_rows = w_base + offs_n.to(tl.int64) * s_wn
    s_rows = s_base + offs_n.to(tl.int64) * s_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
        g = k0 // 32 + offs_g
        g_ok = g < n_blocks
        byte = g[:, None] * 16 + offs_i[None, :]
        packed = tl.load(w_rows[:, None, None] + byte[None, :, :], mask=n_ok[:, None, None] & g_ok[None, :, None],
                         other=0).to(tl.uint32)
        sbyte = tl.load(s_rows[:, None] + g[None, :], mask=n_ok[:, None] & g_ok[None, :], other=127)
        scale = _ue8m0(sbyte.to(tl.uint32))[:, :, None]
        w_lo = tl.reshape(_e2m1(packed & 15) * scale, (BLOCK_N, BLOCK_K // 2))
        w_hi = tl.reshape(_e2m1(packed >> 4) * scale, (BLOCK_N, BLOCK_K // 2))
        if IEEE:
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_even.to(tl.bfloat16), tl.trans(w_lo.to(tl.bfloat16)))
            acc += tl.dot(x_odd.to(tl.bfloat16), tl.trans(w_hi.to(tl.bfloat16)))
    return acc


@triton.jit
def _tile_words(x_base, w_base, s_base, offs_m, m_ok, pid_n, N, K, s_xm, s_wn, s_sn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
                EVEN_K: tl.constexpr):
    """:func:`_tile` over int32 words (``w_base``, ``s_wn`` in words) for bf16 x: the bfloat16 decode, the
    accumulator scaled back by 2^TILE_SHIFT. Weight rows past N read row N - 1 and x rows off ``m_ok`` read row 0
    (the caller's store drops both), so the loads carry no mask where ``EVEN_K`` (K a multiple of ``BLOCK_K``)."""
    W: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 32
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_base + tl.where(m_ok, offs_m, 0).to(tl.int64) * s_xm
    w_rows = w_base + rows * s_wn
    s_rows = s_base + rows * s_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        j = k0 // 8 + tl.arange(0, W)
        g = k0 // 32 + tl.arange(0, G)
        if EVEN_K:
            x = tl.load(x_rows[:, None] + k[None, :])
            w = tl.load(w_rows[:, None] + j[None, :])
            sbyte = tl.load(s_rows[:, None] + g[None, :])
        else:
            x = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(w_rows[:, None] + j[None, :], mask=(j < K // 8)[None, :], other=0)
            sbyte = tl.load(s_rows[:, None] + g[None, :], mask=(g < K // 32)[None, :], other=127)
        acc += tl.dot(x, tl.trans(e2m1_bf16_tile(w, sbyte.to(tl.int32), F32)))
    return acc * TILE_UNIT


@triton.jit
def _fp4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, grp_ptr, y_ptr,
    N, K, E,
    s_xe, s_xm, s_we, s_wn, s_se, s_sn, s_ye, s_ym,
    SORTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    """``y[row, n-tile]`` for one row: dense (group = program_id 2; ``s_xe`` 0 shares x) or sorted (the row's
    group read from ``grp``; group E = past ``offs[-1]``, written as zeros). ``w_ptr``: int32 words, ``s_we`` and
    ``s_wn`` in words."""
    r = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if SORTED:
        e = tl.load(grp_ptr + r).to(tl.int64)
        x_row = x_ptr + r * s_xm
        y_row = y_ptr + r * s_ym
        if e == E:
            tl.store(y_row + offs_n, tl.zeros([BLOCK_N], dtype=y_ptr.dtype.element_ty), mask=n_ok)
            return
    else:
        e = tl.program_id(2).to(tl.int64)
        x_row = x_ptr + e * s_xe + r * s_xm
        y_row = y_ptr + e * s_ye + r * s_ym
    G: tl.constexpr = BLOCK_K // 32
    w_rows = w_ptr + e * s_we + offs_n.to(tl.int64) * s_wn
    s_rows = s_ptr + e * s_se + offs_n.to(tl.int64) * s_sn
    acc = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):  # the loads pipelined STAGES deep
        w, s = load_blocks(w_rows, s_rows, n_ok, k0, K // 32, G)
        acc += fp4_block_sums(w, s, load_x_blocks(x_row, k0, K // 32, G))
    tl.store(y_row + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


# At most GEMV_ROWS rows per weight take the GEMV kernel (sorted groups: at most GEMV_ROWS_SORTED per group on
# average; each row re-reads its group's weights, so several rows per group go to the tiled kernel). Tiles
# from an H200 sweep at V4-Flash expert shapes (benchmarks/bench_fp4_experts.py --sweep).
GEMV_ROWS = 4
GEMV_ROWS_SORTED = 0.5
# The tiled kernels' decode for bf16 x: True :func:`e2m1_bf16_tile` over int32 words, False the byte-wise one
# through float32 (`bench_fp4_experts.py --sweep` times the other one); float32 / float16 x always take the
# byte-wise decode and IEEE float32 dots
TILED_WORDS = True
WORDS_BLOCK_N = 128  # the word decode's tile width: its per-step overheads spread over more weights
# The sorted groups' word decode at 16-row tiles (groups of 16 rows or fewer on average): half as wide, twice as deep
# per step; faster than the dense tile at 64 to 512 tokens over V4-Flash's 256 experts (BENCHMARKS.md run 301)
SORTED_WORDS_TILE = dict(BLOCK_N=64, BLOCK_K=256)
GEMV_CONFIG = dict(BLOCK_N=8, BLOCK_K=512, STAGES=3, num_warps=4)


def _gemv_config() -> dict:
    return dict(GEMV_CONFIG)


def _launch_gemv(x3: Tensor, w3: Tensor, s3: Tensor, y: Tensor, grp: Tensor | None) -> None:
    """GEMV path into ``y``: ``x3 [E or 1, M, K]`` / ``y [E, M, N]`` dense, or ``x3 [R, K]`` / ``y [R, N]`` with
    ``grp [R]`` the group of each row (sorted); ``w3`` packed bytes (read as int32 words)."""
    E, N, half = w3.shape
    words = as_words(w3)
    cfg = _gemv_config()
    sorted_rows = grp is not None
    if grp is None:
        s_xe = x3.stride(0) if x3.shape[0] == E else 0
        grid = (x3.shape[1], triton.cdiv(N, cfg["BLOCK_N"]), E)
        args = (s_xe, x3.stride(1), words.stride(0), words.stride(1), s3.stride(0), s3.stride(1), y.stride(0),
                y.stride(1))
        grp = y  # unused
    else:
        grid = (x3.shape[0], triton.cdiv(N, cfg["BLOCK_N"]))
        args = (0, x3.stride(0), words.stride(0), words.stride(1), s3.stride(0), s3.stride(1), 0, y.stride(0))
    wrap_triton(_fp4_gemv_kernel)[grid](x3, words, s3, grp, y, N, 2 * half, E, *args, SORTED=sorted_rows, **cfg)


def _config(M: int, ieee: bool, device: torch.device) -> dict:
    """Tiles and launch options; fp32 operands take twice the registers of bf16 ones: smaller tiles. The byte
    decode's BLOCK_N 32: twice the programs of 64 and its fastest bf16 tile at V4-Flash expert shapes on the H200
    (BENCHMARKS.md, run 110's FP4 section); the word decode's :data:`WORDS_BLOCK_N` (runs 279, 281). ``F32`` for
    CPU tensors (Triton's interpreter)."""
    block_m = 16 if M <= 16 else (32 if ieee else 64)
    words = TILED_WORDS and not ieee
    block_n = WORDS_BLOCK_N if words else 32
    num_warps, num_stages = (8, 1) if ieee else (4, 3)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64 if ieee else BLOCK_K, IEEE=ieee, WORDS=words,
                F32=device.type != "cuda", num_warps=num_warps, num_stages=num_stages)


def _tiled_weight(w: Tensor, cfg: dict) -> Tensor:
    """The packed codes as the tiled kernels read them: bytes, or int32 words for the word decode."""
    return as_words(w) if cfg["WORDS"] else w


def _launch_sorted(x: Tensor, weight: Tensor, weight_scale: Tensor, offs: Tensor) -> Tensor:
    """Sorted-groups kernel path: ``x [R, K]`` with ``offs [E]`` cumulative row ends -> ``[R, N]``."""
    E, N, half = weight.shape
    R = x.shape[0]
    y = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R * N == 0:
        return y
    x = last_dim_contiguous(x)
    w = last_dim_contiguous(as_bytes(weight))
    s = last_dim_contiguous(as_bytes(weight_scale))
    if R <= GEMV_ROWS_SORTED * E:  # few rows per group: one program per row
        rows = torch.arange(R, device=x.device, dtype=offs.dtype)
        _launch_gemv(x, w, s, y, torch.searchsorted(offs, rows, right=True).to(torch.int32))
        return y
    cu = torch.cat([offs.new_zeros(1), offs])
    cfg = dict(_config(R // E, x.dtype != torch.bfloat16, x.device))  # tiles sized by the rows a group has on average
    if cfg["WORDS"] and cfg["BLOCK_M"] == 16:
        cfg.update(SORTED_WORDS_TILE)
    w = _tiled_weight(w, cfg)
    grid = (triton.cdiv(R, cfg["BLOCK_M"]) + E, triton.cdiv(N, cfg["BLOCK_N"]))
    cfg["EVEN_K"] = (2 * half) % cfg["BLOCK_K"] == 0
    wrap_triton(_fp4_sorted_kernel)[grid](
        x, w, s, cu, y, R, N, 2 * half, E,
        x.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), y.stride(0),
        CHUNK=128, **cfg,
    )
    return y


def _launch(x: Tensor, weight: Tensor, weight_scale: Tensor) -> Tensor:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract."""
    grouped = weight.dim() == 3
    w3 = last_dim_contiguous(as_bytes(weight if grouped else weight[None]))
    s3 = last_dim_contiguous(as_bytes(weight_scale if grouped else weight_scale[None]))
    E, N, half = w3.shape
    M = x.shape[-2]
    x3 = last_dim_contiguous(x if x.dim() == 3 else x[None])
    y = torch.empty(E, M, N, dtype=x.dtype, device=x.device)
    if M * N == 0:
        return y if grouped else y[0]
    if M <= GEMV_ROWS:
        _launch_gemv(x3, w3, s3, y, None)
        return y if grouped else y[0]
    s_xe = x3.stride(0) if x3.shape[0] == E else 0  # a shared [M, K] activation for every group
    cfg = dict(_config(M, x.dtype != torch.bfloat16, x.device))
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * E
    if cfg["WORDS"] and tiles * triton.cdiv(N, cfg["BLOCK_N"]) < num_sms(x.device):
        cfg["BLOCK_N"] = WORDS_BLOCK_N // 2  # a weight or two of few rows: more, narrower programs
    w3 = _tiled_weight(w3, cfg)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), E)
    cfg["EVEN_K"] = (2 * half) % cfg["BLOCK_K"] == 0
    wrap_triton(_fp4_linear_kernel)[grid](
        x3, w3, s3, y, M, N, 2 * half,
        s_xe, x3.stride(1), w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1), y.stride(0), y.stride(1),
        **cfg,
    )
    return y if grouped else y[0]


@triton_op("mla::fp4_block_linear_triton", mutates_args=())
def fp4_block_linear_triton(x: Tensor, weight: Tensor, weight_scale: Tensor, offs: Tensor | None = None) -> Tensor:
    """Triton ``mla::fp4_block_linear`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return torch.ops.mla.fp4_block_linear_ref(x, weight, weight_scale, offs)
    validate(x, weight, weight_scale, offs)
    if offs is not None:
        return _launch_sorted(x, weight, weight_scale, offs)
    return _launch(x, weight, weight_scale)
