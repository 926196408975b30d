""""auto" from measured timings: the selector's decisions from an injected table (the winner per shape
class, ties, classes without data, backends that cannot serve, overrides, other GPUs), and the shipped
H200 file."""

from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo.testing

from mla_compile.backends import select_backend
from mla_compile.ops import timings
from mla_compile.ops.registry import backends_for, priority
from mla_compile.ops.timings import Row, Table

BF16 = torch.bfloat16
SM90 = (9, 0)
DECODE = dict(dtype=BF16, block_size=64, num_heads=16, head_dims=(512, 64))


def _row(op="decode", heads=16, batch=128, context=8192, cache="bfloat16", **us) -> Row:
    return Row(op, "bfloat16", cache, heads, batch, context, {k.replace("_", "-"): v for k, v in us.items()})


def _pick(op="decode", cap=SM90, **kw):
    kw = {**(DECODE if op == "decode" else dict(dtype=BF16, num_heads=16, head_dims=(192, 128))), **kw}
    return select_backend(op, device="cuda", capability=cap, **kw)


@pytest.fixture
def table(everything_installed):
    """Decode at 16 heads: Triton wins small batches, FlashMLA large ones (so the tiers win overall);
    at 128 heads FlashMLA and its tiers tie; FlashInfer (which needs a plan) is fastest everywhere."""
    rows = (_row(batch=2, triton=20.0, flashmla=40.0, flashinfer=15.0),
            _row(batch=128, triton=300.0, flashmla=250.0, flashinfer=200.0),
            _row(heads=128, batch=128, triton=500.0, flashmla=250.0, flashinfer=240.0),
            _row(op="prefill", heads=16, batch=16, context=4096, triton=900.0, sdpa_cudnn=100.0,
                 flash_attn=950.0, flashinfer_trtllm=10.0))
    with timings.using(Table("Test GPU", SM90, rows)):
        yield


def test_the_winner_of_a_class_is_the_fastest_sum_and_a_composite_times_as_its_parts(table):
    choice = _pick()
    assert choice.name == "flashmla-tiered", "triton 20 + flashmla 250 beats triton 320 and flashmla 290"
    assert "fastest in the Test GPU timings for decode [dtype bfloat16, cache bfloat16, heads 16]" in choice.reason
    assert "flashmla-tiered 270.0 us, flashmla 290.0 us, triton 320.0 us" in choice.reason


def test_a_known_batch_narrows_the_class(table):
    small = _pick(batch=2)
    assert small.name == "flashmla-tiered"
    assert "flashmla-tiered 20.0 us, triton 20.0 us, flashmla 40.0 us" in small.reason
    assert "[dtype bfloat16, cache bfloat16, heads 16, batch 2]" in small.reason
    large = _pick(batch=100, context=8000)
    assert large.name == "flashmla-tiered"
    assert "flashmla-tiered 250.0 us, flashmla 250.0 us, triton 300.0" in large.reason
    assert _pick(batch=100, context=100).reason.count("static order") == 1, "no row at context 1024"


def test_a_tie_keeps_the_static_order(table):
    assert priority("decode").index("flashmla-tiered") < priority("decode").index("flashmla")
    choice = _pick(num_heads=128)
    assert choice.name == "flashmla-tiered" and "flashmla-tiered 250.0 us, flashmla 250.0 us" in choice.reason


@pytest.mark.parametrize("kw", [dict(num_heads=64), dict(dtype=torch.float16), dict(cache_dtype=torch.float32)])
def test_a_class_without_data_falls_back_to_the_static_order(table, kw):
    choice = _pick(**kw)
    want = "flashmla-tiered" if kw.get("num_heads") == 64 else "triton"  # FlashMLA is bf16 only
    assert choice.name == want and "static order (no Test GPU timings for decode" in choice.reason


def test_a_backend_that_cannot_serve_is_never_chosen_even_if_fastest(table):
    choice = _pick()
    assert "needs a host-side plan" in choice.rejected["flashinfer"]
    assert _pick(planned=True).name == "flashinfer", "with a plan it serves, and it is the fastest"
    assert _pick(block_size=16).name == "triton", "FlashMLA takes pages of 64 only"
    prefill = _pick("prefill")
    assert "needs sm100-sm103" in prefill.rejected["flashinfer-trtllm"]
    assert "reads lengths on the host" in prefill.rejected["sdpa-cudnn"], "host-syncing: 'auto' skips it"
    assert prefill.name == "triton", "the fastest of those that serve (flash-attn 950, triton 900)"


def test_a_backend_timed_in_only_some_rows_is_not_ranked(everything_installed):
    rows = (_row(batch=2, triton=20.0), _row(batch=128, triton=300.0, flashmla=10.0))
    with timings.using(Table("Test GPU", SM90, rows)):
        choice = _pick()
    # FlashMLA has no figure at batch 2: unranked; the tiers run Triton there and FlashMLA at 128
    assert choice.name == "flashmla-tiered"
    assert "over 2 shape(s): flashmla-tiered 30.0 us, triton 320.0 us;" in choice.reason


def test_explicit_choices_beat_the_timings(table, monkeypatch):
    choice = _pick(requested="flashmla")
    assert choice.name == "flashmla" and choice.reason == "requested by the argument"
    monkeypatch.setenv("MLA_COMPILE_BACKEND", "decode=triton")
    assert _pick().name == "triton"
    assert _pick(requested="auto").name == "flashmla-tiered", "an explicit 'auto' beats the env var"
    with pytest.raises(ValueError, match=r"backend 'flashinfer' \(from the argument\) cannot serve"):
        _pick(requested="flashinfer")


def test_a_table_applies_only_to_gpus_of_its_capability(table):
    choice = _pick(cap=(10, 0), need_lse=False, num_heads=128)
    assert choice.name == "flashinfer-trtllm" and "no timings for this GPU" in choice.reason


def test_the_shipped_h200_file_is_valid_measured_and_names_declared_backends():
    [path] = sorted(timings.FOLDER.glob("*.json"))
    doc = json.loads(path.read_text())
    assert timings.check(doc) == []
    table = timings.load(path)
    assert table.gpu == "NVIDIA H200" and table.capability == SM90 and not table.seeded
    assert "BENCHMARKS.md run" in table.source and table.versions["torch"].startswith("2.11")
    assert {row.op for row in table.rows} == {"decode", "decode_fp8", "sparse_decode", "prefill", "merge",
                                              "v4_attention"}
    for row in table.rows:
        assert set(row.us) <= set(backends_for(row.op)), row
        # every row measured by bench_backends.py, or (the sparse rows with the Gluon kernel, BENCHMARKS run 132)
        # by bench_fp8_sparse.py's CUDA-graph replay of the same calls, every backend of the row in that run
        assert row.source == "bench_backends" or row.source.startswith("bench_fp8_sparse --sparse-only"), row


def test_check_names_every_problem():
    bad = {"format": 1, "gpu": "", "capability": [9], "versions": {},
           "rows": [{"op": "decode"}, {"op": "decode", "dtype": "bfloat16", "cache": "fp8", "heads": 20,
                                      "batch": 128, "context": 4096, "us": {"triton": -1}}]}
    errors = timings.check(bad)
    assert any("gpu must name" in e for e in errors) and any("capability" in e for e in errors)
    assert any("row 0: missing" in e for e in errors) and any("heads 20 is not a bucket bound" in e for e in errors)
    assert any("positive microseconds" in e for e in errors)
    with pytest.raises(ValueError, match="invalid backend timing file"):
        timings.parse(bad)
    assert timings.bucket("heads", 20) == 32 and timings.bucket("batch", 1000) == 256


def test_only_v4_attention_has_context_buckets_below_1024():
    """The finer buckets are v4_attention's (listed slots); every other op's short contexts stay in 1024."""
    assert timings.bucket("context", 512, "prefill") == 1024 == timings.bucket("context", 100)
    assert timings.bucket("context", 512, "v4_attention") == 512
    assert timings.bucket("context", 192, "v4_attention") == 256 and timings.bucket("context", 640, "v4_attention") == 1024


def test_a_block_table_capacity_ranks_by_the_rows_its_sequences_can_reach(everything_installed):
    """A paged decode's capacity (block-table width x page size) bounds every sequence of the call: its class is
    the rows at contexts up to the capacity's bucket; a capacity below every timed context ranks by all rows."""
    rows = (_row(heads=128, batch=2, context=4096, gluon=19.5, flashinfer=20.5),
            _row(heads=128, batch=2, context=8192, gluon=30.2, flashinfer=24.4))
    with timings.using(Table("Test GPU", SM90, rows)):
        every = _pick(num_heads=128, planned=True)
        assert every.name == "flashinfer" and "flashinfer 44.9 us, gluon 49.7 us" in every.reason
        short = _pick(num_heads=128, planned=True, capacity=4096)
        assert short.name == "gluon" and "heads 128, context <= 4096] over 1 shape(s)" in short.reason
        assert _pick(num_heads=128, planned=True, capacity=4097).name == "flashinfer", "4097 is in the 8192 bucket"
        tiny = _pick(num_heads=128, planned=True, capacity=512)
        assert tiny.name == "flashinfer" and "(no rows up to capacity 512: the rows at every context)" in tiny.reason
        assert _pick(num_heads=128, planned=True, capacity=4096, batch=2, context=8192).name == "flashinfer", \
            "a known context is the class itself"


def test_the_capacity_guard_is_its_bucket_not_its_value():
    """Under ``torch.compile(dynamic=True)`` the decode's "auto" reads the block table's width through
    ``context_bound``: widths in one context bucket share a graph, a width in another bucket recompiles."""
    from mla_compile import ops
    from mla_compile.ops.select import context_bound

    assert [context_bound("decode", n) for n in (1, 1024, 1025, 8192, 10 ** 6)] == [1024, 1024, 4096, 8192, 32768]
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(64, 16, 576, generator=gen)
    q = torch.randn(2, 1, 4, 576, generator=gen)
    counter = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def step(q, table, lens):
        return ops.decode(q, cache, table, lens, 0.1)[0]

    torch._dynamo.reset()
    for width, frames in ((3, 1), (5, 1), (64, 1), (80, 2)):  # 48, 80, 1024 tokens: one bucket; 1280: the next
        table = torch.randint(0, cache.shape[0], (2, width), generator=gen, dtype=torch.int32)
        lens = torch.tensor([16 * width - 5, 7], dtype=torch.int32)
        got = step(q, table, lens)
        want = ops.decode(q.double(), cache.double(), table, lens, 0.1, backend="reference")[0]
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        assert counter.frame_count == frames, (width, counter.frame_count)


def test_a_backend_whose_time_follows_the_capacity_is_priced_at_it(everything_installed):
    """FlashMLA's fp8 decode runs over the block table's whole width (``Backend.cost == "capacity"``): "auto" passes
    over it where the call names no capacity, and prices it at its time for the call's capacity in every row of the
    class, while the others keep their rows' times (contexts up to the capacity)."""
    fp8 = dict(dtype=BF16, cache_dtype=torch.uint8, block_size=64, num_heads=128, head_dims=(512, 64),
               cache_align=16, packed_rows=True)
    cls = dict(op="decode_fp8", heads=128, batch=128, cache="fp8")
    rows = (_row(context=4096, gluon64=450.0, flashmla=430.0, **cls), _row(context=8192, gluon64=880.0, flashmla=750.0,
                                                                        **cls))
    with timings.using(Table("Test GPU", SM90, rows)):
        blind = select_backend("decode_fp8", device="cuda", capability=SM90, **fp8)
        assert blind.name == "gluon64" and "the call names no capacity" in blind.rejected["flashmla"]
        short = select_backend("decode_fp8", device="cuda", capability=SM90, capacity=4096, **fp8)
        assert short.name == "flashmla" and "flashmla 430.0 us, gluon64 450.0 us" in short.reason
        # capacity 8192: its 750 at both contexts (1500) against gluon64's 450 + 880 (1330), though 750 < 880
        wide = select_backend("decode_fp8", device="cuda", capability=SM90, capacity=8192, **fp8)
        assert wide.name == "gluon64" and "gluon64 1330.0 us, flashmla 1500.0 us" in wide.reason
        tiny = select_backend("decode_fp8", device="cuda", capability=SM90, capacity=512, **fp8)
        assert tiny.name == "gluon64" and "at which the timings have no rows" in tiny.rejected["flashmla"]
