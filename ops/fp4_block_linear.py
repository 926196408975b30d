"""``mla::fp4_block_linear``: a linear layer over DeepSeek-V4's FP4 expert weights (packed e2m1, ue8m0 scales).

Format (DeepSeek-V4 checkpoints with ``expert_dtype: "fp4"``; facts from transformers 5.x
``integrations/finegrained_fp8.py`` (``_alloc_expert_proj``, ``_unpack_fp4``, ``scale_fmt="ue8m0"``),
``utils/quantization_config.py`` (``FineGrainedFP8Config.expert_dtype``) and
``models/deepseek_v4/configuration_deepseek_v4.py``, and DeepSeek-V4's reference ``fp4_gemm`` which multiplies
the unpacked codes by the scale repeated 32 times along K):

- ``weight [N, K/2]`` bytes (stored ``int8``, or ``float4_e2m1fn_x2``): element ``k = 2j`` of row n is the low
  nibble of byte ``j``, element ``2j + 1`` the high nibble. A nibble is an e2m1 code: bit 3 the sign, bits 2-1
  the exponent e, bit 0 the mantissa m; its value is ``(-1)^sign * (m / 2 if e == 0 else (1 + m / 2) * 2^(e-1))``:
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives (code 8 is -0).
- ``weight_scale [N, K/32]`` ue8m0 bytes (``uint8`` or ``float8_e8m0fnu``): one power of two per row per 32
  consecutive K elements, ``2^(byte - 127)`` (byte 0 is ``2^-127``, 254 is ``2^127``, 255 is NaN).
- ``W[n, k] = e2m1(weight)[n, k] * 2^(weight_scale[n, k // 32] - 127)``; K must be a multiple of 32.

Contract: ``y = x @ W.T`` (weight-only: ``x`` is not rounded; DeepSeek's own kernels also round it to fp8).
Shapes as ``mla::fp8_block_linear``: ``x [M, K]`` with a 2-D weight -> ``y [M, N]``; ``x [E, M, K]`` (or
``[M, K]`` shared by every group) with a 3-D weight ``[E, N, K/2]`` -> ``y [E, M, N]``; sorted groups: a 3-D
weight, ``x [R, K]`` and ``offs [E]`` int32 cumulative row ends (rows ``[offs[e-1], offs[e])`` use group e)
-> ``y [R, N]``, rows past ``offs[-1]`` get 0. ``y`` has x's dtype; the math runs in float32 (float64 for a
float64 ``x``). Dequantized weights must be finite in float32 (``|W| <= 3.4e38``), as every real one is. With
bf16 ``x`` the Triton backend's tiled kernels (more rows a weight than its GEMV takes) hold the weights in
bfloat16, scaled by 2^-32: exact for scale bytes 34..160 (``|W|`` in [2^-94, 6 * 2^33]), below that subnormal or
0, above it inf.

Backends: "reference" (any device, every form; dequantizes every weight it is given, so on a GPU only for
tests), "triton" (CUDA, every form, the default there; the nibbles decoded and scaled in registers).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops._block_linear import check_x_and_offs, empty_output, pick_groups
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("fp4_block_linear", "mla.fp4_block_linear")
BLOCK = 32  # K elements per ue8m0 scale
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
WEIGHT_DTYPES = tuple(d for d in (torch.uint8, torch.int8, _FP4X2) if d is not None)
SCALE_DTYPES = tuple(d for d in (torch.uint8, _E8M0) if d is not None)


def e2m1_values(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """The 16 e2m1 code values ``[16]`` (index = the 4-bit code), from the sign / exponent / mantissa fields."""
    code = torch.arange(16, device=device)
    sign, e, m = code >> 3, (code >> 1) & 3, (code & 1).to(torch.float64)
    mag = torch.where(e == 0, m / 2, torch.ldexp(1 + m / 2, e - 1))
    return torch.where(sign == 1, -mag, mag).to(dtype)


def as_bytes(t: Tensor) -> Tensor:
    """``t`` viewed as ``uint8`` (packed fp4 ``int8`` / ``float4_e2m1fn_x2`` codes, ue8m0 scales)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def validate(x: Tensor, weight: Tensor, weight_scale: Tensor, offs: Tensor | None = None) -> None:
    """Shape/dtype checks (metadata only, no sync)."""
    dtypes = [str(d).removeprefix("torch.") for d in WEIGHT_DTYPES]
    check_tensor(OP, "weight", weight, ndim=(2, 3), dtypes=WEIGHT_DTYPES,
                 expected=f"[N, K/2] or [E, N, K/2] packed e2m1 bytes ({' / '.join(dtypes)})")
    *groups, N, half = weight.shape
    K = 2 * half
    if K % BLOCK:
        raise ValueError(f"{OP}: K = 2 * weight.shape[-1] = {K} must be a multiple of {BLOCK} (one ue8m0 scale "
                         f"per {BLOCK} weights); got weight {list(weight.shape)}")
    scale_shape = (*groups, N, K // BLOCK)
    check_tensor(OP, "weight_scale", weight_scale, ndim=weight.dim(), dtypes=SCALE_DTYPES, shape=scale_shape,
                 expected=f"{list(scale_shape)} ue8m0 bytes (one power of two per row per {BLOCK} weights)")
    check_x_and_offs(OP, x, weight, K, groups, offs, scale_name="weight_scale", scale=weight_scale,
                     weight_form="[E, N, K/2]", x_note=" (K = 2 * packed bytes)")


def scale_values(weight_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """ue8m0 bytes -> ``2^(byte - 127)`` in ``dtype`` (NaN for byte 255), same shape."""
    s = as_bytes(weight_scale).to(torch.int32)
    val = torch.ldexp(torch.ones(s.shape, dtype=torch.float64, device=s.device), s - 127)  # exact in float64
    return torch.where(s == 255, torch.nan, val).to(dtype)


def unpack(weight: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Packed codes ``[..., K/2]`` -> e2m1 values ``[..., K]`` in ``dtype`` (low nibble first)."""
    b = as_bytes(weight).to(torch.int64)
    table = e2m1_values(dtype, weight.device)
    return torch.stack((table[b & 15], table[b >> 4]), dim=-1).flatten(-2)


def dequantize(weight: Tensor, weight_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The real weight ``e2m1 * 2^(scale - 127)`` in ``dtype``: ``[..., N, K]``."""
    return unpack(weight, dtype) * scale_values(weight_scale, dtype).repeat_interleave(BLOCK, dim=-1)


@torch.library.custom_op("mla::fp4_block_linear_ref", mutates_args=(), tags=LAYOUT_TAGS)
def fp4_block_linear_ref(x: Tensor, weight: Tensor, weight_scale: Tensor, offs: Tensor | None = None) -> Tensor:
    """Reference (plain torch, any device): dequantize the weight, then one matmul in float32 (float64).
    With ``offs`` every group runs on every row and each row keeps its own group's result (no host sync)."""
    validate(x, weight, weight_scale, offs)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.matmul(x.to(acc), dequantize(weight, weight_scale, acc).transpose(-1, -2))
    return y.to(x.dtype) if offs is None else pick_groups(y, offs, x.dtype)


def fake(x, weight, weight_scale, offs=None):
    """Fake output shared by every implementation: validate, then ``[M, N]``, ``[E, M, N]`` or (with ``offs``)
    ``[R, N]`` of x's dtype."""
    validate(x, weight, weight_scale, offs)
    return empty_output(x, weight, offs)


fp4_block_linear_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.fp4_block_linear_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="unpack the e2m1 nibbles, scale per 32, matmul in float32 (float64 for float64 x)")


def fp4_block_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, *, offs: Tensor | None = None,
                     backend: str | None = None) -> Tensor:
    """``x [..., K] @ W.T`` for a packed-fp4 ``W``; see the module docstring for the contract.

    ``x`` may have any leading dims with a 2-D ``weight [N, K/2]`` (returns ``[..., N]``); with a 3-D
    ``weight [E, N, K/2]`` it is ``[M, K]`` or ``[E, M, K]`` (returns ``[E, M, N]``), or ``[R, K]`` sorted by
    group with ``offs [E]`` int32 cumulative row ends (returns ``[R, N]``). ``backend``: None/"auto",
    "reference" or "triton".
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]) if weight.dim() == 2 else x
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    y = impl.fn(x2, weight, weight_scale) if offs is None else impl.fn(x2, weight, weight_scale, offs)
    return y.reshape(*lead, weight.shape[0]) if weight.dim() == 2 else y


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(x: Tensor, weight: Tensor, weight_scale: Tensor, offs: Tensor | None = None) -> Tensor:
    import mla_compile.ops.triton.fp4_block_linear  # noqa: F401  (registers mla::fp4_block_linear_triton)
    return torch.ops.mla.fp4_block_linear_triton(x, weight, weight_scale, offs)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=FLOATS, package="triton",
        gpu_tested=True, kernels=("fp4_block_linear_triton", "_fp4_linear_kernel", "_fp4_sorted_kernel",
                                  "_fp4_gemv_kernel"),
        note="ours: e2m1 nibbles and ue8m0 scales decoded in registers; a per-row GEMV for few rows per weight")
