"""Layouts, code conversions and tile copies of ``fp8_decode_tma`` (sm_90 Gluon: TMA tiles, register-A ``wgmma``).

A 64-key tile of 656-byte rows arrives in shared memory by three TMA copies: the four scale groups' codes as
one box ``[4, 64, 128]`` bytes (128-byte swizzle: the ``wgmma`` layout, and conflict-free reads), the rope
rows ``[64, 64]`` bf16 (read by ``wgmma`` straight from shared memory) and the scales ``[64, 4]`` fp32.
The codes never become a float16 tile in shared memory: each group is read twice into registers, converted
exactly (``cvt.e4m3x2``, no scale) and fed to ``wgmma`` as its register operand A:

- scores ``S^T [64 keys, 16 rows] = K_g Q_g^T``: a thread reads 32 bytes of each of its two keys (``KL``);
  the dot reduces over the group's 128 columns in the order ``score_k`` (the queries are stored permuted
  the same way, so the dot is unchanged);
- values ``O_g^T [128 columns, 16 rows] += V_g^T P'_g^T``: a thread reads one 4-byte word (4 columns) of
  each of 16 keys (``VL``) and pairs the keys with ``prmt``; the output columns come out in the order
  ``m`` of ``cvt_v``, which ``column_of_m`` names back.

Bits are listed most significant first; ``d`` is the column within a group (``d = 4 w + b``: word w, byte b).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


BLOCK_N = 64  # keys per tile: wgmma's M
BLOCK_H = 16  # query rows per program: wgmma's N
ROW_BYTES = gl.constexpr(656)

CODE_BOX = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)  # the [4, 64, 128] copy
CODE_SL = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
ROPE_SL = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
SCALE_SL = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
CODE_BOX_C = gl.constexpr(CODE_BOX)
ROPE_C = gl.constexpr(ROPE_SL)
SCALE_C = gl.constexpr(SCALE_SL)
CODE_W = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
SCALE_W = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
# [64 keys, 32 words] int32, score side: thread (warp w, lane 4 r + t) holds keys 16 w + r (+ 8), words 8 t .. 8 t + 7
KL = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32]))
# value side: keys 2 t + {0, 1} + 8 h + 16 kb (registers: key bit 0 first), word 8 w + r
VL = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]], lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
    warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[64, 32]))
# [64 keys, 4 groups] fp32 scales, keys as the score accumulator's rows
SCL = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4]))


@gluon.jit
def score_k(x):
    """The last axis (128 columns d of a group) of a 2-d tensor renamed to the score dot's k:
    k = (d4, d3, d2, d1, d6, d5, d0)."""
    R: gl.constexpr = x.shape[0]
    y = gl.reshape(x, [R, 2, 2, 2, 2, 2, 2, 2])
    return gl.reshape(gl.permute(y, [0, 3, 4, 5, 6, 1, 2, 7]), [R, 128])


@gluon.jit
def cvt_k(words):
    """Code words ``[64 keys, 32]`` (``KL``) to float16 ``[64, 128 d]``, exact, as packed pairs."""
    lo, hi = gl.inline_asm_elementwise(
        """{
        .reg .b16 c0, c1;
        mov.b32 {c0, c1}, $2;
        cvt.rn.f16x2.e4m3x2 $0, c0;
        cvt.rn.f16x2.e4m3x2 $1, c1;
        }""",
        "=r,=r,r,r", [gl.join(words, words)], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)
    return gl.reshape(gl.permute(gl.join(lo, hi), [0, 1, 3, 2]), [64, 128])  # [key, w, b1, b0]


@gluon.jit
def cvt_v(words):
    """Code words ``[64 keys, 32]`` (``VL``) to the value operand float16 ``[128 m, 64 keys]``, exact: key pairs
    joined by ``prmt``, m = (b1, w4, w3, b0, w2, w1, w0)."""
    y = gl.permute(gl.reshape(words, [32, 2, 32]), [0, 2, 1])  # [key pair, w, key bit 0]
    c0, c1, c2, c3 = gl.inline_asm_elementwise(
        """{
        .reg .b32 lo, hi;
        .reg .b16 x0, x1, x2, x3;
        prmt.b32 lo, $4, $5, 0x5140;
        prmt.b32 hi, $4, $5, 0x7362;
        mov.b32 {x0, x1}, lo;
        mov.b32 {x2, x3}, hi;
        cvt.rn.f16x2.e4m3x2 $0, x0;
        cvt.rn.f16x2.e4m3x2 $1, x1;
        cvt.rn.f16x2.e4m3x2 $2, x2;
        cvt.rn.f16x2.e4m3x2 $3, x3;
        }""",
        "=r,=r,=r,=r,r,r", [y], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2)
    x = gl.join(gl.join(c0, c1), gl.join(c2, c3))  # [key pair, w, key bit 0, b0, b1]
    x = gl.reshape(gl.permute(x, [0, 2, 1, 4, 3]), [64, 2, 2, 2, 2, 2, 2, 2])  # key, w4 .. w0, b1, b0
    return gl.reshape(gl.permute(x, [6, 1, 2, 7, 3, 4, 5, 0]), [128, 64])


@gluon.jit
def column_of_m(m):
    """The group column d of value-operand row m (``cvt_v``'s order)."""
    return 4 * ((m & 7) + 8 * ((m >> 4) & 3)) + ((m >> 3) & 1) + 2 * ((m >> 6) & 1)


@gluon.jit
def opaque_zero(i):
    """0 that the compiler cannot prove: indexing the loop-invariant query and P' tiles with it keeps their
    ``wgmma`` descriptors inside the loop instead of hoisted into (and spilled from) registers."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def issue_tile(desc_c, desc_r, desc_s, codes_s, rope_s, sc_s, bars, page, tile, n_tiles, start,
               BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Start the three TMA copies of tile ``tile`` (in block ``page``, ``_gluon.tile_page``) into ring slot
    ``tile % STAGES`` (none past ``n_tiles``)."""
    slot = tile % STAGES
    live = tile < n_tiles
    row = (page * BLOCK_SIZE + (start + tile * BLOCK_N) % BLOCK_SIZE).to(gl.int32)
    bar = bars.index(slot)
    mbarrier.expect(bar, BLOCK_N * ROW_BYTES, pred=live)
    tma.async_copy_global_to_shared(desc_c, [0, row, 0], bar,
                                    codes_s.index(slot)._reinterpret(gl.uint8, [4, BLOCK_N, 128], CODE_BOX_C),
                                    pred=live)
    tma.async_copy_global_to_shared(desc_r, [row, 264], bar, rope_s.index(slot), pred=live)
    tma.async_copy_global_to_shared(desc_s, [row, 512], bar, sc_s.index(slot), pred=live)


@gluon.jit
def load_words(codes, g: gl.constexpr, layout: gl.constexpr):
    """Group ``g``'s code words ``[64 keys, 32]`` int32 of a ring slot (``[4 * 64, 128]`` bytes) in ``layout``."""
    return codes.slice(g * 64, 64)._reinterpret(gl.int32, [64, 32], CODE_W).load(layout)


@gluon.jit
def load_scales(sc_s, slot, n0, end, partial):
    """A tile's four scale columns ``[64]`` fp32 (0 at or past ``end`` when ``partial``), as ``SCL`` rows."""
    sc = sc_s.index(slot)._reinterpret(gl.float32, [64, 4], SCALE_W).load(SCL)
    if partial:
        sc = gl.where((n0 + gl.arange(0, 64, gl.SliceLayout(1, SCL)) < end)[:, None], sc, 0.0)
    sa, sb = gl.split(gl.reshape(sc, [64, 2, 2]))  # columns 0, 2 / 1, 3
    s0, s2 = gl.split(sa)
    s1, s3 = gl.split(sb)
    return s0, s1, s2, s3
