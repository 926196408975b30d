"""``mla::merge_attn_states``: combine two partial attention results over disjoint key sets by LSE.

Contract: ``out_a, out_b [T, H, D]`` with ``lse_a, lse_b [T, H]`` (float32, natural log). Returns
``out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})`` and ``lse = log(e^{lse_a} + e^{lse_b})``.
Exact for empty parts: a part with ``lse = -inf`` contributes nothing (even if its ``out`` is NaN), and
two empty parts give ``out = 0``, ``lse = -inf``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import FLOAT_DTYPES, check_same_device, check_tensor
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("merge", "mla.merge_attn_states", env="all")


def validate(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Shape/dtype checks only (no data is read)."""
    check_tensor(OP, "out_a", out_a, ndim=3, dtypes=FLOAT_DTYPES, expected="[T, H, D]")
    T, H, D = out_a.shape
    check_tensor(OP, "out_b", out_b, dtypes=(out_a.dtype,), shape=(T, H, D), expected="out_a's shape and dtype")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(OP, name, lse, dtypes=(torch.float32,), shape=(T, H), expected=f"[{T}, {H}] float32")
    check_same_device(OP, out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)


@torch.library.custom_op("mla::merge_attn_states_ref", mutates_args=(), tags=LAYOUT_TAGS)
def merge_attn_states_ref(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Reference (plain torch, any device): max-shifted weights, -inf parts weigh exactly 0."""
    validate(out_a, lse_a, out_b, lse_b)
    acc = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    la, lb = lse_a.to(acc), lse_b.to(acc)  # float32 weights would cap a float64 merge at float32 accuracy
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp(la - m_safe)  # exp(-inf) = 0 exactly
    wb = torch.exp(lb - m_safe)
    total = wa + wb
    empty = total == 0
    denom = torch.where(empty, torch.ones_like(total), total)
    a = torch.where((wa > 0)[..., None], out_a.to(acc), 0.0)
    b = torch.where((wb > 0)[..., None], out_b.to(acc), 0.0)
    out = (a * (wa / denom)[..., None].to(acc) + b * (wb / denom)[..., None].to(acc))
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(denom))
    return out.to(out_a.dtype).contiguous(), lse.to(torch.float32).contiguous()


def fake(out_a, lse_a, out_b, lse_b):
    """Fake outputs shared by every merge implementation: validate, then contiguous ``out``, ``lse`` of the
    inputs' shapes and dtypes (``empty_like`` would copy a strided input's layout; the kernels write
    contiguous outputs)."""
    validate(out_a, lse_a, out_b, lse_b)
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape, dtype=torch.float32)


merge_attn_states_ref.register_fake(fake)


declare(OP, "reference", torch.ops.mla.merge_attn_states_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="plain torch, the numerical ground truth")


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *,
                      backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Merge two partial attention results by LSE; see the module docstring. Returns ``(out, lse)``."""
    impl = resolve(OP, out_a.device, backend, dtype=out_a.dtype,
                   shape=lambda: (out_a.shape[1], (out_a.shape[2],), 1))
    return impl.fn(out_a, lse_a, out_b, lse_b)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.merge  # noqa: F401  (registers mla::merge_attn_states_triton)
    return torch.ops.mla.merge_attn_states_triton(out_a, lse_a, out_b, lse_b)


declare(OP, "triton", _triton, rank=10, available=_triton_available, dtypes=FLOATS, package="triton", gpu_tested=True,
        kernels=("merge_attn_states_triton", "_merge_kernel"), note="ours; portable path for ROCm/XPU")
