"""Fake peer libraries for the adapter contract tests.

Each fake records every call (positional args and keywords), asserts what the real library requires
(head dims, dtypes, index dtypes, layouts), and answers with results computed by the float64
references of ``tests/ops/ref64.py`` in the *peer's* layout and LSE base, including the peer's
behaviour on rows it does not define (FA2: ``+inf`` LSE for rows without keys; unwritten padding rows
are NaN; ``merge_state`` turns an empty part into NaN). The adapters must turn all of that into our
contract. Installed with ``monkeypatch.setitem(sys.modules, ...)`` so nothing leaks between tests.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from ..ref64 import Paged, decode_ref64, merge_ref64, prefill_ref64
from ..ref_sparse import dequantize64, sparse_decode_ref64

LOG2E = 1.0 / math.log(2.0)
NAN, INF = float("nan"), float("inf")


def paged_from_tables(block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> Paged:
    """The ref64 ``Paged`` layout a block table and lengths describe (used blocks only)."""
    lens = [int(x) for x in seq_lens.tolist()]
    tables = tuple(tuple(int(b) for b in block_table[i, :-(-n // block_size)].tolist()) for i, n in enumerate(lens))
    return Paged(block_size, num_blocks, tuple(lens), tables, block_table.shape[1], -1)


def _lens(cu: torch.Tensor) -> list[int]:
    c = [int(x) for x in cu.tolist()]
    return [b - a for a, b in zip(c[:-1], c[1:])]


class Calls(list):
    """Recorded calls: ``(name, args, kwargs)``."""

    def named(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self if n == name]


# ------------------------------------------------------------------------------------------ flash_attn

def make_flash_attn(calls: Calls) -> types.ModuleType:
    mod = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        calls.append(("flash_attn_varlen_func", (q, k, v), dict(
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, return_attn_probs=return_attn_probs)))
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FA2 takes one head dim for q, k and v"
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        lq, lk = _lens(cu_seqlens_q), _lens(cu_seqlens_k)
        assert max(lq, default=0) <= max_seqlen_q and max(lk, default=0) <= max_seqlen_k
        out, lse = prefill_ref64(q, k, v, lq, lk, softmax_scale, causal)
        out = out.to(q.dtype)
        lse = lse.to(torch.float32)
        lse[lse == -INF] = INF  # FA2: rows that see no key
        written = int(cu_seqlens_q[-1])
        out[written:], lse[written:] = NAN, NAN  # rows past cu_seqlens_q[-1] are never written
        lse = lse.transpose(0, 1).contiguous()  # [H, total_q]
        return (out, lse, None) if return_attn_probs else out

    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


# ------------------------------------------------------------------------------------------ flash_mla

class FakeSchedMeta:
    """``flash_mla.FlashMLASchedMeta`` (sgl-flash-mla 1.0.0): filled by the first call."""

    def __init__(self):
        self.have_initialized = False
        self.config = None
        self.tile_scheduler_metadata = None
        self.num_splits = None


def make_flash_mla(calls: Calls) -> types.ModuleType:
    """The sgl-flash-mla 1.0.0 interface (``flash_mla_interface.py``) with the requirements its Python code
    and its legacy (sm90) extension enforce: sparse decode takes h_q 64 or 128 only ("Unsupported h_q"),
    fp8 caches, int32 indices (-1 = invalid, no upper-bound check); dense fp8 wants metadata from
    ``get_mla_decoding_metadata(..., is_fp8_kvcache=True, use_legacy=True)``, a 576-byte fp8 cache and
    ``descale_q``/``descale_k``; dense decode needs ``use_legacy=True``."""
    mod = types.ModuleType("flash_mla")

    def get_mla_metadata(*args, **kwargs):
        calls.append(("get_mla_metadata", args, kwargs))
        return FakeSchedMeta(), None

    def get_mla_decoding_metadata(seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False,
                                  topk=None, use_legacy=False):
        calls.append(("get_mla_decoding_metadata", (seqlens_k, num_q_tokens_per_head_k, h_k),
                      dict(h_q=h_q, is_fp8_kvcache=is_fp8_kvcache, topk=topk, use_legacy=use_legacy)))
        if is_fp8_kvcache and topk is None:
            assert use_legacy, "dense fp8 decoding exists only on the legacy side"
        assert seqlens_k.dtype == torch.int32 and seqlens_k.dim() == 1
        dev = seqlens_k.device
        # the legacy dense scheduler's row count: the SMs (off CUDA: the adapter's HOST_SM_COUNT) over the SMs
        # of a 64-row head tile, per KV head
        from mla_compile.ops.adapters.flashmla import HOST_SM_COUNT
        parts = HOST_SM_COUNT // h_k // -(-num_q_tokens_per_head_k // 64)
        return (torch.zeros(parts, 8, dtype=torch.int32, device=dev),
                torch.zeros(seqlens_k.shape[0] + 1, dtype=torch.int32, device=dev))

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                               attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                               extra_topk_length=None, enable_batch_invariant=False, use_legacy=False, kv_format=None,
                               descale_q=None, descale_k=None):
        if is_fp8_kvcache is None:  # the real default: inferred from ``indices``
            is_fp8_kvcache = indices is not None
        calls.append(("flash_mla_with_kvcache", (q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                 tile_scheduler_metadata),
                      dict(num_splits=num_splits, softmax_scale=softmax_scale, causal=causal,
                           is_fp8_kvcache=is_fp8_kvcache, indices=indices, use_legacy=use_legacy,
                           descale_q=descale_q, descale_k=descale_k, topk_length=topk_length,
                           schedule=getattr(tile_scheduler_metadata, "tile_scheduler_metadata", None))))
        meta = tile_scheduler_metadata
        assert isinstance(meta, FakeSchedMeta), "tile_scheduler_metadata must be of type FlashMLASchedMeta"
        assert num_splits is None, "num_splits must be None"
        B, s_q, H, D = q.shape
        assert q.dtype == torch.bfloat16 and D == 576 and head_dim_v == 512
        assert k_cache.dim() == 4 and k_cache.shape[1] == 64 and k_cache.shape[2] == 1
        if indices is None:
            assert use_legacy, "Dense MLA decoding was removed from the current kernels; pass use_legacy=True"
            if is_fp8_kvcache:  # the fork's sm90 dense fp8 extension: another format than the 656-byte rows
                assert meta.tile_scheduler_metadata is not None, (
                    "dense fp8 decoding needs metadata from get_mla_decoding_metadata(..., is_fp8_kvcache=True, "
                    "use_legacy=True) before the first call")
                assert k_cache.shape[3] == 576, "Only head_size_k == 576 is supported"
                assert descale_q is not None and descale_k is not None, "descale is required when input dtype is fp8"
                raise NotImplementedError("fake flash_mla: the per-tensor-scale dense fp8 format is not modelled")
        if meta.tile_scheduler_metadata is None:  # the library schedules and hands its schedule back on the meta
            meta.tile_scheduler_metadata = torch.zeros(8, 8, dtype=torch.int32, device=q.device)
            meta.num_splits = torch.zeros(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        assert not meta.have_initialized, "a fresh schedule per call"
        meta.have_initialized = True
        if meta.tile_scheduler_metadata is not None:  # the schedule the call runs with
            tiles, splits = meta.tile_scheduler_metadata, meta.num_splits
            assert tiles.dtype == splits.dtype == torch.int32 and tiles.dim() == 2 and tiles.shape[1] == 8
            assert splits.shape == (B + 1,), "num_splits must have shape (batch_size+1)"
        if is_fp8_kvcache:  # the 656-byte V3.2 layout, viewed as float8_e4m3fn
            assert k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[3] == 656 and k_cache.is_contiguous()
            rows = dequantize64(k_cache.view(torch.uint8)[:, :, 0], head_dim_v)  # [nb, 64, 576] float64
        else:
            assert k_cache.dtype == torch.bfloat16 and k_cache.shape[3] == D
            rows = k_cache[:, :, 0]
        if indices is not None:  # sparse: fp8 only, not causal, no table, topk in tiles of 64
            assert not causal, "causal must be False when sparse attention is enabled"
            assert is_fp8_kvcache, "is_fp8_kvcache must be True"
            assert use_legacy, "the V3.2 format and sm90 are legacy-only"
            if H not in (64, 128):
                raise RuntimeError(f"sparse_attn_decode_interface, sparse_decode.cpp:377, Unsupported h_q: {H}")
            assert q.is_contiguous()
            assert block_table is None and cache_seqlens is None
            assert indices.dtype == torch.int32 and indices.shape[:2] == (B, s_q) and indices.shape[2] % 64 == 0
            assert indices.is_contiguous()
            n_slots = k_cache.shape[0] * 64
            assert ((indices == -1) | ((indices >= 0) & (indices < n_slots))).all(), (
                "FlashMLA treats only -1 as invalid and checks no upper bound (out-of-bounds reads)")
            if topk_length is not None:  # the sm90 V3.2 kernel asserts (splitkv_mla.cuh, BENCHMARKS run 131)
                raise RuntimeError("Assertion `params.topk_length == nullptr` failed: V3.2 does not support dynamic "
                                   "topk length")
            slots = [[[int(x) for x in indices[b, i].tolist()] for i in range(s_q)] for b in range(B)]
            out, lse = sparse_decode_ref64(q, rows.reshape(-1, D), slots, softmax_scale, head_dim_v)
            out, lse = out.to(q.dtype), lse.to(torch.float32)
            empty = lse == -INF
            out[empty], lse[empty] = NAN, INF  # undefined in FlashMLA: make the adapter fix it
            return out, lse.transpose(1, 2).contiguous()
        assert block_table.dtype == cache_seqlens.dtype == torch.int32
        layout = paged_from_tables(block_table, cache_seqlens, k_cache.shape[0], 64)
        out, lse = decode_ref64(q, rows, layout, softmax_scale, head_dim_v)
        if not causal:  # FlashMLA without causal: every query of a sequence sees all its rows
            for i in range(s_q - 1):
                out[:, i], lse[:, i] = out[:, -1], lse[:, -1]
        out, lse = out.to(q.dtype), lse.to(torch.float32)
        empty = lse == -INF
        out[empty], lse[empty] = NAN, INF  # undefined in FlashMLA: make the adapter fix it
        return out, lse.transpose(1, 2).contiguous()  # lse [B, H, s_q]

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False,
                             return_log2_lse=None):
        """Sparse prefill as documented: natural-log LSE (``return_log2_lse=None``), the sink scaling the
        output only, indices -1 or ``>= s_kv`` invalid, only the leading ``topk_length[i]`` read; rows
        without a valid index are undefined (NaN output, +inf LSE here)."""
        calls.append(("flash_mla_sparse_fwd", (q, kv, indices, sm_scale),
                      dict(d_v=d_v, attn_sink=attn_sink, topk_length=topk_length, use_legacy=use_legacy,
                           return_log2_lse=return_log2_lse)))
        assert use_legacy, "sm90 kernels are legacy-only"
        assert return_log2_lse is None
        s_q, h_q, d_qk = q.shape
        assert q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and d_qk in (512, 576) and d_v == 512
        if h_q not in (64, 128):
            raise RuntimeError(f"sparse_attn_prefill_interface, sparse_prefill.cpp, Unsupported h_q: {h_q}")
        assert q.stride(1) == d_qk and q.stride(2) == 1, "Expected q.stride(1) == d_qk"
        assert kv.dim() == 3 and kv.shape[1:] == (1, d_qk) and kv.stride(-1) == 1
        s_kv = kv.shape[0]
        assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1) and indices.stride(-1) == 1
        topk = indices.shape[2]
        assert topk % 64 == 0 and topk > 0, f"topk ({topk}) mod B_TOPK (64) must be 0"
        if attn_sink is not None:
            assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,) and attn_sink.is_contiguous()
        if topk_length is not None:
            assert topk_length.dtype == torch.int32 and topk_length.shape == (s_q,) and topk_length.is_contiguous()
        idx = indices[:, 0].long()
        col = torch.arange(topk)[None, :]
        valid = (idx >= 0) & (idx < s_kv)
        if topk_length is not None:
            valid &= col < topk_length.long()[:, None]
        rows = kv[:, 0].double()[torch.where(valid, idx, 0)]  # [s_q, topk, d]
        rows = torch.where(valid[..., None], rows, 0.0)
        logits = torch.einsum("thd,tkd->thk", q.double(), rows) * sm_scale
        logits = logits.masked_fill(~valid[:, None, :], -INF)
        lse = torch.logsumexp(logits, dim=-1)
        out = torch.einsum("thk,tkd->thd", torch.exp(logits - lse[..., None]), rows[..., :d_v])
        if attn_sink is not None:
            out = out * torch.sigmoid(lse - attn_sink.double()[None, :])[..., None]
        max_logits = logits.amax(dim=-1)
        empty = ~valid.any(dim=1)
        out[empty], lse[empty] = NAN, INF
        return out.to(q.dtype), max_logits.float(), lse.float()

    mod.FlashMLASchedMeta = FakeSchedMeta
    mod.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    mod.get_mla_metadata = get_mla_metadata
    mod.get_mla_decoding_metadata = get_mla_decoding_metadata
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    return mod


# ------------------------------------------------------------------------------------------ flashinfer

def _paged_mla64(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len, causal, scale):
    """FlashInfer MLA semantics from its plan arrays: ``out [n, H, 512]``, base-2 ``lse [n, H]``."""
    n, H, dc = q_nope.shape
    page = ckv.shape[1]
    out = torch.full((n, H, dc), NAN, dtype=torch.float64)
    lse = torch.full((n, H), NAN, dtype=torch.float64)
    q = torch.cat([q_nope, q_pe], -1).double()
    rows = torch.cat([ckv, kpe], -1).double()
    for i in range(len(kv_len)):
        q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        pages = kv_indices[int(kv_indptr[i]):int(kv_indptr[i + 1])].long()
        L = int(kv_len[i])
        keys = rows[pages].reshape(-1, rows.shape[-1])[:L]
        for j in range(q1 - q0):
            visible = L - (q1 - q0 - 1 - j) if causal else L
            if visible <= 0:
                out[q0 + j], lse[q0 + j] = 0.0, -INF
                continue
            s = torch.einsum("hd,ld->hl", q[q0 + j], keys[:visible]) * scale
            lse_e = torch.logsumexp(s, -1)
            out[q0 + j] = torch.softmax(s, -1) @ keys[:visible, :dc]
            lse[q0 + j] = lse_e * LOG2E
    return out.to(q_nope.dtype), lse.float()


class FakeMLAWrapper:
    def __init__(self, calls: Calls, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        calls.append(("BatchMLAPagedAttentionWrapper", (float_workspace_buffer,),
                      dict(use_cuda_graph=use_cuda_graph, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                           kv_indices=kv_indices, kv_len_arr=kv_len_arr, backend=backend)))
        self.calls, self.backend, self.use_cuda_graph = calls, backend, use_cuda_graph
        self.bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.planned = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        self.calls.append(("mla.plan", (qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
                                        head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type), {}))
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32 and t.device.type == "cpu", "host arrays: plan() reads them on the CPU"
        if self.use_cuda_graph:
            for buf, t in zip(self.bufs, (qo_indptr, kv_indptr, kv_indices, kv_len_arr)):
                buf[:len(t)].copy_(t)
        self.planned = dict(qo_indptr=qo_indptr.clone(), kv_indptr=kv_indptr.clone(), kv_indices=kv_indices.clone(),
                            kv_len=kv_len_arr.clone(), num_heads=num_heads, page_size=page_size, causal=causal,
                            sm_scale=sm_scale)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, profiler_buffer=None,
            kv_len=None, page_table=None, return_lse_base_on_e=False):
        self.calls.append(("mla.run", (q_nope, q_pe, ckv_cache, kpe_cache),
                           dict(return_lse=return_lse, kv_len=kv_len, page_table=page_table,
                                return_lse_base_on_e=return_lse_base_on_e)))
        if self.backend == "cutlass":
            assert not return_lse and q_nope.shape[1] == 128 and page_table.shape[1] % (128 // ckv_cache.shape[1]) == 0
            B = q_nope.shape[0]
            pages_per = page_table.shape[1]
            qo = torch.arange(B + 1, dtype=torch.int32)
            o, _ = _paged_mla64(q_nope, q_pe, ckv_cache, kpe_cache, qo, qo * pages_per, page_table.reshape(-1),
                                kv_len, False, 192 ** -0.5)
            return o
        p = self.planned
        assert p is not None, "run() before plan()"
        assert q_nope.shape[1] == p["num_heads"] and ckv_cache.shape[1] == p["page_size"]
        # the kernel takes q_nope / q_pe strides per token and head (batch_mla_run.cu): only the last dim is dense
        assert q_nope.stride(-1) == 1 and q_pe.stride(-1) == 1
        o, l = _paged_mla64(q_nope, q_pe, ckv_cache, kpe_cache, p["qo_indptr"], p["kv_indptr"], p["kv_indices"],
                            p["kv_len"], p["causal"], p["sm_scale"])
        if return_lse_base_on_e:
            l = l * math.log(2.0)
        return (o, l) if return_lse else o


class FakeRaggedWrapper:
    def __init__(self, calls: Calls, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, backend="auto"):
        calls.append(("BatchPrefillWithRaggedKVCacheWrapper", (float_workspace_buffer, kv_layout), {}))
        assert kv_layout == "NHD"
        self.calls, self.planned = calls, None

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, causal=False,
             sm_scale=None, q_data_type="float16", kv_data_type=None, **kwargs):
        self.calls.append(("ragged.plan", (qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk),
                           dict(head_dim_vo=head_dim_vo, causal=causal, sm_scale=sm_scale, q_data_type=q_data_type,
                                kv_data_type=kv_data_type, **kwargs)))
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu"
        self.planned = dict(lq=_lens(qo_indptr), lk=_lens(kv_indptr), written=int(qo_indptr[-1]),
                            keys=int(kv_indptr[-1]), causal=causal,
                            sm_scale=sm_scale, dims=(head_dim_qk, head_dim_vo))

    def run(self, q, k, v, out=None, lse=None, return_lse=False):
        self.calls.append(("ragged.run", (q, k, v), dict(return_lse=return_lse)))
        p = self.planned
        assert (q.shape[-1], v.shape[-1]) == p["dims"]
        if q.shape[0] != p["written"] or k.shape[0] != p["keys"]:  # as the real wrapper (0.6.18) checks
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] ({p['written']})")
        o, l = prefill_ref64(q, k, v, p["lq"], p["lk"], p["sm_scale"], p["causal"])
        o, l = o.to(q.dtype), (l * LOG2E).float()
        dead = torch.isneginf(l)  # rows that see no key: garbage, as the real kernel leaves them
        o[dead], l[dead] = NAN, NAN
        return (o, l) if return_lse else o


def make_flashinfer(calls: Calls) -> dict[str, types.ModuleType]:
    root = types.ModuleType("flashinfer")
    mla, prefill = types.ModuleType("flashinfer.mla"), types.ModuleType("flashinfer.prefill")
    cascade, decode = types.ModuleType("flashinfer.cascade"), types.ModuleType("flashinfer.decode")
    mla.BatchMLAPagedAttentionWrapper = lambda *a, **k: FakeMLAWrapper(calls, *a, **k)
    prefill.BatchPrefillWithRaggedKVCacheWrapper = lambda *a, **k: FakeRaggedWrapper(calls, *a, **k)

    def merge_state(v_a, s_a, v_b, s_b):
        """FlashInfer's arithmetic, base 2, literally (an empty/empty row gives NaN, 0 x NaN leaks)."""
        calls.append(("merge_state", (v_a, s_a, v_b, s_b), {}))
        assert s_a.dtype == s_b.dtype == torch.float32 and v_a.is_contiguous() and s_a.is_contiguous()
        m = torch.maximum(s_a, s_b).double()
        wa, wb = torch.exp2(s_a.double() - m), torch.exp2(s_b.double() - m)
        v = (v_a.double() * wa[..., None] + v_b.double() * wb[..., None]) / (wa + wb)[..., None]
        return v.to(v_a.dtype), (m + torch.log2(wa + wb)).float()

    def trtllm_ragged_attention_deepseek(**kw):
        calls.append(("trtllm_ragged_attention_deepseek", (), kw))
        q, k, v = kw["query"], kw["key"], kw["value"]
        assert (q.shape[2], k.shape[2], v.shape[2]) == (192, 192, 128) and kw["workspace_buffer"].dtype == torch.uint8
        lq, lk = _lens(kw["cum_seq_lens_q"]), _lens(kw["cum_seq_lens_kv"])
        assert kw["seq_lens"].tolist() == lk and kw["batch_size"] == len(lq)
        assert max(lq, default=0) <= kw["max_q_len"] and max(lk, default=0) <= kw["max_kv_len"]
        o, l = prefill_ref64(q, k, v, lq, lk, kw["bmm1_scale"], kw["is_causal"])
        o, l = o.to(q.dtype), (l * LOG2E).float()
        written = int(kw["cum_seq_lens_q"][-1])
        o[written:], l[written:] = NAN, NAN
        return (o, l) if kw["return_lse"] else o

    def trtllm_batch_decode_with_kv_cache_mla(**kw):
        calls.append(("trtllm_batch_decode_with_kv_cache_mla", (), kw))
        q, cache, table = kw["query"], kw["kv_cache"], kw["block_tables"]
        bs = cache.shape[1]
        assert q.dim() == 4 and q.shape[-1] == 576 and cache.dim() == 3 and bs in (32, 64)
        assert table.shape[1] % (128 // bs) == 0 and kw["max_seq_len"] >= int(kw["seq_lens"].max())
        layout = paged_from_tables(table, kw["seq_lens"], cache.shape[0], bs)
        out, _ = decode_ref64(q, cache, layout, kw["bmm1_scale"] * kw["bmm2_scale"], kw["kv_lora_rank"])
        return out.to(torch.bfloat16)

    cascade.merge_state = merge_state
    prefill.trtllm_ragged_attention_deepseek = trtllm_ragged_attention_deepseek
    decode.trtllm_batch_decode_with_kv_cache_mla = trtllm_batch_decode_with_kv_cache_mla
    root.mla, root.prefill, root.cascade, root.decode = mla, prefill, cascade, decode
    return {"flashinfer": root, "flashinfer.mla": mla, "flashinfer.prefill": prefill,
            "flashinfer.cascade": cascade, "flashinfer.decode": decode}


# ------------------------------------------------------------------------------------------ fixtures

@pytest.fixture
def fake_flash_attn(monkeypatch) -> Calls:
    calls = Calls()
    monkeypatch.setitem(sys.modules, "flash_attn", make_flash_attn(calls))
    return calls


@pytest.fixture
def fake_flash_mla(monkeypatch) -> Calls:
    calls = Calls()
    monkeypatch.setitem(sys.modules, "flash_mla", make_flash_mla(calls))
    return calls


@pytest.fixture
def fake_flashinfer(monkeypatch) -> Calls:
    calls = Calls()
    for name, mod in make_flashinfer(calls).items():
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


@pytest.fixture
def allow_cpu(monkeypatch):
    """``allow_cpu(op, backend)``: let a CUDA-only backend serve CPU tensors (its fake library computes them),
    so the public op function (dispatch, plan passing) can be traced and compiled on CPU."""
    import dataclasses

    from mla_compile.ops.registry import backends_for

    def allow(op: str, backend: str) -> None:
        table = backends_for(op)  # the live table
        monkeypatch.setitem(table, backend, dataclasses.replace(table[backend], devices=("cpu", "cuda")))

    return allow


__all__ = ["Calls", "merge_ref64", "paged_from_tables"]
