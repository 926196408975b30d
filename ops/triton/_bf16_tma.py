"""Shared pieces of the sm_90 Gluon bf16 decodes (``decode_gluon``, ``decode_gluon_ws``): tile shapes, the
shared-memory layouts, a tile's TMA copies into a slot and the zeroing of a partial tile's value rows.
Imports Triton's Gluon, so only the kernels import it."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

BLOCK_M = 64  # query rows a program (wgmma's M)
BLOCK_N = 64  # keys a tile: one block-table entry
DC, DR = 512, 64
D = DC + DR
CHUNK = 64  # columns a TMA copy (128 bytes: the swizzle width)
STAGES = 2  # tile slots
TILE_BYTES = BLOCK_N * D * 2
BOX_SL = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)  # the latent copy's box
BOX_C = gl.constexpr(BOX_SL)
# the splits' float32 partial rows: a [64, 256] block as eight [64, 32] column blocks (128 bytes: the swizzle width)
F32_SL = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
F32_C = gl.constexpr(F32_SL)
F32_BOX_SL = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)  # [1 split, 8, 64, 32]
F32_BOX_C = gl.constexpr(F32_BOX_SL)


def row_blocks_descriptor(out, rows: int, box_blocks: int = DC // CHUNK):
    """A TMA descriptor of ``out``'s ``rows`` bf16 rows of ``DC`` as ``[8, rows, 64]`` column blocks (``BOX_SL``), box
    ``[box_blocks, 64, 64]`` (default: whole rows): where the 64-row kernels store their output rows (``TMA_OUT``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    blocks = out.view(rows, DC).as_strided([DC // CHUNK, rows, CHUNK], [CHUNK, DC, 1])
    return TensorDescriptor.from_tensor(blocks, [box_blocks, BLOCK_M, CHUNK], BOX_SL)


@gluon.jit
def issue_tile(desc_c, desc_r, kc_s, kr_s, ready, page, tile, n_tiles, start, BLOCK_SIZE: gl.constexpr):
    """Start the two TMA copies of tile ``tile`` (none past ``n_tiles``; ``page``: its block-table entry,
    ``_gluon.tile_page``) into slot ``tile % 2``: cache rows ``page * BLOCK_SIZE + (start + 64 tile) % BLOCK_SIZE
    + [0, 64)``, their latent columns as eight ``[64, 64]`` column blocks (``desc_c``; the slot's ``[64, 512]``
    layout holds them one after another) and their rope columns (``desc_r``)."""
    issue_tile_if(desc_c, desc_r, kc_s, kr_s, ready, page, tile, tile < n_tiles, start, BLOCK_SIZE)


@gluon.jit
def tile_row(page, tile, start, BLOCK_SIZE: gl.constexpr):
    """The first cache row (of the cache viewed as ``[rows, 576]``) of tile ``tile`` of a program whose key range
    starts at ``start``: row ``(start + 64 tile) % BLOCK_SIZE`` of page ``page`` (its block-table entry)."""
    return (page * BLOCK_SIZE + (start + tile * 64) % BLOCK_SIZE).to(gl.int32)


@gluon.jit
def issue_tile_if(desc_c, desc_r, kc_s, kr_s, ready, page, tile, live, start, BLOCK_SIZE: gl.constexpr):
    """:func:`issue_tile` of tile ``tile`` where ``live`` (a scalar predicate) holds."""
    row = tile_row(page, tile, start, BLOCK_SIZE)
    slot = tile % 2
    bar = ready.index(slot)
    mbarrier.expect(bar, 64 * 576 * 2, pred=live)
    tma.async_copy_global_to_shared(desc_c, [0, row, 0], bar,
                                    kc_s.index(slot)._reinterpret(gl.bfloat16, [8, 64, 64], BOX_C), pred=live)
    tma.async_copy_global_to_shared(desc_r, [row, 512], bar, kr_s.index(slot), pred=live)


@gluon.jit
def zero_tail(k_v, valid, zl: gl.constexpr):
    """Zero the value columns ``[0, 512)`` of a slot's key rows at or past ``valid`` (a partial tile: rows of a
    page past the sequence may hold NaN, and 0 * NaN would reach the output); ``zl``: a ``[64, 64]`` layout
    of the calling warps."""
    keep = (gl.arange(0, 64, gl.SliceLayout(1, zl)) < valid)[:, None]
    for c in gl.static_range(8):
        part = k_v.slice(c * 64, 64, dim=1)
        x = part.load(zl)
        part.store(gl.where(keep, x, gl.zeros_like(x)))
