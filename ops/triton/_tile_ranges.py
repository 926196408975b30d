"""The balanced tile ranges of the persistent Gluon decodes, found on the device (``_plan.tile_pieces`` is the host
reference; ``tile_merge`` merges what they leave split).

The work items are (row block, sequence) pairs, row-block-major, each the ``cdiv(len, 64)`` key tiles of its
sequence; laid end to end they are ``T`` global tiles, and program c of the grid takes ``[c T // grid, (c + 1) T //
grid)``. A program's run crosses items: its pieces, run one after the other. Each piece's tile t lives in ring slot
``t % 2``; a slot's refill after a piece's last tile in it takes the next piece's tile of that slot (tile 0 into slot
0, tile 1 into slot 1), so a piece of one tile leaves slot 1 for the program to fill with the next piece's tile 1
when that piece starts. Global tiles are 32-bit (the products that find a range are 64-bit).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from mla_compile.ops.triton._gluon import tile_page

CH = gl.constexpr(256)  # sequence lengths read a step by the schedule's search (a 4-warp layout)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def first_item(seq_lens_ptr, B, HB, CH: gl.constexpr):
    """Program ``program_id(0)``'s range ``[g0, g1)`` of the ``HB * sum(tiles)`` global tiles over
    ``num_programs(0)`` programs and the item holding tile ``g0``: ``(g0, g1, h, b, s, nt, len)``, its row block,
    sequence, first global tile, tiles and length (an empty range: ``b`` clamped to a real sequence)."""
    l1: gl.constexpr = gl.BlockedLayout([CH // 128], [32], [4], [0])
    acc = gl.zeros([CH], gl.int64, l1)
    for j0 in range(0, B, CH):
        offs = j0 + gl.arange(0, CH, l1)
        acc += gl.cdiv(gl.load(seq_lens_ptr + offs, mask=offs < B, other=0), 64).to(gl.int64)
    per_head = gl.sum(acc, axis=0)
    total = HB * per_head
    c = gl.program_id(0).to(gl.int64)
    g0 = c * total // gl.num_programs(0)  # the product in 64 bits; the tiles themselves fit 32
    g1 = (c + 1) * total // gl.num_programs(0)
    h = g0 // gl.maximum(per_head, 1)
    r = g0 - h * per_head
    # the sequence: the number of inclusive tile sums <= r; its first tile: their tiles' sum
    n_before = gl.zeros([CH], gl.int32, l1)
    before = gl.zeros([CH], gl.int64, l1)
    carry = per_head * 0
    for j0 in range(0, B, CH):
        offs = j0 + gl.arange(0, CH, l1)
        nt = gl.cdiv(gl.load(seq_lens_ptr + offs, mask=offs < B, other=0), 64).to(gl.int64)
        sel = ((gl.associative_scan(nt, 0, _add) + carry) <= r) & (offs < B)
        n_before += sel.to(gl.int32)
        before += gl.where(sel, nt, 0)
        carry += gl.sum(nt, axis=0)
    b = gl.minimum(gl.sum(n_before, axis=0), B - 1)
    seq_len = gl.load(seq_lens_ptr + b)
    s = h * per_head + gl.sum(before, axis=0)
    return (g0.to(gl.int32), g1.to(gl.int32), h.to(gl.int32), b, s.to(gl.int32), gl.cdiv(seq_len, 64), seq_len)


@gluon.jit
def next_item(seq_lens_ptr, B, h, b, s, nt, g1):
    """The item after ``(h, b)`` (first global tile ``s``, ``nt`` tiles) that has tiles, or any item once past
    ``g1``: ``(h, b, s, nt, len)``."""
    s = s + nt
    wrap = (b + 1 == B).to(gl.int32)
    h = h + wrap
    b = b + 1 - B * wrap
    seq_len = gl.load(seq_lens_ptr + b)
    nt = gl.cdiv(seq_len, 64)
    while (nt == 0) & (s < g1):  # an empty sequence holds no tile: the next (one exists: s < g1 <= T)
        wrap = (b + 1 == B).to(gl.int32)
        h = h + wrap
        b = b + 1 - B * wrap
        seq_len = gl.load(seq_lens_ptr + b)
        nt = gl.cdiv(seq_len, 64)
    return h, b, s, nt, seq_len


@gluon.jit
def piece_tiles(s, nt, g0, g1):
    """Tiles of the item at global tile ``s`` (``nt`` tiles) inside ``[g0, g1)`` (0 past it)."""
    return gl.maximum(gl.minimum(s + nt, g1) - gl.maximum(s, g0), 0)


@gluon.jit
def fill_target(u, slot, n, start, bt_row, n2, bt_row2, BLOCK_SIZE: gl.constexpr):
    """The refill of slot ``slot`` after this piece's tile u - 2: ``(page, tile, n_tiles, start)`` of this piece's
    tile ``u`` while it has one, else of the next piece's tile ``slot`` (``n2`` tiles from key 0)."""
    if u < n:
        page = tile_page(bt_row, u, n, start, BLOCK_SIZE, 64)
        tile = u
        n_t = n
        st = start
    else:
        page = tile_page(bt_row2, slot, n2, 0, BLOCK_SIZE, 64)
        tile = u * 0 + slot
        n_t = n2
        st = start * 0
    return page, tile, n_t, st
