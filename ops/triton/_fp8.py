"""Triton helpers for the DeepSeek fp8 latent format (``mla_compile.ops.fp8_cache``): the e4m3 encoder
and the row quantizer shared by the fp8 cache write and the fused norm + rope + fp8 write kernels, and
the dequantizing tile load shared by the dense and sparse fp8 decode kernels.

The encoder rounds in integer arithmetic instead of a float8 cast: the result is the same
round-to-nearest-even code as ``torch.Tensor.to(torch.float8_e4m3fn)`` on every device, and Triton's
CPU interpreter (whose float8 cast does not round to nearest) gives identical bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals read inside @triton.jit must be tl.constexpr: the CPU interpreter accepts plain floats, the
# sm_90 compiler rejects them (NameError at compile time).
FP8_MAX = tl.constexpr(448.0)
SCALE_FLOOR = tl.constexpr(2.0 ** -64)
GROUP = tl.constexpr(128)


@triton.jit
def e4m3_codes(q):
    """float32 ``q`` with ``|q| <= 448`` (finite) to float8 e4m3fn codes (uint8), round to nearest even."""
    bits = q.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    mag = bits & 0x7FFFFFFF
    # normal range (>= 2**-6): drop 20 of float32's 23 mantissa bits, ties to even; a carry bumps the
    # exponent as it should. Rebias 127 -> 7 (120 << 3 = 960 in code units).
    lsb = (mag >> 20) & 1
    normal = ((mag + 0x7FFFF + lsb) >> 20) - 960
    # subnormals: the nearest multiple of 2**-9, as an integer 0..8 (8 is the smallest normal, code 8),
    # rounded by the float adder: adding 2**23 leaves the rounded integer in the low mantissa bits.
    a = mag.to(tl.float32, bitcast=True)
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag < 0x3C800000, sub, normal)  # 0x3C800000 = 2**-6
    return code.to(tl.uint8) | sign


@triton.jit
def store_fp8_latent(dst, x, ok, DC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DC: tl.constexpr):
    """Quantize float32 latent rows ``x [BLOCK_R, BLOCK_DC]`` (0 past ``DC``) into the fp8 rows at the
    uint8 pointers ``dst [BLOCK_R]`` where ``ok``: e4m3 codes at bytes ``[0, DC)``, then one float32
    scale ``max(amax / 448, 2**-64)`` per 128 values. IEEE division (``div_rn``) matches torch's bytes."""
    G: tl.constexpr = BLOCK_DC // 128
    x3 = tl.reshape(x, (BLOCK_R, G, 128))
    amax = tl.max(tl.abs(x3), axis=2)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full([BLOCK_R, G], FP8_MAX, tl.float32)), SCALE_FLOOR)
    quot = tl.math.div_rn(x3, tl.broadcast_to(scale[:, :, None], (BLOCK_R, G, 128)))
    quot = tl.minimum(tl.maximum(quot, -FP8_MAX), FP8_MAX)
    codes = tl.reshape(e4m3_codes(quot), (BLOCK_R, BLOCK_DC))
    offs_c = tl.arange(0, BLOCK_DC)
    tl.store(dst[:, None] + offs_c[None, :], codes, mask=ok[:, None] & (offs_c < DC)[None, :])
    offs_g = tl.arange(0, G)
    scale_dst = (dst + DC).to(tl.pointer_type(tl.float32))
    tl.store(scale_dst[:, None] + offs_g[None, :], scale, mask=ok[:, None] & (offs_g < DC // 128)[None, :])


@triton.jit
def bf16_bits(x):
    """float32 ``x`` (finite) to bfloat16 bit patterns (int16), round to nearest even, as ``.to(torch.bfloat16)``."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def load_fp8_tile(row_ptr, ok, offs_c, offs_r, DC: tl.constexpr, DR: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_DC: tl.constexpr):
    """Dequantize the fp8 rows at ``row_ptr [BLOCK_N]`` (uint8 pointers to row starts, valid where ``ok``).

    Returns ``(latent [BLOCK_N, BLOCK_DC], k_pe [BLOCK_N, BLOCK_DR])`` float32, 0 where masked.
    ``BLOCK_DC`` is a power of two >= 128 (DC is a multiple of 128).
    """
    G: tl.constexpr = BLOCK_DC // 128
    c_ok = offs_c < DC
    codes = tl.load(row_ptr[:, None] + offs_c[None, :], mask=ok[:, None] & c_ok[None, :], other=0)
    vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    offs_g = tl.arange(0, G)
    scale_ptr = (row_ptr + DC).to(tl.pointer_type(tl.float32))
    sc = tl.load(scale_ptr[:, None] + offs_g[None, :], mask=ok[:, None] & (offs_g < DC // 128)[None, :], other=0.0)
    latent = tl.reshape(tl.reshape(vals, (BLOCK_N, G, 128)) * sc[:, :, None], (BLOCK_N, BLOCK_DC))
    rope_ptr = (row_ptr + DC + 4 * (DC // 128)).to(tl.pointer_type(tl.bfloat16))
    k_pe = tl.load(rope_ptr[:, None] + offs_r[None, :], mask=ok[:, None] & (offs_r < DR)[None, :], other=0.0)
    return latent, k_pe.to(tl.float32)
