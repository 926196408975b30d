"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of our opaque custom ops.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream still runs (once
every program of that one has called ``gdc_launch_dependents`` or ended); ``gdc_wait`` then blocks until that
kernel has ended and its writes are visible. The weights of a GEMV can so stream in while the kernel before it
finishes (a CUDA graph records the launch as a programmatic edge). Every kernel that takes a ``PDL`` flag keeps
this contract:

- before :func:`pdl_wait` it only reads operands that the kernel before it cannot have written, and writes
  nothing. In general that kernel is unknown, so only weights (operands no kernel of a step writes); where the
  kernel before is the op's own previous launch, also what that launch does not write. The skinny GEMVs load
  their first weight tile before the wait (faster: BENCHMARKS.md run 166); the MoE kernels read nothing before
  it (their L2 prefetches and register preloads there were slower: runs 171-175);
- every program calls :func:`pdl_wait`, and :func:`pdl_launch_dependents` only after it. So when the next kernel
  starts, every kernel before this one has ended: the next one only overlaps this one, and need only wait before
  it reads what this one writes. Inductor's PDL code (its ``triton.enable_pdl``: off in torch by default, on in
  ``mla_compile.lowerings.compile_options()``) keeps the same order (its wait before its trigger) and relies on
  it: its kernels wait only when they read their direct predecessor's output.

Only eager launches use it: those inside a ``torch.library.custom_op`` body (:func:`launch_kwargs`) and a
``triton_op``'s when the op runs eagerly, e.g. inside such a body (``launch_kwargs(..., eager_only=True)``):
Inductor regenerates the launches of a traced ``triton_op``'s kernels and would not pass the flag on (those
kernels run as before). Measured effect on the full-depth step: BENCHMARKS.md (runs 166-169, 171-).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ENABLED = True  # a benchmark may turn it off to compare (bench_decode_step --no-pdl)
ON = {"PDL": True, "launch_pdl": True}  # the launch arguments with PDL on (the kernel's flag, the launch option)
OFF = {"PDL": False}


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` take PDL: a CUDA device of compute capability 9.0 or later (a cached host
    query, no sync) and :data:`ENABLED`. The Triton interpreter's CPU tensors never do."""
    if not ENABLED or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def _traced() -> bool:
    """Whether a ``wrap_triton`` launch now is traced into a graph (Inductor regenerates it) rather than run: torch
    runs a ``triton_op``'s body with tracing off when the op runs eagerly. Unknown (an older torch): traced."""
    try:
        from torch._library.triton import is_wrap_triton_enabled
    except ImportError:
        return True
    return is_wrap_triton_enabled()


def launch_kwargs(device: torch.device, waits: bool = True, eager_only: bool = False) -> dict:
    """The kernel's ``PDL`` constexpr and, when on, the ``launch_pdl`` launch option, for ``kernel[grid](...,
    **launch_kwargs(device))``. ``waits``: whether every program of this launch reaches its wait (a kernel whose
    wait sits in a loop passes False when the loop runs no step: then no PDL). ``eager_only``: a ``triton_op``'s
    launch, PDL only when the op runs eagerly (not while Inductor traces it)."""
    if eager_only and _traced():
        return dict(OFF)
    return dict(ON if waits and enabled(device) else OFF)


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """Let the next kernel of the stream be scheduled (after :func:`pdl_wait`: see the module's contract)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the kernel before this one has ended and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
