"""The fp8 index-key format of DeepSeek-V3.2's lightning indexer (one scale per token).

Format: the index cache is ``uint8 [num_blocks, block_size, d + 4]`` (132 bytes per token for
``index_head_dim`` d = 128; see ``mla_compile.ops._fp8_format.fp8_index_row_bytes``), one row per token:

- bytes ``[0, d)``: the key as float8 e4m3fn, ``round(x / s)``;
- bytes ``[d, d + 4)``: the key's float32 scale ``s = max(amax / 448, 2**-64)``, amax = ``max |x|`` over
  the token's d values (for d = 128 this is the "one scale per 128 values" of the latent format).

The scale is the correctly rounded float32 quotient ``amax / 448`` (a tensor divisor: CUDA torch turns a
Python-scalar divisor into a multiply by an inexact reciprocal). Quotients are clamped to +-448 before
the cast; the floor 2**-64 keeps an all-zero key (padding, zeroed rows) from ``0 / 0``; it dequantizes to
exact zeros. Inputs must be finite. Multi-byte fields are in the host's byte order (little-endian).
Dequantization is ``float32(e4m3) * s`` in float32. A row is interleaved (values, then its scale);
a kernel reading a layout with a block's scales stored apart would need its own adapter.

Error bound (per element, against the float32 value written; bf16 inputs are exact in float32): e4m3
keeps 3 mantissa bits, so ``|dequant(x) - x| <= 2**-4 * |x| + 2**-10 * s`` (the second term, for
quotients in e4m3's subnormal range below 2**-6, is ``amax * 2.2e-6``), plus float32 rounding of the
quotient and the product (a relative 2**-23 at most). ``tests/ops/test_fp8_index.py`` checks it
against float64 on keys of mixed magnitude (2**-30 to 2**12, zero rows, outliers, tiny elements).
What it does to the top-k selection is measured and tested there too (see ``mla_compile.ops.sparse_index``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._fp8_format import FP8_INDEX_SCALE_BYTES, fp8_index_row_bytes  # noqa: F401  (re-exported)
from mla_compile.ops.fp8_cache import FP8_MAX, SCALE_FLOOR


def quantize_fp8_index(keys: Tensor) -> Tensor:
    """Index keys ``[..., d]`` (any float dtype, finite) to fp8 index rows ``uint8 [..., d + 4]``."""
    if keys.shape[-1] == 0:
        raise ValueError("quantize_fp8_index: keys' last dim (index_head_dim) must be positive, got 0")
    x = keys.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # a tensor divisor: the correctly rounded amax / 448 (see the module docstring)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(SCALE_FLOOR)
    values = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([values.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_fp8_index(rows: Tensor) -> Tensor:
    """fp8 index rows ``uint8 [..., d + 4]`` to keys ``float32 [..., d]``."""
    d = rows.shape[-1] - FP8_INDEX_SCALE_BYTES
    if rows.dtype != torch.uint8 or d <= 0:
        raise ValueError(f"dequantize_fp8_index: rows must be uint8 [..., d + 4] with d > 0, got {rows.dtype} "
                         f"{list(rows.shape)}")
    values = rows[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., d:].contiguous().view(torch.float32)
    return values * scale
