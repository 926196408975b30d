"""``mla::gather_latent_cache``: copy token ranges of paged sequences into a contiguous workspace.

Contract: for sequence i, workspace rows ``cu_seqlens[i]:cu_seqlens[i+1]`` receive the cache rows of
token positions ``seq_starts[i], seq_starts[i] + 1, ...`` of that sequence, found through
``block_table [N, max_blocks]`` in ``kv_cache [num_blocks, block_size, D]``. Workspace rows past
``cu_seqlens[-1]`` are set to 0. ``out [S, D]`` (the bounded workspace; its size is a shape, never read
from data) is mutated in place and nothing is returned.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_range, check_same_device, check_tensor,
                                     data_checks_enabled)
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve
from mla_compile.ops._paged import ragged_rows
from mla_compile.ops._ragged import segments

OP = declare_op("gather", "mla.gather_latent_cache", env="if_present")


def validate(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_starts: Tensor, out: Tensor) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode. Raises before any write."""
    check_tensor(OP, "kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES, expected="[num_blocks, block_size, D]")
    check_tensor(OP, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, expected="[N, max_blocks] int32")
    N = block_table.shape[0]
    check_tensor(OP, "cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES, shape=(N + 1,), expected=f"[{N + 1}] int32")
    check_tensor(OP, "seq_starts", seq_starts, ndim=1, dtypes=INDEX_DTYPES, shape=(N,), expected=f"[{N}] int32")
    check_tensor(OP, "out", out, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, kv_cache.shape[2]),
                 expected=f"[S, {kv_cache.shape[2]}] workspace")
    check_same_device(OP, kv_cache=kv_cache, block_table=block_table, cu_seqlens=cu_seqlens, seq_starts=seq_starts, out=out)
    if data_checks_enabled(cu_seqlens):
        S = out.shape[0]
        if int(cu_seqlens[0]) != 0 or bool((cu_seqlens.diff() < 0).any()) or int(cu_seqlens[-1]) > S:
            raise ValueError(f"{OP}: cu_seqlens must start at 0, be non-decreasing and end at most at the "
                             f"workspace size {S}, got {cu_seqlens.tolist()}")
        capacity = block_table.shape[1] * kv_cache.shape[1]
        # a negative start would index the block table from its end and gather another block's rows
        check_range(OP, "seq_starts", seq_starts, 0, capacity + 1, what=f"token positions, at most {capacity}")
        check_range(OP, "seq_starts + lengths", seq_starts.long() + cu_seqlens.diff().long(), 0, capacity + 1,
                    what=f"token ranges must end within max_blocks * block_size = {capacity}")
        seq, loc = segments(cu_seqlens, S)
        live = seq < N
        pos = seq_starts.long()[seq[live]] + loc[live]
        check_range(OP, "block_table", block_table.long()[seq[live], pos // kv_cache.shape[1]], 0, kv_cache.shape[0],
                    what=f"block ids of gathered rows, num_blocks = {kv_cache.shape[0]}")


@torch.library.custom_op("mla::gather_latent_cache_ref", mutates_args=("out",), tags=LAYOUT_TAGS)
def gather_latent_cache_ref(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_starts: Tensor,
                            out: Tensor) -> None:
    """Reference (plain torch, any device, no host sync): one indexed gather, padding rows zeroed."""
    validate(kv_cache, block_table, cu_seqlens, seq_starts, out)
    if block_table.shape[0] == 0:
        out.zero_()
        return
    blocks, offsets, live = ragged_rows(block_table, cu_seqlens, seq_starts, out.shape[0], kv_cache.shape[1])
    out.copy_(torch.where(live[:, None], kv_cache[blocks, offsets].to(out.dtype), 0))


@gather_latent_cache_ref.register_fake
def _(kv_cache, block_table, cu_seqlens, seq_starts, out):
    validate(kv_cache, block_table, cu_seqlens, seq_starts, out)
    return None


declare(OP, "reference", torch.ops.mla.gather_latent_cache_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="plain torch")


def gather_latent_cache(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_starts: Tensor,
                        out: Tensor, *, backend: str | None = None) -> None:
    """Gather paged rows into the workspace ``out [S, D]`` (mutated); see the module docstring."""
    resolve(OP, kv_cache.device, backend, dtype=kv_cache.dtype).fn(kv_cache, block_table, cu_seqlens, seq_starts, out)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor,
            seq_starts: Tensor, out: Tensor) -> None:
    import mla_compile.ops.triton.gather  # noqa: F401  (registers mla::gather_latent_cache_triton)
    torch.ops.mla.gather_latent_cache_triton(kv_cache, block_table, cu_seqlens, seq_starts, out)


declare(OP, "triton", _triton, rank=10, available=_triton_available, dtypes=FLOATS, package="triton", gpu_tested=True,
        kernels=("gather_latent_cache_triton", "_gather_kernel"), note="ours")
