"""``mla::prefill``: non-absorbed varlen attention (qk 192 / v 128 for DeepSeek) returning LSE.

Contract: ragged ``q [T, H, Dqk]``, ``k [S, H, Dqk]``, ``v [S, H, Dv]``; sequence i owns query rows
``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``. With
``causal`` the mask is aligned bottom-right: local query j sees local keys ``<= j + len_k - len_q``
(so new tokens see all their context and themselves causally). Rows past ``cu_seqlens_*[-1]`` are
padding. Returns ``out [T, H, Dv]`` (q's dtype) and ``lse [T, H]`` (float32, natural log, token-major
like every LSE in mla_compile); a query that sees no key gets ``out = 0``, ``lse = -inf``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_range, check_same_device, check_tensor,
                                     data_checks_enabled)
from mla_compile.ops.registry import (FLOATS, LAYOUT_TAGS, SM90, call_impl, declare, declare_op, declare_split_op,
                                      run_split_part)
from mla_compile.ops.select import resolve
from mla_compile.ops._ragged import segments

OP = declare_op("prefill", "mla.prefill", env="all")


def validate(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool = True) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode. Causal attention needs at
    least as many keys as queries per sequence; non-causal (a context chunk) may have fewer."""
    if not _well_formed(q, k, v, cu_seqlens_q, cu_seqlens_k):
        _explain(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if data_checks_enabled(cu_seqlens_q):
        for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
            if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
                raise ValueError(f"{OP}: {name} must start at 0, be non-decreasing and end at most at {total} "
                                 f"(rows of the ragged tensor), got {cu.tolist()}")
        if causal:
            check_range(OP, "cu_seqlens_k - cu_seqlens_q", (cu_seqlens_k.diff() - cu_seqlens_q.diff()), 0, 1 << 62,
                        what="each sequence needs at least as many keys as queries when causal")


def _well_formed(q, k, v, cu_seqlens_q, cu_seqlens_k) -> bool:
    """Whether the arguments pass every check of :func:`_explain`, decided in one expression (an eager call pays
    for each check; the named ones run only when this says no). Never True where ``_explain`` would raise."""
    try:
        _, H, D = q.shape
        S, Hk, Dk = k.shape
        Sv, Hv, _ = v.shape
        (n,), (nk,) = cu_seqlens_q.shape, cu_seqlens_k.shape
    except (AttributeError, TypeError, ValueError):
        return False
    return all(isinstance(t, torch.Tensor) for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)) \
        and q.dtype in FLOAT_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype \
        and cu_seqlens_q.dtype in INDEX_DTYPES and cu_seqlens_k.dtype in INDEX_DTYPES \
        and Hk == H and Dk == D and Sv == S and Hv == H and nk == n and n >= 1 \
        and q.device == k.device == v.device == cu_seqlens_q.device == cu_seqlens_k.device


def _explain(q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
    """The shape / dtype / device checks one by one, raising the first failure with the argument named."""
    check_tensor(OP, "q", q, ndim=3, dtypes=FLOAT_DTYPES, expected="[T, H, qk_head_dim]")
    T, H, Dqk = q.shape
    check_tensor(OP, "k", k, ndim=3, dtypes=(q.dtype,), shape=(None, H, Dqk), expected=f"[S, {H}, {Dqk}], q's dtype")
    check_tensor(OP, "v", v, ndim=3, dtypes=(q.dtype,), shape=(k.shape[0], H, None), expected=f"[{k.shape[0]}, {H}, v_head_dim]")
    check_tensor(OP, "cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, expected="[N + 1] int32")
    check_tensor(OP, "cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=INDEX_DTYPES, shape=(cu_seqlens_q.shape[0],),
                 expected=f"[{cu_seqlens_q.shape[0]}] int32, one entry per cu_seqlens_q entry")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"{OP}: cu_seqlens_q must have at least one entry (0), got shape {list(cu_seqlens_q.shape)}")
    check_same_device(OP, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


@torch.library.custom_op("mla::prefill_ref", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                causal: bool) -> tuple[Tensor, Tensor]:
    """Reference (plain torch, any device, float32/float64 math): one masked [T, S] score matrix per head."""
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n = cu_seqlens_q.shape[0] - 1
    seq_q, loc_q = segments(cu_seqlens_q, q.shape[0])
    seq_k, loc_k = segments(cu_seqlens_k, k.shape[0])
    mask = (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] < n)
    if causal:
        idx = seq_q.clamp(max=max(n - 1, 0))
        offset = (cu_seqlens_k.diff().long() - cu_seqlens_q.diff().long())[idx] if n > 0 else torch.zeros_like(idx)
        mask &= loc_k[None, :] <= (loc_q + offset)[:, None]
    scores = torch.einsum("thd,shd->hts", q.to(acc), k.to(acc)) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, T]
    probs = torch.where(mask[None], torch.exp(scores - lse[..., None]), 0.0)
    # Padding key rows may hold anything, NaN included; their weight is 0 but 0 * NaN would still leak.
    v_live = torch.where((seq_k < n)[:, None, None], v.to(acc), 0.0)
    out = torch.einsum("hts,shd->thd", probs, v_live)
    return out.to(q.dtype).contiguous(), lse.transpose(0, 1).to(torch.float32).contiguous()


def fake(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, *backend_args):
    """Fake outputs shared by every prefill implementation: validate, then ``out [T, H, Dv]``, ``lse [T, H]``."""
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    T, H, _ = q.shape
    return q.new_empty(T, H, v.shape[-1]), q.new_empty(T, H, dtype=torch.float32)


prefill_ref.register_fake(fake)


declare(OP, "reference", torch.ops.mla.prefill_ref, rank=100, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        note="plain torch, the numerical ground truth")


def prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float, *,
            causal: bool = True, backend: str | None = None, plan: object | None = None) -> tuple[Tensor, Tensor]:
    """Varlen prefill attention; see the module docstring. Returns ``(out [T, H, Dv], lse [T, H])``.

    ``plan``: the host-side plan of backends that need one (``"flashinfer"``: made by
    ``mla_compile.ops.adapters.flashinfer.plan_flashinfer_prefill`` before the step).
    """
    impl = resolve(OP, q.device, backend, dtype=q.dtype, planned=plan is not None,
                   shape=lambda: (q.shape[1], (q.shape[2], v.shape[2]), 2))
    return call_impl(OP, impl, (q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal), plan)


@torch.library.custom_op("mla::prefill_split", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_split(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                  causal: bool, tiers: str, plan_id: int) -> tuple[Tensor, Tensor]:
    """``mla::prefill`` through the part of ``tiers`` (see :func:`~mla_compile.ops.registry.split_name`) whose
    bound covers this call's ``T`` query tokens; ``plan_id``: the host plan's id for a part that needs one."""
    return run_split_part(OP, tiers, q.shape[0], (q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal), plan_id)


prefill_split.register_fake(fake)
declare_split_op(OP, torch.ops.mla.prefill_split, "tokens")


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
            cu_seqlens_k: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.prefill  # noqa: F401  (registers mla::prefill_triton)
    return torch.ops.mla.prefill_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


declare(OP, "triton", _triton, rank=40, available=_triton_available, dtypes=FLOATS, package="triton", gpu_tested=True,
        autotune=True, kernels=("prefill_triton", "_prefill_kernel", "prefill_triton_config=triton (autotuned config)"),
        note="ours; portable path for ROCm/XPU")


def _triton_tma(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                cu_seqlens_k: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.prefill_tma  # noqa: F401  (registers mla::prefill_triton_tma)
    return torch.ops.mla.prefill_triton_tma(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


# Ranked after "triton": without timings "auto" keeps the pointer kernel.
declare(OP, "triton-tma", _triton_tma, rank=41, available=_triton_available, dtypes=(torch.bfloat16, torch.float16),
        min_capability=SM90, package="triton", gpu_tested=True,
        kernels=("prefill_triton_tma=triton-tma (opaque kernel)", "_prefill_tma_kernel",
                 "prefill_triton_tma_config=triton-tma (autotuned config)"),
        note="ours (sm_90+: q/k/v tiles through host-made TMA descriptors, 128 x 128 tiles); qk a power of two "
             "plus a power of two, v a power of two, 16-byte aligned rows (else the pointer kernel)")


def _gluon(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
           cu_seqlens_k: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.prefill_gluon  # noqa: F401  (registers mla::prefill_gluon)
    return torch.ops.mla.prefill_gluon(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


def _gluon_ws(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
              cu_seqlens_k: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.prefill_gluon  # noqa: F401  (registers mla::prefill_gluon_ws)
    return torch.ops.mla.prefill_gluon_ws(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


# Gluon sm_90 kernels (ops/triton/prefill_gluon.py); ranked after the Triton ones: "auto" takes them from timings.
_GLUON = dict(available=_triton_available, dtypes=(torch.bfloat16, torch.float16), min_capability=SM90,
              max_capability=SM90, package="triton", gpu_tested=True)
declare(OP, "gluon", _gluon, rank=42, **_GLUON,
        kernels=("prefill_gluon=gluon (opaque kernel)", "prefill_gluon_kernel"),
        note="ours (Gluon, sm_90: TMA ring of key/value tiles, wgmma with S in registers and P as a register A "
             "operand, 128 query rows a program); qk a power of two >= 64 plus one, v >= 64 (else 'triton-tma')")
declare(OP, "gluon-ws", _gluon_ws, rank=43, **_GLUON,
        kernels=("prefill_gluon_ws=gluon-ws (opaque kernel)", "prefill_gluon_ws_kernel"),
        note="as 'gluon', warp-specialized after FA3: a TMA producer warpgroup and two consumer warpgroups of 64 "
             "query rows each (128-key tiles)")
