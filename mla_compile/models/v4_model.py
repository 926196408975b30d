"""DeepSeek-V4 over paged caches: :func:`patch_v4` turns an HF ``DeepseekV4ForCausalLM`` into a
compile-friendly model that runs flat token batches with explicit :class:`V4Metadata`.

Per layer (``config.layer_types``):
- ``sliding_attention``: the query attends to the ``sliding_window`` token rows ending at itself;
- ``compressed_sparse_attention`` (CSA, rate m = ``compress_rates[...]``, 4 in V4): plus the top
  ``index_topk`` compressed entries picked by the V4 lightning indexer (overlapping windows, 2m wide);
- ``heavily_compressed_attention`` (HCA, rate 128 in V4): plus every compressed entry the query may see.

Caches (all paged, :meth:`V4ForCausalLM.allocate_cache`): every layer's token rows ``kv [NB, BS, D]``
(``block_table``; only the last ``sliding_window`` positions are read, so blocks that left the window may
be freed by the block manager); compressed layers' entry cache ``[NBe, BS, D]`` (one row per m tokens,
``entry_tables[m]``) and, for CSA, the indexer's key cache ``[NBe, BS, index_head_dim]`` over the same
entry table; the compressors' partial-window state ``[S, R, Cin]`` (row ``state_slot[b]`` per sequence).
The ops are ``mla_compile.ops.v4_compress_write``, ``v4_index_topk`` and ``v4_attention``; the residual
streams use mHC (``hc_mult`` streams, Sinkhorn-normalised mixing), the MoE hash routing
(``tid2eid[input_ids]``) in ``hash_moe`` layers and ``scoring_func`` top-k routing elsewhere, experts
with the ``swiglu_limit`` clamp; all on static shapes without host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mla_compile import ops
from mla_compile.backends import requested_for
from mla_compile.models.attention import half_kernel, linears
from mla_compile.models.consts import freeze, thaw
from mla_compile.models.moe import combine_sorted, fp8_fused_refusal, sort_by_expert, swiglu
from mla_compile.models.region_schema import RegionalCompile, compile_region
from mla_compile.models.rope import rope_cos_sin, rotate_part
from mla_compile.ops import hc_pre, hc_sinkhorn, v4_attention, v4_compress_write, v4_index_topk, write_index_cache
from mla_compile.ops.hc_pre import hc_pre_math
from mla_compile.ops.moe_experts_fp8 import moe_experts_fp8
from mla_compile.ops.moe_gate_route import OP as GATE_ROUTE_OP
from mla_compile.ops.select import parse_backend_spec
from mla_compile.ops.v4_attention import compressed_slots, window_slots

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def is_v4_model(config) -> bool:
    """True for an HF DeepSeek-V4 config (``model_type == "deepseek_v4"``)."""
    return getattr(config, "model_type", None) == "deepseek_v4"


@dataclass
class V4Metadata:
    """One step's placement: ``query_seq [T]`` int32 batch row of each token (-1 = padding), ``seq_lens [B]``
    int32 context length incl. this step, ``block_table [B, max_blocks]`` int32 token-row blocks,
    ``slot_mapping [T]`` int64 token-row slot of each token (-1 = padding), ``entry_tables`` {rate:
    ``[B, max_entry_blocks]`` int32} compressed-entry blocks per compression rate, ``state_slot [B]`` int32
    compressor-state row of each sequence, ``logits_indices [R]`` (None: every token). A sequence's tokens
    are consecutive rows with consecutive positions."""

    query_seq: Tensor
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor
    state_slot: Tensor
    entry_tables: dict[int, Tensor] = field(default_factory=dict)
    logits_indices: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        """Every tensor (for moving or marking dynamic)."""
        out = [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)]
        return out + list(self.entry_tables.values())

    def mark_dynamic(self, input_ids: Tensor, positions: Tensor) -> None:
        """:func:`mark_dynamic` of a step with this metadata (what the CUDA-graph runner calls)."""
        mark_dynamic(input_ids, positions, self)

    def map_tensors(self, fn) -> "V4Metadata":
        """A copy with ``fn`` applied to every tensor."""
        mv = lambda t: None if t is None else fn(t)  # noqa: E731
        return V4Metadata(mv(self.query_seq), mv(self.seq_lens), mv(self.block_table), mv(self.slot_mapping),
                          mv(self.state_slot), {r: mv(t) for r, t in self.entry_tables.items()},
                          mv(self.logits_indices))

    def to(self, device) -> "V4Metadata":
        """A copy with every tensor on ``device`` (host planning builds on CPU, then moves once)."""
        return self.map_tensors(lambda t: t.to(device))

    def flat(self) -> tuple:
        """The metadata as a flat tuple (:meth:`from_flat` rebuilds it): the compression rates in order, then the
        tensors, the entry tables in that order. What a nested compile region takes, so that Dynamo can reuse one
        traced region for every layer (a dataclass argument is traced anew per call)."""
        rates = tuple(sorted(self.entry_tables))
        return (rates, self.query_seq, self.seq_lens, self.block_table, self.slot_mapping, self.state_slot,
                self.logits_indices, *(self.entry_tables[r] for r in rates))

    @staticmethod
    def from_flat(rates, query_seq, seq_lens, block_table, slot_mapping, state_slot, logits_indices, *tables
                  ) -> "V4Metadata":
        """The metadata :meth:`flat` gave."""
        return V4Metadata(query_seq, seq_lens, block_table, slot_mapping, state_slot, dict(zip(rates, tables)),
                          logits_indices)


def mark_dynamic(input_ids: Tensor, positions: Tensor, meta: V4Metadata) -> None:
    """Token count and batch size dynamic: one compiled graph for every batch size and length."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (input_ids, positions, meta.query_seq, meta.slot_mapping):
        mark(t, 0)
    for t in (meta.seq_lens, meta.block_table, meta.state_slot, *meta.entry_tables.values()):
        mark(t, 0)
    for t in (meta.block_table, *meta.entry_tables.values()):  # table widths follow the longest context
        mark(t, 1)
    if meta.logits_indices is not None:
        mark(meta.logits_indices, 0)


def _norm_eps(norm: nn.Module) -> float:
    """The epsilon of HF's ``DeepseekV4UnweightedRMSNorm``: ``variance_epsilon`` from transformers 5.25, ``eps``
    before."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _rms(x: Tensor, eps: float) -> Tensor:
    """Unweighted RMSNorm over the last dim (HF ``DeepseekV4UnweightedRMSNorm``)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_rotation(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """The rotation V4's RoPE applies at ``positions [T]``: ``[2, T, rope_dim / 2]`` float32, the cosines then the
    sines of each pair's angle ``position * inv_freq`` (made once a step, outside the layers, so that no layer's
    kernel evaluates them again per head and channel): :func:`~mla_compile.models.rope.rope_cos_sin`'s pair."""
    return torch.stack(rope_cos_sin(inv_freq, positions))


def rope_interleaved(x: Tensor, rot: Tensor) -> Tensor:
    """V4 RoPE: rotate the trailing ``2 * rot.shape[-1]`` channels of ``x [T, ..., D]`` as interleaved pairs by
    :func:`rope_rotation`'s ``rot [2, T, rope_dim / 2]`` (HF's ``x cos + rotate_half(x) sin``, in float32 or x's
    wider dtype; the leading channels unchanged; x's dtype out): :func:`~mla_compile.models.rope.rotate_part`, one
    element-wise expression that Inductor fuses with the norm before it."""
    return rotate_part(x, rot[0], rot[1], interleave=True, leading=False)


def _own_backend(op: str, backend: str | None) -> str:
    """The backend a V4 op runs with, from ``backend`` (a name or a per-op spec, ``"v4_attention=triton,hc_pre=triton"``;
    None: not read from ``MLA_COMPILE_BACKEND`` here): the name it gives ``op`` (a single name: every V4 op; one the
    op lacks: "reference"), else "auto" once the op's reference is declared GPU-tested, else "reference"."""
    from mla_compile.ops.registry import backends_for

    table = backends_for(op)
    parsed = parse_backend_spec(backend)
    name = parsed.get(op, parsed.get("*", "auto"))
    if name != "auto":
        return name if name in table else "reference"
    return "auto" if table["reference"].gpu_tested else "reference"


class V4Attention(nn.Module):
    """Paged V4 attention sharing the HF ``DeepseekV4Attention``'s weights (and its compressor's)."""

    def __init__(self, hf_attn: nn.Module, config, backend: str | None = None) -> None:
        super().__init__()
        self.hf = hf_attn
        self.layer_type = hf_attn.layer_type
        self.num_heads, self.head_dim = hf_attn.num_heads, hf_attn.head_dim
        self.window = config.sliding_window
        self.o_groups = hf_attn.o_a_proj.n_groups  # config.o_groups, or a rank's share of them (head split)
        self._eps, self._scale = freeze(config.rms_norm_eps), freeze(hf_attn.scaling)  # constants (models/consts.py)
        self.rate = config.compress_rates[self.layer_type] if self.layer_type != SLIDING else 0
        comp = getattr(hf_attn, "compressor", None) if self.layer_type != SLIDING else None
        index = getattr(comp, "indexer", None)
        # the compressor's and its indexer's norm epsilons, constants (models/consts.py); None where they have none
        self._comp_eps = None if comp is None else freeze(comp.kv_norm.variance_epsilon)
        self._index_eps = None if index is None else freeze(index.kv_norm.variance_epsilon)
        self.index_topk = config.index_topk
        self.backend = _own_backend("v4_attention", backend)
        # the slots each query row lists, the timing class "auto" ranks v4_attention by: fixed for a sliding
        # layer (its window) and a CSA layer (window + top-k); an HCA layer's grows with the context (None)
        self.slots = {SLIDING: self.window, CSA: self.window + self.index_topk}.get(self.layer_type)
        self.compress_backend = _own_backend("v4_compress_write", backend)
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        self.kv_cache: Tensor | None = None
        self.comp_cache: Tensor | None = None
        self.index_cache: Tensor | None = None
        self.state: dict[str, tuple[Tensor, Tensor]] = {}

    def forward(self, x: Tensor, positions: Tensor, rot: Tensor, inv_freq: Tensor, meta: V4Metadata) -> Tensor:
        """``x [T, hidden]`` (after the input norm) -> ``[T, hidden]``: :meth:`project`, :meth:`write`, then
        :meth:`attend`."""
        q, kv, comp_in, q_idx, w_idx = self.project(x, rot)
        self.write(kv, comp_in, positions, inv_freq, meta)
        return self.attend(q, q_idx, w_idx, positions, inv_freq, meta)

    def project(self, x: Tensor, rot: Tensor) -> tuple:
        """Every projection of ``x [T, hidden]`` (after the input norm) that the cache writes and the attention
        read, no cache access: ``(q [T, heads, head_dim] (normed, rotated), kv [T, head_dim] (normed, rotated),
        comp_in, q_idx, w_idx)``. ``comp_in``: the compressor's ``(kv, gate)`` projections, then (CSA) the indexer
        compressor's (an empty tuple in a sliding layer); ``q_idx [T, index_heads, index_head_dim]`` (rotated) and
        ``w_idx [T, index_heads]``: the indexer's query and head weights (CSA; None elsewhere). ``rot``:
        :func:`rope_rotation` at the tokens' positions with the layer's ``rope_kind`` frequencies."""
        a = self.hf
        T = x.shape[0]
        q_a, kv = linears(x, a.q_a_proj, a.kv_proj)
        q_res = a.q_a_norm(q_a)
        ix = a.compressor.indexer if self.layer_type == CSA else None
        q, *q_ix = linears(q_res, a.q_b_proj, *(() if ix is None else (ix.q_b_proj,)))
        q = rope_interleaved(_rms(q.view(T, self.num_heads, self.head_dim), thaw(self._eps)), rot)
        kv = rope_interleaved(a.kv_norm(kv), rot)
        if self.layer_type == SLIDING:
            return q, kv, (), None, None
        c = a.compressor
        comp_in = tuple(linears(x, c.kv_proj, c.gate_proj))
        if self.layer_type == HCA:
            return q, kv, comp_in, None, None
        q_idx = rope_interleaved(q_ix[0].view(T, ix.num_heads, ix.head_dim), rot)
        return (q, kv, comp_in + tuple(linears(x, ix.kv_proj, ix.gate_proj)), q_idx,
                linears(x, ix.scorer.weights_proj)[0])

    def write(self, kv: Tensor, comp_in: tuple, positions: Tensor, inv_freq: Tensor, meta: V4Metadata) -> None:
        """The layer's cache writes from :meth:`project`'s ``kv`` and ``comp_in``: the token rows, then (compressed
        layers) the compressor's entries and partial-window state, then (CSA) the indexer's keys and state."""
        write_index_cache(kv, meta.slot_mapping, self.kv_cache)  # a plain row write: [T, D] at token slots
        if self.layer_type == SLIDING:
            return
        a = self.hf
        table = meta.entry_tables[self.rate]
        c = a.compressor
        skv, sg = self.state["compressor"]
        v4_compress_write(comp_in[0], comp_in[1], meta.query_seq, positions, meta.state_slot, skv, sg,
                          c.position_bias, c.kv_norm.weight, inv_freq, self.comp_cache, table, rate=self.rate,
                          eps=thaw(self._comp_eps), overlap=self.layer_type == CSA, backend=self.compress_backend)
        if self.layer_type == CSA:
            ix = c.indexer
            ikv, ig = self.state["indexer"]
            v4_compress_write(comp_in[2], comp_in[3], meta.query_seq, positions, meta.state_slot, ikv, ig,
                              ix.position_bias, ix.kv_norm.weight, inv_freq, self.index_cache, table,
                              rate=self.rate, eps=thaw(self._index_eps), overlap=True, backend=self.compress_backend)

    def attend(self, q: Tensor, q_idx: Tensor | None, w_idx: Tensor | None, positions: Tensor, inv_freq: Tensor,
               meta: V4Metadata) -> Tensor:
        """The attention of :meth:`project`'s queries over the written caches (the window's token rows; the
        compressed entries the indexer picks (CSA) or every visible one (HCA)) and the output projections:
        ``[T, hidden]``. Reads the caches, writes nothing."""
        a = self.hf
        T = q.shape[0]
        bs = self.kv_cache.shape[1]
        ws = window_slots(meta.block_table, meta.query_seq, positions, block_size=bs, window=self.window)
        if self.layer_type == SLIDING:
            comp, cs = self.kv_cache, ws.new_full((T, 0), -1)
        else:
            comp = self.comp_cache
            table = meta.entry_tables[self.rate]
            if self.layer_type == HCA:
                cs = compressed_slots(table, meta.query_seq, positions, block_size=comp.shape[1], rate=self.rate)
            else:
                cs = v4_index_topk(q_idx, w_idx, self.index_cache, table, meta.seq_lens, meta.query_seq, positions,
                                   rate=self.rate, topk=self.index_topk)
        out, _ = v4_attention(q, self.kv_cache, ws, comp, cs, a.sinks, positions, inv_freq, thaw(self._scale),
                              backend=self.backend, slots=self.slots)
        grouped = a.o_a_proj(out.reshape(T, self.o_groups, -1)).flatten(1)
        return linears(grouped, a.o_b_proj)[0]


def _hc_consts(hc: nn.Module) -> tuple[float, float]:
    """The hyper-connection's ``(input norm eps, hc_eps)`` as graph constants: the texts :class:`V4ForCausalLM` keeps
    beside them (a float handed to an op must not become a graph input: ``consts.py``), else the floats themselves
    (an unpatched module)."""
    texts = getattr(hc, "mla_eps", None)
    if texts is not None:
        return thaw(texts[0]), thaw(texts[1])
    return float(_norm_eps(hc.input_norm)), float(hc.hc_eps)


def hyper_connection(hc: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """mHC weights of ``x [T, n, hidden]`` (HF ``DeepseekV4HyperConnection``'s parameters ``fn``, ``base``,
    ``scale``): ``(post [T, n], comb [T, n, n] doubly stochastic by Sinkhorn, collapsed [T, hidden])``:
    ``mla::hc_pre`` where the backend the model was patched with (``hc.mla_backend``, "auto" when unset) resolves to
    its Triton kernels, else the same math traced (its Sinkhorn rounds through ``mla::hc_sinkhorn``)."""
    norm_eps, eps = _hc_consts(hc)
    iters = hc.hc_sinkhorn_iters
    backend = getattr(hc, "mla_backend", "auto")
    if ops.resolve("hc_pre", x.device, backend, dtype=x.dtype).name != "reference":
        return hc_pre(x, hc.fn, hc.base, hc.scale, iters, norm_eps, eps, backend=backend)
    return hc_pre_math(x, hc.fn, hc.base, hc.scale, iters, norm_eps, eps, sinkhorn=hc_sinkhorn)


def hyper_mix(post: Tensor, comb: Tensor, block_out: Tensor, x: Tensor) -> Tensor:
    """``post ⊗ block_out + comb^T x``: the n streams ``[T, n, hidden]`` after a block, rounded as HF's block rounds
    them (``post`` and ``comb`` to x's dtype, ``comb^T x`` summed in float32 (float64 for float64 x) and rounded, then
    the sum). ``comb^T x`` is n multiply-adds over x's streams, not a batched GEMM of ``n x n`` matrices: under
    Inductor the whole mix is one element-wise kernel."""
    dt = x.dtype
    acc = torch.promote_types(dt, torch.float32)
    c = comb.to(dt).to(acc)
    mixed = c[:, 0, :, None] * x[:, 0, None, :].to(acc)
    for j in range(1, x.shape[-2]):
        mixed = torch.addcmul(mixed, c[:, j, :, None], x[:, j, None, :].to(acc))
    return post.to(dt).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed.to(dt)


def hyper_head(head: nn.Module, x: Tensor) -> Tensor:
    """Final collapse of the streams (HF ``DeepseekV4HyperHead``)."""
    flat = _rms(x.flatten(1).float(), _norm_eps(head.input_norm))
    pre = torch.sigmoid(F.linear(flat, head.hc_fn.float()) * head.hc_scale.float() + head.hc_base.float()) + head.eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def _swiglu(h: Tensor, act, limit: float) -> Tensor:
    """V4's clamped SwiGLU of the fused ``[gate | up]`` projection: ``act(min(gate, l)) * clamp(up, -l, l)``."""
    return swiglu(act, *h.chunk(2, dim=-1), limit)


def shared_mlp(mlp: nn.Module, x: Tensor) -> Tensor:
    """HF ``DeepseekV4MLP`` (the shared expert) on ``x [T, hidden]``: its gate and up projections in one
    :func:`~mla_compile.models.attention.linears` call (one GEMV launch for few rows on CUDA), the clamped SwiGLU,
    then the down projection through it too."""
    gate, up = linears(x, mlp.gate_proj, mlp.up_proj)
    return linears(swiglu(mlp.act_fn, gate, up, mlp.limit), mlp.down_proj)[0]


def experts_dense(x: Tensor, weights: Tensor, ids: Tensor, experts: nn.Module) -> Tensor:
    """Every expert on every token, combined by a ``[T, E]`` routing matrix (exact, static shapes, any device)."""
    combine = torch.zeros(x.shape[0], experts.num_experts, dtype=weights.dtype, device=x.device)
    combine = combine.scatter_add_(1, ids.long(), weights)
    h = torch.einsum("th,eih->eti", x, experts.gate_up_proj)
    y = torch.einsum("eti,ehi->eth", _swiglu(h, experts.act_fn, experts.limit), experts.down_proj)
    return torch.einsum("eth,te->th", y, combine.to(y.dtype))


def experts_grouped(x: Tensor, weights: Tensor, ids: Tensor, experts: nn.Module) -> Tensor:
    """Tokens sorted by expert through ``torch._grouped_mm``: each hit expert's weights read once (float32
    sum over the k picks, as :func:`mla_compile.models.moe.combine_sorted`)."""
    order, offs = sort_by_expert(ids, experts.num_experts)
    h = torch._grouped_mm(x[order // ids.shape[1]], experts.gate_up_proj.transpose(1, 2), offs=offs)
    act = _swiglu(h, experts.act_fn, experts.limit).contiguous()
    y = torch._grouped_mm(act, experts.down_proj.transpose(1, 2), offs=offs)
    return combine_sorted(y, order, weights)


# The gate scorings whose mla::moe_gate_route kernel passed its CUDA tests on a GPU (V3's sigmoid, V4-Flash's
# sqrtsoftplus); other scorings route in torch (a GEMV, the scores, torch.topk).
FUSED_ROUTER_SCORINGS: tuple[str, ...] = ("sigmoid", "sqrtsoftplus")


class V4MoE(nn.Module):
    """V4's MoE on static shapes: hash routing (``tid2eid[input_ids]``) or ``scoring_func`` top-k with the
    correction bias, normalised and scaled weights, experts with the ``swiglu_limit`` clamp (``impl``
    "dense": every expert on every token; "grouped": ``torch._grouped_mm`` over tokens sorted by expert;
    "auto": grouped for CUDA bf16), plus the shared expert. Shares the HF block's modules; experts that a
    quantized checkpoint loaded as :class:`~mla_compile.models.fp8_linear.FP8Experts` run in
    ``mla::moe_experts_fp8`` where it serves them (weight-only SiLU, no backend of their own), else through their
    own forward, as :class:`~mla_compile.models.fp4_linear.FP4Experts` do (``mla::moe_experts_fp4``), clamp
    included. ``scoring``: the config's ``scoring_func``; where it is one of :data:`FUSED_ROUTER_SCORINGS`, a
    top-k layer's router GEMV and routing run as one ``mla::moe_gate_route`` on CUDA half precision (see
    :meth:`route`)."""

    def __init__(self, hf_moe: nn.Module, impl: str = "auto", scoring: str | None = None) -> None:
        super().__init__()
        if impl not in ("auto", "dense", "grouped"):
            raise ValueError(f"impl must be 'auto', 'dense' or 'grouped', got {impl!r}")
        self.hf = hf_moe
        self.is_hash = hf_moe.is_hash
        self.impl = impl
        self.scoring = scoring

    def gate_route(self, x: Tensor) -> bool:
        """Whether :meth:`route` runs ``mla::moe_gate_route`` (router GEMV and routing in one launch for few tokens,
        float32 logits): a top-k layer of a scoring in :data:`FUSED_ROUTER_SCORINGS`, x and the gate's weight CUDA
        half precision and that op's "auto" picking "triton". A constant of the graph."""
        return (not self.is_hash and self.scoring in FUSED_ROUTER_SCORINGS
                and half_kernel(GATE_ROUTE_OP, x, None, self.hf.gate.weight) == "triton")

    def route(self, x: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(weights [T, top_k], expert ids [T, top_k])`` of tokens ``x [T, hidden]``: the experts by
        ``tid2eid[input_ids]`` in a hash-routed layer, else the top-k of the gate's scores (the bias only picks),
        the weights their normalised scores times ``routed_scaling_factor``, as the HF gate (where
        :meth:`gate_route`: ``mla::moe_gate_route``'s float32 weights and int32 ids)."""
        g = self.hf.gate
        if self.gate_route(x):
            return ops.moe_gate_route(x, g.weight, g.top_k, bias=g.e_score_correction_bias, scoring=self.scoring,
                                      renormalize=True, scaling=g.routed_scaling_factor)
        scores = g.score_fn(F.linear(x, g.weight))
        if self.is_hash:
            ids = g.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + g.e_score_correction_bias, g.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * g.routed_scaling_factor, ids

    def routed(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` over the HF block's experts (``impl``'s form): ``[T,
        hidden]``, float32 sums for float experts."""
        grouped = self.impl == "grouped" or (self.impl == "auto" and x.is_cuda and x.dtype == torch.bfloat16
                                             and hasattr(torch, "_grouped_mm"))
        experts = self.hf.experts
        if getattr(experts, "is_fp8_block", False) and fp8_fused_refusal(experts) is None:  # fused or grouped
            return moe_experts_fp8(x, weights.float(), ids, experts.gate_proj, experts.gate_proj_scale_inv,
                                   experts.up_proj, experts.up_proj_scale_inv, experts.down_proj,
                                   experts.down_proj_scale_inv, swiglu_limit=experts.swiglu_limit, out_float32=True)
        if getattr(experts, "is_fp8_block", False) or getattr(experts, "is_fp4_block", False):
            return experts(x, weights, ids, grouped=grouped)  # FP8Experts / FP4Experts of a quantized checkpoint
        return (experts_grouped if grouped else experts_dense)(x, weights, ids, experts)

    def forward(self, x: Tensor, input_ids: Tensor) -> Tensor:
        weights, ids = self.route(x, input_ids)
        return self.routed(x, weights, ids).to(x.dtype) + shared_mlp(self.hf.shared_experts, x)


class V4ForCausalLM(RegionalCompile, nn.Module):
    """DeepSeek-V4 causal LM over paged caches; parameter names match the HF model's.

    ``forward(input_ids [T], positions [T], meta) -> logits [R, vocab]``.
    """

    def __init__(self, hf_model: nn.Module, backend: str | None = None, moe_impl: str = "auto") -> None:
        super().__init__()
        self.config = hf_model.config
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        rot = self.model.rotary_emb
        for kind in ("main", "compress"):
            self.register_buffer(f"{kind}_inv_freq", getattr(rot, f"{kind}_inv_freq").detach().float().clone(),
                                 persistent=False)
            if float(getattr(rot, f"{kind}_attention_scaling")) != 1.0:
                raise NotImplementedError(f"DeepSeek-V4 rope '{kind}' with attention scaling != 1 is not supported")
        self.attn = nn.ModuleList(V4Attention(l.self_attn, self.config, backend) for l in self.model.layers)
        self.moe = nn.ModuleList(V4MoE(l.mlp, moe_impl, self.config.scoring_func) for l in self.model.layers)
        hc_backend = requested_for("hc_pre", backend)  # "hc_pre=triton" asks for the kernels by name
        for layer in self.model.layers:  # the mHC ops' epsilons as graph constants (see _hc_consts)
            for hc in (layer.attn_hc, layer.ffn_hc):
                hc.mla_eps = (freeze(_norm_eps(hc.input_norm)), freeze(hc.hc_eps))
                hc.mla_backend = hc_backend

    @property
    def rates(self) -> list[int]:
        """The compression rates in use (the keys of ``V4Metadata.entry_tables``)."""
        return sorted({a.rate for a in self.attn if a.rate})

    def allocate_cache(self, num_blocks: int, block_size: int, num_entry_blocks: int | dict[int, int],
                       max_seqs: int, *, dtype: torch.dtype | None = None, fill: float = 0.0) -> None:
        """Allocate every layer's paged caches and compressor state (``fill``: NaN in tests):
        ``num_blocks`` token-row blocks per layer, ``num_entry_blocks`` compressed-entry blocks per layer (one
        number, or one per compression rate), ``max_seqs`` compressor-state rows."""
        ref = self.lm_head.weight
        dt, dev = dtype or ref.dtype, ref.device
        full = lambda *s: torch.full(s, fill, dtype=dt, device=dev)  # noqa: E731
        for a in self.attn:
            D = a.head_dim
            a.kv_cache = full(num_blocks, block_size, D)
            a.state = {}
            if a.layer_type == SLIDING:
                continue
            n_entry = num_entry_blocks[a.rate] if isinstance(num_entry_blocks, dict) else num_entry_blocks
            a.comp_cache = full(n_entry, block_size, D)
            R = 2 * a.rate if a.layer_type == CSA else a.rate
            cin = 2 * D if a.layer_type == CSA else D
            a.state["compressor"] = (full(max_seqs, R, cin), full(max_seqs, R, cin))
            if a.layer_type == CSA:
                d = a.hf.compressor.indexer.head_dim
                a.index_cache = full(n_entry, block_size, d)
                a.state["indexer"] = (full(max_seqs, R, 2 * d), full(max_seqs, R, 2 * d))

    @torch.no_grad()
    def copy_cache_rows(self, state_rows: list[tuple[int, int]] = (),
                        entry_blocks: dict[int, list[tuple[int, int]]] | None = None) -> None:
        """Copy compressor-state rows ``(src, dst)`` in every compressed layer (compressor and indexer), and
        compressed-entry blocks ``(src, dst)`` per rate (entries and indexer keys) in the layers of that rate.
        Device-to-device copies queued between steps, in stream order (no host transfer, no sync): a prefix-cache
        snapshot and its restore."""
        for src, dst in state_rows:
            for a in self.attn:
                for pair in a.state.values():
                    for t in pair:
                        t[dst].copy_(t[src])
        for rate, pairs in (entry_blocks or {}).items():
            for src, dst in pairs:
                for a in self.attn:
                    if a.rate == rate:
                        for t in (a.comp_cache, a.index_cache):
                            if t is not None:
                                t[dst].copy_(t[src])

    def cache_sizes(self) -> tuple[int, int, dict[int, int], int] | None:
        """What :meth:`allocate_cache` made: ``(num_blocks, block_size, {rate: num_entry_blocks}, max_seqs)``
        (``max_seqs`` 0 for a model of sliding layers only); None before it ran."""
        first = self.attn[0].kv_cache
        if first is None:
            return None
        entries = {a.rate: a.comp_cache.shape[0] for a in self.attn if a.rate and a.comp_cache is not None}
        rows = [a.state["compressor"][0].shape[0] for a in self.attn if "compressor" in a.state]
        return first.shape[0], first.shape[1], entries, min(rows, default=0)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: V4Metadata) -> Tensor:
        """One step over ``T`` flat tokens; returns logits of ``meta.logits_indices`` (or every token).

        With ``regional_compile`` each layer runs as two nested compile regions with its cache writes between them
        (Inductor takes no mutating op inside a region): the attention's mHC collapse, input norm and projections
        (:meth:`V4Attention.project`), then :meth:`V4Attention.write`, then the attention over the caches, its mHC
        mix and the whole MoE block. ``torch.compile`` then compiles each region once per layer kind (attention
        type, hash or top-k routing) and calls it for every layer of that kind, so compile time hardly grows with
        depth; eager runs are unchanged."""
        m = self.model
        h = m.embed_tokens(input_ids)
        x = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        rot = {"main": rope_rotation(positions, self.main_inv_freq),
               "compress": rope_rotation(positions, self.compress_inv_freq)}
        inv = {"main": self.main_inv_freq, "compress": self.compress_inv_freq}
        if self.regional_compile:
            # a region's inputs may not alias each other (torch 2.11's invoke_subgraph refuses it) and a builder's
            # tensors may be views of one arena: the regions read copies (a few small copies a step)
            meta = meta.map_tensors(torch.clone)
            flat, ids, positions = meta.flat(), input_ids.clone(), positions.clone()
            for layer, attn, moe in zip(m.layers, self.attn, self.moe):
                post, comb, q, kv, q_idx, w_idx, *comp_in = _attention_in(layer, attn, x, rot[attn.rope_kind])
                attn.write(kv, tuple(comp_in), positions, inv[attn.rope_kind], meta)
                x = _attention_out_and_moe(layer, attn, moe, x, post, comb, q, q_idx, w_idx, positions,
                                           inv[attn.rope_kind], ids, *flat)
            return self._head(x, meta)
        for layer, attn, moe in zip(m.layers, self.attn, self.moe):
            post, comb, collapsed = hyper_connection(layer.attn_hc, x)
            out = attn(layer.input_layernorm(collapsed), positions, rot[attn.rope_kind], inv[attn.rope_kind], meta)
            x = hyper_mix(post, comb, out, x)
            post, comb, collapsed = hyper_connection(layer.ffn_hc, x)
            x = hyper_mix(post, comb, moe(layer.post_attention_layernorm(collapsed), input_ids), x)
        return self._head(x, meta)

    def _head(self, x: Tensor, meta: V4Metadata) -> Tensor:
        """The logits of the streams ``x [T, hc_mult, hidden]`` after the last layer (at ``meta.logits_indices``)."""
        h = self.model.norm(hyper_head(self.model.hc_head, x))
        if meta.logits_indices is not None:
            h = h[meta.logits_indices]
        return self.lm_head(h)


@compile_region
def _attention_in(layer: nn.Module, attn: V4Attention, x: Tensor, rot: Tensor) -> tuple:
    """A layer's first region: the attention's mHC weights and collapse of the streams ``x``, the input norm and
    :meth:`V4Attention.project`: ``(post, comb, q, kv, q_idx, w_idx, *comp_in)`` (no cache access)."""
    post, comb, collapsed = hyper_connection(layer.attn_hc, x)
    q, kv, comp_in, q_idx, w_idx = attn.project(layer.input_layernorm(collapsed), rot)
    return (post, comb, q, kv, q_idx, w_idx, *comp_in)


@compile_region
def _attention_out_and_moe(layer: nn.Module, attn: V4Attention, moe: "V4MoE", x: Tensor, post: Tensor, comb: Tensor,
                           q: Tensor, q_idx: Tensor | None, w_idx: Tensor | None, positions: Tensor, inv_freq: Tensor,
                           input_ids: Tensor, *flat_meta) -> Tensor:
    """A layer's second region, after its cache writes: :meth:`V4Attention.attend`, the attention's mHC mix into the
    streams ``x``, then the MoE block (its mHC collapse, norm, routing, experts and mix): the layer's output streams.
    ``flat_meta``: the step's :meth:`V4Metadata.flat`."""
    meta = V4Metadata.from_flat(*flat_meta)
    x = hyper_mix(post, comb, attn.attend(q, q_idx, w_idx, positions, inv_freq, meta), x)
    post, comb, collapsed = hyper_connection(layer.ffn_hc, x)
    return hyper_mix(post, comb, moe(layer.post_attention_layernorm(collapsed), input_ids), x)


def patch_v4(hf_model: nn.Module, *, backend: str | None = None, moe_impl: str = "auto") -> V4ForCausalLM:
    """Wrap an HF ``DeepseekV4ForCausalLM`` (weights shared, not copied) as a :class:`V4ForCausalLM`
    (``backend``: the attention ops' backend; ``moe_impl``: "auto", "dense" or "grouped" experts)."""
    if not is_v4_model(getattr(hf_model, "config", None)):
        raise ValueError(f"patch_v4() needs an HF DeepseekV4ForCausalLM, got {type(hf_model).__name__}")
    return V4ForCausalLM(hf_model, backend=backend, moe_impl=moe_impl)


class V4Sequences:
    """Host-side planner for tests and demos: fixed per-sequence block lists (token rows and compressed
    entries per rate), positions tracked on the host, one :class:`V4Metadata` per step. Planning happens
    before the step, never inside it."""

    def __init__(self, model: V4ForCausalLM, max_seqs: int, max_len: int, block_size: int, *, seed: int = 0,
                 fill: float = 0.0, pool_len: int | None = None) -> None:
        """Block tables for ``max_len`` tokens per sequence; caches sized for ``pool_len`` (default
        ``max_len``) tokens per sequence, so runs with different table widths can share cache sizes."""
        self.model, self.block_size = model, block_size
        pool_len = max(pool_len or max_len, max_len)
        nb, pool_nb = -(-max_len // block_size), -(-pool_len // block_size)
        rates = model.rates
        entries = lambda n: max([-(-(n // r) // block_size) for r in rates] + [1])  # noqa: E731
        ne, pool_ne = entries(max_len), entries(pool_len)
        g = torch.Generator().manual_seed(seed)
        self.tables = torch.randperm(max_seqs * pool_nb, generator=g)[: max_seqs * nb].view(max_seqs, nb).to(torch.int32)
        self.entry = {r: torch.randperm(max_seqs * pool_ne, generator=g)[: max_seqs * ne].view(max_seqs, ne)
                      .to(torch.int32) for r in rates}
        model.allocate_cache(max_seqs * pool_nb, block_size, max_seqs * pool_ne, max_seqs, fill=fill)
        self.lens = [0] * max_seqs

    @torch.no_grad()
    def fork(self, src: int, dst: int) -> None:
        """Start sequence ``dst`` as a prefix-cache hit on all of ``src`` (which may end mid-window): full
        blocks are shared, the partly filled last block of the token rows and of each entry cache is copied
        (copy on write), and ``src``'s compressor state row is copied to ``dst``'s. Between steps, on the host."""
        L, bs = self.lens[src], self.block_size
        full, part = divmod(L, bs)
        self.tables[dst, :full] = self.tables[src, :full]
        copies = []  # (cache getter, src block, dst block)
        if part:
            copies.append(("kv_cache", int(self.tables[src, full]), int(self.tables[dst, full])))
        for r, t in self.entry.items():
            efull, epart = divmod(L // r, bs)
            t[dst, :efull] = t[src, :efull]
            if epart:
                copies.append((r, int(t[src, efull]), int(t[dst, efull])))
        for a in self.model.attn:
            for what, sb, db in copies:
                if what == "kv_cache":
                    a.kv_cache[db] = a.kv_cache[sb]
                elif what == a.rate:
                    for cache in (a.comp_cache, a.index_cache):
                        if cache is not None:
                            cache[db] = cache[sb]
            for skv, sg in a.state.values():
                skv[dst], sg[dst] = skv[src], sg[src]
        self.lens[dst] = L

    def metadata(self, seqs: list[int], chunks: list[list[int]]) -> tuple[Tensor, Tensor, V4Metadata]:
        """``(input_ids, positions, meta)`` for a step that appends ``chunks[i]`` to sequence ``seqs[i]``;
        logits are kept for each sequence's last token."""
        ids, pos, qseq, slots, last = [], [], [], [], []
        for b, (s, toks) in enumerate(zip(seqs, chunks)):
            for t in toks:
                p = self.lens[s]
                ids.append(t), pos.append(p), qseq.append(b)
                slots.append(int(self.tables[s, p // self.block_size]) * self.block_size + p % self.block_size)
                self.lens[s] += 1
            last.append(len(ids) - 1)
        idx = torch.tensor(seqs, dtype=torch.long)
        meta = V4Metadata(torch.tensor(qseq, dtype=torch.int32),
                          torch.tensor([self.lens[s] for s in seqs], dtype=torch.int32),
                          self.tables[idx].contiguous(), torch.tensor(slots, dtype=torch.long),
                          torch.tensor(seqs, dtype=torch.int32), {r: t[idx].contiguous() for r, t in self.entry.items()},
                          torch.tensor(last, dtype=torch.long))
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.int32), meta

    def step(self, model, seqs: list[int], chunks: list[list[int]]) -> Tensor:
        """Run one step through ``model`` (the V4ForCausalLM or a compiled one); logits ``[len(seqs), vocab]``. The
        step is planned on the host (:meth:`metadata`) and moved once to the device of the planner's model."""
        device = self.model.lm_head.weight.device
        ids, pos, meta = self.metadata(seqs, chunks)
        ids, pos, meta = ids.to(device), pos.to(device), meta.to(device)
        mark_dynamic(ids, pos, meta)
        return model(ids, pos, meta)
