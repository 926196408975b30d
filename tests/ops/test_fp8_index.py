"""The fp8 index-key cache of DeepSeek-V3.2 (d e4m3 values + one float32 scale per token): byte format,
round-trip error bound against float64, quantizing ``write_index_cache``, ``lightning_index`` reading it
(exactly the selection over the dequantized keys; strongly overlapping the bf16 one), opcheck, compile,
malformed input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from mla_compile.ops import lightning_index, write_index_cache
from mla_compile.ops._fp8_format import fp8_index_row_bytes
from mla_compile.ops.fp8_cache import SCALE_FLOOR
from mla_compile.ops.fp8_index import dequantize_fp8_index, quantize_fp8_index
from .ref64 import F64, IMPLS, Paged, assert_bitwise_equal, generator, paged, randn, seeds
from .ref_sparse import POISON, e4m3_encode, lightning_ref

I32 = torch.int32
FLOAT_IN = [torch.bfloat16, torch.float32, torch.float16]


def expected_index_rows(keys: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, d + 4]`` from the documented formulas: table-searched e4m3 codes of the float32
    quotient ``x / s``, ``s = max(float32(amax) / 448, 2**-64)`` (both correctly rounded on CPU)."""
    x = keys.float()
    scale = torch.clamp_min(x.abs().amax(dim=-1, keepdim=True) / 448.0, 2.0 ** -64)
    codes = e4m3_encode((x / scale).clamp(-448.0, 448.0).to(F64))
    return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize64(rows: torch.Tensor) -> torch.Tensor:
    """Float64 keys of fp8 index rows, field by field (the float64 product rounded once to float32)."""
    d = rows.shape[-1] - 4
    codes = rows[..., :d].contiguous().view(torch.float8_e4m3fn).to(F64)
    scale = rows[..., d:].contiguous().view(torch.float32).to(F64)
    return (codes * scale).float().to(F64)


# ------------------------------------------------------------------------------------------- format

def test_row_width_is_132_bytes_for_v32():
    rows = quantize_fp8_index(torch.randn(3, 128))
    assert rows.shape == (3, 132) and rows.dtype == torch.uint8
    assert fp8_index_row_bytes(128) == 132 and fp8_index_row_bytes(64) == 68


@st.composite
def index_keys(draw):
    """Keys of mixed magnitude per token (2**-30 .. 2**12; 2**-70 below the scale floor for the wide
    dtypes), with all-zero rows, outliers and elements far below their row's amax."""
    gen = generator(draw(seeds))
    T, d = draw(st.integers(1, 6)), draw(st.sampled_from([128, 64, 24]))
    dtype = draw(st.sampled_from(FLOAT_IN))
    low = -20 if dtype == torch.float16 else -30  # fp16 flushes below ~2**-24
    exps = draw(st.lists(st.integers(low, 12), min_size=T, max_size=T))
    x = torch.randn(T, d, generator=gen, dtype=F64) * (2.0 ** torch.tensor(exps, dtype=F64))[:, None]
    kind = draw(st.sampled_from(["plain", "outlier", "tiny-values", "below-floor"]))
    if kind == "outlier":
        x[:, 5] = 3000.0
    elif kind == "tiny-values":
        x[:, : d // 2] *= 2.0 ** -14  # e4m3 subnormals or zero next to the row's amax
    elif kind == "below-floor" and dtype != torch.float16:
        x[-1] = torch.randn(d, generator=gen, dtype=F64) * 2.0 ** -70  # amax < 448 * 2**-64: absolute grid
    x[draw(st.integers(0, T - 1))] = 0.0  # an all-zero key (scale floor, must read back as 0)
    return x.to(dtype)


@given(keys=index_keys())
def test_quantize_bytes_and_round_trip_bound(keys):
    T, d = keys.shape
    rows = quantize_fp8_index(keys)
    assert rows.shape == (T, d + 4) and rows.dtype == torch.uint8
    assert_bitwise_equal(rows, expected_index_rows(keys), "fp8 index rows")

    back = dequantize_fp8_index(rows)
    assert back.dtype == torch.float32 and back.shape == keys.shape
    assert torch.equal(back.to(F64), dequantize64(rows))  # float32 dequantization = float64 product rounded once
    x = keys.to(F64)
    scale = rows[:, d:].contiguous().view(torch.float32).to(F64)
    assert torch.equal(scale[:, 0], torch.clamp_min((x.abs().amax(-1).float() / 448.0).to(F64), SCALE_FLOOR))
    # the documented bound, float32 roundings included (e4m3's worst relative error is 2**-4 / (1 + 2**-4))
    err = (back.to(F64) - x).abs()
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * scale
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
    zero = x.abs().amax(-1) == 0
    assert bool(zero.any()) and bool((back[zero] == 0).all()) and bool((scale[zero] == SCALE_FLOOR).all())
    assert not bool(torch.isnan(back).any())


def test_round_trip_error_is_a_few_percent_on_normal_keys():
    """N(0, 1) keys of 128 dims (LayerNorm'd index keys look like this): 2.6% RMS relative error (3 seeds)."""
    x = torch.randn(4096, 128, generator=generator(5), dtype=F64)
    back = dequantize_fp8_index(quantize_fp8_index(x.float())).to(F64)
    rel = float((back - x).norm() / x.norm())
    assert 0.01 < rel < 0.035, rel  # not lossless, not worse than e4m3's 3 mantissa bits


# ------------------------------------------------------------------------------------------- write

@given(impl=st.sampled_from(IMPLS), bs=st.sampled_from([1, 16]), data=st.data(), seed=seeds,
       dtype=st.sampled_from(FLOAT_IN))
def test_write_fp8_index_cache_matches_loop(impl, bs, data, seed, dtype):
    gen = generator(seed)
    num_blocks, d = data.draw(st.integers(1, 4)), 32
    valid = data.draw(st.lists(st.integers(0, num_blocks * bs - 1), unique=True, max_size=10))
    slots = data.draw(st.permutations(valid + [-1] * data.draw(st.integers(0, 3))))
    k_idx = randn(gen, len(slots), d, dtype=dtype) * 3.0
    cache = torch.full((num_blocks, bs, d + 4), POISON, dtype=torch.uint8)
    expected = cache.clone()
    for t, s in enumerate(slots):
        if s != -1:
            expected[s // bs, s % bs] = expected_index_rows(k_idx[t:t + 1])[0]
    slot_mapping = torch.tensor(slots, dtype=I32)
    if impl == "raw":
        assert torch.ops.mla.write_index_cache_ref(k_idx, slot_mapping, cache) is None
    else:
        assert write_index_cache(k_idx, slot_mapping, cache) is None
    assert_bitwise_equal(cache, expected, "fp8 index cache after write")


# ------------------------------------------------------------------------------------------- lightning indexer

def _fill_fp8_index_cache(layout: Paged, keys_by_seq: list[torch.Tensor]) -> torch.Tensor:
    """A poisoned fp8 index cache holding ``keys_by_seq[b][p]`` at sequence b's position p (written by the op)."""
    cache = torch.full((layout.num_blocks, layout.block_size, keys_by_seq[0].shape[1] + 4), POISON, dtype=torch.uint8)
    for b, keys in enumerate(keys_by_seq):
        slots = [layout.where(b, p)[0] * layout.block_size + layout.where(b, p)[1] for p in range(keys.shape[0])]
        write_index_cache(keys, torch.tensor(slots, dtype=torch.int64), cache)
    return cache


def _query_case(layout: Paged, data, heads: int, dim: int):
    gen = generator(data.draw(seeds))
    T = data.draw(st.integers(1, 6))
    query_seq = [data.draw(st.integers(-1, len(layout.seq_lens) - 1)) for _ in range(T)]
    query_pos = [data.draw(st.integers(0, max(layout.seq_lens[b] - 1, 0))) if b >= 0 else 0 for b in query_seq]
    q = torch.randint(-2, 3, (T, heads, dim), generator=gen).float()
    w = torch.randint(-1, 3, (T, heads), generator=gen).float() / 2
    return gen, q, w, query_seq, query_pos


def _args(q, w, cache, layout, query_seq, query_pos):
    return (q, w, cache, layout.block_table(), layout.seq_lens_tensor(), torch.tensor(query_seq, dtype=I32),
            torch.tensor(query_pos, dtype=I32))


@given(impl=st.sampled_from(IMPLS), layout=paged(min_seqs=1), topk=st.integers(1, 40), data=st.data())
def test_lightning_over_lossless_fp8_keys_matches_loop(impl, layout, topk, data):
    """Keys whose fp8 form is exact (every row's amax is 1.75 = 448 * 2**-8, values multiples of 0.875), so
    scores are exact and ties real: the fp8 write + read equal the float64 Python loop slot for slot."""
    heads, dim = 3, 8
    gen, q, w, query_seq, query_pos = _query_case(layout, data, heads, dim)
    keys = []
    for n in layout.seq_lens:
        k = torch.randint(-2, 3, (n, dim), generator=gen).float() * 0.875
        k[:, 0] = torch.where(torch.rand(n, generator=gen) < 0.5, -1.75, 1.75)
        keys.append(k)
    cache = _fill_fp8_index_cache(layout, keys)
    args = _args(q, w, cache, layout, query_seq, query_pos)
    got = torch.ops.mla.lightning_index_ref(*args, topk) if impl == "raw" else lightning_index(*args, topk=topk)
    exact = torch.full((layout.num_blocks, layout.block_size, dim), float("nan"))
    for b, k in enumerate(keys):
        for p in range(k.shape[0]):
            exact[layout.where(b, p)] = k[p]
    assert got.tolist() == lightning_ref(q, w, exact, layout, query_seq, query_pos, topk)


@given(layout=paged(min_seqs=1), topk=st.integers(1, 40), q64=st.booleans(), data=st.data())
def test_lightning_fp8_equals_float_path_on_dequantized_keys(layout, topk, q64, data):
    """Random keys: the fp8 cache selects exactly what a float32 cache of its dequantized keys selects."""
    gen, q, w, query_seq, query_pos = _query_case(layout, data, 4, 16)
    q, w = randn(gen, *q.shape, dtype=torch.float32), randn(gen, *w.shape, dtype=torch.float32)
    if q64:
        q, w = q.double(), w.double()
    cache = _fill_fp8_index_cache(layout, [randn(gen, n, 16, dtype=torch.bfloat16) for n in layout.seq_lens])
    got = lightning_index(*_args(q, w, cache, layout, query_seq, query_pos), topk=topk)
    want = lightning_index(*_args(q, w, dequantize_fp8_index(cache), layout, query_seq, query_pos), topk=topk)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_top_k_overlaps_bf16_top_k(seed):
    """V3.2 dims (64 index heads x 128), bf16 N(0, 1) keys and queries, one sequence of 2048 tokens,
    16 queries at positions >= 1024, top 256. Measured (8 seeds): the fp8 cache's top-k shares 98.1% of
    its slots with the bf16 cache's on average, at least 96.5% per query; with top 2048 of 8192 tokens
    (2 seeds) 98.4-98.8% on average, at least 98.3%. The selection over fp8 equals the one over its
    dequantized keys exactly."""
    gen = generator(seed)
    L, T, Hi, d, topk, bs = 2048, 16, 64, 128, 256, 64
    nb = L // bs
    table = torch.randperm(nb, generator=gen).view(1, nb).to(I32)
    pos = torch.arange(L)
    slots = table.long()[0, pos // bs] * bs + pos % bs
    keys = randn(gen, L, d, dtype=torch.bfloat16)
    c16 = torch.full((nb, bs, d), float("nan"), dtype=torch.bfloat16)
    c8 = torch.full((nb, bs, d + 4), POISON, dtype=torch.uint8)
    write_index_cache(keys, slots, c16)
    write_index_cache(keys, slots, c8)
    q, w = randn(gen, T, Hi, d, dtype=torch.bfloat16), randn(gen, T, Hi, dtype=torch.float32)
    rest = (table, torch.tensor([L], dtype=I32), torch.zeros(T, dtype=I32),
            torch.randint(L // 2, L, (T,), generator=gen).to(I32))
    bf16 = lightning_index(q, w, c16, *rest, topk=topk)
    fp8 = lightning_index(q, w, c8, *rest, topk=topk)
    assert torch.equal(fp8, lightning_index(q, w, dequantize_fp8_index(c8), *rest, topk=topk))
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / topk for a, b in zip(bf16, fp8)])
    assert bool((fp8 >= 0).all())
    assert float(overlap.mean()) >= 0.95 and float(overlap.min()) >= 0.90, overlap
    assert float(overlap.mean()) < 1.0  # the keys really were quantized


# ------------------------------------------------------------------------------------------- compile, opcheck

def _step(k_idx, slots, cache, q, w, table, lens, qseq, qpos):
    write_index_cache(k_idx, slots, cache)
    return lightning_index(q, w, cache, table, lens, qseq, qpos, topk=5)


def test_fp8_write_and_select_compile_fullgraph():
    torch._dynamo.reset()
    counters.clear()
    gen = generator(3)
    layout = Paged(4, 6, (9, 6), ((4, 1, 0), (5, 2)), 3, -1)
    cache = _fill_fp8_index_cache(layout, [randn(gen, 8, 16, dtype=torch.float32), randn(gen, 5, 16, dtype=torch.float32)])
    slot = [layout.where(b, p)[0] * 4 + layout.where(b, p)[1] for b, p in ((0, 8), (1, 5))]
    slots = torch.tensor([slot[0], -1, slot[1]], dtype=torch.int64)  # this step's tokens: the last of each
    args = (randn(gen, 3, 16, dtype=torch.float32), slots, cache, randn(gen, 3, 2, 16, dtype=torch.float32),
            randn(gen, 3, 2, dtype=torch.float32), layout.block_table(), layout.seq_lens_tensor(),
            torch.tensor([0, -1, 1], dtype=I32), torch.tensor([8, 0, 5], dtype=I32))
    eager = [a.clone() for a in args]
    want = _step(*eager)
    got = torch.compile(_step, fullgraph=True)(*args)
    assert torch.equal(got, want)
    assert_bitwise_equal(args[2], eager[2], "fp8 index cache written under compile")
    assert dict(counters["graph_break"]) == {}
    torch._dynamo.reset()


@pytest.mark.parametrize("case", ["write", "lightning"])
def test_opcheck_fp8(case):
    gen = generator(13)
    table = torch.randperm(6, generator=gen).to(I32).reshape(2, 3)
    cache = quantize_fp8_index(randn(gen, 6, 4, 16, dtype=torch.float32))
    if case == "write":
        torch.library.opcheck(torch.ops.mla.write_index_cache_ref.default,
                              (randn(gen, 3, 16, dtype=torch.float32), torch.tensor([3, -1, 17], dtype=I32), cache))
    else:
        torch.library.opcheck(torch.ops.mla.lightning_index_ref.default,
                              (randn(gen, 3, 2, 16, dtype=torch.float32), randn(gen, 3, 2, dtype=torch.float32), cache,
                               table, torch.tensor([9, 0], dtype=I32), torch.tensor([0, -1, 0], dtype=I32),
                               torch.tensor([8, 0, 3], dtype=I32), 5))


# ------------------------------------------------------------------------------------------- malformed input

@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("cache,exc,match", [
    (torch.zeros(6, 4, 16, dtype=torch.uint8), ValueError, r"k_idx_cache must have shape \[\*, \*, 20\]"),
    (torch.zeros(6, 4, 20, dtype=torch.int8), TypeError, r"k_idx_cache must have dtype"),
], ids=["fp8-width", "int8"])
def test_malformed_fp8_cache_is_named_and_nothing_written(raw, cache, exc, match):
    k_idx = randn(generator(2), 2, 16, dtype=torch.float32)
    slots = torch.tensor([0, 5], dtype=I32)
    before = cache.clone()
    write = torch.ops.mla.write_index_cache_ref if raw else write_index_cache
    with pytest.raises(exc, match="mla.write_index_cache: " + match):
        write(k_idx, slots, cache)
    assert torch.equal(cache, before)
    with pytest.raises(exc, match="mla.lightning_index: " + match):
        args = (k_idx[:, None], torch.ones(2, 1), cache, torch.zeros(1, 1, dtype=I32), torch.tensor([1], dtype=I32),
                torch.zeros(2, dtype=I32), torch.zeros(2, dtype=I32))
        torch.ops.mla.lightning_index_ref(*args, 2) if raw else lightning_index(*args, topk=2)


# ------------------------------------------------------------------------------------------- CUDA

@pytest.mark.cuda
def test_cuda_fp8_index_matches_cpu_bitwise():
    """On the GPU (reference ops, the only backend): the same bytes (scales correctly rounded: a tensor
    divisor) and the same selection as on the CPU."""
    gen = generator(21)
    layout = Paged(64, 40, (700, 1500), (tuple(range(0, 11)), tuple(range(12, 36))), 24, -1)
    keys = [randn(gen, n, 128, dtype=torch.bfloat16) * 2.0 ** float(e) for n, e in zip(layout.seq_lens, (-9, 5))]
    cpu = _fill_fp8_index_cache(layout, keys)
    assert_bitwise_equal(quantize_fp8_index(keys[1].cuda()).cpu(), quantize_fp8_index(keys[1]), "CUDA quantize")
    gpu = torch.full_like(cpu, POISON).cuda()
    for b, k in enumerate(keys):
        slots = [layout.where(b, p)[0] * 64 + layout.where(b, p)[1] for p in range(k.shape[0])]
        write_index_cache(k.cuda(), torch.tensor(slots, dtype=torch.int64, device="cuda"), gpu)
    assert_bitwise_equal(gpu.cpu(), cpu, "fp8 index cache written on CUDA")
    T = 8
    q, w = randn(gen, T, 64, 128, dtype=torch.bfloat16), randn(gen, T, 64, dtype=torch.float32)
    qseq = torch.tensor([0, 1] * 4, dtype=I32)
    qpos = torch.tensor([699, 1499, 300, 1000, 5, 64, 650, 1200], dtype=I32)
    args = (layout.block_table(), layout.seq_lens_tensor(), qseq, qpos)
    want = lightning_index(q, w, cpu, *args, topk=256)
    got = lightning_index(q.cuda(), w.cuda(), gpu, *(a.cuda() for a in args), topk=256)
    # float32 scores summed in another order on the GPU: compare as sets, allowing a swap at a near-tie
    overlap = [len(set(a.tolist()) & set(b.tolist())) / len(set(b.tolist())) for a, b in zip(got.cpu(), want)]
    assert min(overlap) >= 0.99, overlap
