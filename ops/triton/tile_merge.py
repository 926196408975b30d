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
                       ROWS: tl.constexpr, P: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(row blocks * B, cdiv(DC, BLOCK_C))``: program ``(item, c)`` takes columns ``[c BLOCK_C, (c + 1)
    BLOCK_C)`` of item ``item`` (row block ``item // B`` of sequence ``item % B``: its ``ROWS`` rows of ``out [B M,
    DC]`` below ``M``).
    An item of no tile: output 0, LSE -inf; an item one program covered: nothing (written there); else the pieces
    of programs ``cta_of(s) .. cta_of(s + tiles - 1)`` merged by their base-2 LSEs, ``P`` pieces a step (their loads
    issued together: an item over many programs is not walked one piece after another), the natural-log LSE stored
    by column block 0 (programs of no tile among them skipped: they wrote nothing). ``PDL``: everything it reads is
    the decode's, so it waits first."""
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
            p = tl.arange(0, P)
            for c0 in range(c_first, c_last + 1, P):  # P pieces a step, their loads side by side
                c = c0 + p
                g_c = c * total // ctas
                slot = tl.where(g_c >= s, 0, 1)  # the item is program c's first piece, or its last
                # a program with no tile (fewer tiles than programs) between the item's first and last wrote nothing
                mine = (c <= c_last)[:, None] & ((c + 1) * total // ctas > g_c)[:, None] & r_ok[None, :]
                wrow = (2 * c + slot)[:, None] * ROWS + r[None, :]
                l2 = tl.load(wl_ptr + wrow, mask=mine, other=float("-inf"))
                part = tl.load(ws_ptr + wrow[:, :, None] * DC + cols[None, None, :],
                               mask=mine[:, :, None] & ok[None, :, :], other=0.0)
                m_new = tl.maximum(m, tl.max(l2, axis=0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m - m_safe)
                w = tl.math.exp2(l2 - m_safe[None, :])
                acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], axis=0)
                tot = tot * alpha + tl.sum(w, axis=0)
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


def merge_shape(items: int, ctas: int, item_rows: int) -> tuple[int, int]:
    """``(P, BLOCK_C)`` of :func:`merge_tile_pieces` from shapes alone: ``P`` pieces a step (a power of two, 2 to 16:
    about the programs an item spans when there are fewer items than programs, else 2) and ``BLOCK_C`` columns a
    program (a power of two, 8 to 128) so that one step loads ``P * item_rows * BLOCK_C = 8192`` values."""
    p = 2 if items >= ctas else min(16, triton.next_power_of_2(-(-ctas // max(items, 1)) + 1))
    return p, max(8, min(128, 8192 // (p * item_rows)))


def merge_tile_pieces(wrap, seq_lens: Tensor, ws: Tensor, wl: Tensor, out: Tensor, lse: Tensor, batch: int,
                      rows: int, ctas: int, pdl: bool = False, block_c: int | None = None, item_rows: int = 64,
                      pieces: int | None = None) -> None:
    """Merge a persistent decode's pieces into ``out [batch, ..., dc]`` (``batch * rows`` rows) and ``lse`` (natural
    log) and write the rows of empty sequences (the module docstring); items of ``item_rows`` (16 or 64) of a
    sequence's ``rows`` query rows. ``wrap``: the caller module's ``wrap_triton`` (tests record launches through it).
    ``pdl``: launched with PDL (a custom op's body). ``pieces`` / ``block_c``: pieces a step and columns a program
    (default :func:`merge_shape`'s)."""
    if item_rows not in (16, 64):
        raise ValueError(f"merge_tile_pieces: item_rows must be 16 or 64, got {item_rows}")
    dc = out.shape[-1]
    items = triton.cdiv(rows, item_rows) * batch
    p, bc = merge_shape(items, ctas, item_rows)
    p, bc = pieces or p, block_c or bc
    wrap(_tile_merge_kernel)[(items, triton.cdiv(dc, bc))](
        seq_lens, ws, wl, out, lse, batch, rows, ctas, DC=dc, BLOCK_C=bc, CH=CH, BLOCK_N=BLOCK_N,
        ROWS=item_rows, P=p, num_warps=8, **(launch_kwargs(out.device) if pdl else dict(OFF)),
    )
