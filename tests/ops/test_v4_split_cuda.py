"""GPU: ``v4_attention`` with backend "auto" on an H200 takes the split that the shipped timing table makes (from
BENCHMARKS.md run 123: Triton for at most 16 query rows, FlashMLA above), and each call runs its part: the output
equals the named backend's bit for bit and the float64 reference within bf16 tolerance, eager, compiled
(``fullgraph=True``, dynamic rows) and replayed from a CUDA graph per row count with new inputs. Skips without
``flash_mla`` or off sm90."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mla_compile.ops import timings, v4_attention
from mla_compile.ops.registry import parse_split, split_part
from mla_compile.ops.select import resolve
from tests.cuda_capture import capture
from tests.ops.ref_v4 import v4_attention64

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BF16, I32 = torch.bfloat16, torch.int32
H, D, ROPE, BS, WINDOW, TOPK = 64, 512, 64, 64, 128, 512
SCALE = D ** -0.5
SPLIT = "split:triton:16/flashmla"  # what run 123's rows make; a re-measured table may move the bound


def _split(csa: bool) -> str:
    """The split "auto" takes for V4-Flash attention here (a Triton part first, FlashMLA last)."""
    args = _case(0, 2, csa)
    name = resolve("v4_attention", args[0].device, None, dtype=BF16, cache=args[1],
                   shape=lambda: (H, (D,), 1, _slots(csa))).name
    tiers = parse_split(name) if name.startswith("split:") else ()
    assert tiers and tiers[0][1] == "triton" and tiers[-1][1] == "flashmla", name
    return name


@pytest.fixture(autouse=True)
def _need_flashmla_on_sm90():
    if importlib.util.find_spec("flash_mla") is None:
        pytest.skip("flash_mla (sgl-flash-mla) is not installed")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the shipped table and the FlashMLA V4 adapter are sm90's")
    torch._dynamo.reset()


def _case(seed: int, T: int, csa: bool):
    """``T`` query rows of V4-Flash dims: a window list of 128 slots (some -1: before position 0) and, for a CSA
    layer, 512 compressed slots of another cache (-1 holes); random positions and sinks."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(T * 2 + 1, BS, D, generator=g).to(BF16)
    ws = torch.stack([torch.randperm(kv.shape[0] * BS, generator=g)[:WINDOW] for _ in range(T)]).to(I32)
    ws[0, :5] = -1
    if csa:
        comp = torch.randn(9, BS, D, generator=g).to(BF16)
        cs = torch.stack([torch.randperm(9 * BS, generator=g)[:TOPK] for _ in range(T)]).to(I32)
        cs[torch.rand(T, TOPK, generator=g) < 0.1] = -1
    else:
        comp, cs = kv, ws[:, :0]
    q = torch.randn(T, H, D, generator=g).to(BF16)
    sinks = torch.randn(H, generator=g)
    pos = torch.randint(0, 8192, (T,), generator=g, dtype=I32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    return [t.cuda() for t in (q, kv, ws, comp, cs, sinks, pos, inv_freq)]


def _slots(csa: bool) -> int:
    return WINDOW + TOPK if csa else WINDOW


def _check(out, lse, args, T: int, csa: bool):
    part = split_part(parse_split(_split(csa)), T)
    want, want_lse = v4_attention(*args, SCALE, backend=part)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), f"T={T}: not {part}'s result"
    ref, ref_lse = v4_attention64(*args, SCALE)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("csa", [False, True])
def test_auto_takes_the_split_and_runs_the_part_of_each_row_count(csa):
    name = _split(csa)
    h200 = next(t for t in timings.tables() if t.capability == (9, 0))
    if "run 123" in h200.source:
        assert name == SPLIT
    for T in (1, 2, 3, 64):
        args = _case(T, T, csa)
        out, lse = v4_attention(*args, SCALE, slots=_slots(csa))
        _check(out, lse, args, T, csa)


def test_compiled_with_dynamic_rows_runs_each_call_s_part():
    fn = torch.compile(lambda *a: v4_attention(*a, SCALE, slots=WINDOW + TOPK), fullgraph=True, dynamic=True)
    # 48 first: a first call of 64 rows would equal the 64 heads, and Dynamo's duck sizing would tie them
    for i, T in enumerate((48, 2, 37, 2)):
        args = _case(10 + i, T, True)
        with torch.compiler.set_stance("fail_on_recompile") if i else torch.compiler.set_stance("default"):
            out, lse = fn(*args)
        _check(out, lse, args, T, True)


@pytest.mark.parametrize("T", [1, 64])
def test_each_cuda_graph_size_records_its_own_part(T):
    args = _case(20, T, True)
    graph, (out, lse) = capture(lambda *a: v4_attention(*a, SCALE, slots=WINDOW + TOPK), *args)
    for dst, src in zip(args, _case(21, T, True)):
        dst.copy_(src)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, lse, args, T, True)
