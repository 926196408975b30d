"""The sm_90 fp8 decode that streams tiles by TMA and feeds ``wgmma`` from registers (Gluon).

Warp-specialized, one program an SM: a producer warp copies each 64-key tile of the 656-byte cache rows into
a 4-slot shared-memory ring by three TMA copies (``_fp8_tma.issue_tile``), streaming the split's tiles in
order; two consumer warpgroups take alternate tiles, each with its own softmax state, and merge at the end
through shared memory. The codes are read into registers twice and converted exactly to float16 (no
dequantized tile in shared memory, no scale in the products):

- scores: per scale group g, ``S_g^T [64 keys, 16 rows] = K_g Q_g^T`` (``wgmma``, A from registers), then
  ``S^T = R Qr^T + sum_g scale[key, g] S_g^T`` in fp32 (the rope part ``R`` from shared memory);
- the online softmax runs down the key dim; ``P'_g = P * scale[key, g] * 256`` (float16, scales clamped
  at 255 as in ``fp8_decode_gluon``) goes to shared memory as the B operand;
- values: ``O_g^T [128, 16] += V_g^T P'_g^T`` with V's key pairs joined in registers (``prmt``).

The four groups' dots are pipelined (``is_async``: group g + 1 converts while group g multiplies); the
output is rescaled only when a row's maximum grows. So the codes are never rounded and the scales apply in
fp32: LSEs match float64 to ~1e-6 like ``fp8_decode_gluon``'s (``fp8_decode_wgmma``, which rounds
``code * scale`` to float16: ~1e-3). Queries are float16 times a power of two (``_gluon.q_power``).
One stream an SM into a deeper ring beats two programs an SM with two slots each (timings in
BENCHMARKS.md). With several splits the last split of each row
block merges them (no reduce kernel).

Needs sm_90, pages of a multiple of 64 rows and a contiguous cache (a TMA descriptor spans it);
``fp8_decode_gluon.decode_fp8_gluon`` routes other caches to the other kernels.
"""

from __future__ import annotations

import triton
import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mla_compile.ops.triton._fp8_tma import (BLOCK_H, BLOCK_N, CODE_BOX, CODE_SL, KL, ROPE_C, ROPE_SL, ROW_BYTES,
                                             SCALE_C, SCALE_SL, VL, column_of_m, cvt_k, cvt_v, issue_tile, load_scales,
                                             load_words, opaque_zero, score_k)
from mla_compile.ops.triton._gluon import finish_rows, pdl_start, q_power, split_range, tile_page
from mla_compile.ops.triton._pdl import launch_kwargs
from mla_compile.ops.triton.decode import _LOG2E
from mla_compile.ops.triton.fp8_decode_wgmma import split_setup

STAGES = 4  # ring slots of 41 KB, one program an SM (``smem_bytes``)
PROGRAMS_PER_SM = 1
P_UP = gl.constexpr(256.0)  # P' = P * scale * P_UP in float16
PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))  # the consumers' hand-over views
PLAIN1 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
# [4 warps, 16 rows] partial maxima, every warp's in each thread that holds the row (the score accumulator's
# column distribution)
XCH_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [2, 0], [0, 1], [0, 8]], lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
    warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, 16]))


@gluon.jit
def _stage_q(q_ptr, b, pid_h, stride_qb, stride_qs, stride_qh, M, H, q_s, qr_s, scale_log2,
             DC: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr):
    """Store the program's query rows: latent ``[16, 512]`` float16 times ``q_power`` in the score dot's column
    order (``score_k`` per group), rope ``[16, 64]`` bf16 times the same power; returns ``scale_log2`` with the
    power undone."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [4, 1, 1], [2, 1, 0])
    r_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    m_q = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, gl.SliceLayout(2, q_l)))
    row = q_ptr + b * stride_qb + (m_q // H).to(gl.int64) * stride_qs + (m_q % H).to(gl.int64) * stride_qh
    g = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, q_l)))
    d = gl.arange(0, 128, gl.SliceLayout(0, gl.SliceLayout(1, q_l)))
    q = gl.load(row[:, None, None] + (g * 128)[None, :, None] + d[None, None, :], mask=(m_q < M)[:, None, None],
                other=0.0).to(gl.float32)
    up = q_power(gl.max(gl.max(gl.max(gl.abs(q), axis=2), axis=1), axis=0))
    q_s.index(0).store(gl.reshape(score_k(gl.reshape((q * up).to(gl.float16), [BLOCK_H * 4, 128])), [BLOCK_H, DC]))
    m_r = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, r_l))
    row = q_ptr + b * stride_qb + (m_r // H).to(gl.int64) * stride_qs + (m_r % H).to(gl.int64) * stride_qh
    qr = gl.load(row[:, None] + DC + gl.arange(0, DR, gl.SliceLayout(0, r_l))[None, :], mask=(m_r < M)[:, None],
                 other=0.0)
    qr_s.index(0).store((qr.to(gl.float32) * up).to(gl.bfloat16))
    return scale_log2 / up


@gluon.jit
def _scores(cs, rope, q_v, qr_v, sc0, sc1, sc2, sc3, zero_s, dot_a: gl.constexpr):
    """``S^T [64 keys, 16 rows]`` of a ring slot: the rope dot plus the four groups' exact-code dots times their
    scales, two ``wgmma`` groups in flight (the next group converts while one multiplies)."""
    tr = warpgroup_mma(rope, qr_v.permute([1, 0]), zero_s, is_async=True)
    a0 = gl.convert_layout(score_k(cvt_k(load_words(cs, 0, KL))), dot_a)
    t0 = warpgroup_mma(a0, q_v.slice(0, 128, dim=1).permute([1, 0]), zero_s, is_async=True)
    a1 = gl.convert_layout(score_k(cvt_k(load_words(cs, 1, KL))), dot_a)
    t1 = warpgroup_mma(a1, q_v.slice(128, 128, dim=1).permute([1, 0]), zero_s, is_async=True)
    s, t0, a0 = warpgroup_mma_wait(1, deps=[tr, t0, a0])
    s = s + t0 * sc0[:, None]
    a2 = gl.convert_layout(score_k(cvt_k(load_words(cs, 2, KL))), dot_a)
    t2 = warpgroup_mma(a2, q_v.slice(256, 128, dim=1).permute([1, 0]), zero_s, is_async=True)
    t1, a1 = warpgroup_mma_wait(1, deps=[t1, a1])
    s = s + t1 * sc1[:, None]
    a3 = gl.convert_layout(score_k(cvt_k(load_words(cs, 3, KL))), dot_a)
    t3 = warpgroup_mma(a3, q_v.slice(384, 128, dim=1).permute([1, 0]), zero_s, is_async=True)
    t2, a2 = warpgroup_mma_wait(1, deps=[t2, a2])
    s = s + t2 * sc2[:, None]
    t3, a3 = warpgroup_mma_wait(0, deps=[t3, a3])
    return s + t3 * sc3[:, None]


@gluon.jit
def _value_operand(cs, g: gl.constexpr, n0, end, partial, dot_a: gl.constexpr):
    """Group ``g``'s value operand ``[128 m, 64 keys]`` float16 (keys at or past ``end`` zeroed when ``partial``:
    a page's rows past a sequence hold anything, NaN codes included)."""
    w = load_words(cs, g, VL)
    if partial:
        w = gl.where((n0 + gl.arange(0, 64, gl.SliceLayout(1, VL)) < end)[:, None], w, 0)
    return gl.convert_layout(cvt_v(w), dot_a)


@gluon.jit
def _fence_gpu(x):
    """``fence.acq_rel.gpu`` in every thread (returns 0; ``x`` only places it)."""
    return gl.inline_asm_elementwise("fence.acq_rel.gpu;\n mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _merge_if_last(o_buf, l_buf, out_ptr, lse_out_ptr, cnt_ptr, b, pid_h, M, n_splits,
                   DC: gl.constexpr, BLOCK_H: gl.constexpr):
    """After a program stored its split's rows: count it (``cnt_ptr``, zeroed by the launch); the last of the
    ``n_splits`` programs of these rows merges every split's output and base-2 LSE into ``out`` (bf16) and
    ``lse`` (natural log), as ``decode.reduce_splits`` would (empty splits have LSE -inf and output 0)."""
    f = _fence_gpu(pid_h)  # this thread's partial stores, visible at GPU scope before the count (release)
    gl.thread_barrier()
    old = gl.atomic_add(cnt_ptr + b * gl.num_programs(0) + pid_h, 1 + f, sem="acq_rel", scope="gpu")
    if old == n_splits - 1:
        _fence_gpu(old)  # the other programs' stores, visible to every thread here (acquire)
        ml: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ml))
        ok = rows < M
        slot = (b * M + rows) * n_splits
        m = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, ml))
        for sp in range(n_splits):
            m = gl.maximum(m, gl.load(l_buf + slot + sp, mask=ok, other=float("-inf"), cache_modifier=".cg"))
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        cols = gl.arange(0, DC, gl.SliceLayout(0, ml))
        total = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, ml))
        acc = gl.zeros([BLOCK_H, DC], gl.float32, ml)
        for sp in range(n_splits):
            w = gl.exp2(gl.load(l_buf + slot + sp, mask=ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
            o = gl.load(o_buf + ((slot + sp) * DC)[:, None] + cols[None, :], mask=ok[:, None], other=0.0,
                        cache_modifier=".cg")
            total = total + w
            acc = acc + o * w[:, None]
        empty = total == 0.0
        inv = 1.0 / gl.where(empty, 1.0, total)
        lse = gl.where(empty, float("-inf"), (m_safe + gl.log2(gl.where(empty, 1.0, total))) * 0.6931471805599453)
        gl.store(lse_out_ptr + b * M + rows, lse, mask=ok)
        ty: gl.constexpr = out_ptr.dtype.element_ty
        gl.store(out_ptr + ((b * M + rows) * DC)[:, None] + cols[None, :], (acc * inv[:, None]).to(ty),
                 mask=ok[:, None])


@gluon.jit
def _produce(desc_c, desc_r, desc_s, codes_s, rope_s, sc_s, full, empty, bt_row, n_tiles, start,
             BLOCK_SIZE: gl.constexpr):
    """The producer warp: tile t into ring slot t % 4 (``full``) once its previous tile's consumer released it
    (``empty``); block-table entries one tile ahead."""
    page = tile_page(bt_row, 0, n_tiles, start, BLOCK_SIZE, 64)
    for t in range(n_tiles):
        slot = t % 4
        page_next = tile_page(bt_row, t + 1, n_tiles, start, BLOCK_SIZE, 64)
        if t >= 4:
            mbarrier.wait(empty.index(slot), ((t // 4) - 1) & 1)
        issue_tile(desc_c, desc_r, desc_s, codes_s, rope_s, sc_s, full, page, t, n_tiles, start, BLOCK_SIZE, 64, 4)
        page = page_next


@gluon.jit
def _consume(C: gl.constexpr, codes_s, rope_s, sc_s, full, empty, done, q_s, qr_s, p_s, xch, scale_log2,
             start, end, n_tiles, seq_len, pid_h, b, pid_s, M, H, S_Q, n_splits,
             o_ptr, lse_ptr, out_ptr, lse_out_ptr, cnt_ptr, DIRECT: gl.constexpr):
    """Consumer warpgroup ``C``: the split's tiles t = C, C + 2, ... (scores, online softmax, values as in the
    module docstring), each slot released to the producer once read. Consumer 1 then hands its softmax
    state and outputs to consumer 0 through its own ring slots (``done``), and consumer 0 merges them and
    stores the result (one split) or the split's rows and, last of the splits, merges the splits."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    key_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    row_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    rows = pid_h * 16 + gl.arange(0, 16, row_l)
    row_ok = rows < M
    limit = seq_len - (S_Q - 1 - rows // H)
    lim_min = gl.min(gl.where(row_ok, limit, seq_len), axis=0)
    offs_n = gl.arange(0, 64, key_l)
    m_i = gl.full([16], float("-inf"), gl.float32, row_l)
    l_part = gl.zeros([64, 16], gl.float32, acc_l)
    zero_s = gl.zeros([64, 16], gl.float32, acc_l)
    o0 = gl.zeros([128, 16], gl.float32, acc_l)
    o1 = gl.zeros([128, 16], gl.float32, acc_l)
    o2 = gl.zeros([128, 16], gl.float32, acc_l)
    o3 = gl.zeros([128, 16], gl.float32, acc_l)
    p0_s = p_s.index(4 * C + 0)
    p1_s = p_s.index(4 * C + 1)
    p2_s = p_s.index(4 * C + 2)
    p3_s = p_s.index(4 * C + 3)
    xc = xch.index(C)
    for t in range(C, n_tiles, 2):
        slot = t % 4
        n0 = start + t * 64
        mbarrier.wait(full.index(slot), (t // 4) & 1)
        z = opaque_zero(t)
        partial = n0 + 64 > end
        cs = codes_s.index(slot)
        sc0, sc1, sc2, sc3 = load_scales(sc_s, slot, n0, end, partial)
        sc0 = gl.convert_layout(sc0, key_l)
        sc1 = gl.convert_layout(sc1, key_l)
        sc2 = gl.convert_layout(sc2, key_l)
        sc3 = gl.convert_layout(sc3, key_l)
        s = _scores(cs, rope_s.index(slot), q_s.index(z), qr_s.index(z), sc0, sc1, sc2, sc3, zero_s, dot_a)
        s = s * scale_log2
        if n0 + 64 > gl.minimum(end, lim_min):
            pos = n0 + offs_n
            s = gl.where((pos < end)[:, None] & (pos[:, None] < limit[None, :]), s, float("-inf"))
        xc.store(gl.max(gl.reshape(s, [4, 16, 16]), axis=1))
        gl.thread_barrier()  # (this consumer's warps only; the next tile's store comes after its P' barrier)
        m_new = gl.maximum(m_i, gl.convert_layout(gl.max(xc.load(XCH_L), axis=0), row_l))
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing: no NaN
        if gl.max((m_new > m_i).to(gl.int32), axis=0) > 0:
            alpha = gl.exp2(m_i - m_shift)
            l_part = l_part * alpha[None, :]
            o0 = o0 * alpha[None, :]
            o1 = o1 * alpha[None, :]
            o2 = o2 * alpha[None, :]
            o3 = o3 * alpha[None, :]
        p = gl.exp2(s - m_shift[None, :])
        l_part = l_part + p
        m_i = m_new
        p0_s.store((p * (gl.minimum(sc0, 255.0) * P_UP)[:, None]).to(gl.float16))
        p1_s.store((p * (gl.minimum(sc1, 255.0) * P_UP)[:, None]).to(gl.float16))
        p2_s.store((p * (gl.minimum(sc2, 255.0) * P_UP)[:, None]).to(gl.float16))
        p3_s.store((p * (gl.minimum(sc3, 255.0) * P_UP)[:, None]).to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        b0 = _value_operand(cs, 0, n0, end, partial, dot_a)
        u0 = warpgroup_mma(b0, p0_s, o0, is_async=True)
        b1 = _value_operand(cs, 1, n0, end, partial, dot_a)
        u1 = warpgroup_mma(b1, p1_s, o1, is_async=True)
        o0, b0 = warpgroup_mma_wait(1, deps=[u0, b0])
        b2 = _value_operand(cs, 2, n0, end, partial, dot_a)
        u2 = warpgroup_mma(b2, p2_s, o2, is_async=True)
        o1, b1 = warpgroup_mma_wait(1, deps=[u1, b1])
        b3 = _value_operand(cs, 3, n0, end, partial, dot_a)
        u3 = warpgroup_mma(b3, p3_s, o3, is_async=True)
        gl.thread_barrier()  # every warp of this consumer has read the slot
        mbarrier.arrive(empty.index(slot), count=1)
        o2, b2 = warpgroup_mma_wait(1, deps=[u2, b2])
        o3, b3 = warpgroup_mma_wait(0, deps=[u3, b3])

    l_i = gl.sum(l_part, axis=0)
    # consumer 1's state through its own ring slots (no copy lands there once its tiles are done)
    xo = codes_s.index(1)._reinterpret(gl.float32, [512, 16], PLAIN)
    xml = sc_s.index(1)._reinterpret(gl.float32, [256], PLAIN1)
    if C == 1:
        xo.slice(0, 128).store(o0)
        xo.slice(128, 128).store(o1)
        xo.slice(256, 128).store(o2)
        xo.slice(384, 128).store(o3)
        xml.slice(0, 16).store(m_i)
        xml.slice(16, 16).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done, count=1)
    else:
        mbarrier.wait(done, 0)
        m1 = xml.slice(0, 16).load(row_l)
        l1 = xml.slice(16, 16).load(row_l)
        m = gl.maximum(m_i, m1)
        m_s = gl.where(m == float("-inf"), 0.0, m)
        a0 = gl.exp2(m_i - m_s)
        a1 = gl.exp2(m1 - m_s)
        l_i = l_i * a0 + l1 * a1
        o0 = o0 * a0[None, :] + xo.slice(0, 128).load(acc_l) * a1[None, :]
        o1 = o1 * a0[None, :] + xo.slice(128, 128).load(acc_l) * a1[None, :]
        o2 = o2 * a0[None, :] + xo.slice(256, 128).load(acc_l) * a1[None, :]
        o3 = o3 * a0[None, :] + xo.slice(384, 128).load(acc_l) * a1[None, :]
        inv, o_first = finish_rows(l_i, m, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, 512, DIRECT)
        inv = (inv / P_UP)[None, :]
        ptr = o_ptr + o_first[None, :] + column_of_m(gl.arange(0, 128, key_l))[:, None]
        ok = row_ok[None, :]
        ty: gl.constexpr = o_ptr.dtype.element_ty
        gl.store(ptr, (o0 * inv).to(ty), mask=ok)
        gl.store(ptr + 128, (o1 * inv).to(ty), mask=ok)
        gl.store(ptr + 256, (o2 * inv).to(ty), mask=ok)
        gl.store(ptr + 384, (o3 * inv).to(ty), mask=ok)
        if not DIRECT:
            _merge_if_last(o_ptr, lse_ptr, out_ptr, lse_out_ptr, cnt_ptr, b, pid_h, M, n_splits, 512, 16)


@gluon.jit
def decode_fp8_tma_kernel(
    q_ptr, desc_c, desc_r, desc_s, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr, out_ptr, lse_out_ptr, cnt_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_bt,
    M, H, S_Q, n_splits, DC: gl.constexpr, DR: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr,
    STAGES: gl.constexpr, PDL: gl.constexpr = False,
):
    """Grid ``(cdiv(M, 16), n_splits, B)``, 4 warps plus a consumer warpgroup and a producer warp
    (``gl.warp_specialize``); bf16 q ``[B, S_Q, H, 576]``; the descriptors span the cache (``launch``);
    ``BLOCK_N = 64`` divides ``BLOCK_SIZE``. ``DIRECT`` (one split): the result into ``o_ptr`` / ``lse_ptr``;
    else each split's rows into the workspaces ``o_ptr`` / ``lse_ptr`` (as ``decode._decode_split_kernel``'s)
    and the last split of each row block merges them into ``out_ptr`` / ``lse_out_ptr`` (``cnt_ptr``: one
    zeroed int32 a row block). ``PDL``: launched with PDL, every program waits for the kernel before it first."""
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    gl.static_assert(BLOCK_N == 64)
    gl.static_assert(STAGES == 4)
    pdl_start(PDL)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.float16)
    pid_h = gl.program_id(0)
    pid_s, b, seq_len, start, end, n_tiles, bt_row = split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, BLOCK_N)
    codes_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 4 * BLOCK_N, 128], CODE_SL)
    rope_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DR], ROPE_C)
    sc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 16], SCALE_C)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for t in gl.static_range(STAGES):
        mbarrier.init(full.index(t), count=1)
        mbarrier.init(empty.index(t), count=1)
    mbarrier.init(done, count=1)
    q_s = gl.allocate_shared_memory(gl.float16, [1, BLOCK_H, DC], ROPE_C)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, DR], ROPE_C)
    scale_log2 = _stage_q(q_ptr, b, pid_h, stride_qb, stride_qs, stride_qh, M, H, q_s, qr_s,
                          gl.full([], scale_log2, gl.float32), DC, DR, BLOCK_H)
    p_s = gl.allocate_shared_memory(gl.float16, [8, BLOCK_N, BLOCK_H], p_sl)
    xch = gl.allocate_shared_memory(gl.float32, [2, 4, BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([
        (_consume, (0, codes_s, rope_s, sc_s, full, empty, done, q_s, qr_s, p_s, xch, scale_log2, start, end, n_tiles,
                    seq_len, pid_h, b, pid_s, M, H, S_Q, n_splits, o_ptr, lse_ptr, out_ptr, lse_out_ptr, cnt_ptr,
                    DIRECT)),
        (_consume, (1, codes_s, rope_s, sc_s, full, empty, done, q_s, qr_s, p_s, xch, scale_log2, start, end, n_tiles,
                    seq_len, pid_h, b, pid_s, M, H, S_Q, n_splits, o_ptr, lse_ptr, out_ptr, lse_out_ptr, cnt_ptr,
                    DIRECT)),
        (_produce, (desc_c, desc_r, desc_s, codes_s, rope_s, sc_s, full, empty, bt_row, n_tiles, start, BLOCK_SIZE)),
    ], [4, 1], [240, 24])  # warps and registers (setmaxnreg): consumer 1, producer


def smem_bytes() -> int:
    """Shared memory of one program's buffers: the 4-slot tile ring and its full / empty barriers, the
    hand-over barrier, the query rows, each consumer's four P' tiles and cross-warp max exchange. The sm_90
    compile adds under 1 KB for the arguments the partitions receive (checked by a test)."""
    return (STAGES * (BLOCK_N * ROW_BYTES.value + 16) + 8 + BLOCK_H * (512 * 2 + 64 * 2)
            + 2 * (4 * BLOCK_N * BLOCK_H * 2 + 4 * BLOCK_H * 4))


def serves(kv_cache: Tensor) -> bool:
    """Whether a cache suits this kernel's TMA descriptors (given ``wgmma_serves``): contiguous rows and pages,
    under 2^31 rows."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    return (kv_cache.stride(1) == kv_cache.shape[2] and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.shape[2]
            and 0 < rows < 2 ** 31)


def launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
           config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Run the kernel (sm_90; a call ``fp8_cache.gluon_eligible`` accepts, pages of a multiple of 64 rows,
    ``serves(kv_cache)``, ``scale > 0``). ``config``: SPLITS (else the SMs' program slots filled in whole waves,
    ``_plan.opaque_splits``); the last program of each row block merges the splits (no reduce kernel)."""
    B, s_q, H, D = q.shape
    dc = kv_lora_rank
    M = s_q * H
    q, out, lse, splits, direct, o_buf, l_buf = split_setup(q, kv_cache, block_table, dc, BLOCK_N, PROGRAMS_PER_SM,
                                                            config)
    if not splits:
        return out, lse
    block_size = kv_cache.shape[1]
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    groups = rows.as_strided([4, rows.shape[0], 128], [128, rows.stride(0), 1])
    desc_c = TensorDescriptor.from_tensor(groups, [4, BLOCK_N, 128], CODE_BOX)
    desc_r = TensorDescriptor.from_tensor(rows.view(q.dtype), [BLOCK_N, D - dc], ROPE_SL)
    desc_s = TensorDescriptor.from_tensor(rows, [BLOCK_N, 16], SCALE_SL)
    hb = triton.cdiv(M, BLOCK_H)
    # one zeroed counter a row block for the in-kernel merge; one split writes the result itself and never
    # touches the counters (no zeroing launch: any int32 tensor stands in)
    counts = seq_lens if direct else torch.zeros(B * hb, dtype=torch.int32, device=q.device)
    decode_fp8_tma_kernel[(hb, splits, B)](
        q, desc_c, desc_r, desc_s, block_table, seq_lens, o_buf, l_buf, out, lse, counts,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        block_table.stride(0),
        M, H, s_q, splits, DC=dc, DR=D - dc, BLOCK_SIZE=block_size, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        DIRECT=direct, STAGES=STAGES, num_warps=4, **launch_kwargs(q.device),
    )
    return out, lse
