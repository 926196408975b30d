"""Per-step host values uploaded into a persistent device tensor without a host sync on the step's path."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class HostUpload:
    """Fills ``device`` (a persistent tensor: captured CUDA graphs read it at a fixed address) from host memory
    by one non-blocking copy per step. On CUDA the host side is two pinned buffers used in turn, each rewritten
    only after its previous copy finished (the host may run two steps ahead); a CPU ``device`` tensor is written
    in place (no copy); elsewhere one buffer.

    Per step: write the array :meth:`begin` returns, then call :meth:`upload`."""

    def __init__(self, device: Tensor, fill: int = 0) -> None:
        self.device = device
        pin = device.device.type == "cuda"
        self._in_place = device.device.type == "cpu"
        if self._in_place:
            device.fill_(fill)
            self._host = [device]
        else:
            self._host = [torch.full(device.shape, fill, dtype=device.dtype, pin_memory=pin)
                          for _ in range(2 if pin else 1)]
        self._arrays = [h.numpy() for h in self._host]  # numpy views, made once
        self._copied: list = [None] * len(self._host)
        # one event per host buffer, recorded again after each copy from it (begin waits for its last copy first)
        self._events = [torch.cuda.Event() for _ in self._host] if pin else []
        self._turn = 0

    def begin(self) -> np.ndarray:
        """The host buffer of this step (a numpy view), once its previous copy finished."""
        done = self._copied[self._turn]
        if done is not None and not done.query():
            done.synchronize()  # the host is two steps ahead: wait for that step's copy
        return self._arrays[self._turn]

    def upload(self) -> None:
        """Copy this step's host buffer into ``device`` (non-blocking) and move to the next buffer."""
        if self._in_place:
            return
        turn = self._turn
        self.device.copy_(self._host[turn], non_blocking=True)
        if self.device.device.type == "cuda":
            event = self._events[turn]
            event.record()
            self._copied[turn] = event
        self._turn = (turn + 1) % len(self._host)
