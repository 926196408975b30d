"""Launch plans of the split-KV kernels, from shapes only. No Triton import, so CPU-only machines (CI)
test them."""

from __future__ import annotations

import torch


MAX_SPLITS = 64  # the most splits a decode launch uses (the kernels' ``split_count`` clamps to it too)
# The fewest key tiles of the block table's width an opaque launch gives a split, per kernel (the module's name;
# "default" for the rest): fewer tiles, more splits. The bf16 Gluon and the 64-row fp8 Gluon decodes gain from 2
# at one or two sequences, the 16-row fp8 kernel loses (timings in BENCHMARKS.md; bench_splits.py swaps them).
SPLIT_TILES = {"default": 4, "decode_gluon": 2, "fp8_decode_gluon64": 2}


def split_plan(programs, sms: int, cap, requested: int | None = None) -> tuple:
    """``(splits, direct)`` for a split-KV launch of ``programs`` programs on ``sms`` multiprocessors
    (``requested``: a caller's split count, taken as is, direct when 1).

    Splitting adds a workspace round trip, so a concrete launch splits only while a wave of the SMs is
    not full (``direct``: one split, the kernel writes the result). A symbolic ``programs`` (a dynamic
    batch traced by torch.compile) gets the same formula for every size and always the workspace path.
    The formula is a floor division only: a ``Min``/``Max`` of symbolic sizes, or a workspace dim that
    may be 1, makes Inductor decide between them (``check_contiguous_sizes_strides``), a guard on the
    batch that a warm AOTAutograd cache enforces (a recompile for another batch size). ``cap`` (the most
    splits worth taking, int or symbolic) and ``MAX_SPLITS`` are applied where both are concrete; the
    kernels also clamp their effective split count to them on the device (the ``split_cap`` argument;
    the programs past it exit at once), so the traced and the eager launch split the keys the same way
    and agree bit for bit.
    """
    if requested is not None:
        return requested, requested == 1
    if isinstance(programs, int) and programs >= sms:
        return 1, True
    splits = (2 * sms + programs - 1) // programs
    if isinstance(programs, int) and isinstance(cap, int):
        splits = max(1, min(splits, cap, MAX_SPLITS))
    return splits, False


def wave_cost(programs: int, slots: int, cap: int, splits: int) -> float:
    """Time of a launch of ``programs * splits`` programs, ``slots`` at once, in units of one sequence's
    work: whole waves of ``1 / splits`` of a sequence each, plus a fixed cost per program (its setup and
    the workspace round trip) taken as the ``1 / cap`` of a sequence that ``cap`` splits may cut it into."""
    return -(-programs * splits // slots) * (1 / splits + 1 / max(1, cap))


def wave_splits(programs: int, slots: int, cap: int) -> tuple[int, bool]:
    """``(splits, direct)`` for a launch whose size is known when it runs (an opaque op, never traced):
    the split count in ``[1, cap]`` with the least :func:`wave_cost`, the smallest on ties."""
    best = min(range(1, max(1, cap) + 1), key=lambda s: (wave_cost(programs, slots, cap, s), s))
    return best, best == 1


def opaque_splits(config: dict | None, programs: int, slots: int, table_keys: int, block_n: int,
                  kernel: str = "default") -> tuple[int, bool]:
    """``(splits, direct)`` of an opaque (Gluon) split launch of ``programs`` programs, ``slots`` at once: the
    caller's ``config["SPLITS"]`` when given (refused outside ``[1, MAX_SPLITS]``: the merge reads at most that
    many), else :func:`wave_splits` with at most one split per ``SPLIT_TILES[kernel]`` (or the default's) tiles
    of ``block_n`` of the block table's ``table_keys`` positions."""
    if config and "SPLITS" in config:
        splits = config["SPLITS"]
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"mla.decode_fp8 (gluon): config SPLITS must be in [1, {MAX_SPLITS}] (the merge reads "
                             f"at most that many), got {splits}")
        return splits, splits == 1
    tiles = SPLIT_TILES.get(kernel, SPLIT_TILES["default"])
    return wave_splits(programs, slots, max(1, min(table_keys // (tiles * block_n), MAX_SPLITS)))


def split_buffers(out: torch.Tensor, lse: torch.Tensor, rows: int, splits, dc: int,
                  direct: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a split kernel writes: ``out``/``lse`` themselves when ``direct`` (one split), else flat float32
    workspaces of ``rows * splits * dc`` / ``rows * splits`` (row-major ``[rows, splits, dc]``) that
    ``decode.reduce_splits`` folds into them. Flat: a symbolic ``splits`` dim would make the contiguity check
    ask whether it is 1, a guard on the batch."""
    if direct:
        return out, lse
    return (torch.empty(rows * splits * dc, dtype=torch.float32, device=out.device),
            torch.empty(rows * splits, dtype=torch.float32, device=out.device))


# The persistent decodes' balanced tile ranges, on the host: the reference the kernels (``_tile_ranges``, whose
# docstring has the scheme) and the merge (``tile_merge``) are tested against.


def range_start(c: int, total: int, ctas: int) -> int:
    """The first global tile of program ``c``'s range: ``c * total // ctas``."""
    return c * total // ctas


def cta_of_tile(g: int, total: int, ctas: int) -> int:
    """The program whose range holds global tile ``g`` (``0 <= g < total``): the largest ``c`` with
    ``c * total // ctas <= g``, that is ``((g + 1) * ctas - 1) // total``."""
    return ((g + 1) * ctas - 1) // total


def tile_pieces(lens, head_blocks: int, ctas: int, block_n: int = 64) -> list[list[tuple]]:
    """Each program's pieces, in order: ``(row_block, seq, first_tile, n_tiles, whole, ws_slot)`` for sequence
    lengths ``lens`` (a list of ints), ``head_blocks`` row blocks of query rows a sequence (items row-block-major),
    ``ctas`` programs; ``ws_slot`` is None for a whole item, else the program's workspace slot (0: its first piece,
    1: its last)."""
    tiles = [-(-int(n) // block_n) for n in lens]
    per_head, starts = sum(tiles), []
    for h in range(head_blocks):
        acc = h * per_head
        for b, t in enumerate(tiles):
            starts.append((h, b, acc, t))
            acc += t
    total = head_blocks * per_head
    pieces = []
    for c in range(ctas):
        g0, g1 = range_start(c, total, ctas), range_start(c + 1, total, ctas)
        mine = []
        for h, b, s, t in starts:
            lo, hi = max(s, g0), min(s + t, g1)
            if lo < hi:
                whole = lo == s and hi == s + t
                mine.append((h, b, lo - s, hi - lo, whole, None if whole else (0 if not mine else 1)))
        pieces.append(mine)
    return pieces
