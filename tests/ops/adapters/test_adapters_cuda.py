"""GPU: every peer adapter against the float64 reference op and our Triton backend on the same inputs,
eager, under ``torch.compile(fullgraph=True)`` and in CUDA-graph replay with changed lengths.

Written on a CPU machine and NOT YET RUN on a GPU: the first H200 run is their first run. A test skips
when its library is not installed (flash-attn has no wheel for the H200 machine) or the GPU lacks the
capability (the sm100 paths).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile import ops
from mla_compile.backends import select_backend
from mla_compile.ops.adapters.flashinfer import plan_flashinfer_decode, plan_flashinfer_prefill
from tests.cuda_capture import capture

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16, I32 = torch.bfloat16, torch.int32
SCALE = 1 / math.sqrt(192)


def _cap() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


def _need_sm(lo: tuple[int, int], hi: tuple[int, int] | None = None) -> None:
    if _cap() < lo or (hi is not None and _cap() > hi):
        pytest.skip(f"needs sm{lo[0]}{lo[1]}" + (f"-sm{hi[0]}{hi[1]}" if hi else "+") + f", this GPU is {_cap()}")


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------ inputs

def _paged(lens, block_size, H, s_q, seed=0, unused=0, D=576):
    """bf16 ``q [B, s_q, H, D]``, cache, shuffled int32 block table (``unused`` past each end), int32 lengths."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=gen)
    table = torch.full((len(lens), max(need) + 1), unused, dtype=I32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n].to(I32)
        at += n
    cache = (torch.randn(nb, block_size, D, generator=gen) * 0.5).to(BF16)
    q = torch.randn(len(lens), s_q, H, D, generator=gen).to(BF16)
    return q.cuda(), cache.cuda(), table.cuda(), torch.tensor(lens, dtype=I32).cuda()


def _ragged(lens_q, lens_k, H, seed=0, pad=3):
    gen = torch.Generator().manual_seed(seed)
    T, S = sum(lens_q) + pad, sum(lens_k) + pad
    q, k = (torch.randn(n, H, 192, generator=gen).to(BF16).cuda() for n in (T, S))
    v = torch.randn(S, H, 128, generator=gen).to(BF16).cuda()
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32).cuda()  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


def _decode_ref(q, cache, table, lens):
    return torch.ops.mla.decode_ref(q.double(), cache.double(), table, lens, SCALE, 512)


def _prefill_ref(q, k, v, cu_q, cu_k, causal):
    return torch.ops.mla.prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, SCALE, causal)


def _check(out, lse, ref, ref_lse, *, with_lse=True):
    """Fully written, empty queries 0 (and -inf), bf16-level agreement with the float64 reference."""
    assert not out.isnan().any(), "output holds NaN"
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all(), "a query that sees nothing must give out = 0"
    torch.testing.assert_close(out.double(), ref.double(), atol=3e-2, rtol=3e-2)
    if with_lse:
        assert torch.equal(torch.isneginf(lse), empty), "-inf LSE pattern differs from the reference"
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-3, rtol=1e-3)


def _close_to(a, b):
    torch.testing.assert_close(a[0].float(), b[0].float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(a[1], b[1], atol=2e-3, rtol=1e-3, equal_nan=True)


DECODE_LENS = [[700, 1, 64, 130, 2048], [4096] * 3 + [17]]


# ------------------------------------------------------------------------------------------ FlashMLA

@pytest.mark.parametrize("H, s_q", [(16, 1), (128, 1), (128, 2)])
@pytest.mark.parametrize("lens", DECODE_LENS)
def test_flashmla_matches_reference_and_triton(H, s_q, lens):
    pytest.importorskip("flash_mla")
    _need_sm((9, 0), (9, 0))
    q, cache, table, seq = _paged(lens, 64, H, s_q)
    got = ops.decode(q, cache, table, seq, SCALE, backend="flashmla")
    _check(*got, *_decode_ref(q, cache, table, seq))
    _close_to(got, ops.decode(q, cache, table, seq, SCALE, backend="triton"))


@pytest.mark.parametrize("H, s_q", [(16, 1), (128, 1), (128, 2)])
def test_flashmla_with_a_step_schedule_equals_its_own_scheduling(H, s_q):
    """A schedule made once (``flashmla_decode_schedule``) and shared by two calls: the same outputs as the calls
    that schedule inside (bit for bit: the same split schedule), against float64 too; then made inside a compiled,
    captured step and replayed with new lengths."""
    pytest.importorskip("flash_mla")
    _need_sm((9, 0), (9, 0))
    from mla_compile.ops.adapters.flashmla import flashmla_decode_schedule

    q, cache, table, seq = _paged(DECODE_LENS[0], 64, H, s_q)
    sched = flashmla_decode_schedule(seq, H, s_q)
    want = ops.decode(q, cache, table, seq, SCALE, backend="flashmla")
    for _ in range(2):
        got = ops.decode(q, cache, table, seq, SCALE, backend="flashmla", schedule=sched)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _check(*got, *_decode_ref(q, cache, table, seq))

    def step(q, t, s):
        one = flashmla_decode_schedule(s, H, s_q)
        return ops.decode(q, cache, t, s, SCALE, backend="flashmla", schedule=one)

    fn = torch.compile(step, fullgraph=True)
    _check(*fn(q, table, seq), *_decode_ref(q, cache, table, seq))
    graph, outs = capture(fn, q, table, seq)
    seq.copy_(torch.flip(seq, [0]).clamp(max=table.shape[1] * 64))
    graph.replay()
    _check(*[o.clone() for o in outs], *_decode_ref(q, cache, table, seq))


def test_flashmla_compiled_and_replayed_with_new_lengths():
    pytest.importorskip("flash_mla")
    _need_sm((9, 0), (9, 0))
    q, cache, table, seq = _paged([300, 40, 900, 5], 64, 16, 1)
    fn = torch.compile(lambda q, t, s: ops.decode(q, cache, t, s, SCALE, backend="flashmla"), fullgraph=True)
    _check(*fn(q, table, seq), *_decode_ref(q, cache, table, seq))
    assert dict(counters["graph_break"]) == {}
    graph, outs = capture(fn, q, table, seq)
    q2, _, _, _ = _paged([1, 1, 1, 1], 64, 16, 1, seed=5)
    q.copy_(q2)
    seq.copy_(torch.tensor([900, 1, 64, 65], dtype=I32))
    graph.replay()
    _check(*[o.clone() for o in outs], *_decode_ref(q, cache, table, seq))


@pytest.mark.parametrize("B, s_q", [(1, 1), (8, 2), (17, 1), (40, 2)])
def test_flashmla_tiered_matches_reference_on_both_sides_of_the_split(B, s_q):
    """"flashmla-tiered": Triton at <= SMALL_ROWS query rows, FlashMLA above (the same outputs as the
    backend of that side), and replayed in a CUDA graph with new lengths."""
    pytest.importorskip("flash_mla")
    _need_sm((9, 0), (9, 0))
    from mla_compile.ops.adapters.flashmla import SMALL_ROWS

    lens = [int(x) for x in torch.randint(1, 3000, (B,), generator=torch.Generator().manual_seed(B))]
    lens[0] = 0
    q, cache, table, seq = _paged(lens, 64, 16, s_q, seed=B)
    want = ops.decode(q, cache, table, seq, SCALE, backend="flashmla" if B * s_q > SMALL_ROWS else "triton")
    got = ops.decode(q, cache, table, seq, SCALE, backend="flashmla-tiered")
    _check(*got, *_decode_ref(q, cache, table, seq))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    graph, outs = capture(lambda *a: ops.decode(*a, SCALE, backend="flashmla-tiered"), q, cache, table, seq)
    seq.copy_(seq.flip(0))
    graph.replay()
    _check(*[o.clone() for o in outs], *_decode_ref(q, cache, table, seq))


def test_flashmla_zero_length_slots_give_zero_and_minus_inf():
    pytest.importorskip("flash_mla")
    _need_sm((9, 0), (9, 0))
    q, cache, table, seq = _paged([0, 100, 0, 3], 64, 16, 2)
    _check(*ops.decode(q, cache, table, seq, SCALE, backend="flashmla"), *_decode_ref(q, cache, table, seq))


# ------------------------------------------------------------------------------------------ FlashInfer

@pytest.mark.parametrize("H, s_q, block", [(16, 1, 64), (128, 1, 16), (16, 2, 64)])
@pytest.mark.parametrize("lens", DECODE_LENS)
def test_flashinfer_decode_matches_reference_and_triton(H, s_q, block, lens):
    pytest.importorskip("flashinfer")
    q, cache, table, seq = _paged(lens, block, H, s_q)
    plan = plan_flashinfer_decode(table.cpu(), seq.cpu(), num_heads=H, block_size=block, scale=SCALE, dtype=BF16,
                                  query_len=s_q)
    got = ops.decode(q, cache, table, seq, SCALE, backend="flashinfer", plan=plan)
    _check(*got, *_decode_ref(q, cache, table, seq))
    _close_to(got, ops.decode(q, cache, table, seq, SCALE, backend="triton"))


@pytest.mark.parametrize("H", [16, 128])
def test_flashinfer_zero_length_slots_give_zero_and_minus_inf(H):
    """At one query row the adapter returns FlashInfer's own outputs (no boundary kernel after it): the kernel
    writes 0 and an LSE of -inf for a sequence with no key itself, on memory left full of NaNs, eagerly and in a
    graph replayed after its plan gains empty slots."""
    pytest.importorskip("flashinfer")
    q, cache, table, seq = _paged([0, 100, 0, 3], 64, H, 1)
    plan = plan_flashinfer_decode(table.cpu(), seq.cpu(), num_heads=H, block_size=64, scale=SCALE, dtype=BF16,
                                  use_cuda_graph=True)

    def call(q, cache, table, seq):
        return ops.decode(q, cache, table, seq, SCALE, backend="flashinfer", plan=plan)
    torch.full((1 << 26,), float("nan"), device="cuda")  # freed: the outputs may land on NaNs
    _check(*call(q, cache, table, seq), *_decode_ref(q, cache, table, seq))
    seq.copy_(torch.tensor([50, 100, 7, 3], dtype=I32))
    plan_flashinfer_decode(table.cpu(), seq.cpu(), num_heads=H, block_size=64, scale=SCALE, dtype=BF16, plan=plan)
    graph, outs = capture(call, q, cache, table, seq)
    for o in outs:
        o.fill_(float("nan"))
    seq.copy_(torch.tensor([0, 64, 0, 1], dtype=I32))
    plan_flashinfer_decode(table.cpu(), seq.cpu(), num_heads=H, block_size=64, scale=SCALE, dtype=BF16, plan=plan)
    graph.replay()
    _check(*[o.clone() for o in outs], *_decode_ref(q, cache, table, seq))


def test_flashinfer_decode_compiled_and_replayed_after_replanning():
    pytest.importorskip("flashinfer")
    q, cache, table, seq = _paged([300, 40, 900, 5], 64, 16, 1)
    plan = plan_flashinfer_decode(table.cpu(), seq.cpu(), num_heads=16, block_size=64, scale=SCALE, dtype=BF16,
                                  use_cuda_graph=True)
    fn = torch.compile(lambda q, t, s: ops.decode(q, cache, t, s, SCALE, backend="flashinfer", plan=plan),
                       fullgraph=True)
    _check(*fn(q, table, seq), *_decode_ref(q, cache, table, seq))
    assert dict(counters["graph_break"]) == {}
    graph, outs = capture(fn, q, table, seq)
    seq.copy_(torch.tensor([900, 1, 64, 65], dtype=I32))
    plan_flashinfer_decode(table.cpu(), seq.cpu(), num_heads=16, block_size=64, scale=SCALE, dtype=BF16, plan=plan)
    graph.replay()
    _check(*[o.clone() for o in outs], *_decode_ref(q, cache, table, seq))


@pytest.mark.parametrize("causal, lens_q, lens_k", [(True, [500, 1, 37], [500, 1, 37]),
                                                    (True, [64, 200], [1000, 300]),
                                                    (False, [64, 200, 5], [0, 300, 1000])])
def test_flashinfer_prefill_matches_reference_and_triton(causal, lens_q, lens_k):
    pytest.importorskip("flashinfer")
    q, k, v, cu_q, cu_k = _ragged(lens_q, lens_k, 16)
    plan = plan_flashinfer_prefill(cu_q.cpu(), cu_k.cpu(), num_heads=16, head_dim_qk=192, head_dim_v=128, scale=SCALE,
                                   dtype=BF16, causal=causal)
    got = ops.prefill(q, k, v, cu_q, cu_k, SCALE, causal=causal, backend="flashinfer", plan=plan)
    _check(*got, *_prefill_ref(q, k, v, cu_q, cu_k, causal))
    _close_to(got, ops.prefill(q, k, v, cu_q, cu_k, SCALE, causal=causal, backend="triton"))
    fn = torch.compile(lambda *a: ops.prefill(*a, SCALE, causal=causal, backend="flashinfer", plan=plan), fullgraph=True)
    _close_to(fn(q, k, v, cu_q, cu_k), got)


def test_flashinfer_merge_matches_reference_and_triton():
    pytest.importorskip("flashinfer")
    gen = torch.Generator().manual_seed(3)
    out_a, out_b = (torch.randn(300, 16, 128, generator=gen).to(BF16).cuda() for _ in range(2))
    lse_a, lse_b = (torch.randn(300, 16, generator=gen).cuda() * 3 for _ in range(2))
    lse_a[:10], out_a[:10] = float("-inf"), float("nan")
    lse_b[5:20] = float("-inf")
    got = ops.merge_attn_states(out_a, lse_a, out_b, lse_b, backend="flashinfer")
    ref = torch.ops.mla.merge_attn_states_ref(out_a.double(), lse_a, out_b.double(), lse_b)
    _check(*got, *ref)
    _close_to(got, ops.merge_attn_states(out_a, lse_a, out_b, lse_b, backend="triton"))
    fn = torch.compile(lambda *a: ops.merge_attn_states(*a, backend="flashinfer"), fullgraph=True)
    _close_to(fn(out_a, lse_a, out_b, lse_b), got)
    graph, outs = capture(fn, out_a, lse_a, out_b, lse_b)
    graph.replay()
    _close_to([o.clone() for o in outs], got)


# ------------------------------------------------------------------------------------------ SDPA / flash-attn

@pytest.mark.parametrize("causal, lens_q, lens_k", [(True, [500, 1, 37], [500, 1, 37]),
                                                    (True, [64, 200], [1000, 300]),
                                                    (False, [64, 200, 5], [0, 300, 1000])])
@pytest.mark.parametrize("backend", ["sdpa-cudnn", "flash-attn"])
def test_dense_prefill_backends_match_reference_and_triton(backend, causal, lens_q, lens_k):
    if backend == "flash-attn":
        pytest.importorskip("flash_attn")
    if not ops.backends_for("mla.prefill")[backend].available():
        pytest.skip(f"{backend} is not available in this build")
    q, k, v, cu_q, cu_k = _ragged(lens_q, lens_k, 16)
    got = ops.prefill(q, k, v, cu_q, cu_k, SCALE, causal=causal, backend=backend)
    _check(*got, *_prefill_ref(q, k, v, cu_q, cu_k, causal))
    _close_to(got, ops.prefill(q, k, v, cu_q, cu_k, SCALE, causal=causal, backend="triton"))
    fn = torch.compile(lambda *a: ops.prefill(*a, SCALE, causal=causal, backend=backend), fullgraph=True)
    _close_to(fn(q, k, v, cu_q, cu_k), got)
    assert dict(counters["graph_break"]) == {}


def test_flash_attn_replays_in_a_cuda_graph_and_sdpa_refuses_capture():
    q, k, v, cu_q, cu_k = _ragged([40, 9], [40, 9], 16)
    if ops.backends_for("mla.prefill")["sdpa-cudnn"].available():
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                torch.ops.mla.prefill_sdpa_cudnn(q, k, v, cu_q, cu_k, SCALE, True)
    pytest.importorskip("flash_attn")
    graph, outs = capture(lambda *a: ops.prefill(*a, SCALE, backend="flash-attn"), q, k, v, cu_q, cu_k)
    cu_q.copy_(torch.tensor([0, 30, 49], dtype=I32))
    cu_k.copy_(cu_q)
    graph.replay()
    _check(*[o.clone() for o in outs], *_prefill_ref(q, k, v, cu_q, cu_k, True))


# ------------------------------------------------------------------------------------------ Blackwell

def test_sm100_trtllm_decode_and_prefill():
    pytest.importorskip("flashinfer")
    _need_sm((10, 0), (10, 3))
    q, cache, table, seq = _paged([700, 1, 64, 2048], 64, 128, 1)
    got = ops.decode(q, cache, table, seq, SCALE, backend="flashinfer-trtllm")
    _check(*got, *_decode_ref(q, cache, table, seq), with_lse=False)
    got = ops.decode(q, cache, table, seq, SCALE, backend="flashinfer-cutlass")
    _check(*got, *_decode_ref(q, cache, table, seq), with_lse=False)
    q, k, v, cu_q, cu_k = _ragged([64, 200], [1000, 300], 16)
    got = ops.prefill(q, k, v, cu_q, cu_k, SCALE, backend="flashinfer-trtllm")
    _check(*got, *_prefill_ref(q, k, v, cu_q, cu_k, True))


# ------------------------------------------------------------------------------------------ selector

def test_selector_on_this_gpu_picks_an_available_backend_that_runs():
    choice = select_backend("decode", device="cuda", dtype=BF16, block_size=64, num_heads=16, head_dims=(512, 64))
    q, cache, table, seq = _paged([300, 5], 64, 16, 1)
    _check(*ops.decode(q, cache, table, seq, SCALE, backend=choice.name), *_decode_ref(q, cache, table, seq))
    choice = select_backend("prefill", device="cuda", dtype=BF16, num_heads=16, head_dims=(192, 128))
    q, k, v, cu_q, cu_k = _ragged([64, 200], [1000, 300], 16)
    _check(*ops.prefill(q, k, v, cu_q, cu_k, SCALE, backend=choice.name), *_prefill_ref(q, k, v, cu_q, cu_k, True))


def test_flashmla_never_reads_block_table_entries_past_the_length():
    # last in the file: a violation is an illegal memory access that ends the process
    pytest.importorskip("flash_mla")
    _need_sm((9, 0), (9, 0))
    q, cache, table, seq = _paged([100, 3, 64], 64, 16, 1, unused=-1)
    _check(*ops.decode(q, cache, table, seq, SCALE, backend="flashmla"), *_decode_ref(q, cache, table, seq))
