"""Process-wide torch state the test session pins before any test runs (called from ``conftest.py``)."""

from __future__ import annotations

import torch.utils._device as _device


def pin_device_constructors() -> None:
    """Compute now, from the real factory functions, the set by which ``with torch.device(...)`` recognises a
    factory call (``torch.utils._device._device_constructors``: computed once per process, on first use, and
    cached). Tests poison ``torch.empty`` by monkeypatching it to fill NaN; were that first use inside one of
    them, the set would hold the poisoning function instead of ``torch.empty`` and every later
    ``with torch.device("meta")`` of the worker would build real parameters (``nn.Linear`` allocates with
    ``torch.empty``) while ``torch.randn`` still went to meta."""
    constructors = getattr(_device, "_device_constructors", None)
    if constructors is not None:
        constructors()
