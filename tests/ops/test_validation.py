"""Malformed inputs raise a ValueError/TypeError naming the argument, before anything is written.

Each case breaks one thing in an otherwise valid call; the cache (and gather's workspace) must come
out bit-identical, NaN rows included.
"""

from __future__ import annotations

import pytest
import torch

from mla_compile.ops import decode, gather_latent_cache, merge_attn_states, prefill, write_latent_cache
from .ref64 import NAN, RANK, ROPE, Paged, assert_bitwise_equal, fill_paged_cache, generator, randn

D = RANK + ROPE
I32 = torch.int32

# One valid paged batch shared by decode and gather: 2 sequences, block size 16, max 2 blocks each.
LAYOUT = Paged(16, 4, (20, 5), ((2, 0), (3,)), 2, -1)


def _cache() -> torch.Tensor:
    cache = fill_paged_cache(LAYOUT, D, torch.float32, generator(41))
    assert torch.isnan(cache).any()  # the check below must also hold for NaN rows
    return cache


def _replace(args: dict, **changes) -> dict:
    return {**args, **changes}


def _expect_error(fn, args: dict, exc: type, match: str, untouched: tuple[str, ...]) -> None:
    before = {name: args[name].clone() for name in untouched}
    with pytest.raises(exc, match=match):
        fn(**args)
    for name, value in before.items():
        assert_bitwise_equal(args[name], value, f"{name} after a rejected call")


# ------------------------------------------------------------------------------------------- cache write

def _write_args() -> dict:
    gen = generator(42)
    return dict(latent=randn(gen, 4, RANK, dtype=torch.float32), k_pe=randn(gen, 4, ROPE, dtype=torch.float32),
                slot_mapping=torch.tensor([5, -1, 63, 17], dtype=I32), kv_cache=_cache())


W = "mla.write_latent_cache: "
WRITE_CASES = [
    pytest.param(lambda a: dict(latent=a["latent"][None]), ValueError, W + "latent must have 2 dims", id="latent-rank"),
    pytest.param(lambda a: dict(latent=a["latent"].to(I32)), TypeError, W + "latent must have dtype", id="latent-dtype"),
    pytest.param(lambda a: dict(k_pe=a["k_pe"][:3]), ValueError, W + "k_pe must have shape", id="k_pe-rows"),
    pytest.param(lambda a: dict(k_pe=a["k_pe"][:, :8]), ValueError, W + "kv_cache must have shape", id="head-dims"),
    pytest.param(lambda a: dict(slot_mapping=a["slot_mapping"].float()), TypeError, W + "slot_mapping must have dtype",
                 id="float-slots"),
    pytest.param(lambda a: dict(slot_mapping=a["slot_mapping"][None]), ValueError, W + "slot_mapping must have 1 dims",
                 id="slots-rank"),
    pytest.param(lambda a: dict(slot_mapping=torch.tensor([5, -1, 64, 17], dtype=I32)), ValueError,
                 W + "slot_mapping values must lie", id="slot-past-end"),
    pytest.param(lambda a: dict(slot_mapping=torch.tensor([5, -2, 6, 17], dtype=I32)), ValueError,
                 W + "slot_mapping values must lie", id="slot-negative-not-padding"),
    pytest.param(lambda a: dict(kv_cache=a["kv_cache"][0]), ValueError, W + "kv_cache must have 3 dims", id="cache-rank"),
    pytest.param(lambda a: dict(kv_cache=a["kv_cache"].to(I32)), TypeError, W + "kv_cache must have dtype",
                 id="cache-dtype"),
]


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("breakage,exc,match", WRITE_CASES)
def test_write_rejects(breakage, exc, match, raw):
    args = _write_args()
    args = _replace(args, **breakage(args))
    fn = torch.ops.mla.write_latent_cache_ref if raw else write_latent_cache
    _expect_error(fn, args, exc, match, ("kv_cache",))


# ------------------------------------------------------------------------------------------- decode

def _decode_args() -> dict:
    return dict(q=randn(generator(43), 2, 1, 2, D, dtype=torch.float32), kv_cache=_cache(),
                block_table=LAYOUT.block_table(I32), seq_lens=LAYOUT.seq_lens_tensor(I32), scale=0.1,
                kv_lora_rank=RANK)


def _table(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=I32)


DE = "mla.decode: "
DECODE_CASES = [
    pytest.param(lambda a: dict(q=a["q"][None]), ValueError, DE + "q must have 4 dims", id="q-rank"),
    pytest.param(lambda a: dict(q=a["q"].to(I32)), TypeError, DE + "q must have dtype", id="q-dtype"),
    pytest.param(lambda a: dict(q=a["q"][..., :40]), ValueError, DE + "kv_cache must have shape", id="q-dim-vs-cache"),
    pytest.param(lambda a: dict(kv_lora_rank=0), ValueError, DE + "kv_lora_rank must be in", id="rank-zero"),
    pytest.param(lambda a: dict(kv_lora_rank=D + 1), ValueError, DE + "kv_lora_rank must be in", id="rank-too-big"),
    pytest.param(lambda a: dict(block_table=a["block_table"].float()), TypeError, DE + "block_table must have dtype",
                 id="float-table"),
    pytest.param(lambda a: dict(block_table=a["block_table"][0]), ValueError, DE + "block_table must have 2 dims",
                 id="table-rank"),
    pytest.param(lambda a: dict(block_table=a["block_table"][:1]), ValueError, DE + "block_table must have shape",
                 id="table-batch"),
    pytest.param(lambda a: dict(seq_lens=a["seq_lens"].float()), TypeError, DE + "seq_lens must have dtype",
                 id="float-seq-lens"),
    pytest.param(lambda a: dict(seq_lens=torch.tensor([20, 5, 1], dtype=I32)), ValueError, DE + "seq_lens must have shape",
                 id="seq-lens-batch"),
    pytest.param(lambda a: dict(block_table=_table([[2, 4], [3, -1]])), ValueError, DE + "block_table values must lie",
                 id="block-id-past-end"),
    pytest.param(lambda a: dict(block_table=_table([[2, 0], [-1, -1]])), ValueError, DE + "block_table values must lie",
                 id="block-id-negative"),
    pytest.param(lambda a: dict(seq_lens=torch.tensor([33, 5], dtype=I32)), ValueError, DE + "seq_lens values must lie",
                 id="seq-len-past-table"),
    pytest.param(lambda a: dict(seq_lens=torch.tensor([20, -1], dtype=I32)), ValueError, DE + "seq_lens values must lie",
                 id="seq-len-negative"),
    pytest.param(lambda a: dict(kv_cache=a["kv_cache"][0]), ValueError, DE + "kv_cache must have 3 dims", id="cache-rank"),
]


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("breakage,exc,match", DECODE_CASES)
def test_decode_rejects(breakage, exc, match, raw):
    args = _decode_args()
    args = _replace(args, **breakage(args))
    if raw:
        fn = torch.ops.mla.decode_ref
    else:
        def fn(scale, kv_lora_rank, **rest):
            return decode(**rest, scale=scale, kv_lora_rank=kv_lora_rank)
    _expect_error(fn, args, exc, match, ("kv_cache",))


def test_decode_unused_table_entries_are_not_checked():
    """Only blocks below seq_len are read, so entries past them may hold anything (99 > num_blocks here)."""
    args = _replace(_decode_args(), block_table=_table([[2, 0], [3, 99]]))
    out, lse = decode(**args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ------------------------------------------------------------------------------------------- prefill

def _prefill_args() -> dict:
    gen = generator(44)
    return dict(q=randn(gen, 6, 2, 24, dtype=torch.float32), k=randn(gen, 9, 2, 24, dtype=torch.float32),
                v=randn(gen, 9, 2, 16, dtype=torch.float32), cu_seqlens_q=torch.tensor([0, 3, 5], dtype=I32),
                cu_seqlens_k=torch.tensor([0, 4, 9], dtype=I32), scale=0.2, causal=True)


P = "mla.prefill: "
PREFILL_CASES = [
    pytest.param(lambda a: dict(q=a["q"][0]), ValueError, P + "q must have 3 dims", id="q-rank"),
    pytest.param(lambda a: dict(k=a["k"].double()), TypeError, P + "k must have dtype", id="k-dtype"),
    pytest.param(lambda a: dict(k=a["k"][..., :16]), ValueError, P + "k must have shape", id="k-head-dim"),
    pytest.param(lambda a: dict(k=a["k"][:, :1]), ValueError, P + "k must have shape", id="k-heads"),
    pytest.param(lambda a: dict(v=a["v"][:8]), ValueError, P + "v must have shape", id="v-rows"),
    pytest.param(lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].float()), TypeError, P + "cu_seqlens_q must have dtype",
                 id="float-cu-q"),
    pytest.param(lambda a: dict(cu_seqlens_k=a["cu_seqlens_k"][:2]), ValueError, P + "cu_seqlens_k must have shape",
                 id="cu-k-length"),
    pytest.param(lambda a: dict(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=I32)), ValueError,
                 P + "cu_seqlens_q must start at 0", id="cu-q-not-from-0"),
    pytest.param(lambda a: dict(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=I32)), ValueError,
                 P + "cu_seqlens_q must start at 0, be non-decreasing", id="cu-q-decreasing"),
    pytest.param(lambda a: dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=I32)), ValueError,
                 P + "cu_seqlens_q must start at 0, be non-decreasing and end at most at 6", id="cu-q-past-rows"),
    pytest.param(lambda a: dict(cu_seqlens_k=torch.tensor([0, 5, 4], dtype=I32)), ValueError,
                 P + "cu_seqlens_k must start at 0", id="cu-k-decreasing"),
    pytest.param(lambda a: dict(cu_seqlens_k=torch.tensor([0, 2, 9], dtype=I32)), ValueError,
                 P + "cu_seqlens_k - cu_seqlens_q values must lie", id="k-shorter-than-q"),
    pytest.param(lambda a: dict(cu_seqlens_q=torch.zeros(0, dtype=I32), cu_seqlens_k=torch.zeros(0, dtype=I32)),
                 ValueError, P + "cu_seqlens_q must have at least one entry", id="cu-empty"),
    pytest.param(lambda a: dict(cu_seqlens_k=a["cu_seqlens_k"].to("meta")), ValueError,
                 P + "all tensors must be on one device", id="cu-k-other-device"),
]


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("breakage,exc,match", PREFILL_CASES)
def test_prefill_rejects(breakage, exc, match, raw):
    args = _prefill_args()
    args = _replace(args, **breakage(args))
    if raw:
        fn = torch.ops.mla.prefill_ref
    else:
        def fn(causal, **rest):
            return prefill(**rest, causal=causal)
    _expect_error(fn, args, exc, match, ("q", "k", "v"))


# ------------------------------------------------------------------------------------------- merge

def _merge_args() -> dict:
    gen = generator(45)
    return dict(out_a=randn(gen, 3, 2, 8, dtype=torch.float32), lse_a=randn(gen, 3, 2, dtype=torch.float32),
                out_b=randn(gen, 3, 2, 8, dtype=torch.float32), lse_b=randn(gen, 3, 2, dtype=torch.float32))


M = "mla.merge_attn_states: "
MERGE_CASES = [
    pytest.param(lambda a: dict(out_a=a["out_a"][0]), ValueError, M + "out_a must have 3 dims", id="out-a-rank"),
    pytest.param(lambda a: dict(out_b=a["out_b"].double()), TypeError, M + "out_b must have dtype", id="out-b-dtype"),
    pytest.param(lambda a: dict(out_b=a["out_b"][:, :, :4]), ValueError, M + "out_b must have shape", id="out-b-dim"),
    pytest.param(lambda a: dict(lse_a=a["lse_a"].bfloat16()), TypeError, M + "lse_a must have dtype", id="lse-a-bf16"),
    pytest.param(lambda a: dict(lse_b=a["lse_b"][:2]), ValueError, M + "lse_b must have shape", id="lse-b-rows"),
    pytest.param(lambda a: dict(lse_b=a["lse_b"].transpose(0, 1)), ValueError, M + "lse_b must have shape",
                 id="lse-b-head-major"),
]


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("breakage,exc,match", MERGE_CASES)
def test_merge_rejects(breakage, exc, match, raw):
    args = _merge_args()
    args = _replace(args, **breakage(args))
    fn = torch.ops.mla.merge_attn_states_ref if raw else merge_attn_states
    _expect_error(fn, args, exc, match, tuple(args))


# ------------------------------------------------------------------------------------------- gather

def _gather_args() -> dict:
    return dict(kv_cache=_cache(), block_table=LAYOUT.block_table(I32), cu_seqlens=torch.tensor([0, 7, 10], dtype=I32),
                seq_starts=torch.tensor([13, 2], dtype=I32), out=torch.full((12, D), NAN))


G = "mla.gather_latent_cache: "
GATHER_CASES = [
    pytest.param(lambda a: dict(kv_cache=a["kv_cache"][0]), ValueError, G + "kv_cache must have 3 dims", id="cache-rank"),
    pytest.param(lambda a: dict(out=a["out"][:, :40]), ValueError, G + "out must have shape", id="out-dim"),
    pytest.param(lambda a: dict(out=a["out"].to(I32)), TypeError, G + "out must have dtype", id="out-dtype"),
    pytest.param(lambda a: dict(block_table=a["block_table"].float()), TypeError, G + "block_table must have dtype",
                 id="float-table"),
    pytest.param(lambda a: dict(seq_starts=a["seq_starts"].float()), TypeError, G + "seq_starts must have dtype",
                 id="float-starts"),
    pytest.param(lambda a: dict(cu_seqlens=a["cu_seqlens"][:2]), ValueError, G + "cu_seqlens must have shape",
                 id="cu-length"),
    pytest.param(lambda a: dict(cu_seqlens=torch.tensor([1, 7, 10], dtype=I32)), ValueError,
                 G + "cu_seqlens must start at 0", id="cu-not-from-0"),
    pytest.param(lambda a: dict(cu_seqlens=torch.tensor([0, 7, 6], dtype=I32)), ValueError,
                 G + "cu_seqlens must start at 0, be non-decreasing", id="cu-decreasing"),
    pytest.param(lambda a: dict(cu_seqlens=torch.tensor([0, 7, 13], dtype=I32)), ValueError,
                 G + "cu_seqlens must .* end at most at the workspace size 12", id="cu-past-workspace"),
    pytest.param(lambda a: dict(seq_starts=torch.tensor([30, 2], dtype=I32)), ValueError,
                 G + r"seq_starts \+ lengths values must lie", id="range-past-table"),
    pytest.param(lambda a: dict(seq_starts=torch.tensor([-1, 2], dtype=I32)), ValueError,
                 G + "seq_starts values must lie", id="start-negative"),
    pytest.param(lambda a: dict(block_table=_table([[2, 9], [3, -1]])), ValueError, G + "block_table values must lie",
                 id="block-id-past-end"),
]


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("breakage,exc,match", GATHER_CASES)
def test_gather_rejects(breakage, exc, match, raw):
    args = _gather_args()
    args = _replace(args, **breakage(args))
    fn = torch.ops.mla.gather_latent_cache_ref if raw else gather_latent_cache
    _expect_error(fn, args, exc, match, ("kv_cache", "out"))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        decode(**_replace(_decode_args(), scale=0.1), backend="nope")
