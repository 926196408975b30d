"""The fp8 latent cache: byte format, round-trip error bounds, quantizing write, dequantizing gather,
fp8 decode against float64 (tight, on the dequantized rows) and against the bf16 path (the documented bound)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import mla_compile
from mla_compile.ops import (decode, decode_fp8, gather_latent_cache_fp8, write_latent_cache, write_latent_cache_fp8)
from mla_compile.ops.fp8_cache import SCALE_FLOOR, dequantize_fp8_rows, quantize_fp8_rows
from .ref64 import (BLOCK_SIZES, DS_HEADS, DS_RANK, DS_ROPE, F64, IMPLS, LSE_TOL, OUT_TOL, Paged, assert_bitwise_equal,
                    decode_ref64, generator, paged, randn, seeds)
from .ref_sparse import GROUP, dequantize64, fill_fp8_cache, fp8_expected_rows, poisoned_fp8_cache

RANK, ROPE = 128, 16  # the smallest fp8-legal latent (one group of 128)
WIDTH = mla_compile.fp8_row_bytes(RANK, ROPE)
I32 = torch.int32
FLOAT_IN = [torch.bfloat16, torch.float32, torch.float16]


# ------------------------------------------------------------------------------------------- format

def test_row_width_is_deepseeks_656_bytes():
    rows = quantize_fp8_rows(torch.randn(3, DS_RANK), torch.randn(3, DS_ROPE))
    assert rows.shape == (3, 656) and rows.dtype == torch.uint8
    assert WIDTH == 164


@st.composite
def latents(draw):
    """Latents of mixed magnitude per group: zero groups, one outlier, tiny and huge groups."""
    seed = draw(seeds)
    T, groups, rope = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.sampled_from([0, 16, 64]))
    dtype = draw(st.sampled_from(FLOAT_IN))
    gen = generator(seed)
    x = torch.randn(T, groups, GROUP, generator=gen, dtype=F64)
    exponents = torch.tensor(draw(st.lists(st.integers(-12, 4), min_size=groups, max_size=groups)), dtype=F64)
    x = x * (2.0 ** exponents)[None, :, None]  # fp16 overflows past 2**4 * a few sigma, so stop there
    kind = draw(st.sampled_from(["plain", "zero-group", "outlier", "tiny-values"]))
    if kind == "zero-group":
        x[:, 0] = 0.0
    elif kind == "outlier":
        x[:, -1, 7] = 300.0 if dtype != torch.float16 else 3000.0
    elif kind == "tiny-values":
        x[:, 0, :64] *= 2.0 ** -12  # far below the group's amax: e4m3 subnormals or zero
    latent = x.flatten(1).to(dtype)
    k_pe = torch.randn(T, rope, generator=gen, dtype=F64).to(dtype)
    return latent, k_pe


@given(case=latents())
def test_quantize_bytes_and_round_trip_bounds(case):
    latent, k_pe = case
    T, Dc = latent.shape
    G = Dc // GROUP
    rows = quantize_fp8_rows(latent, k_pe)
    assert rows.shape == (T, mla_compile.fp8_row_bytes(Dc, k_pe.shape[1])) and rows.dtype == torch.uint8

    # Bytes equal an independent encoding: table-searched e4m3 codes, float32 scales, bf16 rope.
    expected = fp8_expected_rows(latent, k_pe)
    assert_bitwise_equal(rows, expected, "fp8 rows")

    # Round trip: |x' - x| <= 2^-4 |x| + 2^-10 s_g per element (plus float32 rounding).
    back, k_pe_back = dequantize_fp8_rows(rows, Dc)
    x = latent.to(F64).reshape(T, G, GROUP)
    scale = rows[:, Dc:Dc + 4 * G].contiguous().view(torch.float32).to(F64)
    amax = x.abs().amax(dim=-1)
    assert torch.equal(scale, torch.clamp_min((amax.float() / 448.0).to(F64), SCALE_FLOOR))
    err = (back.to(F64).reshape(T, G, GROUP) - x).abs()
    bound = (2.0 ** -4 * x.abs() + 2.0 ** -10 * scale[..., None]) * (1 + 2.0 ** -20)
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
    zero = amax == 0
    assert torch.equal(back.reshape(T, G, GROUP)[zero], torch.zeros_like(back.reshape(T, G, GROUP)[zero]))
    assert torch.equal(scale[zero], torch.full_like(scale[zero], SCALE_FLOOR))
    assert_bitwise_equal(k_pe_back, k_pe.to(torch.bfloat16).float(), "k_pe after round trip")


def test_all_zero_row_has_floor_scales_and_exact_zero():
    rows = quantize_fp8_rows(torch.zeros(2, 256), torch.zeros(2, 8))
    latent, k_pe = dequantize_fp8_rows(rows, 256)
    assert torch.equal(rows[:, 256:264].contiguous().view(torch.float32), torch.full((2, 2), SCALE_FLOOR))
    assert torch.equal(latent, torch.zeros(2, 256)) and torch.equal(k_pe, torch.zeros(2, 8))  # no 0 / 0 NaN


# ------------------------------------------------------------------------------------------- write

@st.composite
def slot_mappings(draw) -> tuple[int, int, list[int]]:
    """(block_size, num_blocks, slots): distinct slots in shuffled order with -1 padding mixed in."""
    bs = draw(st.sampled_from(BLOCK_SIZES))
    num_blocks = draw(st.integers(1, 4))
    valid = draw(st.lists(st.integers(0, num_blocks * bs - 1), unique=True, max_size=12))
    slots = valid + [-1] * draw(st.integers(0, 3))
    return bs, num_blocks, list(draw(st.permutations(slots)))


def _write(impl, latent, k_pe, slots, cache):
    fn = torch.ops.mla.write_latent_cache_fp8_ref if impl == "raw" else write_latent_cache_fp8
    assert fn(latent, k_pe, slots, cache) is None


@given(impl=st.sampled_from(IMPLS), case=slot_mappings(), dtype=st.sampled_from(FLOAT_IN), slot_i64=st.booleans(),
       seed=seeds)
def test_write_matches_loop_and_skips_padding(impl, case, dtype, slot_i64, seed):
    bs, num_blocks, slots = case
    gen = generator(seed)
    T = len(slots)
    latent, k_pe = randn(gen, T, RANK, dtype=dtype), randn(gen, T, ROPE, dtype=dtype)
    # Random bytes everywhere: rows that are not written must keep them exactly.
    cache = torch.randint(0, 256, (num_blocks, bs, WIDTH), generator=gen, dtype=torch.uint8)
    expected = cache.clone()
    for t, slot in enumerate(slots):
        if slot != -1:
            expected[slot // bs, slot % bs] = fp8_expected_rows(latent[t:t + 1], k_pe[t:t + 1])[0]
    _write(impl, latent, k_pe, torch.tensor(slots, dtype=torch.int64 if slot_i64 else I32), cache)
    assert_bitwise_equal(cache, expected, "fp8 cache after write")


@pytest.mark.parametrize("impl", IMPLS)
def test_write_all_padding_and_empty_write_nothing(impl):
    gen = generator(2)
    cache = torch.randint(0, 256, (2, 16, WIDTH), generator=gen, dtype=torch.uint8)
    before = cache.clone()
    _write(impl, randn(gen, 4, RANK, dtype=torch.float32), randn(gen, 4, ROPE, dtype=torch.float32),
           torch.full((4,), -1, dtype=I32), cache)
    _write(impl, torch.empty(0, RANK), torch.empty(0, ROPE), torch.empty(0, dtype=I32), cache)
    assert_bitwise_equal(cache, before, "fp8 cache after all-padding and empty writes")


def test_write_deepseek_dims():
    gen = generator(3)
    cache = poisoned_fp8_cache(4, 64, 656)
    slots = torch.randperm(256, generator=gen)[:37]
    slots[5] = -1
    latent, k_pe = randn(gen, 37, DS_RANK, dtype=torch.bfloat16), randn(gen, 37, DS_ROPE, dtype=torch.bfloat16)
    write_latent_cache_fp8(latent, k_pe, slots.to(I32), cache)
    written = cache.reshape(256, 656)[slots[slots >= 0]]
    back, k_pe_back = dequantize_fp8_rows(written)
    keep = slots >= 0
    assert_close(back, latent[keep].float(), rtol=2.0 ** -4, atol=1e-4)
    assert torch.equal(k_pe_back, k_pe[keep].float())
    assert int((cache == 0xFF).all(dim=-1).sum()) == 256 - 36


# ------------------------------------------------------------------------------------------- gather

@given(impl=st.sampled_from(IMPLS), out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       layout=paged(min_seqs=1), pad=st.integers(0, 3), data=st.data())
def test_gather_dequantizes_rows_in_order(impl, out_dtype, layout, pad, data):
    gen = generator(data.draw(seeds))
    cache = fill_fp8_cache(layout, RANK, ROPE, gen)
    starts = [data.draw(st.integers(0, n)) for n in layout.seq_lens]
    lengths = [data.draw(st.integers(0, n - s)) for n, s in zip(layout.seq_lens, starts)]
    S = sum(lengths) + pad
    dense = dequantize64(cache, RANK)
    expected = torch.zeros(S, RANK + ROPE, dtype=out_dtype)
    r = 0
    for b, (s, n) in enumerate(zip(starts, lengths)):
        for p in range(s, s + n):
            expected[r] = dense[layout.where(b, p)].to(out_dtype)
            r += 1
    out = torch.full((S, RANK + ROPE), float("nan"), dtype=out_dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=I32)
    args = (cache, layout.block_table(), cu, torch.tensor(starts, dtype=I32), out)
    fn = torch.ops.mla.gather_latent_cache_fp8_ref if impl == "raw" else gather_latent_cache_fp8
    assert fn(*args) is None
    assert_bitwise_equal(out, expected, "dequantized workspace")


# ------------------------------------------------------------------------------------------- decode

@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), impl=st.sampled_from(IMPLS),
       layout=paged(min_seqs=1), s_q=st.integers(1, 3), heads=st.integers(1, 3), squeeze=st.booleans(), seed=seeds)
def test_decode_fp8_matches_float64_on_dequantized_rows(dtype, impl, layout, s_q, heads, squeeze, seed):
    gen = generator(seed)
    cache = fill_fp8_cache(layout, RANK, ROPE, gen)
    B, D = len(layout.seq_lens), RANK + ROPE
    q = randn(gen, B, s_q, heads, D, dtype=dtype)
    scale = D ** -0.5
    ref_out, ref_lse = decode_ref64(q, dequantize64(cache, RANK), layout, scale, RANK)
    before = cache.clone()
    table, lens = layout.block_table(), layout.seq_lens_tensor()
    if impl == "raw":
        out, lse = torch.ops.mla.decode_fp8_ref(q, cache, table, lens, scale, RANK)
    elif squeeze and s_q == 1:
        out, lse = decode_fp8(q[:, 0], cache, table, lens, scale, kv_lora_rank=RANK)
        out, lse = out.unsqueeze(1), lse.unsqueeze(1)
    else:
        out, lse = decode_fp8(q, cache, table, lens, scale, kv_lora_rank=RANK)
    assert out.shape == (B, s_q, heads, RANK) and out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out.to(F64), ref_out, **OUT_TOL[dtype])
    assert_close(lse.to(F64), ref_lse, **LSE_TOL[dtype])
    assert not torch.isnan(out).any()  # poisoned (NaN) rows past seq_len never leak
    assert_bitwise_equal(cache, before, "fp8 cache (decode must not write it)")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_fp8_vs_bf16_documented_bound(seed):
    """DeepSeek dims: fp8 decode stays within the module docstring's bound of bf16 decode on the same data."""
    gen = generator(100 + seed)
    B, bs, max_blocks = 4, 64, 5
    nb = B * max_blocks
    table = torch.randperm(nb, generator=gen).reshape(B, max_blocks).to(I32)
    lens = torch.randint(70, max_blocks * bs + 1, (B,), generator=gen).to(I32)
    latent = randn(gen, nb * bs, DS_RANK, dtype=torch.bfloat16)
    k_pe = randn(gen, nb * bs, DS_ROPE, dtype=torch.bfloat16)
    slots = torch.arange(nb * bs, dtype=I32)
    c16 = torch.zeros(nb, bs, DS_RANK + DS_ROPE, dtype=torch.bfloat16)
    c8 = torch.zeros(nb, bs, 656, dtype=torch.uint8)
    write_latent_cache(latent, k_pe, slots, c16)
    write_latent_cache_fp8(latent, k_pe, slots, c8)
    q = randn(gen, B, 1, DS_HEADS, DS_RANK + DS_ROPE, dtype=torch.bfloat16)
    scale = 192 ** -0.5
    o16, l16 = decode(q.float(), c16, table, lens, scale, kv_lora_rank=DS_RANK)
    o8, l8 = decode_fp8(q.float(), c8, table, lens, scale, kv_lora_rank=DS_RANK)
    diff = (o8 - o16).abs()
    # measured (12 seeds): normwise <= 0.046, max <= 0.066 * max|out|, lse <= 0.046
    assert float(diff.norm() / o16.norm()) <= 0.08
    assert float(diff.max()) <= 0.15 * float(o16.abs().max())
    assert float((l8 - l16).abs().max()) <= 0.1


# ------------------------------------------------------------------------------------------- opcheck

def _opcheck_cases():
    gen = generator(7)
    bs = 4
    table = torch.randperm(6, generator=gen).to(I32).reshape(2, 3)
    cache = quantize_fp8_rows(randn(gen, 6, bs, RANK, dtype=torch.float32),
                              randn(gen, 6, bs, ROPE, dtype=torch.float32))
    slots = torch.randperm(6 * bs, generator=gen)[:5].to(I32)
    slots[0] = -1
    q = randn(gen, 2, 2, 2, RANK + ROPE, dtype=torch.float32)
    return [
        (torch.ops.mla.write_latent_cache_fp8_ref.default,
         (randn(gen, 5, RANK, dtype=torch.bfloat16), randn(gen, 5, ROPE, dtype=torch.bfloat16), slots, cache.clone())),
        (torch.ops.mla.gather_latent_cache_fp8_ref.default,
         (cache, table, torch.tensor([0, 4, 9], dtype=I32), torch.tensor([1, 3], dtype=I32),
          torch.zeros(11, RANK + ROPE))),
        (torch.ops.mla.decode_fp8_ref.default, (q, cache, table, torch.tensor([9, 0], dtype=I32), 0.1, RANK)),
    ]


@pytest.mark.parametrize("case", range(3), ids=["write", "gather", "decode"])
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


# ------------------------------------------------------------------------------------------- malformed inputs

LAYOUT = Paged(16, 4, (20, 5), ((2, 0), (3,)), 2, -1)


def _args(kind: str) -> dict:
    gen = generator(9)
    cache = fill_fp8_cache(LAYOUT, RANK, ROPE, gen)
    if kind == "write":
        return dict(latent=randn(gen, 3, RANK, dtype=torch.float32), k_pe=randn(gen, 3, ROPE, dtype=torch.float32),
                    slot_mapping=torch.tensor([5, -1, 63], dtype=I32), kv_cache=cache)
    if kind == "gather":
        return dict(kv_cache=cache, block_table=LAYOUT.block_table(), cu_seqlens=torch.tensor([0, 7, 10], dtype=I32),
                    seq_starts=torch.tensor([13, 2], dtype=I32), out=torch.zeros(12, RANK + ROPE))
    return dict(q=randn(gen, 2, 1, 2, RANK + ROPE, dtype=torch.float32), kv_cache=cache,
                block_table=LAYOUT.block_table(), seq_lens=LAYOUT.seq_lens_tensor(), scale=0.1, kv_lora_rank=RANK)


W, G, DE = "mla.write_latent_cache_fp8: ", "mla.gather_latent_cache_fp8: ", "mla.decode_fp8: "
BAD = [
    pytest.param("write", lambda a: dict(latent=a["latent"][:, :100]), ValueError, W + "latent's last dim",
                 id="w-rank-128"),
    pytest.param("write", lambda a: dict(latent=a["latent"].to(I32)), TypeError, W + "latent must have dtype",
                 id="w-dtype"),
    pytest.param("write", lambda a: dict(k_pe=a["k_pe"][:2]), ValueError, W + "k_pe must have shape", id="w-k_pe-rows"),
    pytest.param("write", lambda a: dict(kv_cache=a["kv_cache"].float()), TypeError, W + "kv_cache must have dtype",
                 id="w-float-cache"),
    pytest.param("write", lambda a: dict(kv_cache=a["kv_cache"][..., :-2]), ValueError,
                 W + r"kv_cache must have shape \[\*, \*, 164\]", id="w-width"),
    pytest.param("write", lambda a: dict(slot_mapping=torch.tensor([5, -2, 63], dtype=I32)), ValueError,
                 W + "slot_mapping values must lie", id="w-slot-negative"),
    pytest.param("write", lambda a: dict(slot_mapping=torch.tensor([5, -1, 64], dtype=I32)), ValueError,
                 W + "slot_mapping values must lie", id="w-slot-past-end"),
    pytest.param("gather", lambda a: dict(out=torch.zeros(12, RANK + ROPE + 1)), ValueError,
                 G + "kv_cache rows of 164 bytes do not match out's 145 columns", id="g-out-width"),
    pytest.param("gather", lambda a: dict(out=a["out"].to(I32)), TypeError, G + "out must have dtype",
                 id="g-out-dtype"),
    pytest.param("gather", lambda a: dict(cu_seqlens=torch.tensor([0, 7, 13], dtype=I32)), ValueError,
                 G + "cu_seqlens must .* workspace size 12", id="g-cu-past-workspace"),
    pytest.param("gather", lambda a: dict(seq_starts=torch.tensor([30, 2], dtype=I32)), ValueError,
                 G + r"seq_starts \+ lengths values must lie", id="g-range-past-table"),
    pytest.param("gather", lambda a: dict(block_table=torch.tensor([[2, 9], [3, -1]], dtype=I32)), ValueError,
                 G + "block_table values must lie", id="g-block-past-end"),
    pytest.param("decode", lambda a: dict(kv_lora_rank=64), ValueError, DE + "kv_lora_rank must be a multiple of 128",
                 id="d-rank"),
    pytest.param("decode", lambda a: dict(q=a["q"][..., :140]), ValueError, DE + "kv_cache must have shape",
                 id="d-q-dim-vs-cache"),
    pytest.param("decode", lambda a: dict(kv_cache=dequantize64(a["kv_cache"], RANK).float()), TypeError,
                 DE + "kv_cache must have dtype", id="d-bf16-style-cache"),
    pytest.param("decode", lambda a: dict(seq_lens=torch.tensor([33, 5], dtype=I32)), ValueError,
                 DE + "seq_lens values must lie", id="d-seq-len-past-table"),
    pytest.param("decode", lambda a: dict(block_table=torch.tensor([[2, 4], [3, -1]], dtype=I32)), ValueError,
                 DE + "block_table values must lie", id="d-block-past-end"),
    pytest.param("decode", lambda a: dict(block_table=a["block_table"][:1]), ValueError,
                 DE + "block_table must have shape", id="d-table-batch"),
]
RAW = {"write": torch.ops.mla.write_latent_cache_fp8_ref, "gather": torch.ops.mla.gather_latent_cache_fp8_ref,
       "decode": torch.ops.mla.decode_fp8_ref}


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("kind,breakage,exc,match", BAD)
def test_rejects_malformed(kind, breakage, exc, match, raw):
    args = _args(kind)
    args = {**args, **breakage(args)}
    mutated = {"write": "kv_cache", "gather": "out", "decode": "kv_cache"}[kind]
    before = args[mutated].clone()
    if raw:
        fn = RAW[kind]
    else:
        public = {"write": write_latent_cache_fp8, "gather": gather_latent_cache_fp8}.get(kind)
        fn = public or (lambda scale, kv_lora_rank, **rest: decode_fp8(**rest, scale=scale, kv_lora_rank=kv_lora_rank))
    with pytest.raises(exc, match=match):
        fn(**args)
    assert_bitwise_equal(args[mutated], before, f"{mutated} after a rejected call")
