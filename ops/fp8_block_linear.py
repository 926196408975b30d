"""``mla::fp8_block_linear``: a linear layer over DeepSeek's fp8 block-quantized weights.

Contract. ``weight [N, K]`` float8_e4m3fn with ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` float32 stands
for the real weight ``W[n, k] = float(weight[n, k]) * weight_scale_inv[n // 128, k // 128]`` (the checkpoint's
``weight_scale_inv`` is a multiplier despite its name). Grouped form: ``weight [E, N, K]`` with scales
``[E, ceil(N/128), ceil(K/128)]`` is E independent linears (the MoE experts).

- ``act_quant=False`` (weight-only): ``y = x @ W.T``.
- ``act_quant=True`` (DeepSeek's inference recipe): ``x`` is first rounded per token per 128-wide group
  of K: ``s = max(amax(|x_g|) / 448, 2**-64)``, ``x_g -> float(e4m3(x_g / s)) * s`` (round to nearest even,
  the last group may be shorter), then ``y = x_q @ W.T``.

Shapes: ``x [M, K]`` with a 2-D weight -> ``y [M, N]``; ``x [E, M, K]`` (or ``[M, K]``, shared by every
group) with a 3-D weight -> ``y [E, M, N]``. Sorted grouped form (the MoE experts over tokens sorted by
expert): a 3-D weight, ``x [R, K]`` and ``offs [E]`` int32, the cumulative row ends (rows
``[offs[e-1], offs[e])`` use group e, as ``torch._grouped_mm``) -> ``y [R, N]``; rows past ``offs[-1]``
get 0. ``y`` has x's dtype; the math runs in float32 (float64 for a float64 ``x``).

Backends: "reference" (any device, every form), "triton" (CUDA, every form), "scaled-mm" (CUDA,
``act_quant=True`` and 2-D weights with K a multiple of 128 only: torch's blockwise-scaled fp8 matmul,
1x128 activation and 128x128 weight scales).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops._block_linear import check_x_and_offs, empty_output, pick_groups
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, backends_for, declare, declare_op
from mla_compile.ops.select import resolve, why_not_form

OP = declare_op("fp8_block_linear", "mla.fp8_block_linear")
BLOCK = 128
FP8_MAX = 448.0
SCALE_FLOOR = 2.0 ** -64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def validate(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, offs: Tensor | None = None) -> None:
    """Shape/dtype checks (metadata only, no sync)."""
    check_tensor(OP, "weight", weight, ndim=(2, 3), dtypes=(torch.float8_e4m3fn,),
                 expected="[N, K] or [E, N, K] float8_e4m3fn")
    *groups, N, K = weight.shape
    scale_shape = (*groups, _cdiv(N, BLOCK), _cdiv(K, BLOCK))
    check_tensor(OP, "weight_scale_inv", weight_scale_inv, ndim=weight.dim(), dtypes=(torch.float32,),
                 shape=scale_shape, expected=f"{list(scale_shape)} float32 (one scale per 128 x 128 block)")
    check_x_and_offs(OP, x, weight, K, groups, offs, scale_name="weight_scale_inv", scale=weight_scale_inv,
                     weight_form="[E, N, K]")


def dequantize(weight: Tensor, weight_scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The real weight ``weight * weight_scale_inv`` (block-wise) in ``dtype``: ``[..., N, K]``."""
    N, K = weight.shape[-2:]
    scale = weight_scale_inv.to(dtype).repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return weight.to(dtype) * scale[..., :N, :K]


def quantize_activation(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token 1 x 128 group quantization of ``x [..., K]``: ``(codes [..., K] e4m3, scales [..., ceil(K/128)]
    float32)`` with ``x ~ codes * scales`` (the group's scale repeated over its 128 columns)."""
    K = x.shape[-1]
    pad = _cdiv(K, BLOCK) * BLOCK - K
    xg = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, BLOCK))
    scale = (xg.abs().amax(-1) / FP8_MAX).clamp_min(SCALE_FLOOR)
    codes = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.flatten(-2)[..., :K], scale


def _act_round(x: Tensor, acc: torch.dtype) -> Tensor:
    """``x`` rounded as ``act_quant=True`` specifies, in ``acc``."""
    codes, scale = quantize_activation(x)
    return codes.to(acc) * scale.to(acc).repeat_interleave(BLOCK, dim=-1)[..., :x.shape[-1]]


@torch.library.custom_op("mla::fp8_block_linear_ref", mutates_args=(), tags=LAYOUT_TAGS)
def fp8_block_linear_ref(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool,
                         offs: Tensor | None = None) -> Tensor:
    """Reference (plain torch, any device): dequantize the weight, then one matmul in float32 (float64).
    With ``offs`` every group runs on every row and each row keeps its own group's result (no host sync)."""
    validate(x, weight, weight_scale_inv, offs)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xa = _act_round(x, acc) if act_quant else x.to(acc)
    y = torch.matmul(xa, dequantize(weight, weight_scale_inv, acc).transpose(-1, -2))
    return y.to(x.dtype) if offs is None else pick_groups(y, offs, x.dtype)


def fake(x, weight, weight_scale_inv, act_quant, offs=None):
    """Fake output shared by every implementation: validate, then ``[M, N]``, ``[E, M, N]`` or (with ``offs``)
    ``[R, N]`` of x's dtype."""
    validate(x, weight, weight_scale_inv, offs)
    return empty_output(x, weight, offs)


fp8_block_linear_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.fp8_block_linear_ref, rank=100, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        note="dequantize the 128 x 128 blocks, matmul in float32 (float64 for float64 x)")


def fp8_block_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, *, act_quant: bool = False,
                     offs: Tensor | None = None, backend: str | None = None) -> Tensor:
    """``x [..., K] @ W.T`` for an fp8 block-quantized ``W``; see the module docstring for the contract.

    ``x`` may have any leading dims with a 2-D ``weight [N, K]`` (returns ``[..., N]``); with a 3-D
    ``weight [E, N, K]`` it is ``[M, K]`` or ``[E, M, K]`` (returns ``[E, M, N]``), or ``[R, K]`` sorted by
    group with ``offs [E]`` int32 cumulative row ends (returns ``[R, N]``). ``backend``: None/"auto",
    "reference", "triton" or "scaled-mm". Raises ValueError for a backend that cannot run ``act_quant``/``offs``.
    """
    spec = backends_for(OP).get(backend) if backend not in (None, "auto") else None
    why = spec and why_not_form(spec, act_quant, weight.dim() == 3 or offs is not None, x.shape[-1])
    if why:  # the registry's word on the call's form, before anything runs
        raise ValueError(f"{OP}: backend {backend!r} cannot serve this call ({'; '.join(why)}); got "
                         f"act_quant={act_quant}, weight {list(weight.shape)}, offs given: {offs is not None}; "
                         "use backend 'triton' or 'reference'")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]) if weight.dim() == 2 else x
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    y = impl.fn(x2, weight, weight_scale_inv, act_quant) if offs is None else impl.fn(
        x2, weight, weight_scale_inv, act_quant, offs)
    return y.reshape(*lead, weight.shape[0]) if weight.dim() == 2 else y


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool,
            offs: Tensor | None = None) -> Tensor:
    """CUDA half-precision or float32 ``x`` over a 2-D / 3-D weight: ``mla::fp8_block_linear_serial_triton``, which
    picks its K split from the call's rows at run time (a launch too small to fill the GPU splits K and sums the
    slices in the kernel); sorted groups (``offs``) and the rest: ``mla::fp8_block_linear_triton``."""
    import mla_compile.ops.triton.fp8_block_linear  # noqa: F401  (registers both ops)

    if offs is None and x.device.type == "cuda" and x.dtype != torch.float64:
        return torch.ops.mla.fp8_block_linear_serial_triton(x, weight, weight_scale_inv, act_quant, 0)
    return torch.ops.mla.fp8_block_linear_triton(x, weight, weight_scale_inv, act_quant, offs)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=FLOATS, package="triton",
        gpu_tested=True, kernels=("fp8_block_linear_triton", "fp8_block_linear_serial_triton", "_fp8_linear_kernel",
                                  "_fp8_sorted_kernel",
                                  "fp8_block_linear_triton_config=triton (autotuned config)",
                                  "fp8_block_linear_sorted_triton_config=triton (autotuned config)"),
        note="ours: fp8 codes and block scales read directly")


_SCALED_MM_ROWS = 16  # activation rows are padded to a multiple of this for torch._scaled_mm's blockwise path


@torch.library.custom_op("mla::fp8_block_linear_scaled_mm", mutates_args=(), tags=LAYOUT_TAGS)
def fp8_block_linear_scaled_mm(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool,
                               offs: Tensor | None = None) -> Tensor:
    """torch's blockwise-scaled fp8 matmul (``torch._scaled_mm``, 1x128 x 128x128 scales); CUDA, 2-D weights."""
    validate(x, weight, weight_scale_inv, offs)
    if weight.dim() != 2 or not act_quant or weight.shape[1] % BLOCK or x.device.type != "cuda":
        raise ValueError(f"{OP}: backend 'scaled-mm' needs CUDA tensors, a 2-D weight with K a multiple of 128 "
                         f"and act_quant=True; got weight {list(weight.shape)} on {x.device}, act_quant={act_quant}")
    codes, a_scale = quantize_activation(x)
    m = codes.shape[0]
    pad = -m % _SCALED_MM_ROWS
    if pad:  # cuBLASLt's blockwise fp8 heuristic refuses row counts off this multiple (CUBLAS_STATUS_NOT_SUPPORTED)
        codes = torch.cat([codes, codes.new_zeros(pad, codes.shape[1])])
        a_scale = torch.cat([a_scale, a_scale.new_ones(pad, a_scale.shape[1])])
    a_scale = a_scale.t().contiguous().t()  # outer-dim-major, as the blockwise kernel requires
    out = torch._scaled_mm(codes, weight.t(), scale_a=a_scale, scale_b=weight_scale_inv.t(),
                           out_dtype=torch.bfloat16)
    return out[:m].to(x.dtype)


fp8_block_linear_scaled_mm.register_fake(fake)


def _scaled_mm_available() -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.is_available()


declare(OP, "scaled-mm", torch.ops.mla.fp8_block_linear_scaled_mm, rank=60, available=_scaled_mm_available,
        dtypes=FLOATS, act_quant_only=True, grouped=False, k_multiple=BLOCK, autotune=True,
        auto_skip="runs only act_quant=True 2-D weights with K a multiple of 128",
        note="torch._scaled_mm with 1x128 / 128x128 scales")
