"""Triton ``mla::moe_gate_route``: the router GEMV and the routing of up to ``MAX_ROWS`` tokens in one launch.

Program p of the grid computes the float32 logits of experts ``[p * SLICE_E, (p + 1) * SLICE_E)`` for every token
(its gate rows read once, ``[SLICE_E, BLOCK_H]`` tiles; the products of half-precision values are exact in float32)
and stores them in a scratch ``[MAX_ROWS, E]``; then it counts itself in on an arrival counter (a barrier of the
program's threads, then one acquire-release atomic at GPU scope). The program that arrives last reads every
logit, routes every token at once with ``mla::moe_route``'s routing
(:func:`~mla_compile.ops.triton.moe_route._route_rows`), writes the picks best first and puts the counter back to 0
for the next call. So the gate is read by ``cdiv(E, SLICE_E)`` programs at once (a one-program kernel reading
the whole gate was slower than ``torch.mm`` + the route kernel) and the routing needs no second launch. The
counter is a persistent zeroed buffer per device (:func:`~mla_compile.ops._workspace.workspace`): allocated by
the first call (a warm-up before any CUDA-graph capture), so calls on one device must not run concurrently on two
streams. More tokens, more experts than the routing holds, non-CUDA tensors or float32/float64 run the unfused
path inside the op.

``mla::moe_norm_gate_route`` launches the same kernel with ``NORM``: in the loop over the hidden columns each row is
formed as ``x + residual`` (rounded to x's dtype), its squares summed and its values times the norm's weight dotted
with the gate; the dots are scaled by the row's ``rsqrt(mean + eps)`` at the end, and program p stores columns
``[p * CHUNK, (p + 1) * CHUNK)`` of ``h`` and of the normed rows (HF's RMSNorm rounding) for the experts after it.
Without ``NORM`` its sm_90 code is the kernel's before the flag was added (the same PTX but for parameter numbers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops._workspace import workspace
from mla_compile.ops.moe_gate_route import MAX_ROWS, OP, fake, validate
from mla_compile.ops.moe_norm_gate_route import fake as norm_fake
from mla_compile.ops.moe_norm_gate_route import validate as norm_validate
from mla_compile.ops.moe_route import MAX_EXPERTS
from mla_compile.ops.triton._common import last_dim_contiguous, num_sms
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait
from mla_compile.ops.triton.moe_route import _route_rows, route_meta
from mla_compile.ops.triton.skinny_linear import hf_normed, hidden_values

# Launch parameters (a benchmark may swap them): ``tile``, gate elements a program loads per step
# (SLICE_E * BLOCK_H); ``max_slice``, the most experts one program reads; ``num_warps``; for gates of at most
# ``few_experts`` experts ``few_tile`` and ``few_warps`` instead (fewer warps make the last program's routing
# reductions cheaper). SLICE_E is the smallest power of two giving at most one program per SM, at most max_slice.
# H200 (BENCHMARKS.md run 159): one expert a program is the fastest at 256 experts and ties at 64; 2 warps and
# one 2048-wide step save a quarter of the call at V2-Lite's 64 x 2048 gate.
CONFIG = dict(tile=8192, max_slice=1, num_warps=4, few_experts=64, few_tile=2048, few_warps=2)


@triton.jit
def _moe_gate_route_kernel(
    x_ptr, g_ptr, bias_ptr, w_ptr, ids_ptr, logits_ptr, count_ptr, r_ptr, nw_ptr, h_ptr, n_ptr,
    T, H, E, GROUP_SIZE, s_x, s_g, s_w, s_i, s_r, s_h, s_n, scaling, eps, CHUNK,
    ROWS: tl.constexpr, SLICE_E: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
    NUM_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr, NORM: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    es = tl.program_id(0) * SLICE_E + tl.arange(0, SLICE_E)
    es_ok = es < E
    r_idx = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, SLICE_E], dtype=tl.float32)
    ss = tl.zeros([ROWS], dtype=tl.float32)  # NORM: the rows' sums of squares
    g_rows = g_ptr + es.to(tl.int64) * s_g
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < H
        g = tl.load(g_rows[:, None] + h[None, :], mask=es_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        if NORM:
            nw = tl.load(nw_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
        pdl_wait(PDL)  # the gate's tile is in flight before x, the previous kernel's output, is read
        pdl_launch_dependents(PDL)
        for r in tl.static_range(ROWS):
            if NORM:  # the row's hidden values x + residual (rounded as the eager add); the dot of g * h
                xr = hidden_values(x_ptr + r * s_x, r_ptr + r * s_r, h_ptr, h, h_ok & (r < T), True, False)
                ss += tl.where(r_idx == r, tl.sum(xr * xr, axis=0), 0.0)
                xr = xr * nw
            else:
                xr = tl.load(x_ptr + r * s_x + h, mask=h_ok & (r < T), other=0.0)
            part = tl.sum(g * xr.to(tl.float32)[None, :], axis=1)
            acc += tl.where(r_idx[:, None] == r, part[None, :], 0.0)
    if NORM:  # the dots scaled by the rows' rsqrt; this program's slice of h and of the normed rows stored
        inv = tl.math.rsqrt(ss / H + eps)
        acc = acc * inv[:, None]
        _store_norm_slice(x_ptr, r_ptr, nw_ptr, h_ptr, n_ptr, inv, r_idx, T, H, s_x, s_r, s_h, s_n, CHUNK, ROWS,
                          BLOCK_C)
    tl.store(logits_ptr + r_idx[:, None] * E + es[None, :], acc, mask=es_ok[None, :])
    tl.debug_barrier()  # every thread's logits stored before the program counts itself in (release, GPU scope)
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:  # the last program: every other program's logits are visible
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")  # zero again for the next call (stream order)
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        z = tl.load(logits_ptr + r_idx[:, None] * E + e[None, :], mask=ok[None, :], other=0.0, volatile=True)
        weights, ids = _route_rows(z, e, ok, bias_ptr, E, GROUP_SIZE, scaling, ROWS, BLOCK_E, BLOCK_G, BLOCK_K,
                                   TOP_K, NUM_GROUP, TOPK_GROUP, SCORE, HAS_BIAS, RENORM)
        k_idx = tl.arange(0, BLOCK_K)[None, :]
        live = (r_idx[:, None] < T) & (k_idx < TOP_K)  # a one-token call writes one row
        tl.store(w_ptr + r_idx[:, None] * s_w + k_idx, weights, mask=live)
        tl.store(ids_ptr + r_idx[:, None] * s_i + k_idx, ids, mask=live)


@triton.jit
def _store_norm_slice(x_ptr, r_ptr, nw_ptr, h_ptr, n_ptr, inv, r_idx, T, H, s_x, s_r, s_h, s_n, CHUNK,
                      ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program p's columns ``[p * CHUNK, (p + 1) * CHUNK)`` of every row: ``h = x + residual`` and ``normed`` (HF's
    RMSNorm rounding: ``h * inv`` to x's dtype, times the norm's weight, rounded), ``inv [ROWS]`` the rows' rsqrt."""
    c = tl.program_id(0) * CHUNK + tl.arange(0, BLOCK_C)
    c_ok = (c < H) & (tl.arange(0, BLOCK_C) < CHUNK)
    nw = tl.load(nw_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    ty = x_ptr.dtype.element_ty
    for r in tl.static_range(ROWS):
        ok = c_ok & (r < T)
        a = hidden_values(x_ptr + r * s_x, r_ptr + r * s_r, h_ptr + r * s_h, c, ok, True, True)  # h stored
        inv_r = tl.sum(tl.where(r_idx == r, inv, 0.0), axis=0)
        tl.store(n_ptr + r * s_n + c, hf_normed(a, inv_r, nw, ty), mask=ok)


def fusable(x: Tensor, weight: Tensor) -> bool:
    """Whether the fused kernel serves this call (static facts: tokens, experts)."""
    return x.shape[0] <= MAX_ROWS and weight.shape[0] <= MAX_EXPERTS


def slice_experts(E: int, device: torch.device) -> int:
    """Experts one program reads: the smallest power of two (at most ``CONFIG["max_slice"]``) giving at most one
    program per SM."""
    return min(CONFIG["max_slice"], triton.next_power_of_2(triton.cdiv(E, num_sms(device))))


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int,
            scoring: str, renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """Kernel path of ``mla::moe_gate_route`` (the interpreter on CPU tensors too); shapes as the op's contract, at
    most ``MAX_ROWS`` tokens and ``MAX_EXPERTS`` experts."""
    return _kernel(x, weight, bias, top_k, num_group, topk_group, scoring, renormalize, scaling, None)


def _launch_norm(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                 top_k: int, num_group: int, topk_group: int, scoring: str, renormalize: bool,
                 scaling: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Kernel path of ``mla::moe_norm_gate_route`` (the interpreter on CPU tensors too): ``(h, normed, weights,
    ids)``; shapes as that op's contract, at most ``MAX_ROWS`` tokens and ``MAX_EXPERTS`` experts."""
    return _kernel(x, weight, bias, top_k, num_group, topk_group, scoring, renormalize, scaling,
                   (residual, norm_weight, float(eps)))


def _kernel(x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int,
            scoring: str, renormalize: bool, scaling: float, norm: tuple[Tensor, Tensor, float] | None) -> tuple:
    """One launch of :func:`_moe_gate_route_kernel`; ``norm``: ``(residual, norm_weight, eps)`` to add and norm x
    first (then ``h`` and ``normed`` lead the outputs)."""
    T, H = x.shape
    E = weight.shape[0]
    if not fusable(x, weight):
        raise ValueError(f"{OP}: the fused kernel serves at most {MAX_ROWS} tokens and {MAX_EXPERTS} experts, "
                         f"got {T} tokens and {E} experts")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=x.device)
    normed_out = () if norm is None else tuple(torch.empty_like(x, memory_format=torch.contiguous_format)
                                               for _ in range(2))
    if T == 0:
        return *normed_out, weights, ids
    x = last_dim_contiguous(x)
    weight = last_dim_contiguous(weight)
    bias_arg = weight if bias is None else bias.contiguous()
    meta = route_meta(E, top_k, num_group, topk_group, scoring, bias is not None, renormalize)
    slice_e = slice_experts(E, x.device)
    programs = triton.cdiv(E, slice_e)
    few = E <= CONFIG["few_experts"]
    block_h = min(triton.next_power_of_2(H), max(16, CONFIG["few_tile" if few else "tile"] // slice_e))
    logits = torch.empty(MAX_ROWS, E, dtype=torch.float32, device=x.device)
    count = workspace("moe_gate_route-arrivals", x.device, 4, zero=True).view(torch.int32)
    if norm is None:  # the norm's arguments are never read
        r, nw, h, n, eps, chunk = x, x, x, x, 1.0, 1
    else:
        (r, nw, eps), (h, n) = norm, normed_out
        r, nw, chunk = last_dim_contiguous(r), nw.contiguous(), triton.cdiv(H, programs)
    wrap_triton(_moe_gate_route_kernel)[(programs,)](
        x, weight, bias_arg, weights, ids, logits, count, r, nw, h, n, T, H, E, E // num_group, x.stride(0),
        weight.stride(0), weights.stride(0), ids.stride(0), r.stride(0), h.stride(0), n.stride(0), float(scaling),
        float(eps), chunk, ROWS=MAX_ROWS, SLICE_E=slice_e, BLOCK_H=block_h, **meta, NORM=norm is not None,
        BLOCK_C=max(1, triton.next_power_of_2(chunk)), num_warps=CONFIG["few_warps" if few else "num_warps"],
        **launch_kwargs(x.device, H > 0),
    )
    return *normed_out, weights, ids


@torch.library.custom_op("mla::moe_gate_route_triton", mutates_args=())
def moe_gate_route_triton(x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, num_group: int,
                          topk_group: int, scoring: str, renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """Triton ``mla::moe_gate_route`` (contract of the ``_ref`` op): the fused kernel where :func:`fusable`;
    else on CUDA half ``torch.mm(..., out_dtype=float32)`` and ``mla::moe_route``'s kernel, elsewhere the
    reference."""
    half = x.dtype in (torch.bfloat16, torch.float16)
    if x.device.type != "cuda" or not half:
        return torch.ops.mla.moe_gate_route_ref(x, weight, bias, top_k, num_group, topk_group, scoring,
                                                renormalize, scaling)
    validate(x, weight, bias, top_k, num_group, topk_group, scoring)
    if fusable(x, weight):
        return _launch(x, weight, bias, top_k, num_group, topk_group, scoring, renormalize, scaling)
    import mla_compile.ops.triton.moe_route  # noqa: F401  (registers mla::moe_route_triton)
    logits = torch.mm(x, weight.t(), out_dtype=torch.float32)
    return torch.ops.mla.moe_route_triton(logits, bias, top_k, num_group, topk_group, scoring, renormalize, scaling)


moe_gate_route_triton.register_fake(fake)


@torch.library.custom_op("mla::moe_norm_gate_route_triton", mutates_args=())
def moe_norm_gate_route_triton(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                               bias: Tensor | None, top_k: int, num_group: int, topk_group: int, scoring: str,
                               renormalize: bool, scaling: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton ``mla::moe_norm_gate_route`` (contract of the ``_ref`` op): the fused kernel with the add and the norm
    where :func:`fusable`; else on CUDA half one add + norm launch (``mla::skinny_norm_linear``'s) and
    ``mla::moe_gate_route_triton``'s path; elsewhere the reference."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return torch.ops.mla.moe_norm_gate_route_ref(x, residual, norm_weight, eps, weight, bias, top_k, num_group,
                                                     topk_group, scoring, renormalize, scaling)
    norm_validate(x, residual, norm_weight, eps, weight, bias, top_k, num_group, topk_group, scoring)
    if fusable(x, weight):
        return _launch_norm(x, residual, norm_weight, eps, weight, bias, top_k, num_group, topk_group, scoring,
                            renormalize, scaling)
    from mla_compile.ops.triton.skinny_norm_linear import add_norm

    h, normed = add_norm(x, residual, norm_weight, eps)
    return h, normed, *moe_gate_route_triton(normed, weight, bias, top_k, num_group, topk_group, scoring,
                                             renormalize, scaling)


moe_norm_gate_route_triton.register_fake(norm_fake)
