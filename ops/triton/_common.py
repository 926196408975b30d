"""Helpers shared by the Triton kernels: launch-shape heuristics and the ragged-segment search."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Used when there is no CUDA device (interpreter runs): small, so that split paths get exercised.
_FALLBACK_SMS = 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (a host-side property query: no sync, capture-safe)."""
    if device.type != "cuda":
        return _FALLBACK_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def pow2(n: int, low: int = 16) -> int:
    """The next power of two >= max(n, low) (``tl.dot`` wants every dim >= 16)."""
    return max(low, triton.next_power_of_2(max(int(n), 1)))


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride in its last dim (a copy only when it lacks one; for read-only inputs)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


@triton.jit
def find_segment(cu_ptr, n_seq, slot, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Segment ``i`` in ``[0, n_seq]`` owning tile ``slot`` of a ragged layout (``n_seq`` = padding rows).

    Segment i owns the tile slots ``[cu[i] // BLOCK + i, cu[i] // BLOCK + i + cdiv(len_i, BLOCK))``; these
    ranges never overlap, are increasing in i and all lie below ``cdiv(total_rows, BLOCK) + n_seq``, so a
    grid of that size (a shape, never data) covers every tile. Counting the starts <= slot finds i.
    """
    count = 0
    for c in range(0, n_seq + 1, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        ok = idx <= n_seq
        start = tl.load(cu_ptr + idx, mask=ok, other=0) // BLOCK + idx
        count += tl.sum(((start <= slot) & ok).to(tl.int32), axis=0)
    return count - 1
