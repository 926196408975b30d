"""Poisoned allocations for kernel tests: an output element a kernel never writes shows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def poisoned_empty(like: bool = False) -> Iterator[None]:
    """Inside the block every ``torch.empty`` (and ``torch.empty_like`` when ``like``) comes back filled with NaN
    (floating dtypes) or -7 (integer dtypes); the real functions are back on exit, also on an error."""
    real = {"empty": torch.empty, "empty_like": torch.empty_like}

    def poisoning(name: str):
        def alloc(*args, **kwargs):
            t = real[name](*args, **kwargs)
            return t.fill_(float("nan") if t.is_floating_point() else -7)
        return alloc

    names = ["empty", "empty_like"] if like else ["empty"]
    try:
        for name in names:
            setattr(torch, name, poisoning(name))
        yield
    finally:
        for name in names:
            setattr(torch, name, real[name])
