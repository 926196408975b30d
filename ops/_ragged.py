"""Helpers for ragged (cu_seqlens) layouts, shared by the op references."""

from __future__ import annotations

import torch
from torch import Tensor


def segments(cu: Tensor, n_rows: int) -> tuple[Tensor, Tensor]:
    """Sequence id (``len(cu) - 1`` for padding rows) and local index of each of ``n_rows`` ragged rows."""
    rows = torch.arange(n_rows, device=cu.device)
    seq = torch.searchsorted(cu[1:].long().contiguous(), rows, right=True)
    start = cu.long()[seq.clamp(max=cu.shape[0] - 1)]
    return seq, rows - start
