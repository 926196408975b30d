"""What every peer-library adapter shares: finding a library without importing it, the device
capability, persistent workspaces, and the boundary rules of our ops (natural-log LSE, token-major
layout, a query that sees no key gets ``out = 0`` and ``lse = -inf``, padding rows likewise).

The boundary fix-ups below read only tensors already on the device (``seq_lens``, ``cu_seqlens``) and
shapes: no host sync, so they are safe inside ``torch.compile`` and CUDA-graph capture.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import torch
from torch import Tensor

from mla_compile.ops._ragged import segments
from mla_compile.ops._workspace import workspace  # noqa: F401  (the adapters' name for it)
from mla_compile.ops.registry import declare_kernels
from mla_compile.ops.registry import device_capability as capability  # noqa: F401  (adapters' name for it)
from mla_compile.ops.triton import available as triton_available

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


@torch.compiler.assume_constant_result
def importable(module: str) -> bool:
    """Whether top-level ``module`` can be imported here, found without importing it.

    A module already in ``sys.modules`` counts (the contract tests install fakes there); a ``None``
    entry there means "blocked" and does not. Under Dynamo (the public op functions check backends
    while tracing) the answer is computed at trace time and is a constant of the graph.
    """
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_capability(op: str, backend: str, device: torch.device, minimum: tuple[int, int],
                       maximum: tuple[int, int] | None = None) -> None:
    """Raise a ValueError naming the backend when ``device`` is outside ``[minimum, maximum]``.

    Runs inside adapter op bodies (never traced), so the capability query costs nothing under compile.
    """
    if device.type != "cuda":
        return  # CPU contract tests drive the adapters with fake libraries
    cap = capability(device)
    if cap is None or cap < minimum or (maximum is not None and cap > maximum):
        want = f"sm{minimum[0]}{minimum[1]}" + (f" to sm{maximum[0]}{maximum[1]}" if maximum else " or newer")
        have = "not a CUDA GPU" if cap is None else f"sm{cap[0]}{cap[1]}"
        raise ValueError(f"{op}: backend {backend!r} needs a GPU of {want}, this one is {have}; "
                         f"use backend='auto' to pick one that runs here")


def plain_eager(*tensors: Tensor) -> bool:
    """Whether an adapter may run its op body directly instead of through its ``torch.library`` op: nothing is
    being compiled, traced (``torch.jit``), transformed (functorch) or profiled, no torch function or dispatch
    mode is active, and every tensor is a plain ``torch.Tensor`` that needs no grad. Then the op's dispatch layers
    (autograd wrapper, redispatch, Dynamo guard) do nothing but cost host time, which is what an eager call of a
    library whose kernels are short pays most for. Anything else takes the op, so modes, compile, functorch and
    the profiler see the same op as always."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._len_torch_function_stack() == 0 and torch._C._functorch.peek_interpreter_stack() is None
            and not torch.autograd._profiler_enabled() and torch._C._get_tracing_state() is None
            and all(type(t) is Tensor and not t.requires_grad for t in tensors))


def check_dtype(op: str, backend: str, name: str, t: Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """A TypeError naming the argument when ``t``'s dtype is not one the peer kernel takes."""
    if t.dtype not in allowed:
        raise TypeError(f"{op}: backend {backend!r} needs {name} in {[str(d) for d in allowed]}, got {t.dtype}; "
                        f"cast it or use backend='triton'/'reference'")


def check_value(op: str, backend: str, name: str, value: int, allowed: tuple[int, ...]) -> None:
    """A ValueError naming the argument when a static size is not one the peer kernel takes."""
    if value not in allowed:
        raise ValueError(f"{op}: backend {backend!r} needs {name} in {list(allowed)}, got {value}; "
                         f"use backend='triton' or 'reference' for other sizes")


# ------------------------------------------------------------------------------------------ boundary

def decode_visible(seq_lens: Tensor, s_q: int) -> Tensor:
    """``[B, s_q]`` bool: query i of sequence b sees at least one row (``seq_len - (s_q - 1 - i) > 0``)."""
    back = (s_q - 1 - torch.arange(s_q, device=seq_lens.device))[None, :]
    return seq_lens.long()[:, None] - back > 0


def finish_decode(out: Tensor, lse: Tensor, seq_lens: Tensor, lse_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Our decode boundary: ``out [B, s_q, H, Dc]``, ``lse [B, s_q, H]`` (any strides) times ``lse_scale``
    as float32 natural log, empty queries 0 / -inf whatever the peer wrote there; both contiguous.

    On CUDA with Triton this is one kernel (``ops/triton/finish.py``; ``out`` is zeroed in place, so pass
    only a fresh library output); elsewhere torch ops that leave ``out`` unchanged.
    """
    if out.is_cuda and triton_available():  # cached: this runs once per adapter call
        from mla_compile.ops.triton.finish import finish_decode_triton
        return finish_decode_triton(out, lse, seq_lens, lse_scale)
    vis = decode_visible(seq_lens, out.shape[1])
    out = torch.where(vis[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    lse = lse.to(torch.float32) if lse_scale == 1.0 else lse.to(torch.float32) * lse_scale
    lse = torch.where(vis[:, :, None], lse, float("-inf"))
    return out.contiguous(), lse.contiguous()


def prefill_has_keyless_rows(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool) -> bool:
    """Whether some query row of these sequences sees no key (:func:`prefill_live_rows`' rule per sequence; host
    tensors, a plan's): bottom-right causal row i sees ``len_k - len_q + 1 + i`` keys, so some row sees none when
    ``len_k < len_q``; non-causal, the rows of a sequence without keys."""
    len_q, len_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    return bool(((len_k < len_q) if causal else ((len_k == 0) & (len_q > 0))).any())


def prefill_live_rows(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, num_rows: int, causal: bool) -> Tensor:
    """``[T]`` bool: row t belongs to a sequence and sees at least one key (bottom-right causal)."""
    n = cu_seqlens_q.shape[0] - 1
    seq, loc = segments(cu_seqlens_q, num_rows)
    if n == 0:
        return torch.zeros(num_rows, dtype=torch.bool, device=cu_seqlens_q.device)
    idx = seq.clamp(max=n - 1)
    len_q = cu_seqlens_q.diff().long()[idx]
    len_k = cu_seqlens_k.diff().long()[idx]
    seen = torch.minimum(len_k, loc + len_k - len_q + 1) if causal else len_k
    return (seq < n) & (seen > 0)


def finish_prefill(out: Tensor, lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                   causal: bool, lse_scale: float = 1.0, all_live: bool = False) -> tuple[Tensor, Tensor]:
    """Our prefill boundary: ``out [T, H, Dv]``, ``lse [T, H]`` times ``lse_scale`` as float32 natural log;
    padding rows (past ``cu_seqlens_q[-1]``) and rows that see no key get 0 / -inf (FA2's +inf, garbage, NaN
    all go).

    On CUDA with Triton this is one kernel that writes ``out`` only on those rows (zeroed in place, so pass only
    a fresh library output; ``ops/triton/finish.py``); elsewhere torch ops that leave ``out`` unchanged.
    ``all_live``: the caller knows from host lengths (a plan's, :func:`prefill_has_keyless_rows`) that there are
    no padding rows and every row sees a key; the boundary is then the LSE's base alone (scaled in place: a fresh
    library output only), no row-finding work.
    """
    if all_live:
        lse = lse.to(torch.float32)
        return out.contiguous(), (lse.mul_(lse_scale) if lse_scale != 1.0 else lse).contiguous()
    if out.is_cuda and triton_available():
        from mla_compile.ops.triton.finish import finish_prefill_triton
        return finish_prefill_triton(out, lse, cu_seqlens_q, cu_seqlens_k, causal, lse_scale)
    live = prefill_live_rows(cu_seqlens_q, cu_seqlens_k, out.shape[0], causal)
    out = torch.where(live[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    lse = lse.to(torch.float32) if lse_scale == 1.0 else lse.to(torch.float32) * lse_scale
    lse = torch.where(live[:, None], lse, float("-inf"))
    return out.contiguous(), lse.contiguous()


def merge_natural(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Float32 LSE merge of two non-empty partial results (used inside adapters that split a call)."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    out = (out_a.float() * (wa / total)[..., None] + out_b.float() * (wb / total)[..., None]).to(out_a.dtype)
    return out, m + torch.log(total)


declare_kernels("triton (adapter boundary)", "_finish_decode_kernel")
