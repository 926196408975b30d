"""flash-attn 2 (``flash_attn.flash_attn_varlen_func``) as a ``mla::prefill`` backend: ``"flash-attn"``.

Call contract (flash-attn >= 2.6): ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, return_attn_probs=True)`` returns
``(out, softmax_lse [H, total_q], S_dmask)``; the LSE is natural log, head-major.

At our boundary:
- FA2 needs one head dim for q, k and v: ``v`` (128 for DeepSeek) is zero-padded to the qk dim (192)
  and ``out`` sliced back (FA3 would take 128 directly; it is not wired here).
- ``max_seqlen_q/k`` are the row counts ``T`` and ``S`` (upper bounds from shapes) so nothing is read
  on the host: no sync, capturable; programs past a sequence's end exit at once.
- LSE ``[H, T]`` -> ``[T, H]``; FA2 writes ``+inf`` for rows that see no key and leaves rows past
  ``cu_seqlens_q[-1]`` unwritten: both become ``out = 0``, ``lse = -inf``.

Not run on a GPU yet: no flash-attn wheel exists for the H200 test machine's torch/CUDA, so this
adapter is covered by the CPU contract tests (a fake ``flash_attn`` module) only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mla_compile.ops.registry import LAYOUT_TAGS, SM80, declare
from mla_compile.ops.adapters._common import check_dtype, finish_prefill, importable, require_capability
from mla_compile.ops.prefill import OP, validate
from mla_compile.ops.prefill import fake as prefill_fake

BACKEND = "flash-attn"
MODULE = "flash_attn"
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def flash_attn_prefill_core(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                            scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """The adapter on any tensors (CPU with a fake ``flash_attn`` in tests): ``(out [T, H, Dv], lse [T, H])``."""
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    check_dtype(OP, BACKEND, "q", q, DTYPES)
    T, H, Dqk = q.shape
    Dv = v.shape[-1]
    if Dv > Dqk or Dqk > MAX_HEAD_DIM or Dqk % 8:
        raise ValueError(f"{OP}: backend {BACKEND!r} needs v_head_dim <= qk_head_dim <= {MAX_HEAD_DIM} and "
                         f"qk_head_dim a multiple of 8, got qk {Dqk}, v {Dv}; use backend='triton'")
    if T == 0:
        return q.new_zeros(0, H, Dv), q.new_zeros(0, H, dtype=torch.float32)
    from flash_attn import flash_attn_varlen_func

    v_in = F.pad(v, (0, Dqk - Dv)) if Dv < Dqk else v  # FA2: one head dim for q, k and v
    out, lse, _ = flash_attn_varlen_func(
        q, k, v_in, cu_seqlens_q=cu_seqlens_q.to(torch.int32), cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        max_seqlen_q=T, max_seqlen_k=k.shape[0], dropout_p=0.0, softmax_scale=scale, causal=causal,
        return_attn_probs=True)
    return finish_prefill(out[..., :Dv], lse.transpose(0, 1), cu_seqlens_q, cu_seqlens_k, causal)


@torch.library.custom_op("mla::prefill_flash_attn", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_flash_attn(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                       causal: bool) -> tuple[Tensor, Tensor]:
    """``mla::prefill`` through flash-attn 2 (same contract as ``mla::prefill_ref``)."""
    require_capability(OP, BACKEND, q.device, (8, 0))
    return flash_attn_prefill_core(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


prefill_flash_attn.register_fake(prefill_fake)


def available() -> bool:
    """Whether ``flash_attn`` is installed (found without importing it)."""
    return importable(MODULE)


declare(OP, BACKEND, torch.ops.mla.prefill_flash_attn, rank=30, available=available, max_head_dim=MAX_HEAD_DIM,
        min_capability=SM80, package="flash-attn", autotune=True,
        note="FA2, v padded to the qk dim; no wheel for the H200 test machine")
