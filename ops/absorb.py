"""``mla::absorb_q`` and ``mla::absorb_out``: the absorbed decode's projections written in their final layout.

The absorbed decode computes ``q_abs = [q_nope @ W_UK | q_pe]`` per head before the attention and
``out = out_lat @ W_UV`` per head after it (:meth:`mla_compile.models.attention.MLAAttention._decode`). Written
as ``einsum`` + ``cat``, Inductor runs each product as a batched matmul in head-major ``[H, T, *]``
layout and then copies it: into the ``cat`` buffer (``[T, H, Dc]`` of the ``[T, H, Dc + Dr]`` query)
and, after the attention, into the token-major ``[T, H*v]`` rows that ``o_proj`` reads. These ops
have the matmul write straight into that final buffer (``torch.bmm(..., out=<strided view>)``: cuBLAS
and the CPU BLAS take the strided output as is, no temporary), so the copies go away. The fusion pass
in :mod:`mla_compile.lowerings.absorb` puts them in compiled graphs; nothing else calls them.

Contracts (plain torch, any device, float16/bfloat16/float32/float64):

- ``absorb_q(q_nope [T, H, N], w_uk [H, N, Dc], q_pe [T, H, Dr]) -> [T, H, Dc + Dr]`` (contiguous, q_nope's
  dtype): ``[einsum("thn,hnc->thc", q_nope, w_uk) | q_pe.to(q_nope.dtype)]``.
- ``absorb_out(out_lat [T, H, Dc], w_uv [H, V, Dc]) -> [T, H * V]`` (contiguous, out_lat's dtype):
  ``einsum("thc,hvc->thv", out_lat, w_uv).reshape(T, H * V)``.

``w_uk`` / ``w_uv`` have the einsum operand's dtype (a matmul does not mix dtypes); any strides work.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import FLOAT_DTYPES, check_same_device, check_tensor
from mla_compile.ops.registry import LAYOUT_TAGS, declare_kernels

OP_Q = "mla.absorb_q"
OP_OUT = "mla.absorb_out"


def validate_q(q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> None:
    """Shape/dtype checks of ``absorb_q`` (metadata only, no sync)."""
    check_tensor(OP_Q, "q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES, expected="[T, H, qk_nope_head_dim]")
    T, H, N = q_nope.shape
    check_tensor(OP_Q, "w_uk", w_uk, ndim=3, dtypes=(q_nope.dtype,), shape=(H, N, None),
                 expected=f"[{H}, {N}, kv_lora_rank] {q_nope.dtype} (q_nope's heads, nope dim and dtype)")
    check_tensor(OP_Q, "q_pe", q_pe, ndim=3, dtypes=FLOAT_DTYPES, shape=(T, H, None),
                 expected=f"[{T}, {H}, rope_dim] (q_nope's tokens and heads)")
    check_same_device(OP_Q, q_nope=q_nope, w_uk=w_uk, q_pe=q_pe)


def validate_out(out_lat: Tensor, w_uv: Tensor) -> None:
    """Shape/dtype checks of ``absorb_out`` (metadata only, no sync)."""
    check_tensor(OP_OUT, "out_lat", out_lat, ndim=3, dtypes=FLOAT_DTYPES, expected="[T, H, kv_lora_rank]")
    T, H, C = out_lat.shape
    check_tensor(OP_OUT, "w_uv", w_uv, ndim=3, dtypes=(out_lat.dtype,), shape=(H, None, C),
                 expected=f"[{H}, v_head_dim, {C}] {out_lat.dtype} (out_lat's heads, latent dim and dtype)")
    check_same_device(OP_OUT, out_lat=out_lat, w_uv=w_uv)


@torch.library.custom_op("mla::absorb_q", mutates_args=(), tags=LAYOUT_TAGS)
def absorb_q(q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    """``[q_nope @ W_UK | q_pe]`` per head: the matmul writes into the first ``Dc`` columns of the result."""
    validate_q(q_nope, w_uk, q_pe)
    T, H, _ = q_nope.shape
    Dc = w_uk.shape[2]
    q_abs = torch.empty(T, H, Dc + q_pe.shape[2], dtype=q_nope.dtype, device=q_nope.device)
    # out is [H, T, Dc] with unit last stride: bmm writes it in place (no temporary, no copy back)
    torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_abs[..., :Dc].transpose(0, 1))
    q_abs[..., Dc:].copy_(q_pe)
    return q_abs


@absorb_q.register_fake
def _(q_nope, w_uk, q_pe):
    validate_q(q_nope, w_uk, q_pe)
    T, H, _ = q_nope.shape
    return q_nope.new_empty(T, H, w_uk.shape[2] + q_pe.shape[2])


@torch.library.custom_op("mla::absorb_out", mutates_args=(), tags=LAYOUT_TAGS)
def absorb_out(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    """``out_lat @ W_UV^T`` per head, written token-major as the ``[T, H * V]`` rows ``o_proj`` reads."""
    validate_out(out_lat, w_uv)
    T, H, _ = out_lat.shape
    V = w_uv.shape[1]
    out = torch.empty(T, H * V, dtype=out_lat.dtype, device=out_lat.device)
    torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.view(T, H, V).transpose(0, 1))
    return out


@absorb_out.register_fake
def _(out_lat, w_uv):
    validate_out(out_lat, w_uv)
    T, H, _ = out_lat.shape
    return out_lat.new_empty(T, H * w_uv.shape[1])


def absorb_q_reference(q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    """What :func:`absorb_q` computes, as the model writes it (einsum + cat)."""
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    return torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)


def absorb_out_reference(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    """What :func:`absorb_out` computes, as the model writes it (einsum + reshape)."""
    out = torch.einsum("thc,hvc->thv", out_lat, w_uv)
    return out.reshape(out.shape[0], -1)


declare_kernels("torch bmm into place (fusion pass)", "absorb_q", "absorb_out")
