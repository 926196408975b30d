"""MLA ops: ``torch.library`` custom ops (namespace ``mla``) with fake functions, torch references
that run on any device, and per-backend implementations chosen at trace time.

Importing this package registers every op. Public functions pick a backend and call its op.
"""

from mla_compile.ops._cache_tag import tag_compile_caches
from mla_compile.ops._checks import checked_mode, set_checked_mode
from mla_compile.ops.registry import backends_for
from mla_compile.ops.select import resolve
from mla_compile.ops.cache_write import write_latent_cache
from mla_compile.ops.context_attention import context_attention
from mla_compile.ops.decode import decode, decode_step_schedule
from mla_compile.ops.decode_absorb_out import decode_absorb_out
from mla_compile.ops import decode_autotune as _decode_autotune  # noqa: E402,F401  (registers backend "autotune")
from mla_compile.ops import fused_kv_write as _fused_kv_write  # noqa: E402,F401  (registers mla::write_latent_cache_fused)
from mla_compile.ops import absorb as _absorb  # noqa: E402,F401  (registers mla::absorb_q, mla::absorb_out)
from mla_compile.ops.fp4_block_linear import fp4_block_linear
from mla_compile.ops.fp8_block_linear import fp8_block_linear
from mla_compile.ops.fp8_block_linear_pair import fp8_block_linear_pair
from mla_compile.ops import fp8_block_linear_autotune as _fp8_block_linear_autotune  # noqa: E402,F401  (backend "autotune")
from mla_compile.ops.fp8_cache import decode_fp8, gather_latent_cache_fp8, write_latent_cache_fp8
from mla_compile.ops.gather import gather_latent_cache
from mla_compile.ops.merge import merge_attn_states
from mla_compile.ops.moe_experts import moe_experts
from mla_compile.ops.moe_experts_fp4 import moe_experts_fp4
from mla_compile.ops.moe_experts_fp8 import moe_experts_fp8
from mla_compile.ops.moe_gate_route import moe_gate_route
from mla_compile.ops.moe_norm_gate_route import moe_norm_gate_route
from mla_compile.ops.moe_route import moe_route
from mla_compile.ops.hc_pre import hc_pre
from mla_compile.ops.hc_sinkhorn import hc_sinkhorn
from mla_compile.ops.prefill import prefill
from mla_compile.ops.skinny_absorb import skinny_absorb_out, skinny_absorb_q
from mla_compile.ops.skinny_linear import skinny_linear
from mla_compile.ops.skinny_norm_linear import skinny_norm_linear
from mla_compile.ops import prefill_autotune as _prefill_autotune  # noqa: E402,F401  (registers backend "autotune")
from mla_compile.ops.sparse_decode import sparse_decode
from mla_compile.ops.sparse_index import (lightning_index, sink_window_indices, sink_window_query_indices, to_csr,
                                         write_index_cache)
from mla_compile.ops.v4_attention import v4_attention
from mla_compile.ops.v4_compress import v4_compress_write
from mla_compile.ops.v4_index import v4_index_topk
from mla_compile.ops.write_absorb_q import write_latent_cache_absorb_q
from mla_compile.ops import adapters  # noqa: E402,F401  (registers the peer-library backends; imports no peer)

__all__ = [
    "adapters", "backends_for", "checked_mode", "context_attention", "decode", "decode_absorb_out",
    "gather_latent_cache", "hc_pre", "hc_sinkhorn", "merge_attn_states", "prefill",
    "resolve", "set_checked_mode", "write_latent_cache",
    "decode_fp8", "fp4_block_linear", "fp8_block_linear", "fp8_block_linear_pair", "gather_latent_cache_fp8",
    "write_latent_cache_fp8",
    "moe_experts", "moe_experts_fp4", "moe_experts_fp8", "moe_gate_route", "moe_norm_gate_route", "moe_route", "skinny_linear",
    "skinny_norm_linear",
    "skinny_absorb_out", "skinny_absorb_q",
    "lightning_index", "sink_window_indices", "sink_window_query_indices", "sparse_decode", "to_csr", "write_index_cache",
    "v4_attention", "v4_compress_write", "v4_index_topk", "write_latent_cache_absorb_q",
]

tag_compile_caches()  # compile caches follow these ops' sources (schemas included): see _cache_tag
