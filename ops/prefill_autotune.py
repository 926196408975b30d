"""``mla::prefill_autotune``: the backend-neutral prefill whose implementation Inductor picks by timing.

Same contract as ``mla::prefill`` (see :mod:`mla_compile.ops.prefill`): ragged ``q [T, H, Dqk]``,
``k [S, H, Dqk]``, ``v [S, H, Dv]`` with ``cu_seqlens_q/k``; returns ``out [T, H, Dv]`` and ``lse [T, H]``.

The op itself is plain: its eager kernel runs the static default (our Triton kernel on CUDA, the
reference elsewhere) and its fake is the prefill fake. The Inductor lowering in
:mod:`mla_compile.lowerings.prefill` makes it "autotune": on CUDA, Inductor benchmarks every
implementation that can serve the compiled shapes (Triton configurations, plan-free peer backends) and
emits the fastest. Without the lowering the compiled graph calls this op's eager kernel: correct, not
tuned; ``backend="autotune"`` then warns once at trace time on an accelerator.

``mla::prefill_triton_config`` is the Triton kernel with explicit launch parameters (one autotune
choice per configuration); 0 means "the heuristic's value" (``ops/triton/prefill.py:_pick``).
``mla::prefill_triton_tma_config`` is the same for the TMA kernel (``ops/triton/prefill_tma.py``; 0 keeps its
``DEFAULT``), which runs the pointer kernel where the TMA one is not eligible.
"""

from __future__ import annotations


import torch
from torch import Tensor

from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare
from mla_compile.ops.select import resolve
from mla_compile.ops.decode_autotune import warn_unlowered
from mla_compile.ops.prefill import OP, fake, validate

BACKEND = "autotune"
OP_NAME = "mla::prefill_autotune"
_WARNED: set[str] = set()


@torch.library.custom_op("mla::prefill_autotune", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_autotune(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                     causal: bool) -> tuple[Tensor, Tensor]:
    """Eager kernel: the backend "auto" picks for these shapes (never "autotune" itself)."""
    impl = resolve(OP, q.device, None, dtype=q.dtype, shape=lambda: (q.shape[1], (q.shape[2], v.shape[2]), 2))
    out, lse = impl.fn(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
    return out.contiguous(), lse.contiguous()


prefill_autotune.register_fake(fake)


@torch.library.custom_op("mla::prefill_triton_config", mutates_args=(), device_types="cuda", tags=LAYOUT_TAGS)
def prefill_triton_config(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                          causal: bool, block_m: int, block_n: int, num_warps: int,
                          num_stages: int) -> tuple[Tensor, Tensor]:
    """Our Triton prefill with explicit ``BLOCK_M``/``BLOCK_N``/``num_warps``/``num_stages`` (0: heuristic)."""
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    from torch._library.triton import set_wrap_triton_enabled

    from mla_compile.ops.triton.prefill import _launch

    cfg = {k_: v_ for k_, v_ in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("num_warps", num_warps),
                                 ("num_stages", num_stages)) if v_ > 0}
    # a plain custom op body launches the kernel directly (wrap_triton on would route every launch
    # through the higher-order-op dispatch: host time that would swamp Inductor's timings; see decode)
    with set_wrap_triton_enabled(False):
        return _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, config=cfg)


prefill_triton_config.register_fake(fake)


@torch.library.custom_op("mla::prefill_triton_tma_config", mutates_args=(), device_types="cuda", tags=LAYOUT_TAGS)
def prefill_triton_tma_config(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                              scale: float, causal: bool, block_m: int, block_n: int, num_warps: int,
                              num_stages: int, heads_first: int) -> tuple[Tensor, Tensor]:
    """Our TMA Triton prefill with explicit launch parameters (0: ``DEFAULT``'s; ``heads_first`` 1 / 2: on /
    off)."""
    from mla_compile.ops.triton import prefill_tma

    cfg = {k_: v_ for k_, v_ in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("num_warps", num_warps),
                                 ("num_stages", num_stages)) if v_ > 0}
    if heads_first:
        cfg["HEADS_FIRST"] = heads_first == 1
    return prefill_tma.run(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, cfg)


prefill_triton_tma_config.register_fake(fake)


@torch.compiler.assume_constant_result
def _warn_if_unlowered(device_type: str) -> bool:
    return warn_unlowered(OP_NAME, _WARNED, device_type)


def _autotune(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
              causal: bool) -> tuple[Tensor, Tensor]:
    _warn_if_unlowered(q.device.type)
    return torch.ops.mla.prefill_autotune(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


declare(OP, BACKEND, _autotune, rank=70, devices=("any",), dtypes=FLOATS, gpu_tested=False,
        kernels=("prefill_autotune=autotune (not lowered: static default)",),
        note="Inductor times our Triton configs and the plan-free peers (flash-attn, trtllm-gen) that serve the "
             "compiled shapes and emits the fastest (needs `import mla_compile.lowerings`; eager and CPU run "
             "'auto''s choice); never picked by 'auto'")
