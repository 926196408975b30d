"""On-paper memory plan of an MLA model over GPUs: weight bytes per rank, latent-cache bytes per token per rank,
and how many tokens and 32k-token sequences fit (see ``mla_compile.parallel`` for the layout convention).

Counted: every tensor of the HF DeepSeek V2/V3/V3.2 model (the dims come from ``MLAConfig``), plus V3's
router ``e_score_correction_bias`` (a buffer in HF, a tensor of the checkpoint). Not counted: the MTP layers
(``num_nextn_predict_layers``; plain generation does not load them), activations, CUDA graphs and communication
buffers (they come out of ``reserve_gib``).

Sharding: ``q_b_proj``/``q_proj``, ``kv_b_proj`` and ``o_proj`` split by heads over ``attn_tp``; ``q_a_proj``,
``kv_a_proj_with_mqa``, norms, the router and the V3.2 indexer replicated; dense MLPs and shared experts split
over ``tp``; routed experts ``n_routed_experts / ep`` per rank, each split ``tp // ep`` ways; the embedding
vocab-parallel over ``attn_tp`` (replicated under full DP attention, as SGLang does), ``lm_head`` over ``tp``.
Under ``weight_dtype="fp8"`` the linears DeepSeek quantizes are 1 byte per value plus a float32 scale per
128x128 block of the rank's shard; embedding, ``lm_head``, router, norms and the indexer's ``weights_proj``
stay bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from mla_compile.models.cache import CacheLayout, fp8_index_row_bytes
from mla_compile.models.config import MLAConfig
from mla_compile.parallel import ParallelConfig

GIB = 2 ** 30
FP8_BLOCK = 128  # DeepSeek's weight_block_size [128, 128]
PARTS = ("attention", "indexer", "dense_mlp", "shared_experts", "routed_experts", "router", "embedding",
         "lm_head", "norms")


@dataclass(frozen=True)
class WeightTensor:
    """``copies`` tensors of shape ``[rows, cols]`` (a vector has ``cols == 1``), how they are split, and
    whether DeepSeek stores them in fp8.

    ``axis`` ("rows" or "cols", None when replicated) is split over the ``ParallelConfig`` property named by
    ``degree``; ``copies`` (experts) over the property named by ``copies_degree``.
    """

    name: str
    part: str
    rows: int
    cols: int
    copies: int
    quantized: bool = False
    axis: str | None = None
    degree: str | None = None
    copies_degree: str | None = None

    @property
    def numel(self) -> int:
        """Values over all copies (unsharded)."""
        return self.rows * self.cols * self.copies

    def rank_bytes(self, parallel: ParallelConfig, weight_dtype: str) -> int:
        """Bytes one rank holds (a vocab split that does not divide rounds up, as padded vocab shards do)."""
        rows, cols, copies = self.rows, self.cols, self.copies
        if self.axis is not None:
            d = getattr(parallel, self.degree)
            rows, cols = (-(-rows // d), cols) if self.axis == "rows" else (rows, -(-cols // d))
        if self.copies_degree is not None:
            copies //= getattr(parallel, self.copies_degree)
        if not (self.quantized and weight_dtype == "fp8"):
            return 2 * rows * cols * copies
        scales = -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)
        return (rows * cols + 4 * scales) * copies


def weight_tensors(config: MLAConfig) -> list[WeightTensor]:
    """Every weight tensor of the model described by ``config`` (MTP layers excluded)."""
    return list(_weight_tensors(config))


def _weight_tensors(c: MLAConfig) -> Iterator[WeightTensor]:
    L, H, heads = c.num_layers, c.hidden_size, c.num_heads
    dense = min(c.first_k_dense_replace, L) if c.n_routed_experts else L
    moe = L - dense
    W = WeightTensor
    if c.q_lora_rank is None:
        yield W("q_proj", "attention", heads * c.qk_head_dim, H, L, True, "rows", "attn_tp")
    else:
        yield W("q_a_proj", "attention", c.q_lora_rank, H, L, True)
        yield W("q_a_layernorm", "norms", c.q_lora_rank, 1, L)
        yield W("q_b_proj", "attention", heads * c.qk_head_dim, c.q_lora_rank, L, True, "rows", "attn_tp")
    yield W("kv_a_proj_with_mqa", "attention", c.latent_dim, H, L, True)
    yield W("kv_a_layernorm", "norms", c.kv_lora_rank, 1, L)
    yield W("kv_b_proj", "attention", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, L, True,
            "rows", "attn_tp")
    yield W("o_proj", "attention", H, heads * c.v_head_dim, L, True, "cols", "attn_tp")
    if c.is_sparse:  # V3.2 lightning indexer, replicated
        yield W("indexer.wq_b", "indexer", c.index_n_heads * c.index_head_dim, c.q_lora_rank or H, L, True)
        yield W("indexer.wk", "indexer", c.index_head_dim, H, L, True)
        yield W("indexer.k_norm", "indexer", c.index_head_dim, 2, L)  # LayerNorm weight and bias
        yield W("indexer.weights_proj", "indexer", c.index_n_heads, H, L)
    yield W("layernorms", "norms", H, 2, L)  # input_ and post_attention_layernorm
    yield from _mlp("dense_mlp", "dense_mlp", c.intermediate_size, H, dense, "tp")
    if moe:
        yield from _mlp("shared_experts", "shared_experts", c.n_shared_experts * c.moe_intermediate_size, H, moe,
                        "tp")
        yield from _mlp("experts", "routed_experts", c.moe_intermediate_size, H, moe * c.n_routed_experts,
                        "moe_tp", "ep")
        yield W("router.gate", "router", c.n_routed_experts, H, moe)
        if c.router_bias:
            yield W("router.e_score_correction_bias", "router", c.n_routed_experts, 1, moe)
    yield W("embed_tokens", "embedding", c.vocab_size, H, 1, False, "rows", "attn_tp")
    yield W("norm", "norms", H, 1, 1)
    yield W("lm_head", "lm_head", c.vocab_size, H, 1, False, "rows", "tp")


def _mlp(name: str, part: str, inter: int, hidden: int, copies: int, degree: str,
         copies_degree: str | None = None) -> Iterator[WeightTensor]:
    """A SwiGLU MLP: gate and up ``[inter, hidden]`` split by rows, down ``[hidden, inter]`` by columns."""
    if not inter or not copies:
        return
    yield WeightTensor(f"{name}.gate_up_proj", part, 2 * inter, hidden, copies, True, "rows", degree, copies_degree)
    yield WeightTensor(f"{name}.down_proj", part, hidden, inter, copies, True, "cols", degree, copies_degree)


def parameter_count(config: MLAConfig, *, activated: bool = False) -> int:
    """Parameters of the model (MTP layers excluded); with ``activated``, those one token uses: routed experts
    counted ``num_experts_per_tok`` per MoE layer instead of ``n_routed_experts``."""
    total = 0
    for t in weight_tensors(config):
        n = t.numel
        if activated and t.part == "routed_experts":
            n = n // config.n_routed_experts * config.num_experts_per_tok
        total += n
    return total


def kv_bytes_per_token(config: MLAConfig, kv_dtype: str = "bf16") -> int:
    """Cache bytes of one token over all layers, before any split: the latent rows (``CacheLayout``: 1152 B
    per layer in bf16, 656 in fp8) plus, for V3.2, the indexer's key rows (bf16, or 132 B fp8 rows)."""
    total = CacheLayout(config, kv_dtype).bytes_per_token
    if config.is_sparse:
        index_row = fp8_index_row_bytes(config.index_head_dim) if kv_dtype == "fp8" else 2 * config.index_head_dim
        total += index_row * config.num_layers
    return total


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of one rank (every rank of a layout holds the same amounts).

    ``weight_bytes_by_part`` maps each of ``PARTS`` to this rank's bytes; ``kv_bytes_per_token`` is what one
    token of context costs each rank of its attention group (the whole row, divided by ``dcp``);
    ``tokens_per_group`` the context tokens one attention group holds in ``cache_bytes``;
    ``total_tokens`` those of all ``dp_attention`` groups; ``batch_at(context)`` the sequences of that length
    that fit at once.
    """

    config: MLAConfig
    parallel: ParallelConfig
    weight_dtype: str
    kv_dtype: str
    gpu_bytes: int
    reserve_bytes: int
    weight_bytes_by_part: dict[str, int]
    kv_bytes_per_token: float

    @property
    def weight_bytes(self) -> int:
        """All weight bytes on this rank."""
        return sum(self.weight_bytes_by_part.values())

    @property
    def cache_bytes(self) -> int:
        """Bytes left for the latent cache: GPU memory less the reserve and the weights (may be negative)."""
        return self.gpu_bytes - self.reserve_bytes - self.weight_bytes

    @property
    def tokens_per_group(self) -> int:
        """Context tokens one attention group holds (0 when the weights do not fit)."""
        row = kv_bytes_per_token(self.config, self.kv_dtype)
        return max(self.cache_bytes, 0) * self.parallel.dcp // row

    @property
    def total_tokens(self) -> int:
        """Context tokens of the whole deployment: ``tokens_per_group * dp_attention``."""
        return self.tokens_per_group * self.parallel.dp_attention

    def batch_at(self, context: int = 32768) -> int:
        """Sequences of ``context`` tokens that fit at once (whole sequences per attention group)."""
        return self.tokens_per_group // context * self.parallel.dp_attention


def plan_memory(config: MLAConfig, parallel: ParallelConfig, *, gpu_mem_gib: float, weight_dtype: str = "fp8",
                kv_dtype: str = "bf16", reserve_gib: float | None = None) -> MemoryPlan:
    """Plan one rank of ``config`` laid out as ``parallel`` on GPUs of ``gpu_mem_gib`` GiB.

    ``weight_dtype`` "fp8" (DeepSeek's block-quantized checkpoint) or "bf16"; ``kv_dtype`` "bf16" or "fp8"
    (the 656-byte rows); ``reserve_gib`` is kept for activations, CUDA graphs and communication buffers
    (default 10% of the GPU, vLLM's ``gpu_memory_utilization=0.9``). Raises ``ValueError`` for unknown dtypes,
    a negative size or a layout that does not divide the model (``ParallelConfig.validate_for``).
    """
    if weight_dtype not in ("fp8", "bf16"):
        raise ValueError(f"weight_dtype must be 'fp8' or 'bf16', got {weight_dtype!r}")
    if kv_dtype not in ("fp8", "bf16"):
        raise ValueError(f"kv_dtype must be 'bf16' or 'fp8', got {kv_dtype!r}")
    reserve_gib = 0.1 * gpu_mem_gib if reserve_gib is None else reserve_gib
    if gpu_mem_gib <= 0 or reserve_gib < 0:
        raise ValueError(f"gpu_mem_gib must be > 0 and reserve_gib >= 0, got {gpu_mem_gib} and {reserve_gib}")
    parallel.validate_for(config)
    by_part = dict.fromkeys(PARTS, 0)
    for t in weight_tensors(config):
        by_part[t.part] += t.rank_bytes(parallel, weight_dtype)
    return MemoryPlan(config, parallel, weight_dtype, kv_dtype, int(gpu_mem_gib * GIB), int(reserve_gib * GIB),
                      by_part, kv_bytes_per_token(config, kv_dtype) / parallel.dcp)


def format_plan(plan: MemoryPlan, title: str = "", context: int = 32768) -> str:
    """A short per-rank table of ``plan`` (GiB are 2**30 bytes)."""
    p = plan.parallel
    lines = [title or f"tp={p.tp} dp_attention={p.dp_attention} ep={p.ep} dcp={p.dcp} "
             f"({p.world_size} ranks), weights {plan.weight_dtype}, kv cache {plan.kv_dtype}; per rank:"]
    rows = [(f"weights {part}", f"{b / GIB:8.2f} GiB") for part, b in plan.weight_bytes_by_part.items() if b]
    rows += [("weights total", f"{plan.weight_bytes / GIB:8.2f} GiB"),
             ("reserve", f"{plan.reserve_bytes / GIB:8.2f} GiB"),
             ("kv cache budget", f"{plan.cache_bytes / GIB:8.2f} GiB"),
             ("kv bytes / token", f"{plan.kv_bytes_per_token:8.1f}"),
             ("tokens / attention group", f"{plan.tokens_per_group:>8,}"),
             (f"tokens, all {p.dp_attention} group(s)", f"{plan.total_tokens:>8,}"),
             (f"batch at {context // 1024}k context", f"{plan.batch_at(context):>8,}")]
    lines += [f"  {name:<28}{value}" for name, value in rows]
    if plan.cache_bytes <= 0:
        lines.append("  the weights do not fit: raise tp or ep, or use fp8 weights")
    return "\n".join(lines)
