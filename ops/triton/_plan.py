"""Launch plans of the split-KV kernels, from shapes only. No Triton import, so CPU-only machines (CI)
test them."""

from __future__ import annotations

import torch


def split_plan(programs, sms: int, cap) -> tuple:
    """``(splits, direct)`` for a split-KV launch of ``programs`` programs on ``sms`` multiprocessors.

    Splitting adds a workspace round trip, so a concrete launch splits only while a wave of the SMs is
    not full (``direct``: one split, the kernel writes the result). A symbolic ``programs`` (a dynamic
    batch traced by torch.compile) gets one formula for every size and always the workspace path, so
    the trace installs no guard on the batch (no recompile when it crosses ``sms``); at full waves the
    formula gives 1 split and the merge kernel only rescales (a few MB against the cache read).
    ``cap`` (int or symbolic) bounds the split count.
    """
    if isinstance(programs, int):
        if programs >= sms:
            return 1, True
        return torch.sym_min(-(-2 * sms // programs), cap), False
    return torch.sym_max(1, torch.sym_min((2 * sms + programs - 1) // programs, cap)), False
