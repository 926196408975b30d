"""Triton ``mla::gather_latent_cache``: copy paged token ranges into the workspace in one pass.

Grid ``cdiv(S, BLOCK_R) + N`` (shapes only); each program finds its sequence with ``tiles_started`` on
``cu_seqlens``. Workspace rows past ``cu_seqlens[-1]`` are written with zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.gather import validate
from mla_compile.ops.triton._common import tiles_started, last_dim_contiguous, pow2


@triton.jit
def _gather_kernel(
    cache_ptr, bt_ptr, cu_ptr, starts_ptr, out_ptr,
    n_seq, S, block_size,
    s_cb, s_ct, s_bt, s_out,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    slot = tl.program_id(0)
    seq = -1  # the segment owning tile ``slot`` (see ``tiles_started``)
    for c in range(0, n_seq + 1, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        seq += tiles_started(tl.load(cu_ptr + idx, mask=idx <= n_seq, other=0), idx, n_seq, slot, BLOCK_R)
    r0 = tl.load(cu_ptr + seq).to(tl.int64)
    live = seq < n_seq
    seq_c = tl.minimum(seq, tl.maximum(n_seq - 1, 0))  # a safe index for the padding segment's loads
    r_end = tl.where(live, tl.load(cu_ptr + seq_c + 1, mask=live, other=0).to(tl.int64), S)
    rows = r0 + (slot - (r0 // BLOCK_R + seq)) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < r_end
    ld_ok = r_ok & live
    pos = tl.load(starts_ptr + seq_c, mask=live, other=0).to(tl.int64) + (rows - r0)
    blk = tl.load(bt_ptr + seq_c.to(tl.int64) * s_bt + pos // block_size, mask=ld_ok, other=0).to(tl.int64)
    src = cache_ptr + blk * s_cb + (pos % block_size) * s_ct
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = (d < D)[None, :]
        x = tl.load(src[:, None] + d[None, :], mask=ld_ok[:, None] & d_ok, other=0.0)
        tl.store(out_ptr + rows[:, None] * s_out + d[None, :], x.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & d_ok)


def _launch(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_starts: Tensor, out: Tensor) -> None:
    """Kernel path (the interpreter on CPU tensors too). Mutates ``out``."""
    S, D = out.shape
    N = block_table.shape[0]
    if S == 0 or D == 0:
        return
    if out.stride(-1) != 1:
        raise ValueError(f"mla.gather_latent_cache (triton): out needs a unit stride in its last dim, got strides "
                         f"{tuple(out.stride())}; allocate it contiguous or use backend='reference'")
    kv_cache = last_dim_contiguous(kv_cache)
    block_r = 16
    wrap_triton(_gather_kernel)[(triton.cdiv(S, block_r) + N,)](
        kv_cache, block_table, cu_seqlens, seq_starts, out,
        N, S, kv_cache.shape[1],
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), out.stride(0),
        D=D, BLOCK_R=block_r, BLOCK_D=min(pow2(D), 256), CHUNK=128, num_warps=4,
    )


@triton_op("mla::gather_latent_cache_triton", mutates_args=("out",))
def gather_latent_cache_triton(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_starts: Tensor,
                               out: Tensor) -> None:
    """Triton ``mla::gather_latent_cache`` (contract of the ``_ref`` op); non-CUDA runs the reference."""
    if out.device.type != "cuda":
        torch.ops.mla.gather_latent_cache_ref(kv_cache, block_table, cu_seqlens, seq_starts, out)
        return
    validate(kv_cache, block_table, cu_seqlens, seq_starts, out)
    _launch(kv_cache, block_table, cu_seqlens, seq_starts, out)
