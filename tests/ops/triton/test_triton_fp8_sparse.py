"""The Triton fp8-cache write, fp8 decode and sparse decode: CUDA shapes against the reference ops
(float64 math), the fp8-vs-bf16 error bound, torch.compile(fullgraph=True), CUDA-graph replay with
changed indices/lengths, and (CPU, Triton installed) the reference branch of each ``triton_op``."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch.library import opcheck

import mla_compile  # noqa: F401
from tests.cuda_capture import capture
from _sparse_test_util import fp8_paged, float_paged, fp8_width, lens_with_empty, topk_indices, window_indices
from _triton_test_util import assert_attention_close, opcheck_and_compile, poison_allocator
from mla_compile.ops import decode, decode_fp8, sparse_decode, write_latent_cache_fp8

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA GPU and triton")
SCALE = 1 / math.sqrt(192)
DC, DR = 512, 64
BF16_FP8_TOL = 1.5e-2  # sparse decode: bf16 output of keys dequantized to bf16 (one more rounding than the bf16 path)
# sparse decode: LSE of bf16 q against keys dequantized then rounded to bf16 (relative 2**-9 per element; the reference
# uses the exact dequantized values): score errors ~ scale * sqrt(576) * 2**-9 / sqrt(3) ~ 2e-3 each, and
# the max over ~10^4 short-sequence rows reached 7.2e-3 on the H200 (B=33 H=128 s_q=2).
FP8_LSE_ATOL = 1.5e-2


def _load():
    for name in ("fp8_cache_write", "fp8_decode", "sparse_decode"):
        importlib.import_module(f"mla_compile.ops.triton.{name}")


_lens = lens_with_empty


# ------------------------------------------------------------------------------------------ CPU branch

def _cpu_cases():
    gen = torch.Generator().manual_seed(0)
    cache, table, lens, _ = fp8_paged([70, 0, 5], 16, 128, 16, "cpu", gen)
    q = torch.randn(3, 2, 4, 144, generator=gen)
    idx = window_indices(table, lens, 16, 4, 8, 12).expand(3, 2, 12).contiguous()
    lat, kpe = torch.randn(4, 128, generator=gen), torch.randn(4, 16, generator=gen)
    slots = torch.tensor([3, -1, 17, 40], dtype=torch.int32)
    m = torch.ops.mla
    return {
        "write": (m.write_latent_cache_fp8_triton.default, m.write_latent_cache_fp8_ref.default,
                  (lat, kpe, slots, cache.clone())),
        "decode": (m.decode_fp8_triton.default, m.decode_fp8_ref.default, (q, cache, table, lens, SCALE, 128)),
        "sparse": (m.sparse_decode_triton.default, m.sparse_decode_ref.default, (q, cache, idx, SCALE, 128)),
    }


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("name", ["write", "decode", "sparse"])
def test_cpu_branch_opcheck_and_compile(name):
    _load()
    op, ref, args = _cpu_cases()[name]
    opcheck_and_compile(op, ref, args, mutated=3 if name == "write" else None)


# ------------------------------------------------------------------------------------------ fp8 cache write

@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("bs,dtype,T", [(64, torch.bfloat16, 4096), (16, torch.float32, 333), (64, torch.float16, 1)])
def test_fp8_write_bytes_equal_reference(bs, dtype, T):
    gen = torch.Generator().manual_seed(T)
    nb = T // bs + 8
    cache = torch.full((nb, bs, fp8_width(DC, DR)), 0xFF, dtype=torch.uint8, device="cuda")
    latent = (torch.randn(T, DC, generator=gen) * torch.logspace(-6, 3, T)[:, None]).to("cuda", dtype)
    k_pe = torch.randn(T, DR, generator=gen).to("cuda", dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:T].to("cuda", torch.int32)
    slots[::7] = -1
    expected = cache.clone()
    torch.ops.mla.write_latent_cache_fp8_ref(latent, k_pe, slots, expected)
    write_latent_cache_fp8(latent, k_pe, slots, cache, backend="triton")
    torch.cuda.synchronize()
    assert torch.equal(cache, expected), f"{int((cache != expected).sum())} bytes differ from the reference"


# ------------------------------------------------------------------------------------------ fp8 decode

def _fp8_decode(B, H, s_q, lens, bs, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens, rows = fp8_paged(lens, bs, DC, DR, "cuda", gen)
    q = torch.randn(B, s_q, H, DC + DR, generator=gen).to("cuda", dtype)
    poison_allocator()
    out, lse = decode_fp8(q, cache, table, seq_lens, SCALE, backend="triton")
    torch.cuda.synchronize()
    ref, ref_lse = torch.ops.mla.decode_fp8_ref(q.double(), cache, table, seq_lens, SCALE, DC)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous() and lse.is_contiguous()
    # the dense kernel keeps the keys exact (codes times float32 scales): the bf16 path's tolerances
    assert_attention_close(out, lse, ref, ref_lse, dtype)
    return q, rows, table, seq_lens, out, lse


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("B,H,s_q,max_len,bs", [
    (1, 16, 1, 16384, 64),     # one long sequence: many splits
    (128, 16, 1, 2048, 64),    # the memory-bound shape, one wave
    (64, 128, 1, 2048, 64),    # compute-bound heads
    (33, 128, 2, 1024, 64),    # MTP: 2 queries per sequence
    (7, 32, 4, 300, 16),       # block size 16, queries that see nothing
])
def test_fp8_decode_shapes(B, H, s_q, max_len, bs):
    gen = torch.Generator().manual_seed(B * 100 + H)
    _fp8_decode(B, H, s_q, _lens(B, max_len, gen), bs, torch.bfloat16, seed=B + H)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_decode_dtypes(dtype):
    gen = torch.Generator().manual_seed(5)
    _fp8_decode(6, 16, 1, _lens(6, 700, gen), 64, dtype)


@pytest.mark.cuda
@needs_cuda
def test_fp8_decode_error_against_bf16_path():
    """The documented bound of ops/fp8_cache.py, for the kernel: fp8 vs bf16 decode of the same tokens."""
    gen = torch.Generator().manual_seed(11)
    lens = _lens(16, 3000, gen)
    q, rows, table, seq_lens, out, lse = _fp8_decode(16, 16, 1, lens, 64, torch.bfloat16, seed=11)
    bf16_cache = rows.nan_to_num().bfloat16()
    ref, ref_lse = decode(q, bf16_cache, table, seq_lens, SCALE, backend="triton")
    live = seq_lens > 0
    o, r = out[live].double(), ref[live].double()
    assert float((o - r).norm() / r.norm()) <= 0.08
    assert float((o - r).abs().max()) <= 0.15 * float(r.abs().max())
    assert float((lse[live] - ref_lse[live]).abs().max()) <= 0.1


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_dense_decode_dynamic_batch_no_recompile(fp8):
    """A dynamic batch crossing the SM count (one wave of programs) compiles once: the split plan of a
    symbolic batch adds no guard; every size still matches the float64 reference."""
    gen = torch.Generator().manual_seed(21 + fp8)
    batches = (2, 64, torch.cuda.get_device_properties(0).multi_processor_count + 8)
    lens = _lens(max(batches), 1500, gen)
    if fp8:
        cache, table, seq_lens, _ = fp8_paged(lens, 64, DC, DR, "cuda", gen)
        fn, ref_op = decode_fp8, torch.ops.mla.decode_fp8_ref
    else:
        cache, table, seq_lens = float_paged(lens, 64, DC + DR, torch.bfloat16, "cuda", gen)
        fn, ref_op = decode, torch.ops.mla.decode_ref
    q = torch.randn(max(batches), 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    step = torch.compile(lambda q, t, s: fn(q, cache, t, s, SCALE, backend="triton"), fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for i, b in enumerate(batches):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out, lse = step(q[:b], table[:b], seq_lens[:b])
        ref, ref_lse = ref_op(q[:b].double(), cache if fp8 else cache.double(), table[:b], seq_lens[:b], SCALE, DC)
        assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)


# ------------------------------------------------------------------------------------------ sparse decode

def _sparse_check(q, cache, idx, dtype, fp8):
    poison_allocator()
    out, lse = sparse_decode(q, cache, idx, SCALE, backend="triton")
    torch.cuda.synchronize()
    ref, ref_lse = torch.ops.mla.sparse_decode_ref(q.double(), cache if fp8 else cache.double().nan_to_num(), idx,
                                                   SCALE, DC)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_attention_close(out, lse, ref, ref_lse, dtype, tol=BF16_FP8_TOL if fp8 and dtype == torch.bfloat16 else None,
                           lse_atol=FP8_LSE_ATOL if fp8 and dtype == torch.bfloat16 else 2e-3)


def _cache(fp8, lens, bs, gen, dtype=torch.bfloat16):
    if fp8:
        return fp8_paged(lens, bs, DC, DR, "cuda", gen)[:3]
    return float_paged(lens, bs, DC + DR, dtype, "cuda", gen)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("B,H,s_q,max_len,topk", [(4, 16, 1, 8192, 2048), (64, 16, 1, 3000, 2048),
                                                   (32, 128, 1, 2500, 2048), (8, 64, 2, 600, 256)])
def test_sparse_decode_topk_shapes(fp8, B, H, s_q, max_len, topk):
    gen = torch.Generator().manual_seed(B + H + fp8)
    lens = _lens(B, max_len, gen)
    cache, table, seq_lens = _cache(fp8, lens, 64, gen)
    idx = topk_indices(table, seq_lens, 64, s_q, topk, gen)
    q = torch.randn(B, s_q, H, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    _sparse_check(q, cache, idx, torch.bfloat16, fp8)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_decode_sink_window(fp8, dtype):
    gen = torch.Generator().manual_seed(3 + fp8)
    lens = _lens(24, 5000, gen)
    cache, table, seq_lens = _cache(fp8, lens, 64, gen, dtype)
    idx = window_indices(table, seq_lens, 64, sink=16, window=1024, max_kv=1040)
    q = torch.randn(24, 1, 16, DC + DR, generator=gen).to("cuda", dtype)
    _sparse_check(q, cache, idx, dtype, fp8)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_decode_compiled_fullgraph(fp8):
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(9)
    lens = _lens(8, 2000, gen)
    cache, table, seq_lens = _cache(fp8, lens, 64, gen)
    q = torch.randn(8, 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    torch._dynamo.reset()

    def step(q, cache, table, seq_lens):
        idx = window_indices(table, seq_lens, 64, sink=4, window=512, max_kv=516)
        return sparse_decode(q, cache, idx, SCALE, backend="triton")

    (out, lse), codes = run_and_get_code(torch.compile(step, fullgraph=True), q, cache, table, seq_lens)
    assert "def _sparse_split_kernel(" in "\n".join(codes), "the Triton kernel source is not in Inductor's output"
    want, want_lse = step(q, cache, table, seq_lens)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


@pytest.mark.cuda
@needs_cuda
def test_fp8_write_and_decode_compiled_fullgraph():
    gen = torch.Generator().manual_seed(10)
    lens = _lens(8, 1500, gen)
    cache, table, seq_lens, _ = fp8_paged(lens, 64, DC, DR, "cuda", gen)
    q = torch.randn(8, 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    lat = torch.randn(8, DC, generator=gen).to("cuda", torch.bfloat16)
    kpe = torch.randn(8, DR, generator=gen).to("cuda", torch.bfloat16)
    last = (seq_lens.long() - 1).clamp(min=0)
    slots = torch.where(seq_lens > 0, table.long()[torch.arange(8, device="cuda"), last // 64] * 64 + last % 64, -1)

    def step(q, lat, kpe, slots, cache, table, seq_lens):
        write_latent_cache_fp8(lat, kpe, slots, cache, backend="triton")
        return decode_fp8(q, cache, table, seq_lens, SCALE, backend="triton")

    torch._dynamo.reset()
    c1, c2 = cache.clone(), cache.clone()
    out, lse = torch.compile(step, fullgraph=True)(q, lat, kpe, slots, c1, table, seq_lens)
    want, want_lse = step(q, lat, kpe, slots, c2, table, seq_lens)
    assert torch.equal(c1, c2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_replay_with_new_indices(fp8, compiled):
    """Capture one sparse decode; replay with new index lists (all -1 rows included), queries and lengths."""
    gen = torch.Generator().manual_seed(20 + fp8)
    B, s_q, H, topk = 12, 2, 16, 512
    lens = [3000] * B
    cache, table, seq_lens = _cache(fp8, lens, 64, gen)
    st = {"q": torch.zeros(B, s_q, H, DC + DR, device="cuda", dtype=torch.bfloat16),
          "idx": torch.full((B, s_q, topk), -1, device="cuda", dtype=torch.int32)}
    torch._dynamo.reset()
    fn = (lambda q, i: sparse_decode(q, cache, i, SCALE, backend="triton"))
    fn = torch.compile(fn, fullgraph=True) if compiled else fn
    graph, (out, lse) = capture(lambda: fn(st["q"], st["idx"]))
    for _ in range(3):
        new_lens = torch.tensor(_lens(B, 3000, gen), dtype=torch.int32, device="cuda")
        idx = topk_indices(table, new_lens, 64, s_q, topk, gen)
        idx[2] = -1  # a fully padded row
        st["idx"].copy_(idx)
        st["q"].copy_(torch.randn(B, s_q, H, DC + DR, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = torch.ops.mla.sparse_decode_ref(st["q"].double(), cache if fp8 else cache.double().nan_to_num(),
                                                       st["idx"], SCALE, DC)
        assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16, tol=BF16_FP8_TOL if fp8 else None,
                               lse_atol=FP8_LSE_ATOL if fp8 else 2e-3)
        assert torch.isinf(lse[2]).all() and (out[2] == 0).all()


@pytest.mark.cuda
@needs_cuda
def test_cuda_opcheck():
    _load()
    gen = torch.Generator().manual_seed(1)
    cache, table, lens, _ = fp8_paged([70, 0, 130], 64, DC, DR, "cuda", gen)
    q = torch.randn(3, 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    idx = window_indices(table, lens, 64, 4, 32, 36)
    lat = torch.randn(4, DC, generator=gen).to("cuda", torch.bfloat16)
    kpe = torch.randn(4, DR, generator=gen).to("cuda", torch.bfloat16)
    slots = torch.tensor([3, -1, 17, 40], dtype=torch.int32, device="cuda")
    m = torch.ops.mla
    opcheck(m.write_latent_cache_fp8_triton.default, (lat, kpe, slots, cache.clone()))
    opcheck(m.decode_fp8_triton.default, (q, cache, table, lens, SCALE, DC))
    opcheck(m.sparse_decode_triton.default, (q, cache, idx, SCALE, DC))
