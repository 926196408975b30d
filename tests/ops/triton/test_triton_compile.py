"""The Triton ops under opcheck, torch.compile(fullgraph=True) and CUDA-graph capture/replay.

CUDA tests check that Inductor pastes the kernel source into its output (no opaque call to the
``mla::*_triton`` op), that compiled code does not copy the KV cache, and that a captured decode
step (cache write + decode) replays correctly after seq_lens, block tables and slots change. The
CPU tests (Triton installed, no GPU needed) check the reference branch inside each ``triton_op``.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch.library import opcheck

import mla_compile  # noqa: F401
from tests.cuda_capture import capture
from _triton_test_util import assert_attention_close, cu_from_lens, paged_cache
from mla_compile.ops import decode, gather_latent_cache, merge_attn_states, prefill, write_latent_cache

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
SCALE = 1 / math.sqrt(192)


def _load_all():
    for name in ("decode", "prefill", "merge", "cache_write", "gather"):
        importlib.import_module(f"mla_compile.ops.triton.{name}")


def _cases(device, dtype=torch.bfloat16):
    """(op, args) for every Triton op: small shapes with zero lengths and padding."""
    gen = torch.Generator().manual_seed(0)
    cache, table, lens = paged_cache([70, 0, 5, 130], 16, 80, dtype, device=device, gen=gen)
    cache = cache.nan_to_num()
    q = torch.randn(4, 2, 4, 80, generator=gen).to(device, dtype)
    cq, ck = cu_from_lens([5, 0, 9], device), cu_from_lens([7, 3, 9], device)
    pq = torch.randn(16, 2, 48, generator=gen).to(device, dtype)
    pk = torch.randn(19, 2, 48, generator=gen).to(device, dtype)
    pv = torch.randn(19, 2, 32, generator=gen).to(device, dtype)
    oa, ob = torch.randn(2, 6, 3, 40, generator=gen).to(device, dtype)
    la, lb = torch.randn(2, 6, 3, generator=gen).to(device)
    la[0, 0] = float("-inf")
    slots = torch.tensor([3, -1, 17, 40], dtype=torch.int32, device=device)
    lat, kpe = torch.randn(4, 64, generator=gen).to(device, dtype), torch.randn(4, 16, generator=gen).to(device, dtype)
    gcu = cu_from_lens([10, 0, 4, 60], device)
    starts = torch.tensor([0, 3, 1, 5], dtype=torch.int32, device=device)
    work = torch.zeros(80, 80, dtype=dtype, device=device)
    m = torch.ops.mla
    return {
        "decode": (m.decode_triton.default, (q, cache, table, lens, SCALE, 64)),
        "prefill": (m.prefill_triton.default, (pq, pk, pv, cq, ck, SCALE, True)),
        "merge": (m.merge_attn_states_triton.default, (oa, la, ob, lb)),
        "cache_write": (m.write_latent_cache_triton.default, (lat, kpe, slots, cache.clone())),
        "gather": (m.gather_latent_cache_triton.default, (cache, table, gcu, starts, work)),
    }


REFS = {"decode": "decode_ref", "prefill": "prefill_ref", "merge": "merge_attn_states_ref",
        "cache_write": "write_latent_cache_ref", "gather": "gather_latent_cache_ref"}
MUTATED = {"cache_write": 3, "gather": 4}


def _clone_args(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _compare(name, op, args, fn):
    """``fn(op)`` on fresh copies vs the reference op; compares outputs or the mutated argument."""
    a1, a2 = _clone_args(args), _clone_args(args)
    got = fn(op, a1)
    want = getattr(torch.ops.mla, REFS[name]).default(*a2)
    if name in MUTATED:
        i = MUTATED[name]
        torch.testing.assert_close(a1[i], a2[i], atol=0, rtol=0, equal_nan=True)
    else:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("name", list(REFS))
def test_cpu_branch_opcheck_and_compile(name):
    _load_all()
    op, args = _cases("cpu", torch.float32)[name]
    opcheck(op, _clone_args(args))
    _compare(name, op, args, lambda op, a: op(*a))
    torch._dynamo.reset()
    _compare(name, op, args, lambda op, a: torch.compile(lambda *x: op(*x), fullgraph=True)(*a))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(REFS))
def test_cuda_opcheck(name):
    _load_all()
    op, args = _cases("cuda")[name]
    opcheck(op, _clone_args(args))
    _compare(name, op, args, lambda op, a: op(*a))


KERNELS = {"decode": "_decode_split_kernel", "prefill": "_prefill_kernel", "merge": "_merge_kernel",
           "cache_write": "_cache_write_kernel", "gather": "_gather_kernel"}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(REFS))
def test_compiled_code_inlines_kernel(name):
    from torch._inductor.utils import run_and_get_code

    _load_all()
    op, args = _cases("cuda")[name]
    torch._dynamo.reset()
    captured = {}

    def run(op, a):
        out, codes = run_and_get_code(torch.compile(lambda *x: op(*x), fullgraph=True), *a)
        captured["code"] = "\n".join(codes)
        return out

    _compare(name, op, args, run)
    code = captured["code"]
    assert f"def {KERNELS[name]}(" in code, "the Triton kernel source is not in Inductor's output"
    assert f"mla.{op._schema.name.split('::')[1]}" not in code, "compiled code still calls the op opaquely"



@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mutating", [False, True])
def test_compiled_code_never_copies_the_cache(mutating):
    """Peak memory of a compiled decode / cache write stays far below the cache size."""
    gen = torch.Generator().manual_seed(1)
    cache, table, lens = paged_cache([4096] * 64, 64, 576, torch.bfloat16, gen=gen)  # ~300 MB
    cache = cache.nan_to_num()
    q = torch.randn(64, 1, 16, 576, generator=gen).to("cuda", torch.bfloat16)
    lat, kpe = torch.randn(64, 512, device="cuda").bfloat16(), torch.randn(64, 64, device="cuda").bfloat16()
    slots = torch.arange(64, dtype=torch.int32, device="cuda") * 7
    torch._dynamo.reset()
    if mutating:
        fn = torch.compile(lambda: write_latent_cache(lat, kpe, slots, cache, backend="triton"), fullgraph=True)
    else:
        fn = torch.compile(lambda: decode(q, cache, table, lens, SCALE, backend="triton"), fullgraph=True)
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < cache.nbytes // 4, f"compiled code allocated {extra} bytes for a {cache.nbytes}-byte cache"


@pytest.mark.cuda
@needs_cuda
def test_compiled_decode_dynamic_batch_one_graph():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda q, c, t, n: decode(q, c, t, n, SCALE, backend="triton"), fullgraph=True)
    for B in (16, 24, 40):
        gen = torch.Generator().manual_seed(B)
        lens = torch.randint(0, 900, (B,), generator=gen).tolist()
        cache, table, seq_lens = paged_cache(lens, 64, 576, torch.bfloat16, gen=gen, table_cols=16)
        q = torch.randn(B, 1, 16, 576, generator=gen).to("cuda", torch.bfloat16)
        for t in (q, table, seq_lens, cache):
            torch._dynamo.mark_dynamic(t, 0)
        out, lse = fn(q, cache, table, seq_lens)
        ref, ref_lse = torch.ops.mla.decode_ref(q.double(), cache.double(), table, seq_lens, SCALE, 512)
        assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _step(q, latent, k_pe, slots, cache, table, seq_lens):
    write_latent_cache(latent, k_pe, slots, cache, backend="triton")
    return decode(q, cache, table, seq_lens, SCALE, backend="triton")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_replay_with_new_metadata(compiled):
    """Capture write + decode once; replay with new seq_lens, block tables, slots and rows."""
    gen = torch.Generator().manual_seed(2)
    B, H, bs, cols = 12, 16, 64, 8
    nb = B * cols + 5
    dev = "cuda"
    cache = (torch.randn(nb, bs, 576, generator=gen) * 0.5).to(dev, torch.bfloat16)
    static = {
        "q": torch.zeros(B, 1, H, 576, device=dev, dtype=torch.bfloat16),
        "latent": torch.zeros(B, 512, device=dev, dtype=torch.bfloat16),
        "k_pe": torch.zeros(B, 64, device=dev, dtype=torch.bfloat16),
        "slots": torch.full((B,), -1, device=dev, dtype=torch.int32),
        "table": torch.zeros(B, cols, device=dev, dtype=torch.int32),
        "seq_lens": torch.zeros(B, device=dev, dtype=torch.int32),
    }
    torch._dynamo.reset()
    fn = torch.compile(_step, fullgraph=True) if compiled else _step

    def call():
        s = static
        return fn(s["q"], s["latent"], s["k_pe"], s["slots"], cache, s["table"], s["seq_lens"])

    graph, (out, lse) = capture(call)

    for _ in range(3):
        lens = torch.randint(0, cols * bs + 1, (B,), generator=gen)
        lens[0], lens[1] = 0, cols * bs  # padding entry and a full table
        table = torch.randperm(nb, generator=gen)[: B * cols].view(B, cols).to(torch.int32)
        last = (lens - 1).clamp(min=0)
        slots = torch.where(lens > 0, table[torch.arange(B), last // bs] * bs + last % bs, -1).to(torch.int32)
        new = {"q": torch.randn(B, 1, H, 576, generator=gen), "latent": torch.randn(B, 512, generator=gen),
               "k_pe": torch.randn(B, 64, generator=gen), "slots": slots, "table": table, "seq_lens": lens}
        for k, v in new.items():
            static[k].copy_(v.to(dev))
        ref_cache = cache.clone()
        torch.ops.mla.write_latent_cache_ref(static["latent"], static["k_pe"], static["slots"], ref_cache)
        ref, ref_lse = torch.ops.mla.decode_ref(static["q"].double(), ref_cache.double(), static["table"],
                                                static["seq_lens"], SCALE, 512)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, ref_cache), "the captured cache write wrote the wrong rows"
        assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_prefill_merge_gather():
    """A chunked-prefill step (gather context, prefill new tokens, merge) captured, replayed with new lengths."""
    gen = torch.Generator().manual_seed(3)
    N, H, bs, cols, T, S = 4, 8, 16, 8, 96, 128
    dev = "cuda"
    cache = (torch.randn(N * cols + 2, bs, 192, generator=gen)).to(dev, torch.bfloat16)
    st = {"q": torch.zeros(T, H, 192, device=dev, dtype=torch.bfloat16),
          "k": torch.zeros(T, H, 192, device=dev, dtype=torch.bfloat16),
          "v": torch.zeros(T, H, 128, device=dev, dtype=torch.bfloat16),
          "cu": torch.zeros(N + 1, device=dev, dtype=torch.int32),
          "cu_ctx": torch.zeros(N + 1, device=dev, dtype=torch.int32),
          "starts": torch.zeros(N, device=dev, dtype=torch.int32),
          "table": torch.zeros(N, cols, device=dev, dtype=torch.int32)}
    work = torch.zeros(S, 192, device=dev, dtype=torch.bfloat16)

    def step():
        gather_latent_cache(cache, st["table"], st["cu_ctx"], st["starts"], work, backend="triton")
        ctx_k = work.view(S, 1, 192).expand(S, H, 192)
        ctx_v = work[:, :128].reshape(S, 1, 128).expand(S, H, 128)
        o1, l1 = prefill(st["q"], ctx_k, ctx_v, st["cu"], st["cu_ctx"], SCALE, causal=False, backend="triton")
        o2, l2 = prefill(st["q"], st["k"], st["v"], st["cu"], st["cu"], SCALE, causal=True, backend="triton")
        return merge_attn_states(o1, l1, o2, l2, backend="triton")

    graph, (out, lse) = capture(step)

    for _ in range(3):
        new_lens = torch.randint(0, T // N + 1, (N,), generator=gen)
        ctx_lens = new_lens + torch.randint(0, S // N - T // N + 1, (N,), generator=gen)  # keys >= queries
        starts = torch.randint(0, cols * bs - S // N, (N,), generator=gen)
        table = torch.randperm(N * cols + 2, generator=gen)[: N * cols].view(N, cols)
        vals = {"q": torch.randn(T, H, 192, generator=gen), "k": torch.randn(T, H, 192, generator=gen),
                "v": torch.randn(T, H, 128, generator=gen), "cu": cu_from_lens(new_lens.tolist()),
                "cu_ctx": cu_from_lens(ctx_lens.tolist()), "starts": starts, "table": table}
        for k, v in vals.items():
            st[k].copy_(v.to(dev))
        ref_work = torch.zeros_like(work)
        torch.ops.mla.gather_latent_cache_ref(cache, st["table"], st["cu_ctx"], st["starts"], ref_work)
        ck = ref_work.view(S, 1, 192).expand(S, H, 192).contiguous()
        cv = ref_work[:, :128].reshape(S, 1, 128).expand(S, H, 128).contiguous()
        r1 = torch.ops.mla.prefill_ref(st["q"].double(), ck.double(), cv.double(), st["cu"], st["cu_ctx"], SCALE, False)
        r2 = torch.ops.mla.prefill_ref(st["q"].double(), st["k"].double(), st["v"].double(), st["cu"], st["cu"],
                                       SCALE, True)
        ref, ref_lse = torch.ops.mla.merge_attn_states_ref(r1[0], r1[1].float(), r2[0], r2[1].float())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(work, ref_work)
        assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)
