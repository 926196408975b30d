"""Register layouts and relabelings of ``fp8_decode_gluon``'s group-split decode (Gluon, ``mma.sync``).

Warp g of a program owns scale group g of the 656-byte rows (latent columns ``128 g + [0, 128)``) for every key
of a tile. Its code words are loaded 16 bytes at a time, in an order chosen so that the float16 registers
they convert to already form the ``mma.sync`` operand: the tensor ops below only rename registers (each
``convert_layout`` to a dot operand is asserted trivial at compile time):

- ``k_from_d``: the score dot reduces over the 128 columns in a permuted order k (the query rows are
  permuted the same way, so the dot is unchanged);
- ``v_from_moved``: ``cvt_t`` transposes each warp's 8x8 blocks of code pairs (``movmatrix``) so that a
  register holds two keys of one column, the value dot's operand; its output columns come out permuted
  (n), and ``d_from_n`` names them back.

Bits are listed most significant first; d is the column within the group (bytes d0, d1 of a word are its
low bits), key bits 0-2 are the lane's row in an 8-key block.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

BLOCK_N = 32  # keys per tile
BLOCK_H = 16  # query rows per program (the dots' M)


def _layouts(bn: int):
    nb = [[0, 0, 1 << k] for k in range(3, bn.bit_length() - 1)]  # the tile's 8-key blocks: registers
    lanes = [[0, 0, 1], [0, 0, 2], [0, 0, 4]]
    code = gl.DistributedLinearLayout(  # [4 groups, 32 words, bn keys] int32: words 4c..4c+3 and 16 on
        reg_bases=[[0, 1, 0], [0, 2, 0], [0, 16, 0]] + nb, lane_bases=[[0, 4, 0], [0, 8, 0]] + lanes,
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 32, bn])
    rope = gl.DistributedLinearLayout(  # [4 groups, 16 columns, bn keys] bf16: columns 4c..4c+3
        reg_bases=[[0, 1, 0], [0, 2, 0]] + nb, lane_bases=[[0, 4, 0], [0, 8, 0]] + lanes,
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, bn])
    mma_cols = [[0, 0, 1], [0, 8, 0]] + nb  # the score accumulator's registers (key pairs, row + 8, blocks)
    mma_lanes = [[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    xch_s = gl.SharedLinearLayout(  # [4, 16, bn] float32 partial scores: a thread's runs of 4, lanes next
        offset_bases=mma_cols[:2] + mma_lanes + mma_cols[2:] + [[1, 0, 0], [2, 0, 0]])
    xch_r = gl.DistributedLinearLayout(  # [4, 16, bn]: every warp reads all four groups' partials
        reg_bases=mma_cols + [[1, 0, 0], [2, 0, 0]], lane_bases=mma_lanes,
        warp_bases=[[0, 0, 0], [0, 0, 0]], block_bases=[], shape=[4, 16, bn])
    return code, rope, xch_s, xch_r


_CODE, _ROPE, _XCH_S, _XCH_R = _layouts(BLOCK_N)
CODE_L = gl.constexpr(_CODE)
ROPE_L = gl.constexpr(_ROPE)
XCH_S = gl.constexpr(_XCH_S)
XCH_R = gl.constexpr(_XCH_R)


@gluon.jit
def k_from_d(x, AX: gl.constexpr):
    """Axis ``AX`` (1 or 2, 128 long) of a 3-d tensor renamed from column d to the score dot's k:
    k = (d6, d3, d2, d1, d5, d4, d0)."""
    A: gl.constexpr = x.shape[0]
    if AX == 1:
        C: gl.constexpr = x.shape[2]
        y = gl.permute(gl.reshape(x, [A, 2, 2, 2, 2, 2, 2, 2, C]), [0, 1, 4, 5, 6, 2, 3, 7, 8])
        return gl.reshape(y, [A, 128, C])
    else:
        R: gl.constexpr = x.shape[1]
        y = gl.permute(gl.reshape(x, [A, R, 2, 2, 2, 2, 2, 2, 2]), [0, 1, 2, 5, 6, 7, 3, 4, 8])
        return gl.reshape(y, [A, R, 128])


@gluon.jit
def k_from_d16(x, AX: gl.constexpr):
    """The rope's renaming of a 16-long axis ``AX`` (1 or 2): k = (d1, d3, d2, d0)."""
    A: gl.constexpr = x.shape[0]
    if AX == 1:
        C: gl.constexpr = x.shape[2]
        return gl.reshape(gl.permute(gl.reshape(x, [A, 2, 2, 2, 2, C]), [0, 3, 1, 2, 4, 5]), [A, 16, C])
    else:
        R: gl.constexpr = x.shape[1]
        return gl.reshape(gl.permute(gl.reshape(x, [A, R, 2, 2, 2, 2]), [0, 1, 4, 2, 3, 5]), [A, R, 16])


@gluon.jit
def v_from_moved(x):
    """``cvt_t``'s output ``[4, 128 d, N keys]`` (named as its input) as the value operand ``[4, N keys', 128 n]``:
    key' = (key blocks, d5, d4, d0), n = (d6, d3, d2, d1, key2, key1, key0)."""
    N: gl.constexpr = x.shape[2]
    y = gl.permute(gl.reshape(x, [4, 2, 2, 2, 2, 2, 2, 2, N // 8, 2, 2, 2]), [0, 8, 2, 3, 7, 1, 4, 5, 6, 9, 10, 11])
    return gl.reshape(y, [4, N, 128])


@gluon.jit
def d_from_n(o):
    """The value accumulator ``[4, 16, 128 n]`` with its columns named back to d: n = (d6, d3, d2, d0, d5, d4, d1)."""
    y = gl.permute(gl.reshape(o, [4, 16, 2, 2, 2, 2, 2, 2, 2]), [0, 1, 2, 6, 7, 3, 4, 8, 5])
    return gl.reshape(y, [4, 16, 128])


@gluon.jit
def _words_to_d(h0, h1, h2, h3):
    """Four float16 ``[4, 32, N]`` (bytes 0..3 of each code word) as ``[4, 128, N]`` in column order."""
    N: gl.constexpr = h0.shape[2]
    x = gl.join(gl.join(h0, h1), gl.join(h2, h3))  # [4, 32, N, i, j]: byte 2 j + i
    return gl.reshape(gl.permute(x, [0, 1, 4, 3, 2]), [4, 128, N])


# each word's two code pairs (c0, c1) to float16 pairs, split into the four halves of the outputs
_TO_F16 = """
        cvt.rn.f16x2.e4m3x2 r0, c0;
        cvt.rn.f16x2.e4m3x2 r1, c1;
        mov.b32 {$0, $1}, r0;
        mov.b32 {$2, $3}, r1;
        }"""
_CVT = gl.constexpr("""{
        .reg .b16 c0, c1;
        .reg .b32 r0, r1;
        mov.b32 {c0, c1}, $4;""" + _TO_F16)
_CVT_T = gl.constexpr("""{
        .reg .b32 t, u, r0, r1;
        .reg .b16 c0, c1;
        movmatrix.sync.aligned.m8n8.trans.b16 t, $4;
        prmt.b32 u, t, 0, 0x3120;
        mov.b32 {c0, c1}, u;""" + _TO_F16)


@gluon.jit
def _convert(words, ASM: gl.constexpr):
    h0, h1, h2, h3 = gl.inline_asm_elementwise(
        ASM, "=h,=h,=h,=h,r", [words], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=1)
    return _words_to_d(h0, h1, h2, h3)


@gluon.jit
def cvt(words):
    """e4m3 code words ``[4, 32, N]`` int32 to float16 ``[4, 128, N]``, exact (scales are applied later)."""
    return _convert(words, _CVT)


@gluon.jit
def cvt_t(words):
    """``cvt`` after transposing each warp's 8x8 blocks of code pairs (``movmatrix``) and regrouping each
    word's bytes by key pair: a register then holds two keys of one column. The result is named as
    ``cvt``'s; ``v_from_moved`` gives its true names."""
    return _convert(words, _CVT_T)
