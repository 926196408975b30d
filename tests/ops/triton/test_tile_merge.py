"""The balanced tile ranges of the persistent decodes (``ops/triton/_plan.tile_pieces``, CPU) and their merge
(``ops/triton/tile_merge.py``, run by Triton's interpreter): the schedule covers every item's tiles once, in
order, with only a program's first and last pieces partial; the kernels' own enumeration of it and their copies
across pieces (each written out in Python from the Gluon code: every barrier wait meets the copy of the tile it
expects, at its phase, and no copy is left in flight); the merge of pieces written as the persistent kernels
write them (whole items as the result, partial ones as float32 rows and base-2 LSEs in the program's workspace
slots, computed here in float64; items of 64 rows, or 16 as the swapped kernel's) equals the float64 attention over
whole sequences, and writes the rows of empty sequences (output 0, LSE -inf)."""

from __future__ import annotations

import importlib.util
import math
import os
import random

import pytest
import torch

from _triton_test_util import sm90_compile

from mla_compile.ops.triton._plan import cta_of_tile, range_start, tile_pieces

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def _cases():
    rng = random.Random(5)
    cases = [([0, 0, 0], 2, 7), ([1], 1, 132), ([4096] * 4, 2, 132), ([64, 65, 0, 1, 700], 2, 5),
             ([300, 0, 129, 4000], 3, 16), ([128] * 128, 2, 132), ([0, 5, 0, 0], 3, 4), ([64, 0, 0], 2, 5),
             ([0] * 10 + [200], 2, 3), ([4096], 2, 132)]
    for _ in range(30):
        cases.append(([rng.choice([0, 1, 63, 64, 65, rng.randrange(1, 3000)]) for _ in range(rng.randrange(1, 12))],
                      rng.randrange(1, 4), rng.randrange(1, 40)))
    return cases


@pytest.mark.parametrize("lens,hb,ctas", _cases())
def test_pieces_cover_every_item_once_in_order(lens, hb, ctas):
    tiles = [-(-n // 64) for n in lens]
    total = hb * sum(tiles)
    pieces = tile_pieces(lens, hb, ctas)
    assert len(pieces) == ctas
    seen = {(h, b): [] for h in range(hb) for b in range(len(lens))}
    for c, mine in enumerate(pieces):
        g0, g1 = range_start(c, total, ctas), range_start(c + 1, total, ctas)
        assert sum(n for *_, n, _w, _s in mine) == g1 - g0  # the program's whole range, no more
        for i, (h, b, t0, n, whole, slot) in enumerate(mine):
            assert n > 0 and 0 <= t0 and t0 + n <= tiles[b]
            assert whole == (t0 == 0 and n == tiles[b])
            if 0 < i < len(mine) - 1:
                assert whole  # only a program's first and last pieces can be partial
            if not whole:
                assert slot == (0 if i == 0 else 1)
            seen[(h, b)].append((t0, n, c))
            # every tile of the piece lies in program c's range (the merge's arithmetic)
            s = h * sum(tiles) + sum(tiles[:b])
            assert cta_of_tile(s + t0, total, ctas) == c == cta_of_tile(s + t0 + n - 1, total, ctas)
    for (h, b), got in seen.items():
        at = 0
        for t0, n, _ in got:  # the item's pieces in order, back to back
            assert t0 == at
            at += n
        assert at == tiles[b]


def _emulate(q, keys, lens, s_q, H, ctas, out_dtype, rows_per_item):
    """What a persistent decode writes (float64 math): ``out`` / ``lse`` for whole items (NaN elsewhere), the
    workspaces for partial pieces (NaN where unused), and the float64 reference over whole sequences."""
    B, M, dc, R = len(lens), s_q * H, keys.shape[-1] - 64, rows_per_item
    hb = -(-M // R)
    out = torch.full((B * M, dc), float("nan"), dtype=out_dtype)
    lse = torch.full((B * M,), float("nan"))
    ws = torch.full((2 * ctas * R, dc), float("nan"))
    wl = torch.full((2 * ctas * R,), float("nan"))
    ref = torch.zeros(B * M, dc, dtype=torch.float64)
    ref_lse = torch.full((B * M,), float("-inf"), dtype=torch.float64)

    def attend(b, rows, lo, hi):  # rows of sequence b over positions [lo, hi): (o / l, natural-log LSE)
        qpos = rows // H
        limit = lens[b] - (s_q - 1 - qpos)
        pos = torch.arange(lo, hi)
        s = q[b * M + rows].double() @ keys[b, lo:hi].double().T
        s = s.masked_fill(pos[None, :] >= limit[:, None], float("-inf"))
        m = torch.logsumexp(s, dim=1) if hi > lo else torch.full((len(rows),), float("-inf"), dtype=torch.float64)
        p = torch.where(m.isfinite()[:, None], torch.exp(s - m[:, None]), 0.0)
        return p @ keys[b, lo:hi, :dc].double(), m

    for b in range(B):
        rows = torch.arange(M)
        ref[b * M + rows], ref_lse[b * M + rows] = attend(b, rows, 0, lens[b])
    for c, mine in enumerate(tile_pieces(lens, hb, ctas)):
        for h, b, t0, n, whole, slot in mine:
            local = torch.arange(min(R, M - h * R))  # the item's rows below M
            rows = h * R + local
            o, m = attend(b, rows, t0 * 64, min(lens[b], (t0 + n) * 64))
            if whole:
                out[b * M + rows] = o.to(out_dtype)
                lse[b * M + rows] = m.float()
            else:
                at = (2 * c + slot) * R + local
                ws[at] = o.float()
                wl[at] = (m / math.log(2)).float()
    return out, lse, ws, wl, ref, ref_lse


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("lens,s_q,H,ctas,dtype,rows", [
    ([300, 0, 129, 700, 1, 64], 1, 128, 5, torch.float32, 64),   # 12 items over 5 programs: splits, whole, empty
    ([900], 2, 64, 7, torch.float32, 64),                          # one long sequence over 7 programs; MTP rows
    ([0, 0], 1, 64, 3, torch.float32, 64),                         # nothing to attend: every row written 0 / -inf
    ([200, 130, 250, 65], 1, 128, 3, torch.bfloat16, 64),          # bf16 output
    ([63, 1, 2], 4, 16, 2, torch.float32, 64),                     # MTP: rows that see no key in some pieces
    ([700, 0, 300, 1], 1, 16, 6, torch.float32, 16),               # 16-row items (the swapped kernel's)
    ([500, 64, 0], 1, 40, 4, torch.bfloat16, 16),                  # 40 rows: row blocks of 16, 16 and 8
    ([130], 1, 64, 7, torch.float32, 64),                          # 3 tiles, 7 programs: programs of no tile between
    ([1000, 0], 1, 16, 40, torch.float32, 16),                     # 16 tiles over 40 programs
])
def test_the_merge_of_the_pieces_is_the_whole_attention(lens, s_q, H, ctas, dtype, rows):
    from torch.library import wrap_triton

    from mla_compile.ops.triton.tile_merge import merge_tile_pieces

    gen = torch.Generator().manual_seed(sum(lens) + ctas)
    B, M, dc = len(lens), s_q * H, 128
    q = torch.randn(B * M, dc + 64, generator=gen) * 0.2
    keys = torch.randn(B, max(1, max(lens)), dc + 64, generator=gen)
    out, lse, ws, wl, ref, ref_lse = _emulate(q, keys, lens, s_q, H, ctas, dtype, rows)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    # the shapes' own step (merge_shape), one piece a step, and 4 pieces a step over 32 columns
    for pieces, block_c in [(None, None), (1, 64), (4, 32)]:
        got, got_lse = out.clone(), lse.clone()
        merge_tile_pieces(wrap_triton, seq_lens, ws, wl, got, got_lse, B, M, ctas, block_c=block_c, item_rows=rows,
                          pieces=pieces)
        assert not got.isnan().any() and not got_lse.isnan().any(), "rows left unwritten"
        assert torch.equal(got_lse.isinf(), ref_lse.isinf())
        fin = ref_lse.isfinite()
        torch.testing.assert_close(got_lse[fin].double(), ref_lse[fin], atol=1e-5, rtol=1e-5)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
        assert (got[~fin] == 0).all()


def test_the_merge_refuses_items_of_other_sizes():
    pytest.importorskip("triton")
    from mla_compile.ops.triton.tile_merge import merge_tile_pieces

    with pytest.raises(ValueError, match="item_rows must be 16 or 64"):
        merge_tile_pieces(None, torch.zeros(1, dtype=torch.int32), torch.empty(0), torch.empty(0),
                          torch.empty(1, 80, 512), torch.empty(1, 80), 1, 80, 4, item_rows=32)


def _kernel_pieces(lens, hb, ctas):
    """Each program's pieces as the persistent kernels enumerate them: ``_tile_ranges.first_item`` (the inclusive
    tile sums' search), then ``next_item`` / ``piece_tiles`` until a piece has no tile, written out line for line in
    Python; ``(h, b, t0, n, whole, slot)`` as :func:`tile_pieces` gives them."""
    B = len(lens)
    tiles = [-(-n // 64) for n in lens]
    per_head = sum(tiles)
    total = hb * per_head
    out = []
    for c in range(ctas):
        g0, g1 = c * total // ctas, (c + 1) * total // ctas
        h = g0 // max(per_head, 1)
        r = g0 - h * per_head
        incl, acc = [], 0
        for t in tiles:
            acc += t
            incl.append(acc)
        sel = [v <= r for v in incl]
        b = min(sum(sel), B - 1)
        s = h * per_head + sum(t for t, k in zip(tiles, sel) if k)
        nt = tiles[b]
        n = max(min(s + nt, g1) - max(s, g0), 0)
        t0 = max(g0, s) - s
        mine, k = [], 0
        while n > 0:
            whole = t0 == 0 and n == nt
            mine.append((h, b, t0, n, whole, None if whole else min(k, 1)))
            k += 1
            s += nt  # next_item
            wrap = int(b + 1 == B)
            h, b = h + wrap, b + 1 - B * wrap
            nt = tiles[b]
            while nt == 0 and s < g1:
                wrap = int(b + 1 == B)
                h, b = h + wrap, b + 1 - B * wrap
                nt = tiles[b]
            t0 = 0
            n = max(min(s + nt, g1) - s, 0)
        out.append(mine)
    return out


@pytest.mark.parametrize("lens,hb,ctas", _cases())
def test_the_kernels_enumerate_the_host_pieces(lens, hb, ctas):
    assert _kernel_pieces(lens, hb, ctas) == tile_pieces(lens, hb, ctas)


def _ring_check(fills: dict, waits: list) -> None:
    """Match each wait ``(barrier, phase, tile)`` (in program order per barrier) with the barrier's next live fill: its
    count's parity must be the wait's phase and its tile the one the wait expects; every fill is consumed."""
    used = {k: 0 for k in fills}
    for bar, phase, want in waits:
        assert used[bar] < len(fills[bar]), f"wait on {bar} for {want}: no fill left"
        got = fills[bar][used[bar]]
        assert used[bar] % 2 == phase, f"{bar}: fill {used[bar]} ({got}) waited at phase {phase}"
        assert got == want, f"{bar}: waited for {want}, the fill brought {got}"
        used[bar] += 1
    assert all(used[k] == len(v) for k, v in fills.items()), "fills never waited for (copies in flight at the end)"


def _swap_protocol(pieces):
    """The persistent swapped kernel's copies and waits over one program's pieces, in its order
    (``decode_gluon_swap_persist``): ``(fills per slot, waits)``, tiles named ``(piece, tile)``."""
    fills, waits = {0: [], 1: []}, []

    def fill(slot, k, tile, n):
        if tile < n:  # issue_tile's predicate
            fills[slot].append((k, tile))

    u = [0, 0]
    n0 = pieces[0][3] if pieces else 0
    for t in range(2):  # the prologue
        fill(t, 0, t, n0)
    for k, (*_, n, _w, _s) in enumerate(pieces):
        n2 = pieces[k + 1][3] if k + 1 < len(pieces) else 0
        if n == 1:
            fill(1, k + 1, 1, n2)
        waits.append((0, u[0] & 1, (k, 0)))
        for j in range(n):
            slot = j % 2
            if j + 2 < n:
                fill(slot, k, j + 2, n)
            else:
                fill(slot, k + 1, slot, n2)
            if j + 1 < n:
                nslot = 1 - slot
                waits.append((nslot, (u[nslot] + (j + 1) // 2) & 1, (k, j + 1)))
        u = [u[0] + (n + 1) // 2, u[1] + n // 2]
    return fills, waits


@pytest.mark.parametrize("lens,hb,ctas", _cases())
def test_the_swapped_kernels_copies_meet_its_waits(lens, hb, ctas):
    for mine in tile_pieces(lens, hb, ctas):
        _ring_check(*_swap_protocol(mine))


def _seesaw_protocol(pieces):
    """The persistent seesaw's copies and waits over one program's pieces (``decode_gluon_seesaw_persist``): each
    slot's three parts (rope, latent half 0, half 1) on barriers of their own, filled by the warpgroups as its code
    does (warpgroup C's rope and half C of slot C after its own P V, its half C of the other's slot after folding the
    other's tile, the prologue's and the one-tile piece's whole tiles), waited for by the slot owner's S; ``(fills per
    (slot, part), waits)``."""
    parts = [(s, p) for s in (0, 1) for p in ("rope", 0, 1)]
    fills, waits = {k: [] for k in parts}, []

    def fill(slot, part, k, tile, n):
        if tile < n:
            fills[(slot, part)].append((k, tile))

    def target(u, slot, k, n, n2):  # fill_target: this piece's tile u while it has one, else the next piece's
        return (k, u, n) if u < n else (k + 1, slot, n2)

    u = [0, 0]
    n0 = pieces[0][3] if pieces else 0
    for t in range(2):
        for part in ("rope", 0, 1):
            fill(t, part, 0, t, n0)
    for k, (*_, n, _w, _s) in enumerate(pieces):
        n2 = pieces[k + 1][3] if k + 1 < len(pieces) else 0
        if n == 1:  # warpgroup 0, the one-tile piece's rule
            for part in ("rope", 0, 1):
                fill(1, part, k + 1, 1, n2)
        for t in range(n):
            c = t % 2
            for part in ("rope", 0, 1):  # _scores: this warpgroup's slot, its three parts
                waits.append(((c, part), (u[c] + t // 2) & 1, (k, t)))
            if t > 0:  # _release_other after folding tile t - 1: half c of the other's slot
                fill(1 - c, c, *target(t + 1, 1 - c, k, n, n2))
            kk, tt, nn = target(t + 2, c, k, n, n2)  # _own_pv: rope and half c of its own slot
            fill(c, "rope", kk, tt, nn)
            fill(c, c, kk, tt, nn)
        last = n - 1
        c = 1 - last % 2  # the warpgroup that folds the other's last tile, then fills its half of that slot
        fill(1 - c, c, k + 1, 1 - c, n2)
        u = [u[0] + (n + 1) // 2, u[1] + n // 2]
    return fills, waits


@pytest.mark.parametrize("lens,hb,ctas", _cases())
def test_the_seesaw_kernels_copies_meet_its_waits(lens, hb, ctas):
    for mine in tile_pieces(lens, hb, ctas):
        _ring_check(*_seesaw_protocol(mine))


@pytest.mark.parametrize("items,ctas,rows", [(2, 132, 64), (1, 132, 16), (256, 132, 64), (100, 132, 64),
                                             (1024, 132, 16), (7, 5, 64)])
def test_merge_shape_loads_8192_values_a_step_and_covers_an_average_item(items, ctas, rows):
    """``merge_shape``: powers of two, one step's load of ``P * rows * BLOCK_C`` values at most 8192, and with fewer
    items than programs ``P`` at least the programs an item spans on average (so such an item takes one or two
    steps, not one step a piece)."""
    pytest.importorskip("triton")
    from mla_compile.ops.triton.tile_merge import merge_shape

    p, bc = merge_shape(items, ctas, rows)
    assert p & (p - 1) == 0 and bc & (bc - 1) == 0 and 2 <= p <= 16 and 8 <= bc <= 128
    assert p * rows * bc <= 8192
    if items < ctas:
        assert p >= min(16, -(-ctas // items) + 1)


@sm90_compile
@pytest.mark.parametrize("B,M,rows,ctas", [(1, 128, 64, 132), (1, 16, 16, 132), (128, 128, 64, 132)])
def test_the_merge_compiles_for_sm90_without_spills(monkeypatch, B, M, rows, ctas):
    """The merge kernel at the steps :func:`merge_shape` picks (16 pieces of 8 columns for one sequence at 128
    heads, 16 of 32 at 16 heads, 2 of 64 at 128 sequences) over 512 latent columns: it compiles for sm_90 with PDL's
    wait first, and keeps its ``[P, rows, BLOCK_C]`` step in registers (no spills where cuobjdump is bundled)."""
    from mla_compile.ops.triton import _sm90, tile_merge
    from mla_compile.ops.triton._pdl import ON

    from _triton_test_util import assert_pdl_order

    monkeypatch.setattr(tile_merge, "launch_kwargs", lambda device: dict(ON))  # as an sm_90 device launches it
    dc, items, meta = 512, -(-M // rows) * B, torch.device("meta")
    ws, wl = tile_merge.tile_workspace(ctas, dc, meta, rows)
    launches: list = []
    tile_merge.merge_tile_pieces(_sm90.recorder(launches), torch.empty(B, dtype=torch.int32, device=meta), ws, wl,
                                 torch.empty(B, M, dc, dtype=torch.bfloat16, device=meta),
                                 torch.empty(B, M, dtype=torch.float32, device=meta), B, M, ctas, pdl=True,
                                 item_rows=rows)
    (kernel, grid, args, kwargs), = launches
    p, bc = tile_merge.merge_shape(items, ctas, rows)
    assert (kwargs["P"], kwargs["BLOCK_C"]) == (p, bc) and grid == (items, dc // bc)
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    assert_pdl_order(compiled.asm["ptx"], True, "the merge")
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills in the merge"
