"""A Gluon (Triton's tile-level dialect) split-KV decode over the 656-byte fp8 latent cache, sm_89+
(``mma.sync``, ``movmatrix``, hardware e4m3 conversions: ``fp8_cache.gluon_eligible``), with the warps
splitting the scale groups instead of the keys.

Warp g of a 4-warp program owns scale group g (latent columns ``128 g + [0, 128)``, rope columns
``16 g + [0, 16)``) for every key of a 32-key tile, so a tile never goes through shared memory:

1. each thread loads its code words straight into registers (16-byte loads, a tile ahead) and converts
   them to float16 exactly (``cvt.e4m3x2``, no scale: a code is at most 448), already in the score dot's
   operand order (``_fp8_groups``: the load order is chosen so that only register names change);
2. the group's partial scores ``q_g . codes_g`` (``mma.sync``, query rows as M) are multiplied by the
   group's fp32 scales, the rope part added, and the four groups' partials summed through 8 KB of shared
   memory (the one exchange a tile);
3. the value dot of group g needs each key's codes transposed: ``movmatrix`` on the same registers, then
   ``P'[row, key] = P * scale[key, g] * 256`` (float16; 256 undone at the end) times the exact codes.

So the scales are applied in fp32 and the codes are never rounded: LSEs agree with the float64 reference to
~1e-6 (the ``wgmma`` kernel, which rounds ``code * scale`` to float16, to ~1e-3). The query rows run as in
``fp8_decode_wgmma`` (float16 times a power of two); P' limits the scales to at most 255 (values at most
448 * 255, far outside DeepSeek's latents), and terms with P * scale < 2^-22 (float16-subnormal P') round to
an absolute 2^-32. It replaced a slower key-split kernel (timings in BENCHMARKS.md); sm_90 runs
``fp8_decode_tma`` or ``fp8_decode_wgmma`` where pages allow (``sm90_launch``). Same program layout,
splits and outputs as ``decode._decode_split_kernel`` (workspace rows or the final result).
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.fp8_cache import validate_decode
from mla_compile.ops.triton import fp8_decode_tma, fp8_decode_wgmma
from mla_compile.ops.triton._fp8_groups import (BLOCK_H, BLOCK_N, CODE_L, ROPE_L, XCH_R, XCH_S, cvt, cvt_t,
                                                d_from_n, k_from_d, k_from_d16, v_from_moved)
from mla_compile.ops.triton._gluon import finish_rows, q_power, split_range, tile_page
from mla_compile.ops.triton.decode import decode_outputs
from mla_compile.ops.triton.fp8_decode import launch_fp8

PROGRAMS_PER_SM = 2  # by registers (up to 255 a thread, 4 warps); shared memory is ``smem_bytes``
P_UP = gl.constexpr(256.0)  # P' = P * scale * P_UP in float16
Q_S = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]))


@gluon.jit
def _load_tile(kv_ptr, page, tile, n_tiles, start, end, stride_kb, stride_kt, DC: gl.constexpr,
               BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, mma: gl.constexpr):
    """Tile ``tile`` (on ``page``): its code words ``[4, 32, N]`` int32, scales ``[4, N]`` (the score
    accumulator's key slice) and rope ``[4, 16, N]`` bf16, each warp its group's; 0 at or past ``end``."""
    n0 = start + tile * BLOCK_N
    live = tile < n_tiles
    base = kv_ptr + page * stride_kb + (n0 % BLOCK_SIZE).to(gl.int64) * stride_kt

    g = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, CODE_L)))
    w = gl.arange(0, 32, gl.SliceLayout(0, gl.SliceLayout(2, CODE_L)))
    n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, gl.SliceLayout(1, CODE_L)))
    ok = ((n0 + n < end) & live)[None, None, :]
    words = base.to(gl.pointer_type(gl.int32)) + (g * 32)[:, None, None] + w[None, :, None]
    codes = gl.load(words + (n.to(gl.int64) * (stride_kt // 4))[None, None, :], mask=ok, other=0)

    g = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, ROPE_L)))
    d = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(2, ROPE_L)))
    n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, gl.SliceLayout(1, ROPE_L)))
    ok = ((n0 + n < end) & live)[None, None, :]
    rope = (base + DC + 16).to(gl.pointer_type(gl.bfloat16)) + (g * 16)[:, None, None] + d[None, :, None]
    rope = gl.load(rope + (n.to(gl.int64) * (stride_kt // 2))[None, None, :], mask=ok, other=0.0)

    sl: gl.constexpr = gl.SliceLayout(1, mma)
    g = gl.arange(0, 4, gl.SliceLayout(1, sl))
    n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, sl))
    ok = ((n0 + n < end) & live)[None, :]
    sc = (base + DC).to(gl.pointer_type(gl.float32)) + g[:, None]
    sc = gl.load(sc + (n.to(gl.int64) * (stride_kt // 4))[None, :], mask=ok, other=0.0)
    return codes, sc, rope


@gluon.jit
def _step(codes, sc, rope, q_s, qra, xch, acc, m_i, l_i, n0, end, limit, scale_log2,
          BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, mma: gl.constexpr):
    """One tile (first position ``n0``): the group-split score dots, the four partials summed through
    ``xch``, the online softmax (base 2; ``scale_log2 > 0``), the value dots. Returns ``(acc, m_i, l_i)``."""
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(0, mma)
    kb = gl.convert_layout(k_from_d(cvt(codes), 1), dot_b, assert_trivial=True)
    s = mma_v2(q_s.load(dot_a), kb, gl.zeros([4, BLOCK_H, BLOCK_N], gl.float32, mma)) * sc[:, None, :]
    s = mma_v2(qra, gl.convert_layout(k_from_d16(rope, 1), dot_b, assert_trivial=True), s)
    gl.thread_barrier()  # every warp has read the last tile's partials
    xch.store(s)
    gl.thread_barrier()
    s = gl.convert_layout(gl.sum(xch.load(XCH_R), axis=0), rows_l, assert_trivial=True)

    pos = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, rows_l))
    s = gl.where((pos < end)[None, :] & (pos[None, :] < limit[:, None]), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing: no NaN
    alpha = gl.exp2(m_i - m_shift)
    p = gl.exp2(gl.fma(s, gl.full([BLOCK_H, BLOCK_N], 0.0, gl.float32, rows_l) + scale_log2, -m_shift[:, None]))
    l_i = l_i * alpha + gl.sum(p, axis=1)

    p_up = p[None, :, :] * (gl.minimum(sc, 255.0) * P_UP)[:, None, :]
    pa = gl.convert_layout(p_up.to(gl.float16), dot_a, assert_trivial=True)
    vb = gl.convert_layout(v_from_moved(cvt_t(codes)), dot_b, assert_trivial=True)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(2, mma)))[None, :, None]
    return mma_v2(pa, vb, acc), m_new, l_i


@gluon.jit
def decode_fp8_gluon_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt,
    stride_bt,
    M, H, S_Q, n_splits, DC: gl.constexpr, DR: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_H), n_splits, B)``, 4 warps; bf16 q ``[B, S_Q, H, DC + DR]``; ``DC = 512``,
    ``DR = 64``, ``BLOCK_N`` divides ``BLOCK_SIZE`` (every tile lies in one page)."""
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
    q_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [4, 1, 1], [2, 1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, mma))  # [16] rows, in every warp
    acc_row: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, mma))

    scale_log2 = gl.full([], scale_log2, gl.float32)
    pid_h = gl.program_id(0)
    pid_s, b, seq_len, start, end, n_tiles, bt_row = split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, BLOCK_N)
    codes, sc, rope = _load_tile(kv_ptr, tile_page(bt_row, 0, n_tiles, start, BLOCK_SIZE, BLOCK_N), 0, n_tiles, start,
                                 end, stride_kb, stride_kt, DC, BLOCK_SIZE, BLOCK_N, mma)
    page_next = tile_page(bt_row, 1, n_tiles, start, BLOCK_SIZE, BLOCK_N)  # block-table entries a tile ahead

    # the query rows (s_q * H folded): latent [4 groups, 16, 128] float16 times the power of two that puts
    # their largest magnitude in [2^13, 2^15) (undone in scale_log2), in shared memory; rope [4, 16, 16] bf16
    g_q = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, q_l)))
    m_q = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(0, gl.SliceLayout(2, q_l)))
    q_row = q_ptr + b * stride_qb + (m_q // H).to(gl.int64) * stride_qs + (m_q % H).to(gl.int64) * stride_qh
    ok_q = (m_q < M)[None, :, None]
    d_q = gl.arange(0, 128, gl.SliceLayout(0, gl.SliceLayout(1, q_l)))
    q = gl.load(q_row[None, :, None] + (g_q * 128)[:, None, None] + d_q[None, None, :], mask=ok_q, other=0.0)
    q = q.to(gl.float32)
    amax = gl.max(gl.max(gl.max(gl.abs(q), axis=2), axis=1), axis=0)
    up = q_power(amax)
    q_s = gl.allocate_shared_memory(gl.float16, [4, BLOCK_H, 128], Q_S)
    q_s.store(k_from_d((q * up).to(gl.float16), 2))
    d_r = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(1, q_l)))
    qr = gl.load(q_row[None, :, None] + DC + (g_q * 16)[:, None, None] + d_r[None, None, :], mask=ok_q, other=0.0)
    qra = gl.convert_layout(k_from_d16((qr.to(gl.float32) * up).to(gl.bfloat16), 2),
                            gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))
    scale_log2 = scale_log2 / up
    gl.thread_barrier()

    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, row_l)
    row_ok = rows < M
    limit = seq_len - (S_Q - 1 - rows // H)  # causal: a row sees positions < limit
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_l)
    acc = gl.zeros([4, BLOCK_H, 128], gl.float32, mma)
    xch = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H, BLOCK_N], XCH_S)

    for i in range(n_tiles):
        n_codes, n_sc, n_rope = _load_tile(kv_ptr, page_next, i + 1, n_tiles, start, end, stride_kb, stride_kt, DC,
                                           BLOCK_SIZE, BLOCK_N, mma)
        page_next = tile_page(bt_row, i + 2, n_tiles, start, BLOCK_SIZE, BLOCK_N)
        acc, m_i, l_i = _step(codes, sc, rope, q_s, qra, xch, acc, m_i, l_i, start + i * BLOCK_N, end, limit,
                              scale_log2, BLOCK_H, BLOCK_N, mma)
        codes, sc, rope = n_codes, n_sc, n_rope

    inv, o_first = finish_rows(l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT)
    o = d_from_n(acc * gl.convert_layout(inv / P_UP, acc_row)[None, :, None])
    o_l: gl.constexpr = o.type.layout
    g_o = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, o_l)))
    d_o = gl.arange(0, 128, gl.SliceLayout(0, gl.SliceLayout(1, o_l)))
    first = gl.convert_layout(o_first, gl.SliceLayout(0, gl.SliceLayout(2, o_l)))
    ok = gl.convert_layout(row_ok, gl.SliceLayout(0, gl.SliceLayout(2, o_l)))
    ty: gl.constexpr = o_ptr.dtype.element_ty
    gl.store(o_ptr + first[None, :, None] + (g_o * 128)[:, None, None] + d_o[None, None, :], o.to(ty),
             mask=ok[None, :, None])


def smem_bytes() -> int:
    """Shared memory of one program (the sm_90 compile's figure, checked by a test): the float16 query
    rows and the partial-score exchange."""
    return BLOCK_H * 512 * 2 + 4 * BLOCK_H * BLOCK_N * 4


def launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
           config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Run the kernel (a call ``mla_compile.ops.fp8_cache.gluon_eligible`` accepts, ``scale > 0``).
    ``config``: SPLITS (else the SMs' program slots filled in whole waves, ``_plan.opaque_splits``); the
    Triton reduce kernel merges the splits (``fp8_decode_wgmma.launch_split``, the launch both kernels share)."""
    return fp8_decode_wgmma.launch_split(decode_fp8_gluon_kernel, BLOCK_N, PROGRAMS_PER_SM, q, kv_cache, block_table,
                                         seq_lens, scale, kv_lora_rank, config)


@torch.library.custom_op("mla::decode_fp8_gluon", mutates_args=(), tags=LAYOUT_TAGS)
def decode_fp8_gluon(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                     kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Gluon ``mla::decode_fp8`` (same contract as ``mla::decode_fp8_ref``; an opaque call to Inductor): the
    launch ``sm90_launch`` names on sm_90, else this module's. A cache whose base is not 16-byte aligned (a
    view at an odd offset) or a softmax scale <= 0 runs the Triton kernel instead."""
    validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    if kv_cache.data_ptr() % 16 or scale <= 0:
        return launch_fp8(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    sm90 = sm90_launch(q, kv_cache)
    return (sm90 or launch)(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


def wgmma_serves(q: Tensor, kv_cache: Tensor) -> bool:
    """Whether ``mla::decode_fp8_gluon`` runs an sm_90 ``wgmma`` kernel (an sm_90 GPU, pages of a multiple of
    64 rows) rather than this module's group-split one."""
    return torch.cuda.get_device_capability(q.device) == (9, 0) and kv_cache.shape[1] % fp8_decode_wgmma.BLOCK_N == 0


def sm90_launch(q: Tensor, kv_cache: Tensor):
    """The sm_90 launch ``mla::decode_fp8_gluon`` runs, or None (``wgmma_serves`` false): ``fp8_decode_tma``
    (TMA tiles; a contiguous cache), else ``fp8_decode_wgmma``."""
    if not wgmma_serves(q, kv_cache):
        return None
    return fp8_decode_tma.launch if fp8_decode_tma.serves(kv_cache) else fp8_decode_wgmma.launch


@decode_fp8_gluon.register_fake
def _(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank):
    return decode_outputs(q, kv_lora_rank)
