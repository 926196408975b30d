"""Helpers shared by the Triton kernels: launch-shape heuristics and the ragged-segment search."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

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


def widest_tile(programs_per_tile: int, width: int, sms: int, waves: int, divides: int = 0) -> int:
    """The widest output tile (16, 8 or 4 rows) over ``width`` rows that still gives each of ``sms`` SMs ``waves``
    programs when each tile has ``programs_per_tile`` of them (the fused MoE kernels' GEMV tiles); halved until it
    divides ``divides`` (when nonzero)."""
    block = next((wide for wide in (16, 8) if programs_per_tile * triton.cdiv(width, wide) >= waves * sms), 4)
    while divides and divides % block:
        block //= 2
    return block


def check_config(where: str, config: dict | None, keys) -> dict:
    """``config`` as a dict (``{}`` for None); a ValueError naming ``where`` when it has keys outside ``keys``
    (a removed or misspelt launch flag is an error, not an ignored entry)."""
    config = dict(config or {})
    unknown = set(config) - set(keys)
    if unknown:
        raise ValueError(f"{where}: unknown config keys {sorted(unknown)}; expected some of {sorted(keys)}")
    return config


def pow2(n: int, low: int = 16) -> int:
    """The next power of two >= max(n, low) (``tl.dot`` wants every dim >= 16)."""
    return max(low, triton.next_power_of_2(max(int(n), 1)))


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride in its last dim (a copy only when it lacks one; for read-only inputs)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


# Torch's Triton mutation analysis (what Inductor believes a ``triton_op`` kernel writes) follows every
# store address back through the arguments of any jit-function call it depends on, but stops at loads.
# A helper that takes a *pointer* of read-only metadata and returns something a store address depends
# on would therefore mark that metadata as written, and a graph whose inputs are "mutated" is copied
# around and refused by Inductor's CUDA graphs (mode="reduce-overhead"). So the kernels load metadata
# themselves and hand the helpers loaded values.


@triton.jit
def causal_bounds(m0, off, len_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """A prefill tile's key range: ``(hi, full_end)``, the keys its query rows ``[m0, m0 + BLOCK_M)`` can see
    (``off`` = keys before the first query, the causal diagonal's shift) and the end of the ``BLOCK_N`` tiles no
    row of it masks (the tiles in ``[full_end, hi)`` need the causal / length mask)."""
    if CAUSAL:
        hi = tl.minimum(len_k, m0 + BLOCK_M + off)
        full_end = tl.maximum(tl.minimum(m0 + off + 1, len_k), 0) // BLOCK_N * BLOCK_N
    else:
        hi = len_k
        full_end = len_k // BLOCK_N * BLOCK_N
    return hi, full_end


def prefill_outputs(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """A varlen prefill's ``(out [T, H, dv] in q's dtype, lse [T, H] float32)``, uninitialized."""
    T, H = q.shape[0], q.shape[1]
    return (torch.empty(T, H, v.shape[-1], dtype=q.dtype, device=q.device),
            torch.empty(T, H, dtype=torch.float32, device=q.device))


@triton.jit
def tiles_started(cu, idx, n_seq, slot, BLOCK: tl.constexpr):
    """How many of the segments ``idx`` (a chunk of ``[0, n_seq]``, ``cu`` their loaded ``cu_seqlens``
    entries) start at or before tile ``slot`` of a ragged layout: summed over all chunks, minus one, it is
    the segment ``i`` in ``[0, n_seq]`` owning the tile (``n_seq`` = padding rows).

    Segment i owns the tile slots ``[cu[i] // BLOCK + i, cu[i] // BLOCK + i + cdiv(len_i, BLOCK))``; these
    ranges never overlap, are increasing in i and all lie below ``cdiv(total_rows, BLOCK) + n_seq``, so a
    grid of that size (a shape, never data) covers every tile. Counting the starts <= slot finds i.
    """
    return tl.sum((((cu // BLOCK + idx) <= slot) & (idx <= n_seq)).to(tl.int32), axis=0)


@triton.jit
def dot_two_part(q_a, k_a, q_b, k_b, IEEE: tl.constexpr):
    """``q_a @ k_a^T + q_b @ k_b^T`` (fp32): scores over a head dim split in two tiles (512+64, 128+64)."""
    if IEEE:
        s = tl.dot(q_a, tl.trans(k_a), input_precision="ieee")
        s = tl.dot(q_b, tl.trans(k_b), s, input_precision="ieee")
    else:
        s = tl.dot(q_a, tl.trans(k_a))
        s = tl.dot(q_b, tl.trans(k_b), s)
    return s


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One flash-attention update with base-2 scores ``s``: returns the new ``(m_i, l_i, acc)``.

    ``MASKED`` tiles may hold rows that have seen only -inf so far; their shift is taken as 0 so that
    no ``-inf - -inf`` NaN appears (``l_i`` stays 0 and marks the row empty).
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def split_count(n_splits, split_cap):
    """The splits a launch of ``n_splits`` split programs uses: at most ``split_cap`` and 64
    (``_plan.MAX_SPLITS``), at least 1; the programs past it exit and the merge reads only the first ones."""
    return tl.minimum(n_splits, tl.maximum(tl.minimum(split_cap, 64), 1))


@triton.jit
def decode_program(b, seq_len, n_splits, split_cap, M, H, S_Q, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """A split-KV decode program (grid: head blocks, splits, sequences) of sequence ``b`` (``program_id(2)``)
    holding ``seq_len`` rows (loaded by the kernel): its split ``pid_s`` (``pid_s >= n_used``: an unused
    split, the program exits), the key range ``[start, end)`` of that split (whole ``BLOCK_N`` tiles), its
    query rows ``rows`` (``row_ok``: < M), each row's query index ``qi`` and causal bound ``limit`` (it sees
    positions < limit)."""
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_used = split_count(n_splits, split_cap)
    per_split = tl.cdiv(tl.cdiv(seq_len, n_used), BLOCK_N) * BLOCK_N
    start = pid_s * per_split
    end = tl.minimum(start + per_split, seq_len)
    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    qi = rows // H
    return pid_s, n_used, start, end, rows, rows < M, qi, seq_len - (S_Q - 1 - qi)


@triton.jit
def paged_rows(bt_row, kv_ptr, n0, end, stride_kb, stride_kt, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               PAGE_TILES: tl.constexpr):
    """The tile of positions ``n0 + [0, BLOCK_N)`` (``pos_ok``: < end) and each one's cache row pointer,
    found through the sequence's block-table row ``bt_row``. ``PAGE_TILES`` (``BLOCK_N`` divides the block
    size and tiles start at multiples of ``BLOCK_N``): the tile lies in one page, so one block-table entry
    and fixed row offsets give the rows (affine addresses: fewer instructions and registers in the loop
    than a per-row gather)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    pos_ok = pos < end
    if PAGE_TILES:
        page = kv_ptr + tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64) * stride_kb
        return pos, pos_ok, page + ((n0 % BLOCK_SIZE) + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_kt
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    return pos, pos_ok, kv_ptr + blk * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kt


@triton.jit
def slot_dest(slot, cache_ptr, n_slots, block_size, s_cb, s_ct):
    """Which cache-write rows write (``ok``: slot in ``[0, n_slots)``; -1 is padding, out-of-range slots are
    never written) and each row's destination pointer in ``cache_ptr`` (blocks of ``block_size`` rows,
    strides ``s_cb`` / ``s_ct``), from the rows' loaded ``slot`` values (int64; -1 past the real rows)."""
    ok = (slot >= 0) & (slot < n_slots)
    return ok, cache_ptr + (slot // block_size) * s_cb + (slot % block_size) * s_ct
