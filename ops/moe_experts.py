"""``mla::moe_experts``: DeepSeek's routed experts (SiLU gated MLPs) with the shared experts folded in.

Contract. ``x [T, H]``, routing ``weights [T, k]`` float32 and ``ids [T, k]`` int32/int64 (experts in
``[0, E)``), ``gate_up [E, 2I, H]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``) and ``down [E, H, I]`` of
x's dtype (HF's fused-experts layout). Optionally the shared experts as HF holds them, ``shared_gate
[S*I, H]``, ``shared_up [S*I, H]``, ``shared_down [H, S*I]`` (one MLP of width ``S*I``: the same sum as S
experts of width I, each always routed with weight 1). For every token t::

    out[t] = sum_j weights[t, j] * down[e_j] @ a(gate_up[e_j], x[t])  +  shared_down @ a(shared, x[t])
    a(W, x) = round_x.dtype( silu(W_gate @ x) * (W_up @ x) )

with the products accumulated in float32 (float64 for a float64 ``x``) and the activation ``a`` rounded to
x's dtype before the down projection (as the eager model rounds it). The sum over the k picks and the
shared experts is float32; ``out`` is float32 when ``out_float32`` (x's dtype otherwise; float64 stays
float64). Repeated ids in a row count once per pick.

``token_mask [T]`` bool (optional; None: every token is real): rows where it is False (padding tokens of a
step padded to a captured size) give ``out[t] = 0`` exactly, whatever x, weights and ids hold there; the fused
"triton" and "triton-grouped" backends then read no expert weights for them, the others may still compute them
and zero the rows.

Backends: "reference" (plain torch, any device: every expert on every token, combined by a ``[T, E]``
routing matrix), "grouped" (CUDA bf16: tokens sorted by expert, ``torch._grouped_mm``; each hit expert's
weights read once: the large-T path), "triton" (ours, CUDA: reads only the routed experts' rows per
(token, pick): kernel 1 gate_up with SiLU-and-mul fused, kernel 2 down with the weighted combine fused,
one program per (token, H tile) looping over the picks in order: deterministic; the small-T path),
"triton-grouped" (ours, CUDA: the (token, pick) pairs sorted by expert in blocks of one expert, ``tl.dot``
grouped GEMMs reading each hit expert once, shared experts as always-routed experts, a deterministic combine:
the large-T path). "auto" on a GPU: the split ``triton`` up to :data:`FUSED_MAX_TOKENS` tokens,
``triton-grouped`` above (``grouped`` where ours does not serve; chosen inside the op from its static T, so one
graph serves every batch size), where the hidden size is at most :data:`FUSED_MAX_HIDDEN`; at wider hidden
sizes ``triton-grouped`` at every T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mla_compile.ops._checks import INDEX_DTYPES, check_same_device, check_tensor
from mla_compile.ops.registry import (FLOATS, HALF, LAYOUT_TAGS, backends_for, declare, declare_op, declare_split,
                                      declare_split_op, priority, run_split_part)
from mla_compile.ops.select import auto_skip, facts_for, resolve, why_not

OP = declare_op("moe_experts", "mla.moe_experts")
# "auto" runs the fused kernels up to this many tokens, grouped kernels above, and only where the hidden size is at
# most FUSED_MAX_HIDDEN (BENCHMARKS.md run 131: the grouped kernels win from 4 tokens at V2-Lite's 2048, at every
# token count at V3's 7168); the fp8 experts op keeps FUSED_MAX_TOKENS_FP8 (its grouped part is torch's)
FUSED_MAX_TOKENS = 2
FUSED_MAX_HIDDEN = 2048
FUSED_MAX_TOKENS_FP8 = 8


def check_token_mask(op: str, x: Tensor, token_mask: Tensor | None) -> None:
    """``token_mask``: None or ``[T]`` bool on x's device (metadata only, no sync)."""
    if token_mask is None:
        return
    T = x.shape[0]
    check_tensor(op, "token_mask", token_mask, dtypes=(torch.bool,), shape=(T,),
                 expected=f"[{T}] bool, True for the real tokens (e.g. slot_mapping >= 0)")
    check_same_device(op, x=x, token_mask=token_mask)


def zero_masked(out: Tensor, token_mask: Tensor | None) -> Tensor:
    """``out [T, H]`` with the rows where ``token_mask`` is False set to 0 (NaN and inf too); as is for None."""
    return out if token_mask is None else out.masked_fill(~token_mask[:, None], 0)


def validate(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, shared_gate: Tensor | None,
             shared_up: Tensor | None, shared_down: Tensor | None, token_mask: Tensor | None = None) -> None:
    """Shape/dtype checks (metadata only, no sync)."""
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOATS, expected="[T, H]")
    T, H = x.shape
    check_tensor(OP, "gate_up", gate_up, ndim=3, dtypes=(x.dtype,), expected=f"[E, 2I, {H}] of x's dtype {x.dtype}")
    E, two_i, _ = gate_up.shape
    if two_i % 2 or gate_up.shape[2] != H:
        raise ValueError(f"{OP}: gate_up must have shape [E, 2I, {H}] (gate rows then up rows), "
                         f"got {list(gate_up.shape)}")
    I = two_i // 2
    check_tensor(OP, "down", down, dtypes=(x.dtype,), shape=(E, H, I), expected=f"[{E}, {H}, {I}] of x's dtype")
    check_tensor(OP, "ids", ids, ndim=2, dtypes=INDEX_DTYPES, shape=(T, None), expected=f"[{T}, k] int32/int64")
    check_tensor(OP, "weights", weights, dtypes=(torch.float32, torch.float64), shape=(T, ids.shape[1]),
                 expected=f"[{T}, {ids.shape[1]}] float32")
    given = [s is not None for s in (shared_gate, shared_up, shared_down)]
    if any(given) and not all(given):
        raise ValueError(f"{OP}: give all of shared_gate, shared_up, shared_down or none, got {given}")
    if all(given):
        check_tensor(OP, "shared_gate", shared_gate, ndim=2, dtypes=(x.dtype,), shape=(None, H),
                     expected=f"[S*{I}, {H}] of x's dtype")
        width = shared_gate.shape[0]
        if width == 0 or width % I:
            raise ValueError(f"{OP}: shared_gate must have shape [S*{I}, {H}] (S >= 1 shared experts of the "
                             f"routed width {I}), got {list(shared_gate.shape)}")
        check_tensor(OP, "shared_up", shared_up, dtypes=(x.dtype,), shape=(width, H), expected="like shared_gate")
        check_tensor(OP, "shared_down", shared_down, dtypes=(x.dtype,), shape=(H, width),
                     expected=f"[{H}, {width}] of x's dtype")
    check_token_mask(OP, x, token_mask)


def _out_dtype(x: Tensor, out_float32: bool) -> torch.dtype:
    return torch.float32 if out_float32 and x.dtype != torch.float64 else x.dtype


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _activation(g: Tensor, u: Tensor, dtype: torch.dtype, limit: float | None = None) -> Tensor:
    """``silu(g) * u`` rounded to ``dtype`` (the contract's ``a``), back in g's dtype; ``limit`` (V4's
    ``swiglu_limit``, None: none) first clamps g to ``<= limit`` and u to ``[-limit, limit]``."""
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return (F.silu(g) * u).to(dtype).to(g.dtype)


def _shared(x: Tensor, shared_gate: Tensor, shared_up: Tensor, shared_down: Tensor, acc: torch.dtype) -> Tensor:
    """The shared MLP on every token, in ``acc``: ``[T, H]``."""
    xa = x.to(acc)
    a = _activation(xa @ shared_gate.to(acc).T, xa @ shared_up.to(acc).T, x.dtype)
    return a @ shared_down.to(acc).T


@torch.library.custom_op("mla::moe_experts_ref", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_ref(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor,
                    shared_gate: Tensor | None, shared_up: Tensor | None, shared_down: Tensor | None,
                    out_float32: bool, token_mask: Tensor | None = None) -> Tensor:
    """Reference (plain torch, any device): each expert on every token in ``acc``, summed through a ``[T, E]``
    routing matrix (a loop over experts: no data-dependent shapes, memory of one expert at a time); the rows
    that ``token_mask`` masks are zeroed at the end."""
    validate(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, token_mask)
    acc = _acc(x)
    T, H = x.shape
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    combine = torch.zeros(T, E, dtype=acc, device=x.device).scatter_add_(1, ids.long(), weights.to(acc))
    xa = x.to(acc)
    out = torch.zeros(T, H, dtype=acc, device=x.device)
    for e in range(E):
        h = xa @ gate_up[e].to(acc).T
        out += combine[:, e:e + 1] * (_activation(h[:, :I], h[:, I:], x.dtype) @ down[e].to(acc).T)
    if shared_gate is not None:
        out += _shared(x, shared_gate, shared_up, shared_down, acc)
    return zero_masked(out, token_mask).to(_out_dtype(x, out_float32))


def fake(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, out_float32, token_mask=None):
    """Fake output shared by every implementation: validate, then ``[T, H]``."""
    validate(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, token_mask)
    return x.new_empty(x.shape, dtype=_out_dtype(x, out_float32))


moe_experts_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.moe_experts_ref, rank=100, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        note="plain torch, every expert on every token (the numerical ground truth)")


def sort_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """``ids [T, k]`` -> ``(order [T*k], offs [E] int32)``: the (token, slot) copies sorted by expert (stable)
    and each expert's cumulative row end, as ``torch._grouped_mm`` takes them. Token of row r: ``order[r] // k``."""
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    return torch.argsort(flat, stable=True), torch.cumsum(counts, 0, dtype=torch.int32)


def combine_sorted(y: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """Sorted expert outputs ``y [T*k, H]`` back to tokens, weighted: ``[T, H]`` float32."""
    # back to (token, slot) order by a permutation, then a float32 sum over the k slots: deterministic
    # (an index_add_ would add in atomic order, so bf16 rounding and greedy tokens could vary run to run)
    return combine_pairs(torch.empty_like(y).index_copy_(0, order, y), weights)


def combine_pairs(y: Tensor, weights: Tensor) -> Tensor:
    """Expert outputs ``y [T*k, H]`` in (token, slot) order, weighted and summed per token: ``[T, H]`` float32."""
    T, k = weights.shape
    return torch.einsum("tkh,tk->th", y.view(T, k, -1).float(), weights.float())


def grouped_routed(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """The routed experts through ``torch._grouped_mm`` (CUDA bf16): ``[T, H]`` float32."""
    order, offs = sort_by_expert(ids, gate_up.shape[0])
    h = torch._grouped_mm(x[order // ids.shape[1]], gate_up.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(g) * u).contiguous(), down.transpose(1, 2), offs=offs)
    return combine_sorted(y, order, weights)


@torch.library.custom_op("mla::moe_experts_grouped", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_grouped(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor,
                        shared_gate: Tensor | None, shared_up: Tensor | None, shared_down: Tensor | None,
                        out_float32: bool, token_mask: Tensor | None = None) -> Tensor:
    """Grouped GEMMs for the routed experts (each hit expert read once), plain linears for the shared ones;
    masked tokens are computed too, their rows zeroed at the end."""
    validate(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, token_mask)
    out = grouped_routed(x, weights, ids, gate_up, down)
    if shared_gate is not None:
        a = F.silu(F.linear(x, shared_gate)) * F.linear(x, shared_up)
        out = out + F.linear(a, shared_down).float()
    return zero_masked(out, token_mask).to(_out_dtype(x, out_float32))


moe_experts_grouped.register_fake(fake)


def _grouped_available() -> bool:
    return hasattr(torch, "_grouped_mm") and torch.cuda.is_available()


declare(OP, "grouped", torch.ops.mla.moe_experts_grouped, rank=60, available=_grouped_available,
        dtypes=(torch.bfloat16,), package="torch", gpu_tested=True,
        note="tokens sorted by expert, torch._grouped_mm: each hit expert read once (large T)")


@torch.library.custom_op("mla::moe_experts_split", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_split(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor,
                      shared_gate: Tensor | None, shared_up: Tensor | None, shared_down: Tensor | None,
                      out_float32: bool, token_mask: Tensor | None, tiers: str, plan_id: int) -> Tensor:
    """``mla::moe_experts`` through the part of ``tiers`` (``"triton:8/grouped"``) whose token bound covers T."""
    args = (x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, out_float32, token_mask)
    return run_split_part(OP, tiers, x.shape[0], args, plan_id)


moe_experts_split.register_fake(lambda *args: fake(*args[:-2]))
declare_split_op(OP, torch.ops.mla.moe_experts_split, "batch")


@torch.compiler.assume_constant_result
def fused_or_grouped(op: str, device: str, dtype: str, max_tokens: int,
                     preferred: tuple[str, int] | None = None) -> str:
    """"auto" for an experts op ``op`` (``mla::moe_experts`` and its fp8 / fp4 siblings) on ``device`` with x of
    ``dtype`` (names; a graph constant): the split "triton" up to ``max_tokens`` tokens / "triton-grouped" (where
    the op has it, else "grouped") above when both serve (the grouped one alone for ``max_tokens`` 0), else the
    first usable backend ("reference" when none is). ``preferred`` ``(name, tokens)``: a fused backend taken in
    "triton"'s place, up to its own token count, where it serves."""
    facts = facts_for(device, getattr(torch, dtype), need_lse=False)
    table = backends_for(op)
    usable = [n for n in priority(op) if why_not(table[n], facts) is None and auto_skip(table[n]) is None]
    upper = next((n for n in ("triton-grouped", "grouped") if n in usable), None)
    fused, tokens = preferred if preferred is not None and preferred[0] in usable else ("triton", max_tokens)
    if upper is not None and tokens <= 0:
        return upper
    if fused in usable and upper is not None:
        return declare_split(op, ((tokens, fused), (None, upper))).name
    return usable[0] if usable else "reference"


def auto_backend(device: str, dtype: str, hidden: int) -> str:
    """"auto" for ``mla::moe_experts`` on ``device`` with x of ``dtype`` and ``hidden`` columns:
    :func:`fused_or_grouped` with :data:`FUSED_MAX_TOKENS` up to :data:`FUSED_MAX_HIDDEN`, else grouped alone."""
    return fused_or_grouped(OP, device, dtype, FUSED_MAX_TOKENS if hidden <= FUSED_MAX_HIDDEN else 0)


def moe_experts(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, *,
                shared_gate: Tensor | None = None, shared_up: Tensor | None = None,
                shared_down: Tensor | None = None, out_float32: bool = False, backend: str | None = None,
                token_mask: Tensor | None = None) -> Tensor:
    """Routed (and shared) experts of ``x [T, H]`` -> ``[T, H]``; see the module docstring for the contract.
    ``backend``: None/"auto" (:func:`auto_backend`), "reference", "grouped", "triton" or a split name.
    ``token_mask [T]`` bool: False rows (padding tokens) give 0 and, in the fused kernels, read no weights."""
    if backend in (None, "auto"):
        backend = auto_backend(str(x.device), str(x.dtype).replace("torch.", ""), x.shape[-1])
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    return impl.fn(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, bool(out_float32),
                   token_mask)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, shared_gate: Tensor | None,
            shared_up: Tensor | None, shared_down: Tensor | None, out_float32: bool,
            token_mask: Tensor | None = None) -> Tensor:
    import mla_compile.ops.triton.moe_experts  # noqa: F401  (registers mla::moe_experts_triton)
    return torch.ops.mla.moe_experts_triton(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down,
                                            out_float32, token_mask)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=(torch.float32, *HALF), package="triton",
        gpu_tested=True, kernels=("moe_experts_triton", "_moe_gate_up_kernel", "_moe_gate_up_dot_kernel",
                                  "_moe_gate_up_pipe_kernel",
                                  "_moe_down_kernel", "_moe_down_dot_kernel"),
        note="ours: reads only the routed experts; gate_up+SiLU*up, then down+weighted combine (small T)")


def _triton_grouped(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor,
                    shared_gate: Tensor | None, shared_up: Tensor | None, shared_down: Tensor | None,
                    out_float32: bool, token_mask: Tensor | None = None) -> Tensor:
    import mla_compile.ops.triton.moe_grouped  # noqa: F401  (registers mla::moe_experts_grouped_triton)
    return torch.ops.mla.moe_experts_grouped_triton(x, weights, ids, gate_up, down, shared_gate, shared_up,
                                                    shared_down, out_float32, token_mask)


declare(OP, "triton-grouped", _triton_grouped, rank=55, available=_triton_available,
        dtypes=(torch.float32, *HALF), package="triton", gpu_tested=True,
        kernels=("moe_experts_grouped_triton", "_moe_sort_kernel", "_moe_align_kernel", "_moe_grouped_gate_up_kernel",
                 "_moe_grouped_down_kernel", "_moe_combine_kernel"),
        note="ours: pairs sorted by expert in blocks of 16-64 rows, tl.dot grouped GEMMs, each hit expert "
             "read once; deterministic combine (many tokens)")
