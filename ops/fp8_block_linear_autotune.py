"""``mla::fp8_block_linear_autotune``: the backend-neutral fp8 block linear whose implementation Inductor picks.

Same contract as ``mla::fp8_block_linear`` (see :mod:`mla_compile.ops.fp8_block_linear`): ``x`` with a 2-D
weight ``[N, K]`` -> ``[M, N]``, a 3-D weight ``[E, N, K]`` -> ``[E, M, N]``, or sorted groups with ``offs``
-> ``[R, N]``.

The op itself is plain: its eager kernel runs the backend "auto" picks (our Triton kernel on CUDA, the
reference elsewhere) and its fake is the op's fake. What makes it "autotune" is the Inductor lowering in
:mod:`mla_compile.lowerings.fp8_linear`: with that module imported and the graph on CUDA, Inductor times
every implementation the registry says serves the call (our Triton kernel in a few launch configurations;
torch's blockwise-scaled matmul for ``act_quant=True`` 2-D weights with K a multiple of 128) and emits the
fastest. Without the lowering the compiled graph calls this op's eager kernel: correct, not tuned.

``mla::fp8_block_linear_triton_config`` (2-D and 3-D weights) and ``mla::fp8_block_linear_sorted_triton_config``
(sorted groups, ``offs`` before ``act_quant``: the lowering passes tensors first) are the Triton kernel with
explicit launch parameters (and, without ``offs``, K slices), one autotune choice per configuration; 0 keeps
the heuristic's value.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from mla_compile.ops.decode_autotune import warn_unlowered
from mla_compile.ops.fp8_block_linear import OP, fake, validate
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare
from mla_compile.ops.select import resolve

BACKEND = "autotune"
OP_NAME = "mla::fp8_block_linear_autotune"
_WARNED: set[str] = set()


@torch.library.custom_op(OP_NAME, mutates_args=(), tags=LAYOUT_TAGS)
def fp8_block_linear_autotune(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool,
                              offs: Tensor | None = None) -> Tensor:
    """Eager kernel: the backend "auto" picks for this call (never "autotune" itself)."""
    impl = resolve(OP, x.device, None, dtype=x.dtype)
    y = impl.fn(x, weight, weight_scale_inv, act_quant) if offs is None else impl.fn(
        x, weight, weight_scale_inv, act_quant, offs)
    return y.contiguous()


fp8_block_linear_autotune.register_fake(fake)


def _check_dtype(x: Tensor) -> None:
    if x.dtype == torch.float64:
        raise ValueError(f"{OP}: the Triton config ops run float16 / bfloat16 / float32 x, got float64 (backend "
                         "'triton' runs the reference for it)")


def _triton_launch(x: Tensor, launch, args: tuple, block_m: int, block_n: int, num_warps: int,
                   num_stages: int) -> Tensor:
    """``launch(*args, config=...)`` with the nonzero launch parameters, the kernels launched directly (a
    plain custom op body: wrap_triton's higher-order-op dispatch would add host time to every timed call). A
    Triton build failure becomes a RuntimeError, which Inductor's autotuning records as an unusable choice."""
    if x.device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        raise ValueError(f"{OP}: the Triton config ops run CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); "
                         f"got x on {x.device}")
    from torch._library.triton import set_wrap_triton_enabled

    cfg = {k: v for k, v in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("num_warps", num_warps),
                             ("num_stages", num_stages)) if v > 0}
    from triton.errors import TritonError

    try:
        with set_wrap_triton_enabled(False):
            return launch(*args, config=cfg)
    except TritonError as e:  # a config this GPU cannot build (shared memory, registers): a RuntimeError, which
        raise RuntimeError(f"{OP}: Triton config {cfg} failed: {type(e).__name__}: {e}") from e  # autotuning skips


@torch.library.custom_op("mla::fp8_block_linear_triton_config", mutates_args=(), tags=LAYOUT_TAGS)
def fp8_block_linear_triton_config(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool,
                                   block_m: int, block_n: int, num_warps: int, num_stages: int,
                                   split_k: int) -> Tensor:
    """Our Triton fp8 linear (2-D or 3-D weight, no ``offs``) with explicit ``BLOCK_M``/``BLOCK_N``/``num_warps``/
    ``num_stages`` and K slices ``split_k`` (0: the heuristic's value of each), summed in the kernel (a serial
    split, as ``mla::fp8_block_linear_serial_triton``); ``BLOCK_N`` divides 128."""
    validate(x, weight, weight_scale_inv)
    _check_dtype(x)
    from mla_compile.ops.triton.fp8_block_linear import _launch

    launch = functools.partial(_launch, serial=True)
    return _triton_launch(x, launch, (x, weight, weight_scale_inv, act_quant, split_k or None), block_m, block_n,
                          num_warps, num_stages)


fp8_block_linear_triton_config.register_fake(lambda x, weight, weight_scale_inv, act_quant, *cfg:
                                             fake(x, weight, weight_scale_inv, act_quant))


@torch.library.custom_op("mla::fp8_block_linear_sorted_triton_config", mutates_args=(), tags=LAYOUT_TAGS)
def fp8_block_linear_sorted_triton_config(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, offs: Tensor,
                                          act_quant: bool, block_m: int, block_n: int, num_warps: int,
                                          num_stages: int) -> Tensor:
    """Our Triton fp8 linear over sorted groups (``x [R, K]``, ``weight [E, N, K]``, ``offs [E]``) with explicit
    launch parameters (0: the heuristic's)."""
    validate(x, weight, weight_scale_inv, offs)
    _check_dtype(x)
    from mla_compile.ops.triton.fp8_block_linear import _launch_sorted

    return _triton_launch(x, _launch_sorted, (x, weight, weight_scale_inv, act_quant, offs), block_m, block_n,
                          num_warps, num_stages)


fp8_block_linear_sorted_triton_config.register_fake(lambda x, weight, weight_scale_inv, offs, act_quant, *cfg:
                                                    fake(x, weight, weight_scale_inv, act_quant, offs))


@torch.compiler.assume_constant_result
def _warn_if_unlowered(device_type: str) -> bool:
    return warn_unlowered(OP_NAME, _WARNED, device_type)


def _autotune(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool,
              offs: Tensor | None = None) -> Tensor:
    _warn_if_unlowered(x.device.type)
    return torch.ops.mla.fp8_block_linear_autotune(x, weight, weight_scale_inv, act_quant, offs)


declare(OP, BACKEND, _autotune, rank=70, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        kernels=("fp8_block_linear_autotune=autotune (not lowered: static default)",),
        note="Inductor times our Triton configs and, where it serves, torch's blockwise-scaled matmul per compiled "
             "shape and emits the fastest (needs `import mla_compile.lowerings`; eager and CPU run 'auto''s "
             "choice); never picked by 'auto'")
