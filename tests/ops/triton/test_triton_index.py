"""The Triton index-key cache write and lightning indexer at DeepSeek-V3.2 dims (64 index heads x 128,
block 64, a few thousand tokens, fp8 and bf16 caches) against the reference ops and float64 scores;
the lightning indexer under torch.compile(fullgraph=True) and CUDA-graph replay with changed lengths;
and (CPU, Triton installed) the reference branch of each ``triton_op``.

The test bodies take their device and dims from module globals so that a CPU dry run under the
interpreter can shrink them (``DEVICE``, ``HEADS``, ``DIM``, ``LENS``, ``PER_SEQ``, ``TOPK``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mla_compile  # noqa: F401
from _index_test_util import assert_valid_topk, index_paged, index_queries, lightning_scores64
from _triton_test_util import opcheck_and_compile, poison_allocator
from mla_compile.ops import lightning_index, write_index_cache
from tests.cuda_capture import capture

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA GPU and triton")
DEVICE = "cuda"
HEADS, DIM, BS = 64, 128, 64
LENS = [3000, 1500, 700, 0, 64]
PER_SEQ = [256, 64, 1, 1, 5]  # a prefill chunk, a shorter one, decode tokens, a token of an empty sequence
TOPK = 2048
SCORE_ATOL = 2e-4  # bf16 x bf16 (or e4m3 codes) products, float32 accumulation over 128, scores ~ 1-10
TIE_TOL = 2 * SCORE_ATOL  # scores closer than this may come out in either order


def _load():
    for name in ("index_cache_write", "lightning_index"):
        importlib.import_module(f"mla_compile.ops.triton.{name}")


def _write(k_idx, slots, cache):
    if torch.device(DEVICE).type == "cuda":
        write_index_cache(k_idx, slots, cache, backend="triton")
    else:
        from mla_compile.ops.triton import index_cache_write as tw
        tw._launch(k_idx, slots, cache)


def _index(*args, topk):
    if torch.device(DEVICE).type == "cuda":
        return lightning_index(*args, topk=topk, backend="triton")
    from mla_compile.ops.triton import lightning_index as tli
    return tli._launch(*args, topk)


# ------------------------------------------------------------------------------------------ CPU branch

def _cpu_cases():
    gen = torch.Generator().manual_seed(0)
    cache, table, lens, _ = index_paged([40, 0, 9], 16, 32, "fp8", "cpu", gen)
    q, w, qseq, qpos = index_queries([40, 0, 9], [3, 1, 2], 4, 32, torch.float32, "cpu", gen)
    slots = torch.tensor([3, -1, 17, 40], dtype=torch.int32)
    m = torch.ops.mla
    return {
        "write": (m.write_index_cache_triton.default, m.write_index_cache_ref.default,
                  (torch.randn(4, 32, generator=gen), slots, cache.clone())),
        "lightning": (m.lightning_index_triton.default, m.lightning_index_ref.default,
                      (q, w, cache, table.clamp(max=cache.shape[0] - 1), lens, qseq, qpos, 10)),
    }


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("name", ["write", "lightning"])
def test_cpu_branch_opcheck_and_compile(name):
    _load()
    op, ref, args = _cpu_cases()[name]
    opcheck_and_compile(op, ref, args, mutated=2 if name == "write" else None)


# ------------------------------------------------------------------------------------------ cache write

def _write_case(kind, src, gen, T=3000, nb=64):
    width = DIM + 4 if kind == "fp8" else DIM
    cache = (torch.full((nb, BS, width), 0xFF, dtype=torch.uint8) if kind == "fp8"
             else torch.full((nb, BS, width), float("nan"), dtype=kind)).to(DEVICE)
    # magnitudes over 11 decades (subnormal e4m3 quotients), an all-zero key
    k_idx = (torch.randn(T, DIM, generator=gen) * torch.logspace(-8, 3, T)[torch.randperm(T, generator=gen), None])
    k_idx[7] = 0
    slots = torch.randperm(nb * BS, generator=gen)[:T].to(torch.int32)
    slots[::97] = -1
    return k_idx.to(DEVICE, src), slots.to(DEVICE), cache


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind,src", [("fp8", torch.bfloat16), ("fp8", torch.float32), (torch.bfloat16, torch.float32)])
def test_index_write_bytes_equal_reference(kind, src):
    gen = torch.Generator().manual_seed(5)
    k_idx, slots, cache = _write_case(kind, src, gen)
    expected = cache.clone()
    torch.ops.mla.write_index_cache_ref(k_idx, slots, expected)
    _write(k_idx, slots, cache)
    got, want = cache.view(torch.uint8), expected.view(torch.uint8)
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ from the reference"


# ------------------------------------------------------------------------------------------ lightning indexer

def _case(kind, ints, seed):
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens, keys = index_paged(LENS, BS, DIM, kind, DEVICE, gen, ints=ints)
    q, w, qseq, qpos = index_queries(LENS, PER_SEQ, HEADS, DIM, torch.bfloat16, DEVICE, gen, ints=ints)
    return (q, w, cache, table, seq_lens, qseq, qpos), keys


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fp8", torch.bfloat16])
def test_lightning_exact_inputs_equal_reference(kind):
    """Exact integer inputs (real ties, every score exact in float32): element-for-element equal to the
    reference op in float64 (stable sort) and in float32."""
    args, _ = _case(kind, ints=True, seed=1)
    poison_allocator(device=DEVICE)
    got = _index(*args, topk=TOPK)
    q, w = args[:2]
    want64 = torch.ops.mla.lightning_index_ref(q.double(), w.double(), *args[2:], TOPK)
    want32 = torch.ops.mla.lightning_index_ref(*args, TOPK)
    assert torch.equal(got, want64)
    assert torch.equal(got, want32)
    assert (got == -1).any() and (got[:, -1] >= 0).any()  # some rows padded, some full


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fp8", torch.bfloat16])
def test_lightning_random_inputs_match_float64(kind):
    """Gaussian inputs: scores within float32 error of float64 (the -inf pattern exact, every element
    written) and a valid top-k of the float64 scores, equal to its top set wherever that is clear."""
    from mla_compile.ops.triton import lightning_index as tli

    args, keys = _case(kind, ints=False, seed=2)
    q, w, cache, table, seq_lens, qseq, qpos = args
    want = lightning_scores64(q, w, keys, table, seq_lens, qseq, qpos)
    scores = torch.full(want.shape, float("nan"), device=DEVICE)
    tli.lightning_scores(*args, out=scores)
    assert not scores.isnan().any(), "unwritten scores"
    assert torch.equal(torch.isinf(scores), torch.isinf(want)), "-inf pattern differs"
    fin = torch.isfinite(want)
    torch.testing.assert_close(scores.double()[fin], want[fin], atol=SCORE_ATOL, rtol=1e-5)
    poison_allocator(device=DEVICE)
    got = _index(*args, topk=TOPK)
    clear = assert_valid_topk(got, want, table, seq_lens, qseq, BS, TOPK, tol=TIE_TOL)
    assert clear >= 0.5 * q.shape[0], f"only {clear} of {q.shape[0]} rows had a clear top set"


@needs_cuda
@pytest.mark.cuda
def test_lightning_compiles_fullgraph_and_replays_in_cuda_graph(fresh_dynamo):
    """torch.compile(fullgraph=True) equals eager; the compiled call captured in a CUDA graph replays with
    new seq_lens / query positions / queries copied into its inputs and gives the reference's indices."""
    args, _ = _case("fp8", ints=True, seed=3)
    fn = torch.compile(lambda *a: lightning_index(*a, topk=TOPK, backend="triton"), fullgraph=True)
    want = torch.ops.mla.lightning_index_ref(*args, TOPK)
    assert torch.equal(fn(*args), want)

    static = [a.clone() for a in args]
    graph, out = capture(lambda: fn(*static), warmup=2)

    gen = torch.Generator().manual_seed(4)
    q, w, cache, table, seq_lens, qseq, qpos = static
    for shrink in (1, 700, 2999):
        new_lens = (args[4] - shrink).clamp(min=0)
        new_pos = torch.minimum(args[6], (new_lens[args[5].long().clamp(min=0)] - 1).clamp(min=0).to(torch.int32))
        seq_lens.copy_(new_lens)
        qpos.copy_(new_pos)
        q.copy_(torch.randint(-2, 3, q.shape, generator=gen).to(q.dtype))
        out.fill_(-7)
        graph.replay()
        want = torch.ops.mla.lightning_index_ref(*static, TOPK)
        assert torch.equal(out, want), f"replay with seq_lens shrunk by {shrink}"


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_topk_kernel_takes_any_row_count_up_to_2048_entries_and_never_guards():
    """Which calls the in-register top-k sorts: rows of at most ``TOPK_ANY_L`` entries at any count, a symbolic one
    too; longer rows (to ``TOPK_MAX_L``) only at a few static rows; a symbolic length never. The symbolic sizes leave
    no guard."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from mla_compile.ops.triton.lightning_index import TOPK_ANY_L, TOPK_MAX_L, TOPK_MAX_T, kernel_sorts

    assert (TOPK_ANY_L, TOPK_MAX_L, TOPK_MAX_T) == (2048, 4096, 8)
    assert kernel_sorts(1, 2048) and kernel_sorts(16384, 2048) and kernel_sorts(300, 1024)
    assert kernel_sorts(8, 4096) and kernel_sorts(3, 3000) and not kernel_sorts(9, 4096)
    assert not kernel_sorts(1, 4097) and not kernel_sorts(4, 0)
    env = ShapeEnv()
    T = env.create_symintnode(env.create_symbol(64, ConstantSource("T")), hint=64)
    L = env.create_symintnode(env.create_symbol(1024, ConstantSource("L")), hint=1024)
    assert kernel_sorts(T, 2048) and not kernel_sorts(T, 4096) and not kernel_sorts(1, L)
    assert not env.guards


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("T,L,k", [(1, 2048, 512), (7, 4096, 2048), (8, 2048, 512), (3, 3000, 2048), (64, 2048, 512),
                                   (300, 1024, 512)])
@pytest.mark.parametrize("num_warps", [None, 16])
def test_topk_positions_equal_select_topk_on_cuda(T, L, k, num_warps):
    """The in-register top-k on the GPU: exactly ``select_topk``'s positions and order (ties, -inf rows and -0.0)."""
    from mla_compile.ops.sparse_index import select_topk
    from mla_compile.ops.triton.lightning_index import topk_positions

    gen = torch.Generator().manual_seed(T * L + k)
    scores = torch.randn(T, L, generator=gen)
    scores[0, ::5] = torch.randint(-2, 3, (len(range(0, L, 5)),), generator=gen).float()  # ties with -0.0 / 0.0
    scores[0, 1::7] = -0.0
    scores[-1, L // 3:] = float("-inf")
    scores = scores.to(DEVICE)
    torch.testing.assert_close(topk_positions(scores, k, num_warps=num_warps), select_topk(scores, k), rtol=0, atol=0)


@needs_cuda
@pytest.mark.cuda
def test_topk_positions_compiled_over_a_symbolic_row_count(fresh_dynamo, monkeypatch):
    """Compiled with a dynamic row count (a decode batch's) over 2048 entries, the kernel (never ``select_topk``)
    serves every count from one graph: the positions equal ``select_topk``'s at 3, 64 and 200 rows, and another
    count compiles nothing new."""
    from mla_compile.ops.sparse_index import select_topk
    from mla_compile.ops.triton import lightning_index as li

    def refuse(*a):
        raise AssertionError("select_topk called: the kernel should sort these rows")

    monkeypatch.setattr(li, "select_topk", refuse)
    fn = torch.compile(lambda s: li.topk_positions(s, 512), fullgraph=True)
    gen = torch.Generator().manual_seed(11)
    for T in (3, 64, 200):
        scores = torch.randn(T, 2048, generator=gen)
        scores[T // 2, 1000:] = float("-inf")
        scores = scores.to(DEVICE)
        torch._dynamo.mark_dynamic(scores, 0)
        torch.testing.assert_close(fn(scores), select_topk(scores, 512), rtol=0, atol=0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        fn(torch.randn(17, 2048, device=DEVICE))
