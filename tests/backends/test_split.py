"""Splits by batch: "auto" runs, inside one op of the graph, the backend that the timing table says is fastest
for the call's number of query rows, where the class's overall winner loses by more than the spread."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mla_compile import ops
from mla_compile.ops import registry, timings
from mla_compile.ops.registry import FLOATS, Backend, declare_split, parse_split, priority, split_name
from mla_compile.ops.select import facts_for, select
from tests.ops.ref64 import Paged, decode_ref64, fill_paged_cache, generator, randn

SM90 = (9, 0)


def _table(us_by_batch: dict[int, dict[str, float]], heads: int = 16) -> timings.Table:
    rows = tuple(timings.Row("decode", "bfloat16", "bfloat16", heads, b, L, dict(us), shape="", source="test")
                 for b, us in us_by_batch.items() for L in (4096, 8192))
    return timings.Table("Test GPU", SM90, rows, {"torch": "test"}, "test")


def _tiers(table, names, prefer=None, tiers=None):
    return timings.tiers_by_batch("decode", names, capability=SM90, dtype=torch.bfloat16,
                                  cache_dtype=torch.bfloat16, num_heads=16, table=table, prefer=prefer, tiers=tiers)


def test_split_names_round_trip_and_malformed_ones_are_named():
    tiers = ((2, "triton"), (16, "flashinfer"), (None, "flashmla"))
    assert split_name(tiers) == "split:triton:2/flashinfer:16/flashmla"
    assert parse_split(split_name(tiers)) == tiers
    assert registry.split_part(tiers, 1) == "triton" and registry.split_part(tiers, 3) == "flashinfer"
    assert registry.split_part(tiers, 16) == "flashinfer" and registry.split_part(tiers, 17) == "flashmla"
    for bad, what in (("split:triton:x/flashmla", "rows a positive int"), ("split:triton/flashmla", "row bound"),
                      ("split:a:16/b:2/c", "must increase"), ("split:a:2/b:4", "the last none")):
        with pytest.raises(ValueError, match=what):
            parse_split(bad)


def test_tiers_follow_the_fastest_per_batch_only_where_it_pays():
    t = _table({2: {"a": 10.0, "b": 20.0}, 16: {"a": 50.0, "b": 40.0}, 128: {"a": 400.0, "b": 300.0}})
    assert _tiers(t, ["a", "b"], prefer="b")[0] == ((2, "a"), (None, "b"))
    # "a" only 2% faster at batch 2: within the spread, the overall winner keeps every batch
    close = _table({2: {"a": 19.6, "b": 20.0}, 16: {"a": 50.0, "b": 40.0}, 128: {"a": 400.0, "b": 300.0}})
    assert _tiers(close, ["a", "b"], prefer="b")[0] == ()
    assert _tiers(close, ["a", "b"])[0] == ((2, "a"), (None, "b"))  # no overall winner given: strict
    # a composite that runs one part over a whole bucket counts as that part
    comp = {"c": ((16, "a"), (None, "b"))}
    t3 = _table({2: {"a": 10.0, "b": 20.0, "d": 12.0}, 16: {"a": 50.0, "b": 40.0, "d": 30.0},
                 128: {"a": 400.0, "b": 300.0, "d": 500.0}})
    assert _tiers(t3, ["c", "a", "b", "d"], prefer="c", tiers=comp)[0] == ((2, "a"), (16, "d"), (None, "b"))
    # ... and a split equal to the preferred composite's own tiers is no split
    t4 = _table({2: {"a": 10.0, "b": 20.0}, 16: {"a": 30.0, "b": 40.0}, 128: {"a": 400.0, "b": 300.0}})
    assert _tiers(t4, ["c", "a", "b"], prefer="c", tiers=comp)[0] == ()
    # a bucket where no backend is timed: the table cannot tell
    gap = _table({2: {"a": 10.0}, 16: {"z": 1.0}, 128: {"a": 400.0, "b": 300.0}})
    assert _tiers(gap, ["a", "b"], prefer="b")[0] == ()


@pytest.fixture
def private_decode_table(monkeypatch):
    """The decode backends in a copy of the registry's table, so what a test declares is gone after it."""
    monkeypatch.setitem(registry._TABLE, "decode", dict(registry._TABLE["decode"]))
    return registry._TABLE["decode"]


def test_auto_picks_a_split_derived_from_the_table_and_keeps_it_out_of_the_priority(
        everything_installed, private_decode_table):
    fast_small = {2: {"triton": 10.0, "flashmla": 30.0, "flashinfer": 25.0, "flashmla-tiered": 10.0},
                  16: {"triton": 80.0, "flashmla": 60.0, "flashinfer": 50.0, "flashmla-tiered": 80.0},
                  128: {"triton": 900.0, "flashmla": 300.0, "flashinfer": 400.0, "flashmla-tiered": 300.0}}
    facts = dict(cache_dtype=torch.bfloat16, block_size=64, num_heads=16, head_dims=(512, 64), cap=SM90)
    with timings.using(_table(fast_small)):
        plain = select("decode", facts_for("cuda", torch.bfloat16, **facts))
        planned = select("decode", facts_for("cuda", torch.bfloat16, planned=True, **facts))
        known_batch = select("decode", facts_for("cuda", torch.bfloat16, planned=True, batch=16, **facts))
    assert plain.name == "split:triton:2/flashmla"  # flashmla-tiered's own split is triton to 16: not this one
    assert planned.name == "split:triton:2/flashinfer:16/flashmla" and "fastest per batch" in planned.reason
    assert known_batch.name == "flashinfer"  # a known batch has one class: no split
    spec = registry.backends_for("decode")[planned.name]
    assert spec.derived and spec.needs_plan and spec.cuda_graph == "planned" and spec.gpu_tested
    assert registry.backends_for("decode")[plain.name].cuda_graph == "full"
    assert not registry.backends_for("decode")[plain.name].needs_plan
    assert all(not n.startswith("split:") for n in priority("decode"))
    # a split is as able as its weakest part: without a plan the FlashInfer part cannot serve
    with pytest.raises(ValueError, match="needs a host-side plan"):
        select("decode", facts_for("cuda", torch.bfloat16, **facts), requested=planned.name)


def _spy(name: str, calls: list, *, needs_plan: bool = False) -> Backend:
    def run(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, plan_id=None):
        calls.append((name, q.shape[0] * q.shape[1], plan_id))
        return torch.ops.mla.decode_ref(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return Backend(name, "decode", run, rank=99, devices=("any",), dtypes=FLOATS, gpu_tested=True,
                   needs_plan=needs_plan, plan_id_fn=run if needs_plan else None)


def _decode_case(B: int, seed: int):
    """A random paged decode of ``B`` sequences; every other size is fixed and distinct, so a compiled graph
    sees only the batch change (no duck-sizing coincidences)."""
    rng = random.Random(seed)
    bs, rank, rope, H, num_blocks, max_blocks = 16, 32, 8, 7, 24, 6
    lens = [rng.randint(1, 40) for _ in range(B)]
    needed = [-(-n // bs) for n in lens]
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables, k = [], 0
    for m in needed:
        tables.append(tuple(perm[k:k + m]))
        k += m
    layout = Paged(bs, num_blocks, tuple(lens), tuple(tables), max_blocks, -1)
    gen = generator(seed)
    cache = fill_paged_cache(layout, rank + rope, torch.float32, gen)
    q = randn(gen, B, 1, H, rank + rope, dtype=torch.float32)
    return q, cache, layout, rank


def test_a_split_runs_the_part_of_each_call_s_rows_inside_one_compiled_graph(private_decode_table):
    calls: list = []
    private_decode_table["spy-small"] = _spy("spy-small", calls)
    private_decode_table["spy-large"] = _spy("spy-large", calls)
    split = declare_split("decode", ((2, "spy-small"), (None, "spy-large"))).name

    def step(q, cache, table, lens):
        return ops.decode(q, cache, table, lens, 0.3, kv_lora_rank=32, backend=split)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for i, B in enumerate((2, 3, 5, 2)):
        q, cache, layout, rank = _decode_case(B, seed=100 + i)
        want_out, want_lse = decode_ref64(q, cache, layout, 0.3, rank)
        args = (q, cache, layout.block_table(), layout.seq_lens_tensor())
        with torch.compiler.set_stance("fail_on_recompile") if i else torch.compiler.set_stance("default"):
            out, lse = compiled(*args)
        torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)
        assert calls[-1][:2] == ("spy-small" if B <= 2 else "spy-large", B)
    torch._dynamo.reset()


def test_a_split_passes_the_plan_id_to_the_part_that_plans_and_refuses_a_missing_plan(private_decode_table):
    calls: list = []
    private_decode_table["spy-planned"] = _spy("spy-planned", calls, needs_plan=True)
    private_decode_table["spy-eager"] = _spy("spy-eager", calls)
    spec = declare_split("decode", ((2, "spy-eager"), (None, "spy-planned")))
    assert spec.needs_plan
    q, cache, layout, rank = _decode_case(4, seed=7)
    args = (q, cache, layout.block_table(), layout.seq_lens_tensor())
    with pytest.raises(ValueError, match="needs plan="):
        ops.decode(*args, 0.3, kv_lora_rank=rank, backend=spec.name)
    plan = dataclasses.make_dataclass("Plan", [("plan_id", int)])(41)
    out, _ = ops.decode(*args, 0.3, kv_lora_rank=rank, backend=spec.name, plan=plan)
    assert calls[-1] == ("spy-planned", 4, 41)
    torch.testing.assert_close(out.double(), decode_ref64(q, cache, layout, 0.3, rank)[0], atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="needs a host plan, and none was given"):
        torch.ops.mla.decode_split(*args, 0.3, rank, spec.name[len("split:"):], -1)


def test_the_shipped_h200_table_splits_where_one_backend_loses_a_batch_class(everything_installed):
    """The picks "auto" makes from the H200 file (its decode rows from BENCHMARKS run 231: FlashMLA timed on the
    step schedule the model makes) for the model's decode (batch unknown): one Gluon kernel at 16 heads; at 128
    heads our 64-row Gluon kernel to 2 sequences (17.4 + 27.8 us against FlashMLA's 21.9 + 26.3) then FlashMLA,
    and with FlashInfer's plan FlashInfer to 2 sequences (19.6 + 22.8); a block-table capacity narrows the class
    to the contexts it can hold."""
    picks = {}
    for heads in (16, 128):
        for planned in (False, True):
            f = facts_for("cuda", torch.bfloat16, cache_dtype=torch.bfloat16, block_size=64, num_heads=heads,
                          head_dims=(512, 64), planned=planned, cap=SM90)
            picks[heads, planned] = select("decode", f).name
    assert picks[16, False] == "gluon"
    assert picks[16, True] == "gluon"
    assert picks[128, False] == "split:gluon:2/flashmla"
    assert picks[128, True] == "split:flashinfer:2/flashmla"

    def planned_128(capacity):
        f = facts_for("cuda", torch.bfloat16, cache_dtype=torch.bfloat16, block_size=64, num_heads=128,
                      head_dims=(512, 64), planned=True, cap=SM90, capacity=capacity)
        return select("decode", f).name
    # block tables of at most 4096 tokens: ranked by the 4096 rows only, where Gluon is the fastest at 2 sequences;
    # wider tables (and a model's usual ones) by every row, as a graph that names none
    assert planned_128(4096) == "split:gluon:2/flashmla"
    assert planned_128(8192) == planned_128(163840) == picks[128, True]


def test_prefill_splits_by_tokens_and_runs_the_part_of_each_call_s_token_count(monkeypatch):
    """Prefill's classes mix sequences and lengths, so its split bounds count tokens (batch bound x context
    bound); the split op picks the part by the call's token count."""
    t = timings.Table("Test GPU", SM90, (
        timings.Row("prefill", "bfloat16", "bfloat16", 16, 2, 1024, {"a": 50.0, "b": 400.0}),
        timings.Row("prefill", "bfloat16", "bfloat16", 16, 16, 4096, {"a": 1600.0, "b": 1300.0})))
    split, why = timings.tiers_by_batch("prefill", ["a", "b"], capability=SM90, dtype=torch.bfloat16,
                                        cache_dtype=torch.bfloat16, num_heads=16, table=t, prefer="a",
                                        counts="tokens")
    assert split == ((2048, "a"), (None, "b")) and "tokens <= 2048: a 50.0 us" in why
    monkeypatch.setitem(registry._TABLE, "prefill", dict(registry._TABLE["prefill"]))
    calls: list = []

    def spy(name):
        def run(q, k, v, cu_q, cu_k, scale, causal):
            calls.append((name, q.shape[0]))
            return torch.ops.mla.prefill_ref(q, k, v, cu_q, cu_k, scale, causal)
        return Backend(name, "prefill", run, rank=99, devices=("any",), dtypes=FLOATS, gpu_tested=True)
    registry._TABLE["prefill"]["spy-few"] = spy("spy-few")
    registry._TABLE["prefill"]["spy-many"] = spy("spy-many")
    name = declare_split("prefill", ((6, "spy-few"), (None, "spy-many"))).name
    gen = generator(3)
    for lens in ([2, 4], [3, 5]):
        T = sum(lens)
        q, k = randn(gen, T, 2, 24, dtype=torch.float32), randn(gen, T, 2, 24, dtype=torch.float32)
        v = randn(gen, T, 2, 16, dtype=torch.float32)
        cu = torch.tensor([0, lens[0], T], dtype=torch.int32)
        out, lse = ops.prefill(q, k, v, cu, cu, 0.2, causal=True, backend=name)
        want = ops.prefill(q, k, v, cu, cu, 0.2, causal=True, backend="reference")
        assert calls[-1] == ("spy-few" if T <= 6 else "spy-many", T)
        torch.testing.assert_close(out, want[0])
        torch.testing.assert_close(lse, want[1])


def test_fp8_decode_picks_from_the_shipped_h200_table_and_its_split_runs_each_part(
        everything_installed, monkeypatch):
    """fp8 decode (BENCHMARKS run 232): at 128 heads the 16-row Gluon kernel to 2 sequences (28.1 + 38.2 us
    against gluon64's 30.3 + 38.6), gluon64 above (FlashMLA's fp8 adapter, faster at batch 128 in the table, is
    passed over by "auto" unless the call names its block tables' capacity: its cost follows it); at 16 heads
    gluon64 to 2 sequences, the 16-row Gluon kernel above. The split op (``mla::decode_fp8_split``)
    runs the part of each call's query rows, here with CPU spies for both parts."""
    def pick(heads, capacity=None):
        f = facts_for("cuda", torch.bfloat16, cache_dtype=torch.uint8, block_size=64, num_heads=heads,
                      head_dims=(512, 64), cache_align=16, packed_rows=True, cap=SM90, capacity=capacity)
        return select("decode_fp8", f).name
    assert pick(128) == "split:gluon:2/gluon64" and pick(16) == "split:gluon64:2/gluon"
    # a named capacity prices FlashMLA at it: with tables of 4096 tokens it takes 128 sequences (411.9 against
    # gluon64's 446.8 us in the file); at 8192 its 727.9 us for every length loses to gluon64's 446.8 + 871.1
    assert pick(128, 4096) == "split:gluon:2/gluon64:16/flashmla"
    assert pick(128, 8192) == pick(128, 163840) == "split:gluon:2/gluon64"

    from mla_compile.ops import fp8_cache
    monkeypatch.setitem(registry._TABLE, "decode_fp8", dict(registry._TABLE["decode_fp8"]))
    calls: list = []

    def spy(name):
        def run(q, kv_cache, block_table, seq_lens, scale, rank):
            calls.append((name, q.shape[0] * q.shape[1]))
            return torch.ops.mla.decode_fp8_ref(q, kv_cache, block_table, seq_lens, scale, rank)
        return Backend(name, "decode_fp8", run, rank=99, devices=("any",), dtypes=FLOATS, gpu_tested=True)
    for name in ("spy-few", "spy-many"):
        registry._TABLE["decode_fp8"][name] = spy(name)
    split = declare_split("decode_fp8", ((2, "spy-few"), (None, "spy-many"))).name
    gen = generator(5)
    rows = randn(gen, 3 * 64, 576, dtype=torch.float32)
    cache = fp8_cache.quantize_fp8_rows(rows[:, :512], rows[:, 512:]).view(3, 64, 656)
    for B in (2, 3):
        q = randn(gen, B, 1, 4, 576, dtype=torch.float32)
        table = torch.tensor([[0], [1], [2]][:B], dtype=torch.int32)
        lens = torch.tensor([64, 17, 40][:B], dtype=torch.int32)
        out, lse = ops.decode_fp8(q, cache, table, lens, 0.3, backend=split)
        ref, ref_lse = torch.ops.mla.decode_fp8_ref(q.double(), cache, table, lens, 0.3, 512)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-5, rtol=1e-5)
        assert calls[-1] == ("spy-few" if B <= 2 else "spy-many", B)
    torch.library.opcheck(torch.ops.mla.decode_fp8_split.default,
                          (q, cache, table, lens, 0.3, 512, split[len("split:"):], -1))
