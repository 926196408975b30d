"""The merge after a persistent decode over balanced tile ranges (``_tile_ranges``; ``_plan.tile_pieces`` is the host
reference).

A persistent decode runs ``ctas`` programs; program c takes global tiles ``[c T // ctas, (c + 1) T // ctas)`` of the
``T = row_blocks * sum(cdiv(len, 64))`` tiles of the (row block, sequence) items laid end to end, row-block-major
(``rows`` query rows an item: 64, or 16 for the swapped kernel). An item that one program covers whole was written by
that program (the result, natural-log LSE). An item that several programs cover has one piece in each: the float32
partial rows ``o / l`` of a piece and their base-2 LSE in program c's workspace slot 0 (the item is c's first piece)
or 1 (its last), rows ``(2 c + slot) rows + r`` of ``ws [2 ctas rows, dc]`` and ``wl [2 ctas rows]``.
:func:`merge_tile_pieces` folds those pieces and writes the items of empty sequences (output 0, LSE -inf). Every
value the kernel needs comes from the lengths on the device: no host planning, nothing read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mla_compile.ops.triton._pdl import OFF, launch_kwargs, pdl_launch_dependents, pdl_wait

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
                       ROWS: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(row blocks * B, cdiv(DC, BLOCK_C))``: program ``(item, c)`` takes columns ``[c BLOCK_C, (c + 1)
    BLOCK_C)`` of item ``item`` (row block ``item // B`` of sequence ``item % B``: its ``ROWS`` rows of ``out [B M,
    DC]`` below ``M``).
    An item of no tile: output 0, LSE -inf; an item one program covered: nothing (written there); else the pieces
    of programs ``cta_of(s) .. cta_of(s + tiles - 1)`` merged by their base-2 LSEs, the natural-log LSE stored by
    column block 0 (programs of no tile among them skipped: they wrote nothing). ``PDL``: everything it reads is the
    decode's, so it waits first."""
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    item = tl.program_id(0)
    pid_c = tl.program_id(1)
    h = item // B
    b = item % B
    r = tl.arange(0, ROWS)
    r_ok = h * ROWS + r < M
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = r_ok[:, None] & (cols < DC)[None, :]
    out_row = (b * M + h * ROWS + r).to(tl.int64)
    nt = tl.cdiv(tl.load(seq_lens_ptr + b), BLOCK_N).to(tl.int64)
    if nt == 0:
        tl.store(out_ptr + out_row[:, None] * DC + cols[None, :],
                 tl.zeros([ROWS, BLOCK_C], dtype=out_ptr.dtype.element_ty), mask=ok)
        if pid_c == 0:
            tl.store(lse_ptr + out_row, tl.full([ROWS], float("-inf"), tl.float32), mask=r_ok)
    else:
        before, per_head = _tiles_before(seq_lens_ptr, B, b, CH, BLOCK_N)
        total = tl.cdiv(M, ROWS) * per_head
        s = h * per_head + before
        c_first = ((s + 1) * ctas - 1) // total
        c_last = ((s + nt) * ctas - 1) // total
        if c_first != c_last:
            m = tl.full([ROWS], float("-inf"), tl.float32)
            tot = tl.zeros([ROWS], dtype=tl.float32)
            acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
            for c in range(c_first, c_last + 1):
                g_c = c * total // ctas
                slot = tl.where(g_c >= s, 0, 1)  # the item is program c's first piece, or its last
                # a program with no tile (fewer tiles than programs) between the item's first and last wrote nothing
                mine = r_ok & ((c + 1) * total // ctas > g_c)
                wrow = (2 * c + slot) * ROWS + r
                l2 = tl.load(wl_ptr + wrow, mask=mine, other=float("-inf"))
                part = tl.load(ws_ptr + wrow[:, None] * DC + cols[None, :], mask=mine[:, None] & ok, other=0.0)
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
            tl.store(out_ptr + out_row[:, None] * DC + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
            if pid_c == 0:
                tl.store(lse_ptr + out_row, lse, mask=r_ok)


def tile_workspace(ctas: int, dc: int, device: torch.device, rows: int = 64) -> tuple[Tensor, Tensor]:
    """Uninitialized float32 workspaces of a persistent decode of ``ctas`` programs over items of ``rows`` query rows:
    partial rows ``[2 ctas rows, dc]`` and their base-2 LSEs ``[2 ctas rows]`` (two slots a program: its first and
    its last piece)."""
    return (torch.empty(2 * ctas * rows, dc, dtype=torch.float32, device=device),
            torch.empty(2 * ctas * rows, dtype=torch.float32, device=device))


def merge_tile_pieces(wrap, seq_lens: Tensor, ws: Tensor, wl: Tensor, out: Tensor, lse: Tensor, batch: int,
                      rows: int, ctas: int, pdl: bool = False, block_c: int = 128, item_rows: int = 64) -> None:
    """Merge a persistent decode's pieces into ``out [batch, ..., dc]`` (``batch * rows`` rows) and ``lse`` (natural
    log) and write the rows of empty sequences (the module docstring); items of ``item_rows`` (16 or 64) of a
    sequence's ``rows`` query rows. ``wrap``: the caller module's ``wrap_triton`` (tests record launches through it).
    ``pdl``: launched with PDL (a custom op's body)."""
    if item_rows not in (16, 64):
        raise ValueError(f"merge_tile_pieces: item_rows must be 16 or 64, got {item_rows}")
    dc = out.shape[-1]
    wrap(_tile_merge_kernel)[(triton.cdiv(rows, item_rows) * batch, triton.cdiv(dc, block_c))](
        seq_lens, ws, wl, out, lse, batch, rows, ctas, DC=dc, BLOCK_C=block_c, CH=CH, BLOCK_N=BLOCK_N,
        ROWS=item_rows, num_warps=4, **(launch_kwargs(out.device) if pdl else dict(OFF)),
    )
