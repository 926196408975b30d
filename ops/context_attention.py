"""``mla::context_attention``: prefill queries attend to their cached context, slice by slice.

Contract: prefill queries ``q [T, H, nope + rope]`` whose attention over their new tokens gave
``out [T, H, v]`` and ``lse [T, H]`` (float32, natural log) also attend to the cached context of
their sequences. The context of prefill sequence i (positions ``0 .. context_len_i - 1``, found
through ``block_table [N, max_blocks]`` in ``kv_cache``) is covered by ``C`` slices:
slice c holds ``slice_rows[c]`` workspace rows, of which rows ``slice_cu_seqlens[c, i] :
slice_cu_seqlens[c, i + 1]`` are positions ``slice_starts[c, i], ...`` of sequence i. Each slice is
gathered into a workspace of ``slice_rows[c]`` rows (bf16/float cache, or the 656-byte fp8 rows
dequantized to q's dtype), up-projected by ``kv_b_weight [H * (nope + v), kv_lora_rank]`` to
per-head keys ``[k_nope | k_pe]`` and values, attended without a mask and merged into
``(out, lse)`` by LSE. Returns the merged ``(out [T, H, v], lse [T, H])``; ``out``/``lse`` are not
mutated. With ``C = 0`` it returns copies.

The slice count is a tensor dimension, not a Python value of the caller, so a compiled graph that
calls this op serves any context length without recompiling; the workspace never exceeds the
largest ``slice_rows`` entry (the planner's per-slice budget). ``slice_rows [C]`` is an int64
*host* tensor (read on the host inside the op: workspace sizes, no device sync); every other
index tensor lives on q's device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve
from mla_compile.ops.fp8_cache import fp8_row_bytes, gather_latent_cache_fp8
from mla_compile.ops.gather import gather_latent_cache
from mla_compile.ops.merge import merge_attn_states
from mla_compile.ops.prefill import prefill

OP = declare_op("context_attention", "mla.context_attention")


def validate(q: Tensor, out: Tensor, lse: Tensor, kv_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
             slice_cu_seqlens: Tensor, slice_starts: Tensor, slice_rows: Tensor, kv_b_weight: Tensor,
             kv_lora_rank: int, rope_dim: int) -> None:
    """Shape/dtype/device checks (metadata only, no sync); the gather and prefill ops check the data."""
    check_tensor(OP, "q", q, ndim=3, dtypes=FLOAT_DTYPES, expected="[T, H, qk_nope_head_dim + rope_dim]")
    T, H, Dqk = q.shape
    nope = Dqk - rope_dim
    if not 0 < rope_dim < Dqk:
        raise ValueError(f"{OP}: rope_dim must be in (0, {Dqk}) (q's last dim is nope + rope), got {rope_dim}")
    check_tensor(OP, "out", out, ndim=3, dtypes=(q.dtype,), shape=(T, H, None), expected=f"[{T}, {H}, v_head_dim]")
    v = out.shape[2]
    check_tensor(OP, "lse", lse, ndim=2, dtypes=(torch.float32,), shape=(T, H), expected=f"[{T}, {H}] float32")
    if kv_cache.dtype == torch.uint8:
        width, kind = fp8_row_bytes(kv_lora_rank, rope_dim), "uint8 fp8 rows"
    else:
        width, kind = kv_lora_rank + rope_dim, "float rows"
    check_tensor(OP, "kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES + (torch.uint8,), shape=(None, None, width),
                 expected=f"[num_blocks, block_size, {width}] ({kind})")
    check_tensor(OP, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, expected="[N, max_blocks] int32")
    N = block_table.shape[0]
    check_tensor(OP, "cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, shape=(N + 1,), expected=f"[{N + 1}]")
    check_tensor(OP, "slice_cu_seqlens", slice_cu_seqlens, ndim=2, dtypes=INDEX_DTYPES, shape=(None, N + 1),
                 expected=f"[C, {N + 1}] int32")
    C = slice_cu_seqlens.shape[0]
    check_tensor(OP, "slice_starts", slice_starts, ndim=2, dtypes=INDEX_DTYPES, shape=(C, N), expected=f"[{C}, {N}] int32")
    check_tensor(OP, "slice_rows", slice_rows, ndim=1, dtypes=INDEX_DTYPES, shape=(C,), expected=f"[{C}] int64 host tensor")
    if slice_rows.device.type not in ("cpu", "meta"):
        raise ValueError(f"{OP}: slice_rows must be a host (CPU) tensor (the workspace sizes are read on the host), "
                         f"got device {slice_rows.device}")
    check_tensor(OP, "kv_b_weight", kv_b_weight, ndim=2, dtypes=(q.dtype,), shape=(H * (nope + v), kv_lora_rank),
                 expected=f"[{H} * ({nope} + {v}), {kv_lora_rank}] (kv_b_proj.weight), q's dtype")
    check_same_device(OP, q=q, out=out, lse=lse, kv_cache=kv_cache, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                      slice_cu_seqlens=slice_cu_seqlens, slice_starts=slice_starts, kv_b_weight=kv_b_weight)


def up_project(latent: Tensor, k_pe: Tensor, kv_b_weight: Tensor, num_heads: int, nope: int,
               v_dim: int) -> tuple[Tensor, Tensor]:
    """Latent rows ``latent [n, kv_lora_rank]`` and ``k_pe [n, rope]`` -> per-head keys ``[n, H, nope + rope]``
    (``[latent @ W_UK | k_pe]``, k_pe cast to the keys' dtype) and contiguous values ``[n, H, v_dim]``, with
    ``kv_b_weight [H * (nope + v_dim), kv_lora_rank]`` (``kv_b_proj.weight``): the non-absorbed prefill path."""
    # no symbolic row count in the views (unflatten, expand with -1): cheaper for Dynamo to trace
    kv = torch.nn.functional.linear(latent, kv_b_weight).unflatten(-1, (num_heads, nope + v_dim))
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1).to(k_nope.dtype)], dim=-1)
    return k, v.contiguous()


@torch.library.custom_op("mla::context_attention", mutates_args=(), tags=LAYOUT_TAGS)
def context_attention_op(q: Tensor, out: Tensor, lse: Tensor, kv_cache: Tensor, block_table: Tensor,
                         cu_seqlens_q: Tensor, slice_cu_seqlens: Tensor, slice_starts: Tensor, slice_rows: Tensor,
                         kv_b_weight: Tensor, scale: float, kv_lora_rank: int, rope_dim: int,
                         prefill_backend: str, merge_backend: str, gather_backend: str) -> tuple[Tensor, Tensor]:
    """The slice loop over the gather, prefill and merge ops (each with the named backend, "auto" allowed)."""
    validate(q, out, lse, kv_cache, block_table, cu_seqlens_q, slice_cu_seqlens, slice_starts, slice_rows,
             kv_b_weight, kv_lora_rank, rope_dim)
    H, nope, v = q.shape[1], q.shape[2] - rope_dim, out.shape[2]
    auto = lambda name: None if name == "auto" else name  # noqa: E731
    fp8 = kv_cache.dtype == torch.uint8
    row_dtype = q.dtype if fp8 else kv_cache.dtype
    out, lse = out.clone(), lse.clone()
    for c, n_rows in enumerate(slice_rows.tolist()):
        rows = torch.empty(n_rows, kv_lora_rank + rope_dim, dtype=row_dtype, device=q.device)
        gather = gather_latent_cache_fp8 if fp8 else gather_latent_cache
        gather(kv_cache, block_table, slice_cu_seqlens[c], slice_starts[c], rows, backend=auto(gather_backend))
        latent, k_pe = rows.to(q.dtype).split([kv_lora_rank, rope_dim], dim=-1)
        k, v_c = up_project(latent, k_pe, kv_b_weight, H, nope, v)
        out_c, lse_c = prefill(q, k, v_c, cu_seqlens_q, slice_cu_seqlens[c], scale, causal=False,
                               backend=auto(prefill_backend))
        out, lse = merge_attn_states(out, lse, out_c, lse_c, backend=auto(merge_backend))
    return out, lse


@context_attention_op.register_fake
def _(q, out, lse, kv_cache, block_table, cu_seqlens_q, slice_cu_seqlens, slice_starts, slice_rows, kv_b_weight,
      scale, kv_lora_rank, rope_dim, prefill_backend, merge_backend, gather_backend):
    validate(q, out, lse, kv_cache, block_table, cu_seqlens_q, slice_cu_seqlens, slice_starts, slice_rows,
             kv_b_weight, kv_lora_rank, rope_dim)
    return torch.empty_like(out), torch.empty_like(lse)


declare(OP, "composite", torch.ops.mla.context_attention, rank=10, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        note="gather, prefill and merge per context slice, each with its own backend")


def context_attention(q: Tensor, out: Tensor, lse: Tensor, kv_cache: Tensor, block_table: Tensor,
                      cu_seqlens_q: Tensor, slice_cu_seqlens: Tensor, slice_starts: Tensor, slice_rows: Tensor,
                      kv_b_weight: Tensor, scale: float, *, kv_lora_rank: int, rope_dim: int,
                      prefill_backend: str | None = None, merge_backend: str | None = None,
                      gather_backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Merge the cached context into ``(out, lse)``; see the module docstring for the contract.

    ``*_backend``: the backend of each inner op (None/"auto": that op's default).
    """
    resolve(OP, q.device, "composite")
    return torch.ops.mla.context_attention(q, out, lse, kv_cache, block_table, cu_seqlens_q, slice_cu_seqlens,
                                           slice_starts, slice_rows, kv_b_weight, scale, kv_lora_rank, rope_dim,
                                           prefill_backend or "auto", merge_backend or "auto",
                                           gather_backend or "auto")
