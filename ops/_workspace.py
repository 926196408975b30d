"""Persistent device buffers shared by the kernels and adapters that need scratch memory or semaphores across calls."""

from __future__ import annotations

import torch
from torch import Tensor

_WORKSPACES: dict[tuple[str, str, int], Tensor] = {}


def workspace(key: str, device: torch.device, nbytes: int, *, zero: bool = False) -> Tensor:
    """A persistent uint8 buffer per ``(key, device)``, allocated on first use and reused after.

    Allocate it in a warm-up call before CUDA-graph capture (every capture recipe warms up first);
    ``zero`` buffers (semaphores: the trtllm-gen kernels', the router kernel's arrival counter) are zeroed once,
    and the kernels that use them leave them zeroed. Calls on one device share the buffer, so its users must not run
    concurrently on two streams.
    """
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    k = (key, device.type, index)
    buf = _WORKSPACES.get(k)
    if buf is None or buf.numel() < nbytes:
        buf = (torch.zeros if zero else torch.empty)(nbytes, dtype=torch.uint8, device=device)
        _WORKSPACES[k] = buf
    return buf
