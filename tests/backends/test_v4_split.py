"""``mla::v4_attention`` split by query rows: "auto" takes, from the timing table, Triton for few query rows and
FlashMLA for many (BENCHMARKS.md run 117's numbers, given here as a table and shipped in the H200 file); the split
op runs the part of each call's ``T`` inside one op of the graph; the layers name the slots they list, the rows'
context key."""

from __future__ import annotations

import pytest
import torch

from mla_compile.ops import registry, select as select_module, timings, v4_attention
from mla_compile.ops.registry import FLOATS, Backend, declare_split, parse_split, split_part
from mla_compile.ops.select import facts_for, resolve, select
from tests.ops.ref_v4 import v4_attention64

SM90 = (9, 0)
BF16, I32 = torch.bfloat16, torch.int32
V4 = dict(cache_dtype=BF16, block_size=64, head_dims=(512,), cache_align=256, packed_rows=True, cap=SM90)
FLASH_SPLIT = "split:triton:2/flashmla"


# BENCHMARKS.md run 117 (64 heads x 512, ctx 8192, one call in a replayed CUDA graph): slots -> {B: (triton, flashmla)}
RUN_117 = {128: {1: (26.6, 27.6), 64: (49.4, 35.4), 256: (194.1, 62.8)},  # sliding: the window
           640: {1: (50.5, 61.0), 64: (235.0, 82.3), 256: (887.2, 142.2)},  # CSA: window + top-512
           192: {1: (34.6, 52.0), 64: (64.9, 60.4), 256: (267.3, 111.6)}}  # HCA: window + 8192 / 128 entries


def _run_117_rows() -> set:
    return {(64, timings.bucket("batch", b), timings.bucket("context", slots, "v4_attention"), t, f)
            for slots, by in RUN_117.items() for b, (t, f) in by.items()}


@pytest.fixture
def run_117(everything_installed):
    """An H200 table holding run 117's V4 attention rows only."""
    rows = tuple(timings.Row("v4_attention", "bfloat16", "bfloat16", h, b, c, {"triton": t, "flashmla": f})
                 for h, b, c, t, f in _run_117_rows())
    with timings.using(timings.Table("NVIDIA H200", SM90, rows, {"torch": "test"}, "run 117")):
        yield


def _pick(heads=64, **kw):
    return select("v4_attention", facts_for("cuda", BF16, num_heads=heads, **{**V4, **kw}))


def test_the_shipped_rows_are_keyed_by_the_slots_the_model_lists(everything_installed):
    """The H200 file's v4_attention rows: one class per layer kind, measured by bench_backends.py; at 64 heads
    (V4-Flash) "auto" splits Triton for few rows, FlashMLA for many, at every layer kind."""
    [h200] = [t for t in timings.tables() if t.capability == SM90]
    rows = [r for r in h200.rows if r.op == "v4_attention"]
    kinds = {timings.bucket("context", n, "v4_attention") for n in RUN_117}
    assert len(kinds) == 3, "the three layer kinds are three classes"
    assert rows and {r.context for r in rows} <= kinds
    assert all(r.source == "bench_backends" and {"triton", "flashmla"} <= set(r.us) for r in rows)
    for n in (*RUN_117, None):
        tiers = parse_split(_pick(context=n).name)
        assert tiers[0][1] == "triton" and tiers[-1][1] == "flashmla", tiers


@pytest.mark.parametrize("slots", [128, 640, 192, None, 1152])
def test_auto_splits_triton_for_few_rows_flashmla_for_many_on_an_h200(run_117, slots):
    """A graph (batch unknown): per layer kind's class (slots), or every row when the slots are not fixed (HCA:
    None) or not measured (1152: a top-1024 CSA layer, widened to every context)."""
    choice = _pick(context=slots)
    assert choice.name == FLASH_SPLIT, choice.reason
    assert "batch <= 2: triton" in choice.reason and "flashmla" in choice.reason
    if slots == 1152:
        assert "no rows at context 1152: the rows at every context" in choice.reason
    spec = registry.backends_for("v4_attention")[choice.name]
    assert spec.derived and spec.gpu_tested and spec.cuda_graph == "full" and not spec.needs_plan
    tiers = parse_split(choice.name)
    assert [split_part(tiers, T) for T in (1, 2, 3, 64, 4096)] == ["triton"] * 2 + ["flashmla"] * 3
    assert FLASH_SPLIT not in registry.priority("v4_attention")


def test_a_known_batch_takes_one_backend_and_unmeasured_heads_keep_the_static_order(run_117):
    assert _pick(context=640, batch=1).name == "triton"
    assert _pick(context=640, batch=256).name == "flashmla"
    plain = _pick(heads=128, context=640)
    assert plain.name == "triton" and "static order" in plain.reason  # no 128-head rows yet
    assert _pick(head_dims=(256,), context=640).name == "triton", "FlashMLA takes head dim 512 only"
    assert _pick(cap=(10, 0), context=640).name == "triton", "FlashMLA's V4 adapter is sm90 only"


def test_the_public_function_s_facts_reach_the_split(run_117, monkeypatch):
    """``v4_attention(..., slots=)``'s resolve on an assumed sm90 CUDA device: its facts (heads, D, the cache's
    page and layout, the listed slots) find the rows."""
    monkeypatch.setattr(select_module, "device_capability", lambda device=None: SM90)
    cache = torch.empty(4, 64, 512, dtype=BF16)
    for slots in (128, 640, None):
        impl = resolve("v4_attention", torch.device("cuda"), None, dtype=BF16, cache=cache,
                       shape=lambda: (64, (512,), 1, slots))
        assert impl.name == FLASH_SPLIT
    impl = resolve("v4_attention", torch.device("cuda"), None, dtype=BF16, cache=cache,
                   shape=lambda: (128, (512,), 1, 640))
    assert impl.name == "triton"


# ------------------------------------------------------------------------------- the split op (CPU)

def _case(seed: int, T: int, H: int = 5, D: int = 24, rope: int = 6, nb: int = 9, bs: int = 4):
    """Random V4 attention inputs of ``T`` query rows; every other size fixed and distinct (H 5, D 24, rope / 2 3,
    pages 9 and 10 of 4 rows, lists of 7 and 11: a compiled graph sees only T change, no duck-sizing
    coincidence for T of 2 or 12 and more). Unlisted cache rows are NaN."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    kv = torch.randn(nb, bs, D, generator=g)
    comp = torch.randn(nb + 1, bs, D, generator=g)
    ws = torch.stack([torch.randperm(nb * bs, generator=g)[:7] for _ in range(T)]).to(I32)
    ws[0, :2] = -1
    cs = torch.stack([torch.randperm((nb + 1) * bs, generator=g)[:11] for _ in range(T)]).to(I32)
    cs[-1, 3:] = -1
    for cache, slots in ((kv, ws), (comp, cs)):
        used = torch.zeros(cache.shape[0] * bs, dtype=torch.bool)
        used[slots[slots >= 0].long()] = True
        cache.view(-1, D)[~used] = float("nan")
    sinks = torch.randn(H, generator=g)
    pos = torch.randint(0, 200, (T,), generator=g, dtype=I32)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    return q, kv, ws, comp, cs, sinks, pos, inv_freq


@pytest.fixture
def private_v4_table(monkeypatch):
    """The v4_attention backends in a copy of the registry's table, so what a test declares is gone after it."""
    monkeypatch.setitem(registry._TABLE, "v4_attention", dict(registry._TABLE["v4_attention"]))
    return registry._TABLE["v4_attention"]


def _spy(name: str, calls: list) -> Backend:
    def run(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq, scale):
        calls.append((name, q.shape[0]))
        return torch.ops.mla.v4_attention_ref(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos,
                                              inv_freq, scale)
    return Backend(name, "v4_attention", run, rank=99, devices=("any",), dtypes=FLOATS, cache_dtypes=FLOATS,
                   gpu_tested=True)


def _spy_split(table: dict, calls: list) -> str:
    table["spy-few"] = _spy("spy-few", calls)
    table["spy-many"] = _spy("spy-many", calls)
    return declare_split("v4_attention", ((2, "spy-few"), (None, "spy-many"))).name


def _check(out, lse, args, scale):
    want, want_lse = v4_attention64(*args, scale)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)


def test_the_split_runs_the_part_of_each_call_s_rows(private_v4_table):
    calls: list = []
    name = _spy_split(private_v4_table, calls)
    for i, T in enumerate((1, 2, 3, 6)):
        args = _case(10 + i, T)
        out, lse = v4_attention(*args, 0.25, backend=name)
        assert calls[-1] == ("spy-few" if T <= 2 else "spy-many", T)
        _check(out, lse, args, 0.25)
    with pytest.raises(ValueError, match="runs .nope. for 2 rows, which is not a declared backend"):
        torch.ops.mla.v4_attention_split(*_case(1, 2), 0.25, "nope:2/spy-many", -1)


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_split_runs_inside_one_compiled_graph_for_every_row_count(private_v4_table):
    from torch._dynamo.utils import counters

    calls: list = []
    name = _spy_split(private_v4_table, calls)
    compiled = torch.compile(lambda *a: v4_attention(*a, 0.25, backend=name), fullgraph=True, dynamic=True)
    for i, T in enumerate((12, 2, 13, 2)):
        args = _case(20 + i, T)
        with torch.compiler.set_stance("fail_on_recompile") if i else torch.compiler.set_stance("default"):
            out, lse = compiled(*args)
        assert calls[-1] == ("spy-few" if T <= 2 else "spy-many", T)
        _check(out, lse, args, 0.25)
    assert dict(counters["graph_break"]) == {}


def test_opcheck_the_split_op():
    for T, tiers in ((3, "reference:2/reference"), (2, "reference")):
        torch.library.opcheck(torch.ops.mla.v4_attention_split.default, (*_case(5, T), 0.25, tiers, -1))


def test_inspect_names_the_split_op():
    from mla_compile.graphs.inspect import op_backend

    assert op_backend("mla::v4_attention_split") == "split"
    assert registry.split_rows("v4_attention") == "batch"


def test_doctor_shows_the_v4_split_on_an_assumed_h200(run_117, monkeypatch):
    from mla_compile.app import doctor

    monkeypatch.setattr(select_module, "device_capability", lambda device=None: SM90)
    lines = doctor._v4_choices(torch.device("cuda"))
    flash = [ln for ln in lines if "(64 heads)" in ln]
    assert len(flash) == 3 and all(f"-> {FLASH_SPLIT}: auto: fastest per batch" in ln for ln in flash), flash
    assert "v4_attention sliding (128 slots)" in flash[0] and "CSA (640 slots)" in flash[1]
    assert "HCA (all slots)" in flash[2]
    assert all("-> triton: auto: first GPU-tested" in ln for ln in lines if "(128 heads)" in ln)
    report = doctor.doctor_report()  # on this machine's device: the section is there whatever it picks
    assert "selection for DeepSeek-V4 attention" in report and "DeepSeek-V4 (64 heads) v4_attention CSA" in report
