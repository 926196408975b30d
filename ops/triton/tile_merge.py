"""The merge after a persistent decode over balanced tile ranges (``_plan.tile_pieces`` is its host reference).

A persistent decode runs ``ctas`` programs; program c takes global tiles ``[c T // ctas, (c + 1) T // ctas)`` of the
``T = head_blocks * sum(cdiv(len, 64))`` tiles of the (head block, sequence) items laid end to end, head-block-major.
An item that one program covers whole was written by that program (the result, natural-log LSE). An item that
several programs cover has one piece in each: the float32 partial rows ``o / l`` of a piece and their base-2 LSE in
program c's workspace slot 0 (the item is c's first piece) or 1 (its last), rows ``(2 c + slot) * 64 + r`` of
``ws [2 ctas * 64, dc]`` and ``wl [2 ctas * 64]``. :func:`merge_tile_pieces` folds those pieces and writes the
items of empty sequences (output 0, LSE -inf). Every value the kernel needs comes from the lengths on the device:
no host planning, nothing read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mla_compile.ops.triton._pdl import OFF, launch_kwargs, pdl_launch_dependents, pdl_wait

ROWS = 64  # query rows of an item (a head block)
BLOCK_N = 64  # keys of a tile
CH = 256  # sequence lengths read a step


@triton.jit
def _tiles_before(seq_lens_ptr, B, b, CH: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(tiles of the sequences before b, tiles of all B sequences)`` (``cdiv(len, BLOCK_N)`` each), int64."""
    before = tl.zeros([CH], dtype=tl.int64)
    total = tl.zeros([CH], dtype=tl.int64)
    for j0 in range(0, B, CH):
        offs = j0 + tl.arange(0, CH)
        nt = tl.cdiv(tl.load(seq_lens_ptr + offs, mask=offs < B, other=0), BLOCK_N).to(tl.int64)
        before += tl.where(offs < b, nt, 0)
        total += nt
    return tl.sum(before, axis=0), tl.sum(total, axis=0)


@triton.jit
def _tile_merge_kernel(seq_lens_ptr, ws_ptr, wl_ptr, out_ptr, lse_ptr, B, M, ctas,
                       DC: tl.constexpr, BLOCK_C: tl.constexpr, CH: tl.constexpr, BLOCK_N: tl.constexpr,
                       PDL: tl.constexpr):
    """Grid ``(head blocks * B, cdiv(DC, BLOCK_C))``: program ``(item, c)`` takes columns ``[c BLOCK_C, (c + 1)
    BLOCK_C)`` of item ``item`` (head block ``item // B`` of sequence ``item % B``, its 64 rows of ``out [B M, DC]``).
    An item of no tile: output 0, LSE -inf; an item one program covered: nothing (written there); else the pieces
    of programs ``cta_of(s) .. cta_of(s + tiles - 1)`` merged by their base-2 LSEs, the natural-log LSE stored by
    column block 0. ``PDL``: everything it reads is the decode's, so it waits first."""
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    item = tl.program_id(0)
    pid_c = tl.program_id(1)
    h = item // B
    b = item % B
    r = tl.arange(0, 64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < DC
    out_row = (b * M + h * 64 + r).to(tl.int64)
    nt = tl.cdiv(tl.load(seq_lens_ptr + b), BLOCK_N).to(tl.int64)
    if nt == 0:
        tl.store(out_ptr + out_row[:, None] * DC + cols[None, :],
                 tl.zeros([64, BLOCK_C], dtype=out_ptr.dtype.element_ty), mask=c_ok[None, :])
        if pid_c == 0:
            tl.store(lse_ptr + out_row, tl.full([64], float("-inf"), tl.float32))
    else:
        before, per_head = _tiles_before(seq_lens_ptr, B, b, CH, BLOCK_N)
        total = (M // 64) * per_head
        s = h * per_head + before
        c_first = ((s + 1) * ctas - 1) // total
        c_last = ((s + nt) * ctas - 1) // total
        if c_first != c_last:
            m = tl.full([64], float("-inf"), tl.float32)
            tot = tl.zeros([64], dtype=tl.float32)
            acc = tl.zeros([64, BLOCK_C], dtype=tl.float32)
            for c in range(c_first, c_last + 1):
                slot = tl.where(c * total // ctas >= s, 0, 1)  # the item is program c's first piece, or its last
                wrow = (2 * c + slot) * 64 + r
                l2 = tl.load(wl_ptr + wrow)
                part = tl.load(ws_ptr + wrow[:, None] * DC + cols[None, :], mask=c_ok[None, :], other=0.0)
                m_new = tl.maximum(m, l2)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m - m_safe)
                w = tl.math.exp2(l2 - m_safe)
                acc = acc * alpha[:, None] + part * w[:, None]
                tot = tot * alpha + w
                m = m_new
            empty = tot == 0.0
            out = acc / tl.where(empty, 1.0, tot)[:, None]
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            lse = tl.where(empty, float("-inf"),
                           (m_safe + tl.math.log2(tl.where(empty, 1.0, tot))) * 0.6931471805599453)
            tl.store(out_ptr + out_row[:, None] * DC + cols[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=c_ok[None, :])
            if pid_c == 0:
                tl.store(lse_ptr + out_row, lse)


def tile_workspace(ctas: int, dc: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Uninitialized float32 workspaces of a persistent decode of ``ctas`` programs: partial rows ``[2 ctas 64,
    dc]`` and their base-2 LSEs ``[2 ctas 64]`` (two slots a program: its first and its last piece)."""
    return (torch.empty(2 * ctas * ROWS, dc, dtype=torch.float32, device=device),
            torch.empty(2 * ctas * ROWS, dtype=torch.float32, device=device))


def merge_tile_pieces(wrap, seq_lens: Tensor, ws: Tensor, wl: Tensor, out: Tensor, lse: Tensor, batch: int,
                      rows: int, ctas: int, pdl: bool = False, block_c: int = 128) -> None:
    """Merge a persistent decode's pieces into ``out [batch, ..., dc]`` (``batch * rows`` rows, ``rows`` a multiple of
    64) and ``lse`` (natural log) and write the rows of empty sequences (the module docstring). ``wrap``: the caller
    module's ``wrap_triton`` (tests record launches through it). ``pdl``: launched with PDL (a custom op's body)."""
    if rows % ROWS:
        raise ValueError(f"merge_tile_pieces: rows a sequence must be a multiple of {ROWS}, got {rows}")
    dc = out.shape[-1]
    wrap(_tile_merge_kernel)[(rows // ROWS * batch, triton.cdiv(dc, block_c))](
        seq_lens, ws, wl, out, lse, batch, rows, ctas, DC=dc, BLOCK_C=block_c, CH=CH, BLOCK_N=BLOCK_N, num_warps=4,
        **(launch_kwargs(out.device) if pdl else dict(OFF)),
    )
