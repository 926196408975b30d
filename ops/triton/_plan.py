"""Launch plans of the split-KV kernels, from shapes only. No Triton import, so CPU-only machines (CI)
test them."""

from __future__ import annotations

import torch


def split_plan(programs, sms: int, cap, requested: int | None = None) -> tuple:
    """``(splits, direct)`` for a split-KV launch of ``programs`` programs on ``sms`` multiprocessors
    (``requested``: a caller's split count, taken as is, direct when 1).

    Splitting adds a workspace round trip, so a concrete launch splits only while a wave of the SMs is
    not full (``direct``: one split, the kernel writes the result). A symbolic ``programs`` (a dynamic
    batch traced by torch.compile) gets the same formula for every size and always the workspace path,
    so the trace installs no guard on the batch (no recompile when it crosses ``sms``); from two waves
    on the formula gives 1 split (between one and two, 2) and the merge kernel only rescales (a few MB
    against the cache read). ``cap`` (int or symbolic, >= 1) bounds the split count.
    """
    if requested is not None:
        return requested, requested == 1
    if isinstance(programs, int) and programs >= sms:
        return 1, True
    return torch.sym_max(1, torch.sym_min((2 * sms + programs - 1) // programs, cap)), False



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
