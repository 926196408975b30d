"""``mla::skinny_absorb_q`` / ``mla::skinny_absorb_out``: the absorbed decode's per-head projections for few tokens.

Contracts (those of :mod:`mla_compile.ops.absorb`'s ``mla::absorb_q`` / ``mla::absorb_out``, which are the
"reference" backends):

- ``skinny_absorb_q(q_nope [T, H, N], w_uk [H, N, Dc], q_pe [T, H, Dr]) -> [T, H, Dc + Dr]`` (contiguous, q_nope's
  dtype): ``[einsum("thn,hnc->thc", q_nope, w_uk) | q_pe]``, products accumulated in float32 (float64 for float64).
- ``skinny_absorb_out(out_lat [T, H, Dc], w_uv [H, V, Dc]) -> [T, H * V]`` (contiguous, out_lat's dtype):
  ``einsum("thc,hvc->thv", out_lat, w_uv).reshape(T, H * V)``, the rows ``o_proj`` reads.

``w_uk`` / ``w_uv`` are ``kv_b_proj.weight``'s per-head views: any head and row strides, read in place (the Triton
kernels copy a weight only if its last dim is not unit-stride, which the model's views never are).

Backends: "reference" (``torch.bmm`` writing into the final layout, any device), "triton" (ours, CUDA half
precision, up to :data:`MAX_ROWS` tokens: a per-head GEMV, one launch, every weight element read once for all
tokens; ``absorb_q``'s kernel also copies q_pe into place; more tokens run the reference inside the op, so one
compiled graph serves every batch size).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops import absorb as _absorb
from mla_compile.ops.registry import FLOATS, HALF, declare, declare_op
from mla_compile.ops.select import resolve

OP_Q = declare_op("skinny_absorb_q", "mla.skinny_absorb_q")
OP_OUT = declare_op("skinny_absorb_out", "mla.skinny_absorb_out")
MAX_ROWS = 2  # tokens the per-head GEMV serves (a decode step of one sequence, padded to the graph's size 2)

validate_q = _absorb.validate_q
validate_out = _absorb.validate_out


# the references are mla::absorb_q / mla::absorb_out themselves; their kernels keep the label the fusion pass gave
_BMM = "torch bmm into place (fusion pass)"
declare(OP_Q, "reference", torch.ops.mla.absorb_q, rank=100, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        kernels=(f"absorb_q={_BMM}",), note="mla::absorb_q: torch.bmm into place")
declare(OP_OUT, "reference", torch.ops.mla.absorb_out, rank=100, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        kernels=(f"absorb_out={_BMM}",), note="mla::absorb_out: torch.bmm into place")


def skinny_absorb_q(q_nope: Tensor, w_uk: Tensor, q_pe: Tensor, backend: str | None = None) -> Tensor:
    """``[q_nope @ W_UK | q_pe]`` per head: ``[T, H, N]``, ``[H, N, Dc]``, ``[T, H, Dr]`` -> ``[T, H, Dc + Dr]``;
    see the module docstring. ``backend``: None/"auto", "reference" or "triton"."""
    return resolve(OP_Q, q_nope.device, backend, dtype=q_nope.dtype).fn(q_nope, w_uk, q_pe)


def skinny_absorb_out(out_lat: Tensor, w_uv: Tensor, backend: str | None = None) -> Tensor:
    """``out_lat @ W_UV^T`` per head, token-major: ``[T, H, Dc]``, ``[H, V, Dc]`` -> ``[T, H * V]``; see the module
    docstring. ``backend``: None/"auto", "reference" or "triton"."""
    return resolve(OP_OUT, out_lat.device, backend, dtype=out_lat.dtype).fn(out_lat, w_uv)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton_q(q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    import mla_compile.ops.triton.skinny_absorb  # noqa: F401  (registers mla::skinny_absorb_q_triton)
    return torch.ops.mla.skinny_absorb_q_triton(q_nope, w_uk, q_pe)


def _triton_out(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    import mla_compile.ops.triton.skinny_absorb  # noqa: F401  (registers mla::skinny_absorb_out_triton)
    return torch.ops.mla.skinny_absorb_out_triton(out_lat, w_uv)


declare(OP_Q, "triton", _triton_q, rank=50, available=_triton_available, dtypes=HALF, package="triton",
        gpu_tested=True, kernels=("skinny_absorb_q_triton", "_skinny_absorb_q_kernel"),
        note=f"ours: a per-head GEMV with q_pe copied into place, one launch, up to {MAX_ROWS} tokens (bmm above)")
declare(OP_OUT, "triton", _triton_out, rank=50, available=_triton_available, dtypes=HALF, package="triton",
        gpu_tested=True, kernels=("skinny_absorb_out_triton", "_skinny_absorb_out_kernel"),
        note=f"ours: a per-head GEMV written token-major, one launch, up to {MAX_ROWS} tokens (bmm above)")
