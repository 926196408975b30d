"""FlashInfer (``flashinfer-python``) as backend ``"flashinfer"`` of ``mla::decode``, ``mla::prefill`` and
``mla::merge_attn_states``.

FlashInfer splits every call in two: ``wrapper.plan(...)`` runs on the host (it copies the indptr
arrays to the CPU and builds a schedule) and ``wrapper.run(...)`` only launches. Our ops must never
sync inside compiled or captured code, so the plan happens *outside* the op:

    plan = plan_flashinfer_decode(block_table_cpu, seq_lens_cpu, num_heads=16, block_size=64,
                                  scale=s, dtype=torch.bfloat16)          # host, before the step
    out, lse = ops.decode(q, cache, block_table, seq_lens, s, backend="flashinfer", plan=plan)

The metadata builder keeps one plan object per batch shape and re-plans it in place each step
(``plan=`` argument); the op receives the plan's static id, so a compiled graph stays valid across
steps. With ``use_cuda_graph=True`` the plan owns persistent index buffers (FlashInfer's CUDA-graph
mode): re-plan before every replay. The op checks the plan matches its inputs' static shapes; it
cannot check the *values* (that would sync), so the plan must be made from this step's metadata.

Boundary: FlashInfer's LSE is **base 2**; ours is natural log (decode asks the kernel for it; prefill ``x ln 2``).
Queries that see no key and padding rows get ``out = 0``, ``lse = -inf``: the decode kernel writes that itself
for a sequence without keys, so a one-row decode returns its outputs as they are (no kernel after it); with
more query rows (causal rows that see nothing) and in prefill our boundary kernel sets them. ``merge_state``
takes base-2 LSE too and would turn a ``-inf`` part with a NaN output into NaN, so empty parts are zeroed
before and fixed after.

The CPU contract tests (a fake ``flashinfer`` module that behaves as the H200's kernels) cover the calls; the
CUDA tests (``tests/ops/adapters/test_adapters_cuda.py``) the real library.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mla_compile.ops.decode import OP as DECODE_OP
from mla_compile.ops.decode import fake as decode_fake
from mla_compile.ops.decode import validate as validate_decode
from mla_compile.ops.merge import OP as MERGE_OP
from mla_compile.ops.merge import fake as merge_fake
from mla_compile.ops.merge import validate as validate_merge
from mla_compile.ops.prefill import OP as PREFILL_OP
from mla_compile.ops.prefill import fake as prefill_fake
from mla_compile.ops.prefill import validate as validate_prefill
from mla_compile.ops.registry import DEEPSEEK_DECODE, DEEPSEEK_PREFILL, LAYOUT_TAGS, SM80, declare
from mla_compile.ops.adapters._common import (LN2, LOG2E, check_dtype, finish_decode, finish_prefill, importable,
                                              plain_eager, prefill_has_keyless_rows, require_capability,
                                              workspace)

BACKEND = "flashinfer"
MODULE = "flashinfer"
DTYPES = (torch.float16, torch.bfloat16)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)

_PLANS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def available() -> bool:
    """Whether ``flashinfer`` is installed (found without importing it)."""
    return importable(MODULE)


def _host(t: Tensor) -> Tensor:
    return t.detach().to("cpu")  # a no-op for the CPU tensors the builder should pass


def _mismatch(kind: str, plan_id: int, want: dict) -> None:
    diffs = [f"{k}: planned {a}, got {b}" for k, (a, b) in want.items() if a != b]
    if diffs:
        raise ValueError(f"{kind} plan {plan_id} does not match this call ({'; '.join(diffs)}): re-plan it "
                         f"with this step's metadata before the step")


# ------------------------------------------------------------------------------------------ decode

@dataclass(eq=False)
class FlashInferDecodePlan:
    """FlashInfer MLA paged-decode plan for one batch (``plan_flashinfer_decode`` makes and re-plans it).

    Keep it alive while graphs that use it run; ``plan_id`` is what the op receives.
    """

    plan_id: int
    wrapper: Any
    batch_size: int
    query_len: int
    num_heads: int
    block_size: int
    kv_lora_rank: int
    rope_dim: int
    scale: float
    dtype: torch.dtype
    kv_dtype: torch.dtype
    use_cuda_graph: bool
    buffers: tuple[Tensor, ...] = field(default=(), repr=False)
    times_planned: int = 0

    def check(self, q: Tensor, kv_cache: Tensor, scale: float, kv_lora_rank: int) -> None:
        """ValueError when the static facts of a call differ from what was planned."""
        B, s_q, H, D = q.shape
        want = {"batch": (self.batch_size, B), "query_len": (self.query_len, s_q), "num_heads": (self.num_heads, H),
                "block_size": (self.block_size, kv_cache.shape[1]), "kv_lora_rank": (self.kv_lora_rank, kv_lora_rank),
                "rope_dim": (self.rope_dim, D - kv_lora_rank), "scale": (self.scale, scale),
                "q dtype": (self.dtype, q.dtype), "cache dtype": (self.kv_dtype, kv_cache.dtype)}
        _mismatch("FlashInfer decode", self.plan_id, want)


def plan_flashinfer_decode(block_table: Tensor, seq_lens: Tensor, *, num_heads: int, block_size: int, scale: float,
                           dtype: torch.dtype, kv_dtype: torch.dtype | None = None, query_len: int = 1,
                           kv_lora_rank: int = 512, rope_dim: int = 64, device: torch.device | str = "cuda",
                           plan: FlashInferDecodePlan | None = None, use_cuda_graph: bool = False,
                           workspace_bytes: int = WORKSPACE_BYTES) -> FlashInferDecodePlan:
    """Host-side plan of FlashInfer MLA decode for this step; call it before the step, outside compiled code.

    ``block_table [B, max_blocks]`` and ``seq_lens [B]`` (context incl. the ``query_len`` new tokens)
    should be CPU tensors (device ones are copied to the host: a sync). Pass the previous ``plan`` to
    re-plan it in place (same ``plan_id``, so compiled graphs keep working); with ``use_cuda_graph`` the
    plan's persistent buffers are sized by the first call's ``block_table`` and the batch size is fixed.
    Zero-length padding slots are passed on; their rows are set to 0 / -inf at the op's boundary.
    """
    bt, lens = _host(block_table), _host(seq_lens).long()
    if bt.dim() != 2 or lens.shape != (bt.shape[0],):
        raise ValueError(f"plan_flashinfer_decode: block_table must be [B, max_blocks] and seq_lens [B], got "
                         f"{list(bt.shape)} and {list(lens.shape)}")
    B = bt.shape[0]
    pages = (lens + block_size - 1) // block_size
    if B and int(pages.max()) > bt.shape[1]:
        raise ValueError(f"plan_flashinfer_decode: seq_lens need up to {int(pages.max())} blocks of {block_size}, "
                         f"block_table has {bt.shape[1]} columns")
    used = torch.arange(bt.shape[1])[None, :] < pages[:, None]
    kv_indices = bt[used].to(torch.int32)  # row-major: each sequence's blocks in order
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)]).to(torch.int32)
    qo_indptr = (torch.arange(B + 1) * query_len).to(torch.int32)
    kv_len = lens.to(torch.int32)
    kv_dtype = kv_dtype or dtype
    if plan is None:
        import flashinfer

        dev = torch.device(device)
        ws = workspace("flashinfer-float", dev, workspace_bytes)
        buffers: tuple[Tensor, ...] = ()
        if use_cuda_graph:
            sizes = (B + 1, B + 1, max(bt.numel(), 1), B)  # qo_indptr, kv_indptr, kv_indices, kv_len
            buffers = tuple(torch.empty(n, dtype=torch.int32, device=dev) for n in sizes)
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                ws, use_cuda_graph=True, qo_indptr=buffers[0], kv_indptr=buffers[1], kv_indices=buffers[2],
                kv_len_arr=buffers[3])
        else:
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws)
        plan = FlashInferDecodePlan(next(_IDS), wrapper, B, query_len, num_heads, block_size, kv_lora_rank, rope_dim,
                                    float(scale), dtype, kv_dtype, use_cuda_graph, buffers)
        _PLANS[plan.plan_id] = plan
    else:
        if plan.use_cuda_graph and (B != plan.batch_size or kv_indices.numel() > plan.buffers[2].numel()):
            raise ValueError(f"plan_flashinfer_decode: CUDA-graph plan {plan.plan_id} holds batch {plan.batch_size} "
                             f"and {plan.buffers[2].numel()} block ids, got batch {B} and {kv_indices.numel()}: "
                             f"make one plan per captured batch size")
        fixed = {"query_len": (plan.query_len, query_len), "num_heads": (plan.num_heads, num_heads),
                 "block_size": (plan.block_size, block_size), "kv_lora_rank": (plan.kv_lora_rank, kv_lora_rank),
                 "rope_dim": (plan.rope_dim, rope_dim), "scale": (plan.scale, float(scale)),
                 "dtype": (plan.dtype, dtype), "kv_dtype": (plan.kv_dtype, kv_dtype)}
        bad = [f"{k}: {a} -> {b}" for k, (a, b) in fixed.items() if a != b]
        if bad:
            raise ValueError(f"plan_flashinfer_decode: plan {plan.plan_id} was made for other static facts "
                             f"({'; '.join(bad)}); make a new plan")
        plan.batch_size = B
    plan.wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, kv_lora_rank, rope_dim, block_size,
                      query_len > 1, float(scale), dtype, kv_dtype)
    plan.times_planned += 1
    return plan


class FlashInferDecodePlanner:
    """One CUDA-graph plan per batch size behind one ``plan_id``: hand it to
    :class:`~mla_compile.serving.builder.MetadataBuilder` (``decode_planner=``), which calls it with each step's
    host ``block_table`` / ``seq_lens`` before the step (and before capture). The op picks the plan of
    the batch size it runs with, so one compiled graph serves every capture size without recompiling.
    """

    def __init__(self, *, num_heads: int, block_size: int, scale: float, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, query_len: int = 1, kv_lora_rank: int = 512, rope_dim: int = 64,
                 device: torch.device | str = "cuda", use_cuda_graph: bool = True,
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.plan_id = next(_IDS)
        self.facts = dict(num_heads=num_heads, block_size=block_size, scale=float(scale), dtype=dtype,
                          kv_dtype=kv_dtype, query_len=query_len, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                          device=device, use_cuda_graph=use_cuda_graph, workspace_bytes=workspace_bytes)
        self.plans: dict[int, FlashInferDecodePlan] = {}
        _PLANS[self.plan_id] = self

    def __call__(self, block_table: Tensor, seq_lens: Tensor) -> "FlashInferDecodePlanner":
        """(Re-)plan the batch size of ``block_table [B, max_blocks]`` (host tensors); returns ``self``."""
        B = block_table.shape[0]
        self.plans[B] = plan_flashinfer_decode(block_table, seq_lens, plan=self.plans.get(B), **self.facts)
        return self

    def plan_for(self, batch: int) -> FlashInferDecodePlan:
        """The plan of ``batch`` sequences (ValueError when that size was never planned)."""
        plan = self.plans.get(batch)
        if plan is None:
            raise ValueError(f"FlashInfer decode planner {self.plan_id} has no plan for batch {batch} (planned: "
                             f"{sorted(self.plans)}): the metadata builder plans each step before it runs")
        return plan


def _lookup(plan_id: int, kind: type):
    plan = _PLANS.get(plan_id)
    if not isinstance(plan, kind):
        raise ValueError(f"FlashInfer plan {plan_id} no longer exists (or is not a {kind.__name__}): keep the plan "
                         f"object alive while code that uses it runs")
    return plan


def flashinfer_decode_core(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                           kv_lora_rank: int, plan: FlashInferDecodePlan) -> tuple[Tensor, Tensor]:
    """The decode adapter on any tensors (CPU with a fake ``flashinfer`` in tests)."""
    validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    check_dtype(DECODE_OP, BACKEND, "q", q, DTYPES)
    check_dtype(DECODE_OP, BACKEND, "kv_cache", kv_cache, DTYPES)
    plan.check(q, kv_cache, scale, kv_lora_rank)
    B, s_q, H, _ = q.shape
    # strided views, no copies: the kernel takes q's token and head strides (only the last dim must be dense),
    # and it returns the natural-log LSE itself
    q_nope = q[..., :kv_lora_rank].reshape(B * s_q, H, kv_lora_rank)
    q_pe = q[..., kv_lora_rank:].reshape(B * s_q, H, -1)
    out, lse = plan.wrapper.run(q_nope, q_pe, kv_cache[..., :kv_lora_rank], kv_cache[..., kv_lora_rank:],
                                return_lse=True, return_lse_base_on_e=True)
    out, lse = out.view(B, s_q, H, kv_lora_rank), lse.view(B, s_q, H)
    if s_q == 1:
        # one query row: FlashInfer's outputs are our contract as they are (contiguous, float32 natural-log LSE,
        # and a sequence with no key gets 0 / -inf from the kernel itself: test_adapters_cuda checks it on
        # NaN-filled memory), so no boundary kernel follows it
        return out, lse
    return finish_decode(out, lse, seq_lens)


@torch.library.custom_op("mla::decode_flashinfer", mutates_args=(), tags=LAYOUT_TAGS)
def decode_flashinfer(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                      kv_lora_rank: int, plan_id: int) -> tuple[Tensor, Tensor]:
    """``mla::decode`` through FlashInfer's MLA paged decode, planned by ``plan_flashinfer_decode``."""
    require_capability(DECODE_OP, BACKEND, q.device, (8, 0))
    plan = _PLANS.get(plan_id)
    plan = plan.plan_for(q.shape[0]) if isinstance(plan, FlashInferDecodePlanner) else _lookup(plan_id, FlashInferDecodePlan)
    return flashinfer_decode_core(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, plan)


decode_flashinfer.register_fake(decode_fake)


def _decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
            plan: FlashInferDecodePlan | FlashInferDecodePlanner | None = None) -> tuple[Tensor, Tensor]:
    if not isinstance(plan, (FlashInferDecodePlan, FlashInferDecodePlanner)):
        raise ValueError(f"{DECODE_OP}: backend 'flashinfer' needs plan=FlashInferDecodePlan (made on the host by "
                         f"mla_compile.ops.adapters.flashinfer.plan_flashinfer_decode before the step) or a "
                         f"FlashInferDecodePlanner given to the MetadataBuilder, got "
                         f"{type(plan).__name__}; or use backend 'flashmla'/'triton'")
    return torch.ops.mla.decode_flashinfer(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, plan.plan_id)


declare(DECODE_OP, BACKEND, _decode, rank=30, available=available, head_dims=DEEPSEEK_DECODE, needs_plan=True,
        plan_id_fn=torch.ops.mla.decode_flashinfer, cuda_graph="planned", min_capability=SM80, package="flashinfer-python", gpu_tested=True,
        kernels=("decode_flashinfer",), note="plan_flashinfer_decode() on the host before each step")


# ------------------------------------------------------------------------------------------ prefill

_PREFILL_FACTS = ("sequences", "num_heads", "head_dim_qk", "head_dim_v", "scale", "causal", "dtype")


@dataclass(eq=False)
class FlashInferPrefillPlan:
    """FlashInfer ragged-prefill plan (``plan_flashinfer_prefill`` makes and re-plans it)."""

    plan_id: int
    wrapper: Any
    num_seqs: int
    num_heads: int
    head_dim_qk: int
    head_dim_v: int
    scale: float
    causal: bool
    dtype: torch.dtype
    total_q: int = 0  # cu_seqlens_q[-1] / cu_seqlens_k[-1] at plan time (host): FlashInfer wants exact row counts
    total_k: int = 0
    dead_rows: bool = True  # some query row sees no key (host lengths): the boundary kernel must zero it
    times_planned: int = 0

    def check(self, q: Tensor, v: Tensor, cu_seqlens_q: Tensor, scale: float, causal: bool) -> None:
        """ValueError when the static facts of a call differ from what was planned."""
        planned = (self.num_seqs, self.num_heads, self.head_dim_qk, self.head_dim_v, self.scale, self.causal,
                   self.dtype)
        got = (cu_seqlens_q.shape[0] - 1, q.shape[1], q.shape[2], v.shape[2], scale, causal, q.dtype)
        if planned != got:  # the message only on a mismatch (an eager call pays for every check)
            _mismatch("FlashInfer prefill", self.plan_id, dict(zip(_PREFILL_FACTS, zip(planned, got))))


def plan_flashinfer_prefill(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *, num_heads: int, head_dim_qk: int,
                            head_dim_v: int, scale: float, dtype: torch.dtype, causal: bool = True,
                            device: torch.device | str = "cuda", plan: FlashInferPrefillPlan | None = None,
                            workspace_bytes: int = WORKSPACE_BYTES) -> FlashInferPrefillPlan:
    """Host-side plan of FlashInfer ragged prefill (qk 192 / v 128 for DeepSeek); call it before the step.

    ``cu_seqlens_q/k [N + 1]`` should be CPU tensors (device ones are copied: a sync). Pass the
    previous ``plan`` to re-plan it in place.
    """
    cu_q, cu_k = _host(cu_seqlens_q).to(torch.int32), _host(cu_seqlens_k).to(torch.int32)
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape or cu_q.shape[0] < 1:
        raise ValueError(f"plan_flashinfer_prefill: cu_seqlens_q and cu_seqlens_k must both be [N + 1], got "
                         f"{list(cu_q.shape)} and {list(cu_k.shape)}")
    if plan is None:
        import flashinfer

        ws = workspace("flashinfer-float", torch.device(device), workspace_bytes)
        wrapper = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        plan = FlashInferPrefillPlan(next(_IDS), wrapper, cu_q.shape[0] - 1, num_heads, head_dim_qk, head_dim_v,
                                     float(scale), causal, dtype)
        _PLANS[plan.plan_id] = plan
    else:
        fixed = {"num_heads": (plan.num_heads, num_heads), "head_dim_qk": (plan.head_dim_qk, head_dim_qk),
                 "head_dim_v": (plan.head_dim_v, head_dim_v), "scale": (plan.scale, float(scale)),
                 "causal": (plan.causal, causal), "dtype": (plan.dtype, dtype)}
        bad = [f"{k}: {a} -> {b}" for k, (a, b) in fixed.items() if a != b]
        if bad:
            raise ValueError(f"plan_flashinfer_prefill: plan {plan.plan_id} was made for other static facts "
                             f"({'; '.join(bad)}); make a new plan")
        plan.num_seqs = cu_q.shape[0] - 1
    plan.total_q, plan.total_k = int(cu_q[-1]), int(cu_k[-1])
    plan.dead_rows = prefill_has_keyless_rows(cu_q, cu_k, causal)
    plan.wrapper.plan(cu_q, cu_k, num_heads, num_heads, head_dim_qk, head_dim_vo=head_dim_v, causal=causal,
                      sm_scale=float(scale), q_data_type=dtype, kv_data_type=dtype)
    plan.times_planned += 1
    return plan


class FlashInferPrefillPlanner:
    """One re-planned FlashInfer ragged-prefill plan behind one ``plan_id``: hand it to
    :class:`~mla_compile.serving.builder.MetadataBuilder` (``prefill_planner=``), which calls it with each step's host
    ``cu_seqlens_q`` / ``cu_seqlens_k`` before the step; it rides along as ``PrefillMetadata.plan``, the same
    object every step, so a compiled graph holds one constant and the op reads the current plan when it runs.
    (Prefill is never captured: FlashInfer's ragged prefill plans exact row counts on the host.)"""

    def __init__(self, *, num_heads: int, head_dim_qk: int, head_dim_v: int, scale: float, dtype: torch.dtype,
                 causal: bool = True, device: torch.device | str = "cuda",
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.plan_id = next(_IDS)
        self.facts = dict(num_heads=num_heads, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, scale=float(scale),
                          dtype=dtype, causal=causal, device=device, workspace_bytes=workspace_bytes)
        self.plan: FlashInferPrefillPlan | None = None
        _PLANS[self.plan_id] = self

    def __call__(self, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> "FlashInferPrefillPlanner":
        """(Re-)plan this step's prefill from host ``cu_seqlens_q/k [N + 1]``; returns ``self``."""
        self.plan = plan_flashinfer_prefill(cu_seqlens_q, cu_seqlens_k, plan=self.plan, **self.facts)
        return self

    def current(self) -> FlashInferPrefillPlan:
        """The plan of the step being run (ValueError before the first step was planned)."""
        if self.plan is None:
            raise ValueError(f"FlashInfer prefill planner {self.plan_id} has planned no step yet: the metadata "
                             f"builder plans each step before it runs")
        return self.plan


def flashinfer_prefill_core(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                            scale: float, causal: bool, plan: FlashInferPrefillPlan) -> tuple[Tensor, Tensor]:
    """The prefill adapter on any tensors (CPU with a fake ``flashinfer`` in tests)."""
    validate_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    check_dtype(PREFILL_OP, BACKEND, "q", q, DTYPES)
    plan.check(q, v, cu_seqlens_q, scale, causal)
    if q.shape[0] < plan.total_q or k.shape[0] < plan.total_k:
        raise ValueError(f"{PREFILL_OP}: FlashInfer plan {plan.plan_id} covers {plan.total_q} query / {plan.total_k} "
                         f"key rows but q has {q.shape[0]} and k {k.shape[0]}; re-plan for this step")
    # our API allows padding rows past cu[-1]; FlashInfer does not
    rows, tq, tk = q.shape[0], plan.total_q, plan.total_k
    if tq < rows:
        q = q[:tq]
    if tk < k.shape[0]:
        k, v = k[:tk], v[:tk]
    out, lse = plan.wrapper.run(q, k, v, return_lse=True)
    if tq < rows:
        out = torch.cat([out, out.new_zeros(rows - tq, *out.shape[1:])])
        lse = torch.cat([lse, lse.new_full((rows - tq, lse.shape[1]), float("-inf"))])
    # no padding rows and every row sees a key (the plan's host lengths): the boundary is one multiply instead
    # of the row-finding kernel (whose launch is most of an eager call's host time at small shapes)
    return finish_prefill(out, lse, cu_seqlens_q, cu_seqlens_k, causal, LN2, all_live=tq == rows and not plan.dead_rows)


@torch.library.custom_op("mla::prefill_flashinfer", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_flashinfer(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                       causal: bool, plan_id: int) -> tuple[Tensor, Tensor]:
    """``mla::prefill`` through FlashInfer's ragged prefill, planned by ``plan_flashinfer_prefill``."""
    plan = _PLANS.get(plan_id)
    plan = plan if isinstance(plan, FlashInferPrefillPlanner) else _lookup(plan_id, FlashInferPrefillPlan)
    return _prefill_body(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, plan)


def _prefill_body(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                  causal: bool, plan: FlashInferPrefillPlan | FlashInferPrefillPlanner) -> tuple[Tensor, Tensor]:
    """What ``mla::prefill_flashinfer`` runs, given the plan (or the planner, whose current plan it takes)."""
    require_capability(PREFILL_OP, BACKEND, q.device, (8, 0))
    plan = plan.current() if isinstance(plan, FlashInferPrefillPlanner) else plan
    return flashinfer_prefill_core(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, plan)


prefill_flashinfer.register_fake(prefill_fake)


def _prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
             causal: bool, plan: FlashInferPrefillPlan | FlashInferPrefillPlanner | None = None
             ) -> tuple[Tensor, Tensor]:
    if not isinstance(plan, (FlashInferPrefillPlan, FlashInferPrefillPlanner)):
        raise ValueError(f"{PREFILL_OP}: backend 'flashinfer' needs plan=FlashInferPrefillPlan (made on the host by "
                         f"mla_compile.ops.adapters.flashinfer.plan_flashinfer_prefill before the step) or a "
                         f"FlashInferPrefillPlanner given to the MetadataBuilder, got "
                         f"{type(plan).__name__}; or use backend 'sdpa-cudnn'/'triton'")
    if plain_eager(q, k, v, cu_seqlens_q, cu_seqlens_k):  # the op's body, without its dispatch layers' host time
        return _prefill_body(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, plan)
    return torch.ops.mla.prefill_flashinfer(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, plan.plan_id)


declare(PREFILL_OP, BACKEND, _prefill, rank=10, available=available, head_dims=DEEPSEEK_PREFILL, needs_plan=True,
        plan_id_fn=torch.ops.mla.prefill_flashinfer, cuda_graph="none", min_capability=SM80, package="flashinfer-python", gpu_tested=True,
        kernels=("prefill_flashinfer",), note="plan_flashinfer_prefill() on the host before each step")


# ------------------------------------------------------------------------------------------ merge

MERGE_MAX_DIM = 256


def flashinfer_merge_core(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The merge adapter on any tensors: natural-log LSE in and out, empty parts exact."""
    validate_merge(out_a, lse_a, out_b, lse_b)
    check_dtype(MERGE_OP, BACKEND, "out_a", out_a, DTYPES)
    if out_a.shape[-1] > MERGE_MAX_DIM:  # measured on the H200: D=512 fails at launch ("invalid argument")
        raise ValueError(f"{MERGE_OP}: backend 'flashinfer' takes head dims up to {MERGE_MAX_DIM} (out_a "
                         f"[..., D]), got D={out_a.shape[-1]}; use backend 'triton'")
    from flashinfer.cascade import merge_state

    empty_a, empty_b = torch.isneginf(lse_a), torch.isneginf(lse_b)
    zero = torch.zeros((), dtype=out_a.dtype, device=out_a.device)
    a = torch.where(empty_a[..., None], zero, out_a)  # 0 x NaN would leak through merge_state's weights
    b = torch.where(empty_b[..., None], zero, out_b)
    out, lse2 = merge_state(a, (lse_a * LOG2E).contiguous(), b, (lse_b * LOG2E).contiguous())
    both = (empty_a & empty_b)
    out = torch.where(both[..., None], zero, out)
    lse = torch.where(both, float("-inf"), lse2.to(torch.float32) * LN2)
    return out.contiguous(), lse.contiguous()


@torch.library.custom_op("mla::merge_attn_states_flashinfer", mutates_args=(), tags=LAYOUT_TAGS)
def merge_attn_states_flashinfer(out_a: Tensor, lse_a: Tensor, out_b: Tensor,
                                 lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """``mla::merge_attn_states`` through ``flashinfer.cascade.merge_state`` (same contract as the reference)."""
    return flashinfer_merge_core(out_a, lse_a, out_b, lse_b)


merge_attn_states_flashinfer.register_fake(merge_fake)


declare(MERGE_OP, BACKEND, torch.ops.mla.merge_attn_states_flashinfer, rank=20, available=available,
        max_head_dim=MERGE_MAX_DIM, min_capability=SM80, package="flashinfer-python", gpu_tested=True,
        note="merge_state (base-2 LSE converted at the boundary)")
