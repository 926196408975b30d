"""FlashInfer's Blackwell-only (sm100) MLA paths, registered with their capability requirement so
they show as unavailable on Hopper:

- ``mla::decode`` backend ``"flashinfer-trtllm"``: ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla``
  (TRT-LLM-gen kernels; block size 32 or 64; ``q [B, s_q, H, 576]``, the 576-wide cache as is).
- ``mla::decode`` backend ``"flashinfer-cutlass"``: ``BatchMLAPagedAttentionWrapper(..., backend="cutlass")``
  (the CUTLASS MLA decode; 128 heads, s_q = 1). FlashInfer's wrapper concatenates the two cache halves
  on every call (a full cache copy), so it is registered for completeness with the lowest priority.
- ``mla::prefill`` backend ``"flashinfer-trtllm"``: ``flashinfer.prefill.trtllm_ragged_attention_deepseek``
  (qk 192 / v 128; LSE ``[T, H]`` base 2, compared against the ragged wrapper's base-2 LSE in
  FlashInfer's own tests).

Neither decode path returns an LSE: their ``lse`` is NaN (-inf for queries that see no row), and the
selector picks them only when the caller does not need the LSE. The lengths the kernels take as host
ints (``max_seq_len``, ``max_q_len``, ``max_kv_len``) are upper bounds from shapes, so nothing syncs.
Block tables are padded with zero columns to the multiple of ``128 / block_size`` the kernels want.

Not run on any GPU (we have no Blackwell machine): the CPU contract tests use a fake ``flashinfer``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mla_compile.ops.decode import OP as DECODE_OP
from mla_compile.ops.decode import fake as decode_fake
from mla_compile.ops.decode import validate as validate_decode
from mla_compile.ops.prefill import OP as PREFILL_OP
from mla_compile.ops.prefill import fake as prefill_fake
from mla_compile.ops.prefill import validate as validate_prefill
from mla_compile.ops.registry import DEEPSEEK_DECODE, DEEPSEEK_PREFILL, LAYOUT_TAGS, declare
from mla_compile.ops.adapters._common import (LN2, check_dtype, check_value, finish_decode, finish_prefill,
                                              importable, require_capability, workspace)

MODULE = "flashinfer"
SM100, SM103 = (10, 0), (10, 3)
DTYPES = (torch.bfloat16,)
WORKSPACE_BYTES = 128 << 20


def available() -> bool:
    """Whether ``flashinfer`` is installed (found without importing it); the capability is checked apart."""
    return importable(MODULE)


def _pad_table(block_table: Tensor, block_size: int) -> Tensor:
    """Zero columns up to a multiple of ``128 / block_size`` (entries past a sequence's end are never read)."""
    multiple = max(128 // block_size, 1)
    extra = -block_table.shape[1] % multiple
    table = block_table.to(torch.int32)
    return F.pad(table, (0, extra)) if extra else table


def _check_decode(backend: str, q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                  kv_lora_rank: int, block_sizes: tuple[int, ...]) -> None:
    op = DECODE_OP
    validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    check_dtype(op, backend, "q", q, DTYPES)
    check_dtype(op, backend, "kv_cache", kv_cache, DTYPES)
    check_value(op, backend, "kv_lora_rank", kv_lora_rank, (512,))
    check_value(op, backend, "head dim (q.shape[-1])", q.shape[-1], (576,))
    check_value(op, backend, "block_size (kv_cache.shape[1])", kv_cache.shape[1], block_sizes)


def _no_lse(out: Tensor) -> Tensor:
    return torch.full(out.shape[:-1], float("nan"), dtype=torch.float32, device=out.device)


def trtllm_decode_core(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                       kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``"flashinfer-trtllm"`` decode on any tensors (CPU with a fake ``flashinfer`` in tests); lse is NaN."""
    _check_decode("flashinfer-trtllm", q, kv_cache, block_table, seq_lens, kv_lora_rank, (32, 64))
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

    block_size = kv_cache.shape[1]
    table = _pad_table(block_table, block_size)
    ws = workspace("flashinfer-trtllm", q.device, WORKSPACE_BYTES, zero=True)
    out = trtllm_batch_decode_with_kv_cache_mla(
        query=q, kv_cache=kv_cache, workspace_buffer=ws,
        qk_nope_head_dim=128, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=q.shape[-1] - kv_lora_rank,
        block_tables=table, seq_lens=seq_lens.to(torch.int32), max_seq_len=table.shape[1] * block_size,
        bmm1_scale=scale, bmm2_scale=1.0)
    out = out.view(*q.shape[:-1], kv_lora_rank)
    return finish_decode(out, _no_lse(out), seq_lens)


def cutlass_decode_core(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                        kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``"flashinfer-cutlass"`` decode on any tensors; 128 heads, s_q = 1; lse is NaN.

    The CUTLASS kernel takes no softmax-scale argument; its built-in scale is assumed to be DeepSeek's
    ``1/sqrt(192)`` (not verified on a GPU), so any other ``scale`` (yarn's mscale) is refused.
    """
    backend = "flashinfer-cutlass"
    _check_decode(backend, q, kv_cache, block_table, seq_lens, kv_lora_rank, (32, 64, 128))
    check_value(DECODE_OP, backend, "num_heads (q.shape[2])", q.shape[2], (128,))
    check_value(DECODE_OP, backend, "query_len (q.shape[1])", q.shape[1], (1,))
    if abs(scale - 192 ** -0.5) > 1e-6 * scale:
        raise ValueError(f"{DECODE_OP}: backend {backend!r} uses the fixed softmax scale 1/sqrt(192), got "
                         f"scale={scale}; use backend 'flashinfer-trtllm' or 'triton'")
    import flashinfer

    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        workspace("flashinfer-float", q.device, WORKSPACE_BYTES), backend="cutlass")
    B = q.shape[0]
    out = wrapper.run(q[:, 0, :, :kv_lora_rank], q[:, 0, :, kv_lora_rank:], kv_cache[..., :kv_lora_rank],
                      kv_cache[..., kv_lora_rank:], kv_len=seq_lens.to(torch.int32),
                      page_table=_pad_table(block_table, kv_cache.shape[1]))
    out = out.view(B, 1, q.shape[2], kv_lora_rank)
    return finish_decode(out, _no_lse(out), seq_lens)


def trtllm_prefill_core(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """``"flashinfer-trtllm"`` ragged prefill on any tensors; base-2 LSE converted to natural log."""
    backend, op = "flashinfer-trtllm", PREFILL_OP
    validate_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    check_dtype(op, backend, "q", q, DTYPES)
    check_value(op, backend, "qk_head_dim (q.shape[2])", q.shape[2], (192,))
    check_value(op, backend, "v_head_dim (v.shape[2])", v.shape[2], (128,))
    from flashinfer.prefill import trtllm_ragged_attention_deepseek

    cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    out, lse = trtllm_ragged_attention_deepseek(
        query=q, key=k, value=v, workspace_buffer=workspace("flashinfer-trtllm", q.device, WORKSPACE_BYTES, zero=True),
        seq_lens=cu_k.diff(), max_q_len=q.shape[0], max_kv_len=k.shape[0], bmm1_scale=scale, bmm2_scale=1.0,
        o_sf_scale=-1.0, batch_size=cu_q.shape[0] - 1, window_left=-1, cum_seq_lens_q=cu_q, cum_seq_lens_kv=cu_k,
        enable_pdl=False, is_causal=causal, return_lse=True)
    return finish_prefill(out, lse, cu_seqlens_q, cu_seqlens_k, causal, LN2)


@torch.library.custom_op("mla::decode_flashinfer_trtllm", mutates_args=(), tags=LAYOUT_TAGS)
def decode_flashinfer_trtllm(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                             kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode`` through FlashInfer's trtllm-gen MLA decode (sm100/sm103; lse is NaN)."""
    require_capability(DECODE_OP, "flashinfer-trtllm", q.device, SM100, SM103)
    return trtllm_decode_core(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


@torch.library.custom_op("mla::decode_flashinfer_cutlass", mutates_args=(), tags=LAYOUT_TAGS)
def decode_flashinfer_cutlass(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                              kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode`` through FlashInfer's CUTLASS MLA decode (sm100/sm103, 128 heads; lse is NaN)."""
    require_capability(DECODE_OP, "flashinfer-cutlass", q.device, SM100, SM103)
    return cutlass_decode_core(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


@torch.library.custom_op("mla::prefill_flashinfer_trtllm", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_flashinfer_trtllm(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                              scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """``mla::prefill`` through FlashInfer's trtllm-gen ragged prefill for DeepSeek (sm100/sm103)."""
    require_capability(PREFILL_OP, "flashinfer-trtllm", q.device, SM100, SM103)
    return trtllm_prefill_core(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


decode_flashinfer_trtllm.register_fake(decode_fake)
decode_flashinfer_cutlass.register_fake(decode_fake)


prefill_flashinfer_trtllm.register_fake(prefill_fake)


BLACKWELL = dict(available=available, dtypes=DTYPES, min_capability=SM100, max_capability=SM103,
                 package="flashinfer-python", autotune=True)
declare(DECODE_OP, "flashinfer-trtllm", torch.ops.mla.decode_flashinfer_trtllm, rank=40, block_sizes=(32, 64),
        head_dims=DEEPSEEK_DECODE, lse=False, **BLACKWELL, note="Blackwell trtllm-gen kernels; returns no LSE")
declare(DECODE_OP, "flashinfer-cutlass", torch.ops.mla.decode_flashinfer_cutlass, rank=60, block_sizes=(32, 64, 128),
        num_heads=(128,), head_dims=DEEPSEEK_DECODE, multi_query=False, lse=False, **BLACKWELL,
        note="Blackwell CUTLASS kernel; no LSE; FlashInfer's wrapper copies the cache per call")
declare(PREFILL_OP, "flashinfer-trtllm", torch.ops.mla.prefill_flashinfer_trtllm, rank=20, head_dims=DEEPSEEK_PREFILL,
        **BLACKWELL, note="Blackwell trtllm-gen ragged prefill")
