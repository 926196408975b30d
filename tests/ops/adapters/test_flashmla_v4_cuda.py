"""GPU: ``mla::v4_attention`` through FlashMLA's sparse kernel (backend "flashmla") at DeepSeek-V4 dims (head 512,
rope 64, window 128, block size 64) against the float64 reference of the paper's equations: window lists that
start before position 0, an empty compressed set, a padding row with no slot at all, duplicates, a dominating
sink, NaN in every cache row no list names; eager, ``torch.compile(fullgraph=True)`` and CUDA-graph replay with
new slot lists, positions and queries (outputs poisoned before the replay). Skips without ``flash_mla`` or off
sm90."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mla_compile.ops import v4_attention
from mla_compile.ops.v4_attention import window_slots
from tests.cuda_capture import capture
from tests.ops.ref_v4 import v4_attention64

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BF16, I32 = torch.bfloat16, torch.int32
D, ROPE, BS, WINDOW = 512, 64, 64, 128
SCALE = D ** -0.5
NAN = float("nan")


@pytest.fixture(autouse=True)
def _need_flashmla():
    if importlib.util.find_spec("flash_mla") is None:
        pytest.skip("flash_mla (sgl-flash-mla) is not installed")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FlashMLA V4 adapter uses the sm90 kernels")
    torch._dynamo.reset()


def _case(seed, H, topk=512, sliding=False, T=9):
    """``T`` query rows of ``T`` sequences at positions crossing the window boundary (pos < 127: the window list
    starts with -1), the last one a padding row; compressed lists of ``topk`` columns with -1 holes, row 1's
    empty; head 1's sink dominates. Unlisted cache rows are NaN."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor([5, 126, 127, 128, 1000, 4095, 300, 2047, 0][:T], dtype=I32)
    seq = torch.arange(T, dtype=I32)
    seq[-1] = -1
    per = 4096 // BS
    table = torch.randperm(T * per + 3, generator=g)[: T * per].view(T, per).to(I32)
    kv = torch.randn(T * per + 3, BS, D, generator=g).to(BF16)
    ws = window_slots(table, seq, pos, block_size=BS, window=WINDOW)
    if sliding:
        comp, cs = kv, ws[:, :0]
    else:
        comp = torch.randn(40, BS, D, generator=g).to(BF16)
        cs = torch.stack([torch.randperm(40 * BS, generator=g)[:topk] for _ in range(T)]).to(I32)
        cs[torch.rand(T, topk, generator=g) < 0.2] = -1
        cs[:, 7] = cs[:, 3]  # a duplicate counts twice
        cs[1] = -1
        cs[-1] = -1
        used = torch.zeros(40 * BS, dtype=torch.bool)
        used[cs[cs >= 0].long()] = True
        comp.view(-1, D)[~used] = NAN
    listed = torch.zeros(kv.shape[0] * BS, dtype=torch.bool)
    listed[ws[ws >= 0].long()] = True
    kv.view(-1, D)[~listed] = NAN
    q = torch.randn(T, H, D, generator=g).to(BF16)
    sinks = torch.randn(H, generator=g)
    sinks[1] = 25.0
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    return [t.cuda() for t in (q, kv, ws, comp, cs, sinks, pos, inv_freq)]


def _check(out, lse, args):
    ref, ref_lse = v4_attention64(*args, SCALE)
    assert out.dtype == BF16 and lse.dtype == torch.float32 and not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(ref_lse)
    assert empty.any() and torch.equal(torch.isneginf(lse), empty) and (out[empty] == 0).all()
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("H,sliding", [(64, False), (128, False), (16, False), (64, True), (200, False)])
def test_matches_reference(H, sliding):
    args = _case(H, H, sliding=sliding)
    out, lse = v4_attention(*args, SCALE, backend="flashmla")
    _check(out, lse, args)
    tri, tri_lse = v4_attention(*args, SCALE, backend="triton")
    assert float((out.double() - tri.double()).norm() / tri.double().norm()) < 2e-2


def test_dominating_sink_leaves_the_lse():
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(3, 64)
    plain, plain_lse = v4_attention(q, kv, ws, comp, cs, torch.full_like(sinks, float("-inf")), pos, inv_freq, SCALE,
                                    backend="flashmla")
    big = torch.full_like(sinks, 40.0)
    out, lse = v4_attention(q, kv, ws, comp, cs, big, pos, inv_freq, SCALE, backend="flashmla")
    torch.testing.assert_close(lse, plain_lse)
    assert out.abs().max() < 1e-6 * plain.abs().max()
    _check(out, lse, [q, kv, ws, comp, cs, big, pos, inv_freq])


def test_compiled_fullgraph_equals_eager():
    args = _case(4, 64)
    want, want_lse = v4_attention(*args, SCALE, backend="flashmla")
    fn = torch.compile(lambda *a: v4_attention(*a, SCALE, backend="flashmla"), fullgraph=True)
    out, lse = fn(*args)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("sliding", [False, True])
def test_cuda_graph_replays_with_new_lists(sliding):
    """Captured once; a replay after new queries, positions, slot lists and sinks are copied into the same
    tensors recomputes the result (outputs poisoned before the replay)."""
    args = _case(5, 64, sliding=sliding)
    graph, (out, lse) = capture(lambda *a: v4_attention(*a, SCALE, backend="flashmla"), *args)
    new = _case(6, 64, sliding=sliding)
    for dst, src in zip(args, new):
        dst.copy_(src)
    out.fill_(NAN)
    lse.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, lse, args)
