"""``mla::write_latent_cache_absorb_q``: a decode step's latent cache write and its absorbed queries, in one op.

Contract. ``latent [T, Dc]``, ``k_pe [T, Dr]``, ``norm_weight [Dc]``, ``cos`` / ``sin [T, Dr / 2]`` float32,
``slot_mapping [T]``, ``kv_cache`` (mutated), ``eps`` and ``interleave`` as ``mla::write_latent_cache_fused``
(:mod:`mla_compile.ops.fused_kv_write`: the latent's RMSNorm, k_pe's RoPE, the paged write; a uint8 cache gets the fp8
rows), and ``q_nope [T, H, N]``, ``w_uk [H, N, Dc]`` (``kv_b_proj``'s views, any strides), the raw (not yet
rotated) ``q_pe [T, H, Dr]``, all of one half-precision or float dtype, give ``q_abs [T, H, Dc + Dr]``:
``mla::absorb_q(q_nope, w_uk, rope(q_pe))`` with ``rope`` the same RoPE (``cos`` / ``sin`` of the token, the output
rounded to q_pe's dtype). A decode step's work between its projections and its attention: in a regional compile,
mutating ops run between the regions, so the cache write and the absorbed projection (with q_pe's RoPE) become
one launch there instead of three.

Backends: "reference" (``mla::write_latent_cache_fused``'s reference, then ``mla::absorb_q`` of the rotated q_pe,
any device), "triton" (ours, CUDA half precision, up to :data:`MAX_ROWS` tokens: one launch whose first programs are
``mla::skinny_absorb_q``'s (the ``cb == 0`` ones rotating q_pe as they copy it) and whose last ``T`` programs are
``mla::write_latent_cache_fused``'s; more tokens: that op and ``mla::absorb_q`` inside). GPU-tested and faster than
the launches it replaces (BENCHMARKS.md runs 216-218): "auto" takes "triton" on CUDA half precision, and so does the
model's regional decode step (``backend="write_latent_cache_absorb_q=reference"`` keeps the three launches).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.absorb import validate_q
from mla_compile.ops.fused_kv_write import rope, validate as validate_write
from mla_compile.ops.fused_kv_write import write_latent_cache_fused_reference
from mla_compile.ops.registry import FLOATS, HALF, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve
from mla_compile.ops.skinny_absorb import MAX_ROWS  # tokens the one launch serves: mla::skinny_absorb_q's

OP = declare_op("write_latent_cache_absorb_q", "mla.write_latent_cache_absorb_q")


def validate(latent: Tensor, k_pe: Tensor, norm_weight: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor,
             kv_cache: Tensor, q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> None:
    """The fused cache write's checks and ``mla::absorb_q``'s, then the rows agreeing (no sync)."""
    validate_write(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache)
    validate_q(q_nope, w_uk, q_pe)
    T, Dc = latent.shape
    H = q_nope.shape[1]
    check_tensor(OP, "q_nope", q_nope, ndim=3, dtypes=FLOATS, shape=(T, None, None),
                 expected=f"[{T}, H, nope] (latent's {T} tokens)")
    check_tensor(OP, "w_uk", w_uk, ndim=3, dtypes=(q_nope.dtype,), shape=(None, None, Dc),
                 expected=f"[{H}, nope, {Dc}] (the latent's width {Dc})")
    check_tensor(OP, "q_pe", q_pe, ndim=3, dtypes=(q_nope.dtype,), shape=(None, None, k_pe.shape[1]),
                 expected=f"[{T}, {H}, {k_pe.shape[1]}] of q_nope's dtype (k_pe's width: the same rotation)")


def rope_heads(q_pe: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """``fused_kv_write.rope`` of every head of ``q_pe [T, H, Dr]`` (the token's ``cos`` / ``sin [T, Dr / 2]``)."""
    T, H, Dr = q_pe.shape
    return rope(q_pe.reshape(T * H, Dr), cos.repeat_interleave(H, 0), sin.repeat_interleave(H, 0),
                interleave).view(T, H, Dr)


@torch.library.custom_op("mla::write_latent_cache_absorb_q_ref", mutates_args=("kv_cache",), tags=LAYOUT_TAGS)
def write_latent_cache_absorb_q_ref(latent: Tensor, k_pe: Tensor, norm_weight: Tensor, cos: Tensor, sin: Tensor,
                                    slot_mapping: Tensor, kv_cache: Tensor, eps: float, interleave: bool,
                                    q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    """Reference (plain torch, any device): the fused write's reference, then ``mla::absorb_q`` of the rotated q_pe."""
    validate(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, q_nope, w_uk, q_pe)
    write_latent_cache_fused_reference(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, eps, interleave)
    return torch.ops.mla.absorb_q(q_nope, w_uk, rope_heads(q_pe, cos, sin, interleave))


def fake(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, eps, interleave, q_nope, w_uk, q_pe):
    """Fake output shared by every implementation: ``q_abs [T, H, Dc + Dr]`` of q_nope's dtype."""
    validate(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, q_nope, w_uk, q_pe)
    T, H, _ = q_nope.shape
    return q_nope.new_empty(T, H, w_uk.shape[2] + q_pe.shape[2])


write_latent_cache_absorb_q_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.write_latent_cache_absorb_q_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="the fused cache write's reference, then mla::absorb_q of the rotated q_pe")


def write_latent_cache_absorb_q(latent: Tensor, k_pe: Tensor, norm_weight: Tensor, cos: Tensor, sin: Tensor,
                                slot_mapping: Tensor, kv_cache: Tensor, eps: float, interleave: bool, q_nope: Tensor,
                                w_uk: Tensor, q_pe: Tensor, *, backend: str | None = None) -> Tensor:
    """Write the step's latent rows into ``kv_cache`` and return ``q_abs [T, H, Dc + Dr]``; see the module docstring.
    ``backend``: None/"auto", "reference" or "triton"."""
    impl = resolve(OP, q_nope.device, backend, dtype=q_nope.dtype)
    return impl.fn(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, float(eps), bool(interleave), q_nope,
                   w_uk, q_pe)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(*args):
    import mla_compile.ops.triton.write_absorb_q  # noqa: F401  (registers mla::write_latent_cache_absorb_q_triton)
    return torch.ops.mla.write_latent_cache_absorb_q_triton(*args)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=HALF, package="triton", gpu_tested=True,
        kernels=("write_latent_cache_absorb_q_triton", "_write_absorb_q_kernel"),
        note=f"ours: mla::skinny_absorb_q's programs (q_pe rotated as copied) and the fused cache write's in one "
             f"launch, up to {MAX_ROWS} tokens")
