"""Per-op backend tables: which implementation serves an op call, chosen at trace time.

Each op file registers its implementations here (``register_impl``); the public function of the op
calls :func:`resolve`. The choice is a Python-level decision, so under ``torch.compile`` it is made
once while tracing and is static in the graph. Priorities across external libraries live in
``mla_compile.backends``; this table only knows what exists and on which devices it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


# Every ``mla::`` custom op declares its layout constraint instead of relying on the global default
# (``torch._functorch.config.custom_op_default_layout_constraint``, which a user may change): Inductor
# passes each input with the strides eager would have, so no kernel or peer library ever sees strides
# it was not written for (the kernels make the last dim contiguous themselves, the peers copy when they
# must). ``triton_op`` kernels take no tags: Inductor traces into them and hands them strides directly.
LAYOUT_TAGS = (torch.Tag.needs_exact_strides,)


@dataclass(frozen=True)
class Impl:
    """One implementation of an op: ``fn`` runs it; ``devices`` are the device types it accepts.

    ``takes_plan``: ``fn`` accepts a ``plan=`` keyword (a host-side plan made before the step, e.g.
    FlashInfer's); the public op function passes it only to such implementations.
    """

    backend: str
    fn: Callable
    devices: tuple[str, ...]
    available: Callable[[], bool] = lambda: True
    takes_plan: bool = False


_TABLE: dict[str, dict[str, Impl]] = {}


def register_impl(op: str, backend: str, fn: Callable, devices: tuple[str, ...],
                  available: Callable[[], bool] = lambda: True, takes_plan: bool = False) -> None:
    """Register ``fn`` as ``backend``'s implementation of ``op`` on ``devices`` (e.g. ("cuda",))."""
    _TABLE.setdefault(op, {})[backend] = Impl(backend, fn, devices, available, takes_plan)


def call_impl(op: str, impl: Impl, args: tuple, plan: object | None):
    """Run ``impl.fn(*args)``, passing ``plan=`` when given; a plan for a backend that takes none is an error."""
    if plan is None:
        return impl.fn(*args)
    if not impl.takes_plan:
        takers = sorted(b for b, i in _TABLE.get(op, {}).items() if i.takes_plan)
        raise ValueError(f"{op}: plan= is only used by backends that plan on the host ({takers}); "
                         f"backend {impl.backend!r} takes none: drop plan= or pick one of those")
    return impl.fn(*args, plan=plan)


def backends_for(op: str) -> dict[str, Impl]:
    """Every registered implementation of ``op`` by backend name."""
    return dict(_TABLE.get(op, {}))


def default_backend(op: str, device: torch.device) -> str:
    """Our own default: the Triton kernel on CUDA when it exists and Triton imports, else the reference."""
    impls = _TABLE.get(op, {})
    triton = impls.get("triton")
    if device.type in ("cuda", "xpu") and triton is not None and device.type in triton.devices and triton.available():
        return "triton"
    return "reference"


def resolve(op: str, device: torch.device, backend: str | None) -> Impl:
    """The implementation of ``op`` for ``backend`` ("auto"/None picks); errors say what would work."""
    impls = _TABLE.get(op)
    if not impls:
        raise NotImplementedError(f"mla op {op!r} has no registered implementation")
    name = default_backend(op, device) if backend in (None, "auto") else backend
    impl = impls.get(name)
    if impl is None:
        raise ValueError(f"{op}: unknown backend {name!r}; registered: {sorted(impls)}")
    if device.type not in impl.devices and "any" not in impl.devices:
        usable = sorted(b for b, i in impls.items() if device.type in i.devices or "any" in i.devices)
        raise ValueError(f"{op}: backend {name!r} runs on {list(impl.devices)}, not on {device.type}; "
                         f"backends for {device.type}: {usable}")
    if not impl.available():
        raise ValueError(f"{op}: backend {name!r} is not importable here; use backend='reference' or install it")
    return impl
