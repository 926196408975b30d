"""``mla::skinny_linear``: bias-free linears of few rows sharing one input, in one launch.

Contract. ``x [M, K]`` and ``weights``, a list of one or two ``[N_i, K]`` matrices of x's dtype (nn.Linear's
layout), give ``[x @ W_i.T for each i]``, each ``[M, N_i]`` of x's dtype, the products accumulated in float32
(float64 for float64 x). The decode step's projections are such linears: ``q_proj`` (or ``q_a_proj``) and
``kv_a_proj_with_mqa`` read the same hidden state, ``o_proj`` reads the attention's output.

Backends: "reference" (``F.linear`` per weight, any device), "triton" (ours, CUDA, up to
:data:`MAX_ROWS` rows: a GEMV over the weights' rows, one program per 4 rows of one weight, every weight in one
launch; more rows run ``F.linear`` inside the op, so one compiled graph serves every batch size). A weight's
rows are read once from memory per program of rows of x, so few rows read the weights about once: the
memory floor, where cuBLAS's GEMMs at two rows run at about half the bandwidth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("skinny_linear", "mla.skinny_linear")
MAX_ROWS = 2  # the Triton GEMV serves up to this many rows (it beats cuBLAS there: BENCHMARKS.md run 128)
MAX_WEIGHTS = 2


def validate(x: Tensor, weights: list[Tensor]) -> None:
    """Shape/dtype checks (metadata only, no sync)."""
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOATS, expected="[M, K]")
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"{OP}: weights must be a list of 1 to {MAX_WEIGHTS} matrices [N_i, K], got {len(weights)}")
    K = x.shape[1]
    for i, w in enumerate(weights):
        check_tensor(OP, f"weights[{i}]", w, ndim=2, dtypes=(x.dtype,), shape=(None, K),
                     expected=f"[N, {K}] of x's dtype {x.dtype}")
        if w.device != x.device:
            raise ValueError(f"{OP}: weights[{i}] is on {w.device}, x on {x.device}")


@torch.library.custom_op("mla::skinny_linear_ref", mutates_args=(), tags=LAYOUT_TAGS)
def skinny_linear_ref(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """Reference (plain torch, any device): ``F.linear`` per weight."""
    validate(x, weights)
    return [F.linear(x, w) for w in weights]


def fake(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """Fake outputs shared by every implementation: validate, then ``[M, N_i]`` of x's dtype."""
    validate(x, weights)
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights]


skinny_linear_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.skinny_linear_ref, rank=100, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        note="F.linear per weight")


def skinny_linear(x: Tensor, weights: list[Tensor], backend: str | None = None) -> list[Tensor]:
    """``[x @ W.T for W in weights]`` (one or two weights sharing ``x [M, K]``); see the module docstring.
    ``backend``: None/"auto", "reference" or "triton"."""
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    return impl.fn(x, list(weights))


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    import mla_compile.ops.triton.skinny_linear  # noqa: F401  (registers mla::skinny_linear_triton)
    return torch.ops.mla.skinny_linear_triton(x, weights)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=(torch.bfloat16, torch.float16),
        package="triton", gpu_tested=True,
        kernels=("skinny_linear_triton", "_skinny_linear_kernel", "_skinny_linear_pipe_kernel"),
        note=f"ours: a GEMV over the weights' rows, all weights in one launch, up to {MAX_ROWS} rows (F.linear above)")
