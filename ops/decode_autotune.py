"""``mla::decode_autotune``: the backend-neutral decode whose implementation Inductor picks by timing.

Same contract as ``mla::decode`` (see :mod:`mla_compile.ops.decode`): ``q [B, s_q, H, D]`` over the
paged latent cache, returns ``out [B, s_q, H, kv_lora_rank]`` and ``lse [B, s_q, H]``.

The op itself is plain: its eager kernel runs the static default (our Triton kernel on CUDA, the
reference elsewhere), and its fake is the decode fake. What makes it "autotune" is the Inductor
lowering in :mod:`mla_compile.lowerings.decode`: when that module is imported and the graph runs on
CUDA, Inductor benchmarks every implementation that can serve the shapes (Triton configurations,
FlashMLA) and emits the fastest. Without the lowering (``mla_compile.lowerings`` not imported, or the
private Inductor API unusable) the compiled graph calls this op's eager kernel: correct, not tuned;
:func:`lowering_installed` says which case holds, and ``backend="autotune"`` warns once at trace time
(from :func:`mla_compile.ops.decode.decode`'s dispatch, outside compiled code) when it is not.

``mla::decode_triton_config`` is the Triton kernel with explicit launch parameters (one autotune
choice per configuration); 0 means "the heuristic's value".
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_kernels
from mla_compile.ops.select import resolve
from mla_compile.ops.decode import OP, fake, validate

BACKEND = "autotune"
_LOWERED: set[str] = set()
_WARNED: set[str] = set()


def mark_lowered(op_name: str) -> None:
    """Called by :mod:`mla_compile.lowerings` when it registers the lowering of ``op_name`` (e.g. "mla::decode_autotune")."""
    _LOWERED.add(op_name)


def lowering_installed(op_name: str = "mla::decode_autotune") -> bool:
    """Whether an Inductor lowering that autotunes ``op_name`` is registered in this process."""
    return op_name in _LOWERED


@torch.library.custom_op("mla::decode_autotune", mutates_args=(), tags=LAYOUT_TAGS)
def decode_autotune(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                    kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Eager kernel: the backend "auto" picks for these shapes (never "autotune" itself)."""
    impl = resolve(OP, q.device, None, dtype=q.dtype, cache=kv_cache,
                   shape=lambda: (q.shape[2], (kv_lora_rank, q.shape[3] - kv_lora_rank), q.shape[1]))
    out, lse = impl.fn(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return out.contiguous(), lse.contiguous()


decode_autotune.register_fake(fake)


@torch.library.custom_op("mla::decode_triton_config", mutates_args=(), device_types="cuda", tags=LAYOUT_TAGS)
def decode_triton_config(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                         kv_lora_rank: int, block_n: int, num_warps: int, num_stages: int,
                         splits: int) -> tuple[Tensor, Tensor]:
    """Our Triton decode with explicit ``BLOCK_N``/``num_warps``/``num_stages``/split count (0: heuristic)."""
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    from torch._library.triton import set_wrap_triton_enabled

    from mla_compile.ops.triton.decode import _launch

    cfg = {k: v for k, v in (("BLOCK_N", block_n), ("num_warps", num_warps), ("num_stages", num_stages),
                             ("SPLITS", splits)) if v > 0}
    # a plain custom op body: launch the kernels directly, as a triton_op's eager call does (with
    # wrap_triton on, each launch goes through the higher-order-op dispatch, whose host time dwarfs the
    # kernel's and would make Inductor's autotune timings of this choice meaningless)
    with set_wrap_triton_enabled(False):
        return _launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, config=cfg)


decode_triton_config.register_fake(fake)


def _op(qualname: str):
    ns, name = qualname.split("::")
    return getattr(getattr(torch.ops, ns), name).default


@torch.library.custom_op("mla::decode_by_rows", mutates_args=(), tags=LAYOUT_TAGS)
def decode_by_rows(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                   kv_lora_rank: int, bounds: list[int], names: str, extras: list[int],
                   extra_lens: list[int]) -> tuple[Tensor, Tensor]:
    """Decode implementations split by step size, as the autotune lowering emits them for a dynamic batch
    whose sizes time differently. ``names`` is a comma-separated list of ops (a schema has no list of
    strings); ``names[i]`` (an op such as "mla::decode_triton_config", called with the
    decode arguments and then its ``extra_lens[i]`` ints taken in order from ``extras``) serves the steps
    of ``rows = B * s_q`` with ``bounds[i-1] < rows <= bounds[i]`` (``bounds`` ascending, one fewer than
    ``names``; the last name takes everything above). The split reads shapes only (no host sync): each
    CUDA-graph capture size records the kernel of its range."""
    names = names.split(",")
    if not (len(names) == len(extra_lens) == len(bounds) + 1 and sum(extra_lens) == len(extras)):
        raise ValueError(f"mla.decode_by_rows: needs len(names) == len(extra_lens) == len(bounds) + 1 and "
                         f"sum(extra_lens) == len(extras), got {len(names)} names, {len(extra_lens)} extra_lens, "
                         f"{len(bounds)} bounds, {len(extras)} extras")
    rows = q.shape[0] * q.shape[1]
    i = sum(1 for b in bounds if rows > b)
    start = sum(extra_lens[:i])
    out, lse = _op(names[i])(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank,
                             *extras[start:start + extra_lens[i]])
    return out.contiguous(), lse.contiguous()


decode_by_rows.register_fake(lambda q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, *split:
                             fake(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank))


def warn_unlowered(op_name: str, warned: set[str], device_type: str) -> bool:
    """Warn once per ``warned`` set when ``backend="autotune"`` of ``op_name`` is used on an accelerator without
    its lowering (each op's ``_warn_if_unlowered`` calls it at trace time, as a constant result)."""
    if device_type != "cpu" and not lowering_installed(op_name) and op_name not in warned:
        warned.add(op_name)
        warnings.warn(f"backend='autotune': no Inductor lowering is installed for {op_name}, so compiled graphs "
                      "run the static default backend untuned; `import mla_compile.lowerings` before compiling to "
                      "let Inductor time every backend", stacklevel=3)
    return True


@torch.compiler.assume_constant_result
def _warn_if_unlowered(device_type: str) -> bool:
    return warn_unlowered("mla::decode_autotune", _WARNED, device_type)


def _autotune(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
              kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    _warn_if_unlowered(q.device.type)
    return torch.ops.mla.decode_autotune(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


declare(OP, BACKEND, _autotune, rank=70, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        kernels=("decode_autotune=autotune (not lowered: static default)", "decode_by_rows=autotune (split by rows)"),
        note="Inductor times every decode backend that serves the compiled shapes and emits the fastest "
             "(needs `import mla_compile.lowerings`; eager and CPU run 'auto''s choice); never picked by 'auto'")
