"""torch SDPA's cuDNN kernel as a ``mla::prefill`` backend: ``"sdpa-cudnn"`` (CUDA only).

The public ``F.scaled_dot_product_attention`` returns no LSE, so the adapter calls
``torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, attn_bias=None, compute_log_sumexp=True,
dropout_p=0.0, is_causal=..., return_debug_mask=False, scale=s)`` with ``q [1, H, Lq, E]``,
``k [1, H, Lk, E]``, ``v [1, H, Lk, Ev]`` (Ev may differ from E: qk 192 / v 128 ran at 541 TFLOPS on
the H200 through the public call). It returns ``(out [1, H, Lq, Ev], logsumexp, ...)``; torch 2.13's
meta function gives ``logsumexp`` the shape ``[B, H, Lq, 1]`` (float32), earlier versions ``[B, H, Lq]``:
the adapter reshapes to ``[B, H, Lq]`` either way. We take it as natural log (cuDNN's softmax stats);
the CUDA tests check that against the float64 reference on the H200. The op takes dense batches, so:

- the adapter reads ``cu_seqlens`` on the host (``.tolist()``, a sync) and runs one call per sequence:
  this backend cannot be captured in a CUDA graph (it raises if asked to) and suits eager/compiled
  prefill only;
- SDPA's ``is_causal`` aligns the mask top-left; our contract is bottom-right. A sequence with cached
  context (``Lk > Lq``) is split into its context keys (no mask) and its new keys (a square causal
  block, where top-left and bottom-right agree), merged by LSE.

Not run on a GPU yet: the CPU contract tests drive it with a fake attention function.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from mla_compile.ops.registry import LAYOUT_TAGS, SM80, declare
from mla_compile.ops.adapters._common import check_dtype, merge_natural, require_capability
from mla_compile.ops.prefill import OP, validate
from mla_compile.ops.prefill import fake as prefill_fake

BACKEND = "sdpa-cudnn"
DTYPES = (torch.float16, torch.bfloat16)


def _attend(attn_fn: Callable, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """One dense call: ``q [1, H, Lq, E]`` -> ``(out [1, H, Lq, Ev], lse [1, H, Lq] float32)``."""
    res = attn_fn(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].reshape(q.shape[0], q.shape[1], q.shape[2]).to(torch.float32)


def sdpa_cudnn_prefill_core(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                            scale: float, causal: bool, *, attn_fn: Callable | None = None) -> tuple[Tensor, Tensor]:
    """The adapter on any tensors; ``attn_fn`` replaces the cuDNN op (the CPU contract tests pass a fake)."""
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    check_dtype(OP, BACKEND, "q", q, DTYPES)
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{OP}: backend {BACKEND!r} reads cu_seqlens on the host and cannot be captured in a "
                           f"CUDA graph; use backend 'flashinfer' (with a plan), 'flash-attn' or 'triton' there")
    attn_fn = attn_fn or torch.ops.aten._scaled_dot_product_cudnn_attention
    T, H, _ = q.shape
    out = q.new_zeros(T, H, v.shape[-1])
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # the host sync (see the module docstring)
    for q0, q1, k0, k1 in zip(starts_q[:-1], starts_q[1:], starts_k[:-1], starts_k[1:]):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue  # rows stay 0 / -inf
        qs = q[q0:q1].transpose(0, 1).unsqueeze(0)
        ks, vs = k[k0:k1].transpose(0, 1).unsqueeze(0), v[k0:k1].transpose(0, 1).unsqueeze(0)
        ctx = lk - lq
        if not causal or ctx == 0:
            o, l = _attend(attn_fn, qs, ks, vs, causal, scale)
        else:  # bottom-right causal = all context keys + a square causal block over the new keys
            o1, l1 = _attend(attn_fn, qs, ks[:, :, :ctx], vs[:, :, :ctx], False, scale)
            o2, l2 = _attend(attn_fn, qs, ks[:, :, ctx:], vs[:, :, ctx:], True, scale)
            o, l = merge_natural(o1, l1, o2, l2)
        out[q0:q1] = o[0].transpose(0, 1)
        lse[q0:q1] = l[0].transpose(0, 1)
    return out, lse


@torch.library.custom_op("mla::prefill_sdpa_cudnn", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_sdpa_cudnn(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                       causal: bool) -> tuple[Tensor, Tensor]:
    """``mla::prefill`` through cuDNN SDPA, one call per sequence (same contract as ``mla::prefill_ref``)."""
    require_capability(OP, BACKEND, q.device, (8, 0))
    return sdpa_cudnn_prefill_core(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


prefill_sdpa_cudnn.register_fake(prefill_fake)


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether this torch build has CUDA and cuDNN (checked without touching a GPU; a constant under Dynamo)."""
    return torch.backends.cuda.is_built() and torch.backends.cudnn.is_available()


declare(OP, BACKEND, torch.ops.mla.prefill_sdpa_cudnn, rank=50, available=available, max_head_dim=256,
        host_sync=True, cuda_graph="none", min_capability=SM80, package="torch", gpu_tested=True,
        note="one cuDNN call per sequence; reads cu_seqlens on the host (a sync)")
