"""Triton ``mla::moe_route``: DeepSeek routing in one kernel, one program per token row.

A program holds its row's E scores in registers (E <= 1024): sigmoid, sqrt(softplus) or softmax, the bias, the
group scores (a masked max, and for the per-expert scorings a second masked max past the first argmax), the
``topk_group`` best groups and then the ``top_k`` best experts by repeated argmax (lowest index on ties), the weights
gathered from the unbiased scores, renormalized and scaled. Picks are written best first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.moe_route import MAX_EXPERTS, OP, validate
from mla_compile.ops.triton._common import last_dim_contiguous

SCORE_CODES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}  # the kernels' SCORE constexpr per scoring


@triton.jit
def _argmax_first(v, idx, BIG: tl.constexpr):
    """Per row of ``v [R, N]``: the lowest index (``idx [N]``, ``BIG`` past the last) of the row's maximum, ``[R]``."""
    m = tl.max(v, axis=1)
    return tl.min(tl.where(v == m[:, None], idx[None, :], BIG), axis=1)


@triton.jit
def _route_rows(z, e, ok, bias_ptr, E, GROUP_SIZE, scaling, ROWS: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
                NUM_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr,
                RENORM: tl.constexpr):
    """``ROWS`` tokens' routing at once from their float32 logits ``z [ROWS, BLOCK_E]`` (experts ``e``, ``ok``:
    ``e < E``): ``(weights [ROWS, BLOCK_K] float32, ids [ROWS, BLOCK_K] int32)``, each row's first ``TOP_K``
    entries best first. Every step reduces along the experts of each row, so the rows share each reduction."""
    okr = ok[None, :]
    er = e[None, :]
    if SCORE == 1:  # sigmoid
        scores = 1.0 / (1.0 + tl.exp(-z))
    elif SCORE == 2:  # sqrt(softplus), softplus linear above 20 as torch's
        ez = tl.exp(tl.minimum(z, 20.0))
        u = 1.0 + ez  # log1p(ez) as log(u) * ez / (u - 1): accurate where ez is far below 1 (z very negative)
        softplus = tl.where(u == 1.0, ez, tl.log(u) * (ez / (u - 1.0)))
        scores = tl.sqrt(tl.where(z > 20.0, z, softplus))
    else:  # softmax over the row
        z = tl.where(okr, z, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(okr, choice, float("-inf"))

    if NUM_GROUP > 1:
        gid = er // GROUP_SIZE
        g_idx = tl.arange(0, BLOCK_G)[None, :]
        g_scores = tl.full([ROWS, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUP):
            in_g = okr & (gid == g)
            v = tl.where(in_g, choice, float("-inf"))
            best = tl.max(v, axis=1)
            if SCORE > 0:  # per-expert scores: the sum of the group's two best choices
                first = _argmax_first(v, e, BLOCK_E)
                best += tl.max(tl.where(er == first[:, None], float("-inf"), v), axis=1)
            g_scores = tl.where(g_idx == g, best[:, None], g_scores)
        keep_g = tl.zeros([ROWS, BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            pick = _argmax_first(tl.where(keep_g == 0, g_scores, float("-inf")), tl.arange(0, BLOCK_G), BLOCK_G)
            keep_g = tl.where(g_idx == pick[:, None], 1, keep_g)
        keep = tl.zeros([ROWS, BLOCK_E], dtype=tl.int32)
        for g in tl.static_range(NUM_GROUP):
            kept = tl.sum(tl.where(g_idx == g, keep_g, 0), axis=1)
            keep = tl.where((gid == g) & (kept[:, None] > 0), 1, keep)
        fill = float("-inf") if SCORE > 0 else 0.0
        choice = tl.where(okr, tl.where(keep > 0, choice, fill), float("-inf"))

    k_idx = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
    taken = tl.zeros([ROWS, BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        # NaN scores match no maximum (BLOCK_E comes back): keep the id in range, so the experts never read past E
        pick = tl.minimum(_argmax_first(tl.where(taken == 0, choice, float("-inf")), e, BLOCK_E), E - 1)[:, None]
        taken = tl.where(er == pick, 1, taken)
        weights = tl.where(k_idx == j, tl.sum(tl.where(er == pick, scores, 0.0), axis=1)[:, None], weights)
        ids = tl.where(k_idx == j, pick, ids)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    return weights * scaling, ids


@triton.jit
def _moe_route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr,
    E, GROUP_SIZE, s_l, s_w, s_i, scaling,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
    NUM_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
):
    scaling = tl.full([], scaling, tl.float32)  # Inductor passes Python floats as fp64
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    z = tl.load(logits_ptr + t * s_l + e, mask=ok, other=0.0).to(tl.float32)[None, :]
    weights, ids = _route_rows(z, e, ok, bias_ptr, E, GROUP_SIZE, scaling, 1, BLOCK_E, BLOCK_G, BLOCK_K, TOP_K,
                               NUM_GROUP, TOPK_GROUP, SCORE, HAS_BIAS, RENORM)
    k_idx = tl.arange(0, BLOCK_K)[None, :]
    k_ok = k_idx < TOP_K
    tl.store(w_ptr + t * s_w + k_idx, weights, mask=k_ok)
    tl.store(ids_ptr + t * s_i + k_idx, ids, mask=k_ok)


def route_meta(E: int, top_k: int, num_group: int, topk_group: int, scoring: str, has_bias: bool,
               renormalize: bool) -> dict:
    """The routing constexprs of :func:`_route_rows` for these routing constants."""
    return dict(BLOCK_E=triton.next_power_of_2(E), BLOCK_G=max(2, triton.next_power_of_2(num_group)),
                BLOCK_K=max(2, triton.next_power_of_2(top_k)), TOP_K=top_k, NUM_GROUP=num_group,
                TOPK_GROUP=topk_group, SCORE=SCORE_CODES[scoring], HAS_BIAS=has_bias, RENORM=renormalize)


def _launch(logits: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int, scoring: str,
            renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract."""
    T, E = logits.shape
    if E > MAX_EXPERTS:
        raise ValueError(f"{OP}: backend 'triton' routes at most {MAX_EXPERTS} experts, got {E}; "
                         "use backend 'reference'")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, ids
    logits = last_dim_contiguous(logits)
    bias_arg = logits if bias is None else bias.contiguous()
    wrap_triton(_moe_route_kernel)[(T,)](
        logits, bias_arg, weights, ids, E, E // num_group, logits.stride(0), weights.stride(0), ids.stride(0),
        float(scaling), **route_meta(E, top_k, num_group, topk_group, scoring, bias is not None, renormalize),
        num_warps=4,
    )
    return weights, ids


@triton_op("mla::moe_route_triton", mutates_args=())
def moe_route_triton(logits: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int,
                     scoring: str, renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """Triton ``mla::moe_route`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    if logits.device.type != "cuda" or logits.dtype == torch.float64:
        return torch.ops.mla.moe_route_ref(logits, bias, top_k, num_group, topk_group, scoring, renormalize,
                                           scaling)
    validate(logits, bias, top_k, num_group, topk_group, scoring)
    return _launch(logits, bias, top_k, num_group, topk_group, scoring, renormalize, scaling)
