"""Input validation shared by the MLA ops.

Shape and dtype checks read only metadata: they run in the fake functions (once, at trace time under
``torch.compile``) and in eager calls, and never sync with the device. Checks that read tensor *data*
(block ids in range, seq_lens within the block table, slots in range) sync the host, so they run on
CPU tensors always and on accelerators only in checked mode (``MLA_COMPILE_CHECKED=1`` or
:func:`set_checked_mode`); the metadata builders validate the same facts on host-side data instead.
"""

from __future__ import annotations

from typing import Sequence

import torch

_CHECKED = False
INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def set_checked_mode(enabled: bool) -> None:
    """Turn on data checks (host syncs) for accelerator tensors too."""
    global _CHECKED
    _CHECKED = bool(enabled)


def checked_mode() -> bool:
    """Whether data checks run on accelerator tensors."""
    return _CHECKED


def data_checks_enabled(t: torch.Tensor) -> bool:
    """Data checks run on real CPU tensors always, elsewhere only in checked mode; never on fakes."""
    kind = t.device.type
    if kind != "cpu" and not _CHECKED:  # the usual accelerator call: decided without the slower checks below
        return False
    if kind == "meta" or isinstance(t, torch._subclasses.FakeTensor):
        return False
    return not torch.compiler.is_compiling()


def _fmt(shape: Sequence) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_tensor(op: str, name: str, t: torch.Tensor, *, ndim: int | Sequence[int] | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, shape: Sequence | None = None,
                 expected: str = "") -> None:
    """Raise a ValueError/TypeError naming ``op`` and argument ``name`` if ``t`` has the wrong form.

    ``shape`` entries that are None are not checked; ``expected`` is a human form like ``[T, 512]``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    got = t.shape  # the message parts below are built only on a failure (eager calls pay for every check)
    if ndim is not None and (len(got) != ndim if isinstance(ndim, int) else len(got) not in tuple(ndim)):
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        raise ValueError(f"{op}: {name} must have {' or '.join(map(str, allowed))} dims{_want(expected)}, "
                         f"got shape {_fmt(got)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype in {[str(d) for d in dtypes]}{_want(expected)}, got {t.dtype}")
    if shape is not None and (len(shape) != len(got) or any(s is not None and g != s for s, g in zip(shape, got))):
        expect = _fmt("*" if s is None else s for s in shape)
        raise ValueError(f"{op}: {name} must have shape {expect}{_want(expected)}, got {_fmt(got)}")


def _want(expected: str) -> str:
    return f" (expected {expected})" if expected else ""


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    """All tensors on one device, or a ValueError listing where each one is."""
    first = None
    for t in tensors.values():
        if first is None:
            first = t.device
        elif t.device != first:
            devices = {name: t.device for name, t in tensors.items()}
            raise ValueError(f"{op}: all tensors must be on one device, got {devices}")


def check_range(op: str, name: str, t: torch.Tensor, low: int, high: int, *, ignore: int | None = None,
                what: str = "") -> None:
    """Data check: every value of ``t`` (except ``ignore``) lies in ``[low, high)``. Syncs the host."""
    if t.numel() == 0:
        return
    vals = t if ignore is None else t[t != ignore]
    if vals.numel() == 0:
        return
    lo, hi = int(vals.min()), int(vals.max())
    if lo < low or hi >= high:
        extra = f" ({what})" if what else ""
        raise ValueError(f"{op}: {name} values must lie in [{low}, {high}){extra}, got min {lo}, max {hi}")
