"""What the block-quantized linear ops (``mla::fp8_block_linear``, ``mla::fp4_block_linear``) share: the
grouped form's row selection and the output shape every implementation returns."""

from __future__ import annotations

import torch
from torch import Tensor


def pick_groups(y: Tensor, offs: Tensor, dtype: torch.dtype) -> Tensor:
    """``[R, N]`` from ``y [E, R, N]`` (every group's result on every row): row ``r`` keeps its own group's
    (group ``g`` holds rows ``offs[g-1] <= r < offs[g]``), rows past ``offs[-1]`` are 0; no host sync."""
    rows = torch.arange(y.shape[1], device=y.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)  # E for rows past offs[-1]
    picked = y.gather(0, group.clamp_max(y.shape[0] - 1)[None, :, None].expand(1, -1, y.shape[-1]))[0]
    return torch.where((group < y.shape[0])[:, None], picked, 0).to(dtype)


def empty_output(x: Tensor, weight: Tensor, offs: Tensor | None) -> Tensor:
    """The output every implementation returns, empty: ``[M, N]``, ``[E, M, N]`` (3-D weight, no ``offs``) or
    (with ``offs``) ``[R, N]``, of x's dtype."""
    N = weight.shape[-2]
    if weight.dim() == 3 and offs is None:
        return x.new_empty(weight.shape[0], x.shape[-2], N)
    return x.new_empty(x.shape[0], N)
