"""FlashInfer adapters against a fake ``flashinfer``: the host-side plan made outside the op (indptr /
indices built from the block table, CPU arrays, CUDA-graph buffers), the run call, base-2 LSE -> natural
log, empty rows and padding -> ``0 / -inf``, ``merge_state``'s NaN on empty parts fixed, and outputs
equal to the float64 reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from mla_compile import ops
from mla_compile.ops import backends_for
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.models.metadata import SeqChunk
from mla_compile.ops.adapters.flashinfer import (FlashInferDecodePlan, FlashInferDecodePlanner, FlashInferPrefillPlanner,
                                                 flashinfer_decode_core, flashinfer_merge_core,
                                                 flashinfer_prefill_core, plan_flashinfer_decode,
                                                 plan_flashinfer_prefill)
from ..ref64 import (LSE_TOL, OUT_TOL, Paged, decode_ref64, fill_paged_cache, generator, merge_ref64, prefill_ref64,
                     randn)

BF16, I32 = torch.bfloat16, torch.int32
LAYOUT = Paged(16, 9, (0, 20, 1, 40), ((), (7, 2), (0,), (5, 1, 8)), 4, 3)
WS = 1 << 10  # a tiny workspace: the fake does not use it


def _decode_inputs(s_q: int, heads: int = 2, seed: int = 0, layout: Paged = LAYOUT):
    gen = generator(seed)
    cache = fill_paged_cache(layout, 576, BF16, gen)
    q = randn(gen, len(layout.seq_lens), s_q, heads, 576, dtype=BF16)
    return q, cache, layout.block_table(I32), layout.seq_lens_tensor(I32)


def _plan(table, lens, s_q, heads=2, scale=0.1, **kw):
    return plan_flashinfer_decode(table, lens, num_heads=heads, block_size=16, scale=scale, dtype=BF16, query_len=s_q,
                                  device="cpu", workspace_bytes=WS, **kw)


@pytest.mark.parametrize("s_q", [1, 2])
def test_decode_plan_and_run_contract(fake_flashinfer, s_q):
    q, cache, table, lens = _decode_inputs(s_q)
    plan = _plan(table, lens, s_q)
    [(pargs, _)] = fake_flashinfer.named("mla.plan")
    qo_indptr, kv_indptr, kv_indices, kv_len, H, dc, dr, page, causal, scale, qdt, kvdt = pargs
    assert qo_indptr.tolist() == [i * s_q for i in range(5)]
    assert kv_indptr.tolist() == [0, 0, 2, 3, 6] and kv_indices.tolist() == [7, 2, 0, 5, 1, 8]
    assert kv_len.tolist() == [0, 20, 1, 40] and (H, dc, dr, page) == (2, 512, 64, 16)
    assert causal is (s_q > 1) and scale == 0.1 and qdt == kvdt == BF16

    out, lse = flashinfer_decode_core(q, cache, table, lens, 0.1, 512, plan)
    [(rargs, rkw)] = fake_flashinfer.named("mla.run")
    q_nope, q_pe, ckv, kpe = rargs
    assert q_nope.shape == (4 * s_q, 2, 512) and q_pe.shape == (4 * s_q, 2, 64) and rkw["return_lse"] is True
    assert ckv.shape == (9, 16, 512) and kpe.shape == (9, 16, 64) and ckv.data_ptr() == cache.data_ptr()

    ref_out, ref_lse = decode_ref64(q, cache, LAYOUT, 0.1, 512)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])  # base 2 x ln 2
    empty = ref_lse == float("-inf")
    assert empty.any() and torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()


@pytest.mark.parametrize("s_q", [1, 2])
def test_one_query_row_takes_flashinfers_outputs_without_a_boundary_kernel(fake_flashinfer, monkeypatch, s_q):
    """At one query row FlashInfer's outputs are returned as they are (the kernel writes 0 / -inf for a sequence
    with no key: the fake does as the H200's kernel, test_adapters_cuda checks the real one); with more rows the
    boundary still sets the rows that see no key."""
    import mla_compile.ops.adapters.flashinfer as adapter

    finished = []
    real = adapter.finish_decode
    monkeypatch.setattr(adapter, "finish_decode", lambda *a: finished.append(1) or real(*a))
    q, cache, table, lens = _decode_inputs(s_q, seed=3)
    out, lse = flashinfer_decode_core(q, cache, table, lens, 0.1, 512, _plan(table, lens, s_q))
    assert finished == ([] if s_q == 1 else [1])
    assert out.is_contiguous() and lse.is_contiguous() and lse.dtype == torch.float32
    ref_out, ref_lse = decode_ref64(q, cache, LAYOUT, 0.1, 512)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])


def test_decode_through_the_custom_op_and_compiled(fake_flashinfer, allow_cpu):
    allow_cpu("mla.decode", "flashinfer")
    q, cache, table, lens = _decode_inputs(1, seed=1)
    plan = _plan(table, lens, 1)
    want = flashinfer_decode_core(q, cache, table, lens, 0.1, 512, plan)
    got = torch.ops.mla.decode_flashinfer(q, cache, table, lens, 0.1, 512, plan.plan_id)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the public function: dispatch, the plan handed to the backend, the plan id a constant of the graph
    fn = torch.compile(lambda *a: ops.decode(*a, 0.1, kv_lora_rank=512, backend="flashinfer", plan=plan),
                       fullgraph=True, backend="aot_eager")
    got = fn(q, cache, table, lens)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    _plan(table, lens, 1, plan=plan)  # re-planned in place: the compiled graph keeps working, no recompile
    with torch.compiler.set_stance("fail_on_recompile"):
        fn(q, cache, table, lens)
    with pytest.raises(ValueError, match="plan= is only used by backends that plan on the host"):
        ops.decode(q, cache, table, lens, 0.1, kv_lora_rank=512, backend="reference", plan=plan)
    torch.library.opcheck(torch.ops.mla.decode_flashinfer.default, (q, cache, table, lens, 0.1, 512, plan.plan_id))


def test_replanning_keeps_the_plan_id_and_follows_new_lengths(fake_flashinfer):
    q, _, table, lens = _decode_inputs(1, seed=2)
    plan = _plan(table, lens, 1)
    first_id = plan.plan_id
    layout2 = Paged(16, 9, (3, 17, 1, 33), ((6,), (7, 2), (0,), (5, 1, 8)), 4, 3)
    cache2 = fill_paged_cache(layout2, 576, BF16, generator(3))
    table2, lens2 = layout2.block_table(I32), layout2.seq_lens_tensor(I32)
    assert _plan(table2, lens2, 1, plan=plan) is plan and plan.plan_id == first_id and plan.times_planned == 2
    out, lse = torch.ops.mla.decode_flashinfer(q, cache2, table2, lens2, 0.1, 512, plan.plan_id)
    ref_out, ref_lse = decode_ref64(q, cache2, layout2, 0.1, 512)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])
    assert len(fake_flashinfer.named("BatchMLAPagedAttentionWrapper")) == 1, "one wrapper per plan object"


def test_cuda_graph_plans_fill_persistent_buffers(fake_flashinfer):
    _, _, table, lens = _decode_inputs(1)
    plan = _plan(table, lens, 1, use_cuda_graph=True)
    [(_, ckw)] = fake_flashinfer.named("BatchMLAPagedAttentionWrapper")
    assert ckw["use_cuda_graph"] is True and ckw["kv_indices"] is plan.buffers[2]
    assert plan.buffers[1].tolist() == [0, 0, 2, 3, 6] and plan.buffers[3].tolist() == [0, 20, 1, 40]
    with pytest.raises(ValueError, match="make one plan per captured batch size"):
        _plan(table[:2], lens[:2], 1, plan=plan, use_cuda_graph=True)


def test_plan_mismatch_and_missing_plan_are_clear_errors(fake_flashinfer):
    q, cache, table, lens = _decode_inputs(1)
    plan = _plan(table, lens, 1, heads=4)
    with pytest.raises(ValueError, match=r"plan \d+ does not match this call \(num_heads: planned 4, got 2\)"):
        flashinfer_decode_core(q, cache, table, lens, 0.1, 512, plan)
    with pytest.raises(ValueError, match="made for other static facts"):
        _plan(table, lens, 1, heads=2, plan=plan)
    with pytest.raises(ValueError, match="needs plan=FlashInferDecodePlan"):
        backends_for("mla.decode")["flashinfer"].fn(q, cache, table, lens, 0.1, 512)
    with pytest.raises(ValueError, match="no longer exists"):
        torch.ops.mla.decode_flashinfer(q, cache, table, lens, 0.1, 512, 10 ** 9)
    assert isinstance(plan, FlashInferDecodePlan)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_plan_and_run_contract(fake_flashinfer, causal):
    gen = generator(5)
    lens_q, lens_k = ([3, 4], [5, 4]) if causal else ([3, 4], [0, 6])
    q, k = randn(gen, 8, 2, 192, dtype=BF16), randn(gen, 11, 2, 192, dtype=BF16)
    v = randn(gen, 11, 2, 128, dtype=BF16)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=I32), torch.tensor([0] + [sum(lens_k[:i + 1]) for i in range(2)], dtype=I32)
    plan = plan_flashinfer_prefill(cu_q, cu_k, num_heads=2, head_dim_qk=192, head_dim_v=128, scale=0.1, dtype=BF16,
                                   causal=causal, device="cpu", workspace_bytes=WS)
    [(pargs, pkw)] = fake_flashinfer.named("ragged.plan")
    assert pargs[2:] == (2, 2, 192) and pkw["head_dim_vo"] == 128 and pkw["causal"] is causal
    assert pkw["sm_scale"] == 0.1 and pkw["q_data_type"] == pkw["kv_data_type"] == BF16

    out, lse = flashinfer_prefill_core(q, k, v, cu_q, cu_k, 0.1, causal, plan)
    assert fake_flashinfer.named("ragged.run")[0][1]["return_lse"] is True
    ref_out, ref_lse = prefill_ref64(q, k, v, lens_q, lens_k, 0.1, causal)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])
    assert torch.isneginf(lse[7]).all() and (out[7] == 0).all(), "the padding row past cu_seqlens_q[-1]"
    got = torch.ops.mla.prefill_flashinfer(q, k, v, cu_q, cu_k, 0.1, causal, plan.plan_id)
    assert torch.equal(got[0], out) and torch.equal(got[1], lse)


def test_eager_prefill_skips_the_op_layers_and_gives_the_ops_results(fake_flashinfer, allow_cpu, monkeypatch):
    """An eager call of the public prefill with plain tensors runs the op body directly (no ``torch.library``
    dispatch layers: their host time is most of a short eager call); anything that needs the op (a dispatch or
    function mode, grad, functorch, the profiler, compile) goes through it. Both give the op's results, equal
    to the float64 reference, the padding row 0 / -inf."""
    import mla_compile.ops.adapters.flashinfer as fi
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    allow_cpu("mla.prefill", "flashinfer")
    gen = generator(13)
    q, k = randn(gen, 9, 2, 192, dtype=BF16), randn(gen, 10, 2, 192, dtype=BF16)
    v = randn(gen, 10, 2, 128, dtype=BF16)
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=I32), torch.tensor([0, 4, 10], dtype=I32)
    plan = plan_flashinfer_prefill(cu_q, cu_k, num_heads=2, head_dim_qk=192, head_dim_v=128, scale=0.1, dtype=BF16,
                                   device="cpu", workspace_bytes=WS)
    call = lambda *t: ops.prefill(*t, cu_q, cu_k, 0.1, causal=True, backend="flashinfer", plan=plan)  # noqa: E731
    bodies, lookups = [], []  # the op's own code looks its plan up by id; the direct path holds the object
    body, lookup = fi._prefill_body, fi._lookup
    monkeypatch.setattr(fi, "_prefill_body", lambda *a: bodies.append(1) or body(*a))
    monkeypatch.setattr(fi, "_lookup", lambda *a: lookups.append(1) or lookup(*a))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    class Nothing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    fast = call(q, k, v)
    assert (len(bodies), len(lookups)) == (1, 0), "the eager call ran the body once, directly"
    with Ops() as mode:
        through = call(q, k, v)
    assert "mla.prefill_flashinfer.default" in mode.seen, "under a dispatch mode the op is what runs"
    assert (len(bodies), len(lookups)) == (2, 1)
    with Nothing():
        by_function_mode = call(q, k, v)
    with torch.autograd.profiler.profile() as prof:
        profiled = call(q, k, v)
    assert "mla::prefill_flashinfer" in {e.name for e in prof.function_events}
    with_grad = call(q.clone().requires_grad_(), k, v)
    ref_out, ref_lse = prefill_ref64(q, k, v, [3, 5], [4, 6], 0.1, True)
    assert_close(fast[0].double(), ref_out, **OUT_TOL[BF16])
    assert_close(fast[1].double(), ref_lse, **LSE_TOL[BF16])
    assert torch.isneginf(fast[1][8]).all() and (fast[0][8] == 0).all(), "the padding row past cu_seqlens_q[-1]"
    for other in (through, by_function_mode, profiled, with_grad):
        assert torch.equal(other[0], fast[0]) and torch.equal(other[1], fast[1])
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(compiled[0], fast[0]) and torch.equal(compiled[1], fast[1])


@pytest.mark.parametrize("fact", ["sequences", "num_heads", "head_dim_qk", "head_dim_v", "scale", "causal", "dtype"])
def test_prefill_plan_refuses_a_call_whose_static_facts_differ(fake_flashinfer, fact):
    """Each static fact of the plan is checked on every call (eager or through the op), the fact named."""
    gen = generator(17)
    heads, dqk, dv, dtype = 2, 192, 128, BF16
    facts = dict(num_heads=heads, head_dim_qk=dqk, head_dim_v=dv, scale=0.1, dtype=dtype, causal=True, device="cpu",
                 workspace_bytes=WS)
    cu = torch.tensor([0, 3, 7], dtype=I32)
    if fact == "sequences":
        cu = torch.tensor([0, 3, 5, 7], dtype=I32)
    heads += fact == "num_heads"
    dqk += 64 * (fact == "head_dim_qk")
    dv += 64 * (fact == "head_dim_v")
    dtype = torch.float16 if fact == "dtype" else dtype
    plan = plan_flashinfer_prefill(torch.tensor([0, 3, 7], dtype=I32), torch.tensor([0, 3, 7], dtype=I32), **facts)
    q, k = randn(gen, 7, heads, dqk, dtype=dtype), randn(gen, 7, heads, dqk, dtype=dtype)
    v = randn(gen, 7, heads, dv, dtype=dtype)
    scale, causal = (0.2 if fact == "scale" else 0.1), fact != "causal"
    with pytest.raises(ValueError, match=rf"plan \d+ does not match this call \({fact}: planned"):
        flashinfer_prefill_core(q, k, v, cu, cu, scale, causal, plan)
    with pytest.raises(ValueError, match=rf"\({fact}: planned"):
        torch.ops.mla.prefill_flashinfer(q, k, v, cu, cu, scale, causal, plan.plan_id)


@pytest.mark.parametrize("make", ["plain", "fake", "function_mode", "grad", "vmap", "profiler", "parameter"])
def test_plain_eager_is_true_only_without_modes_transforms_profiler_or_grad(make):
    """``plain_eager``: the condition under which an adapter may skip its op's dispatch layers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    from mla_compile.ops.adapters._common import plain_eager

    x = torch.randn(3, 2)
    if make == "plain":
        assert plain_eager(x, x[0])
    elif make == "fake":
        with FakeTensorMode() as fm:
            assert not plain_eager(fm.from_tensor(x))
        with FakeTensorMode():
            assert not plain_eager(x)  # the mode alone is enough
    elif make == "function_mode":
        with TorchFunctionMode():
            assert not plain_eager(x)
    elif make == "grad":
        assert not plain_eager(x, torch.randn(2, requires_grad=True))
    elif make == "vmap":
        seen = []
        torch.func.vmap(lambda t: seen.append(plain_eager(t)) or t)(x)
        assert seen == [False]
    elif make == "profiler":
        with torch.autograd.profiler.profile():
            assert not plain_eager(x)
    else:
        assert not plain_eager(torch.nn.Parameter(x, requires_grad=False)), "a subclass takes the op"


@pytest.mark.parametrize("causal,lens_q,lens_k,dead", [(True, [3, 4], [5, 4], False), (False, [3, 4], [5, 4], False),
                                                        (False, [3, 4], [0, 6], True)])
def test_prefill_plan_knows_dead_rows_and_skips_the_row_kernel_without_them(fake_flashinfer, monkeypatch, causal,
                                                                            lens_q, lens_k, dead):
    """The plan records from its host lengths whether some query row sees no key; a call without such rows
    and without padding rows converts the LSE's base alone (no row-finding boundary work), a call with them
    still zeroes them: both against the float64 reference, the fake leaving NaN on rows without keys."""
    import mla_compile.ops.adapters._common as common

    gen = generator(9)
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=I32) for lens in (lens_q, lens_k))
    q, k = randn(gen, 7, 2, 192, dtype=BF16), randn(gen, sum(lens_k), 2, 192, dtype=BF16)
    v = randn(gen, sum(lens_k), 2, 128, dtype=BF16)
    facts = dict(num_heads=2, head_dim_qk=192, head_dim_v=128, scale=0.1, dtype=BF16, causal=causal, device="cpu",
                 workspace_bytes=WS)
    plan = plan_flashinfer_prefill(cu_q, cu_k, **facts)
    assert plan.dead_rows is dead
    ran = []
    live_rows = common.prefill_live_rows  # the row-finding path of finish_prefill (CPU tensors here)
    monkeypatch.setattr(common, "prefill_live_rows", lambda *a: ran.append(1) or live_rows(*a))
    out, lse = flashinfer_prefill_core(q, k, v, cu_q, cu_k, 0.1, causal, plan)
    assert len(ran) == dead
    assert lse.dtype == torch.float32 and not out.isnan().any() and not lse.isnan().any()
    ref_out, ref_lse = prefill_ref64(q, k, v, lens_q, lens_k, 0.1, causal)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])
    # 4 queries over 2 keys: rows without keys when causal (the plan says so; validate refuses such calls)
    few = plan_flashinfer_prefill(torch.tensor([0, 3, 7], dtype=I32), torch.tensor([0, 3, 5], dtype=I32), **facts)
    assert few.dead_rows is causal


@pytest.mark.parametrize("causal", [True, False])
def test_the_plans_keyless_rule_is_the_live_row_rule_per_sequence(causal):
    """``prefill_has_keyless_rows`` (the plan's host check) says yes exactly when ``prefill_live_rows`` marks some
    row of a sequence dead, over random lengths with empty queries and keys."""
    from mla_compile.ops.adapters._common import prefill_has_keyless_rows, prefill_live_rows

    gen = generator(11)
    for _ in range(200):
        n = int(torch.randint(1, 5, (1,), generator=gen))
        lens_q = torch.randint(0, 5, (n,), generator=gen)
        lens_k = torch.randint(0, 7, (n,), generator=gen)
        cu_q, cu_k = (torch.nn.functional.pad(x.cumsum(0), (1, 0)).to(I32) for x in (lens_q, lens_k))
        live = prefill_live_rows(cu_q, cu_k, int(cu_q[-1]), causal)
        assert prefill_has_keyless_rows(cu_q, cu_k, causal) is (not bool(live.all())), (lens_q, lens_k)


def test_merge_converts_the_base_and_keeps_empty_parts_exact(fake_flashinfer):
    gen = generator(7)
    out_a, out_b = randn(gen, 5, 2, 16, dtype=BF16), randn(gen, 5, 2, 16, dtype=BF16)
    lse_a, lse_b = randn(gen, 5, 2, dtype=torch.float32), randn(gen, 5, 2, dtype=torch.float32)
    lse_a[0], out_a[0] = float("-inf"), float("nan")  # an empty part whose output is garbage
    lse_a[1] = lse_b[1] = float("-inf")  # both empty
    out, lse = flashinfer_merge_core(out_a, lse_a, out_b, lse_b)
    [(args, _)] = fake_flashinfer.named("merge_state")
    assert_close(args[1], lse_a * (1 / math.log(2)))  # handed over in base 2
    ref_out, ref_lse = merge_ref64(out_a, lse_a, out_b, lse_b)
    assert not out.isnan().any()
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    got = torch.ops.mla.merge_attn_states_flashinfer(out_a, lse_a, out_b, lse_b)
    assert torch.equal(got[0], out) and torch.equal(got[1], lse)


def test_metadata_builder_plans_every_step_through_one_planner(fake_flashinfer):
    """The builder calls the planner with host tables before capture and before each step; the op
    picks the plan of its batch size, re-planned in place (the same object a captured graph holds)."""
    planner = FlashInferDecodePlanner(num_heads=2, block_size=16, scale=0.1, dtype=BF16, device="cpu",
                                      workspace_bytes=WS)
    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=3, max_tokens=8, block_size=16, device="cpu",
                              decode_planner=planner)
    pad = builder.padding_decode(4)
    assert pad.meta.decode.plan is planner and sorted(planner.plans) == [4]
    captured = planner.plans[4]
    chunks = [SeqChunk(list(LAYOUT.tables[i]), [1], LAYOUT.seq_lens[i] - 1) for i in (1, 3, 2)]
    step = builder.build(chunks, decode_batch=4)
    assert step.meta.decode.plan is planner and planner.plans[4] is captured and captured.times_planned == 2
    _, kv_indptr, kv_indices, kv_len, *_ = fake_flashinfer.named("mla.plan")[-1][0]
    assert kv_len.tolist() == [20, 40, 1, 0] and kv_indices.tolist() == [7, 2, 5, 1, 8, 0]
    gen = generator(5)
    cache = fill_paged_cache(LAYOUT, 576, BF16, gen)
    q = randn(gen, 4, 1, 2, 576, dtype=BF16)
    meta = step.meta.decode
    out, lse = torch.ops.mla.decode_flashinfer(q, cache, meta.block_table, meta.seq_lens, 0.1, 512, meta.plan.plan_id)
    ref_out, ref_lse = torch.ops.mla.decode_ref(q.double(), cache.double(), meta.block_table, meta.seq_lens, 0.1, 512)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse.double(), **LSE_TOL[BF16])
    with pytest.raises(ValueError, match="no plan for batch 2"):
        torch.ops.mla.decode_flashinfer(q[:2], cache, meta.block_table[:2], meta.seq_lens[:2], 0.1, 512,
                                        planner.plan_id)


def test_merge_refuses_head_dims_flashinfer_cannot_launch(fake_flashinfer):
    """D=512 failed at launch on the H200 (run 6): a clear error before the call."""
    out = torch.randn(4, 2, 512).to(BF16)
    lse = torch.randn(4, 2)
    with pytest.raises(ValueError, match="head dims up to 256.*D=512"):
        flashinfer_merge_core(out, lse, out, lse)
    assert not fake_flashinfer.named("merge_state")


def test_metadata_builder_plans_each_prefill_through_one_prefill_planner(fake_flashinfer):
    """The builder re-plans one FlashInfer ragged-prefill plan from each step's host cu_seqlens before the step;
    the metadata carries the planner (one constant object for compiled graphs) and the op runs its current
    plan, which matches the float64 causal prefill of that step."""
    planner = FlashInferPrefillPlanner(num_heads=2, head_dim_qk=192, head_dim_v=128, scale=0.1, dtype=BF16,
                                       device="cpu", workspace_bytes=WS)
    with pytest.raises(ValueError, match="planned no step yet"):
        planner.current()
    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=3, max_tokens=16, block_size=16, device="cpu",
                              prefill_planner=planner)
    gen = generator(11)
    for step_no, lens in enumerate(([3, 5], [6, 1, 2])):
        chunks = [SeqChunk([i], list(range(1, n + 1)), 0) for i, n in enumerate(lens)]
        step = builder.build([], chunks)
        pre = step.meta.prefill
        assert pre.plan is planner and planner.current().times_planned == step_no + 1
        qo_indptr, kv_indptr = fake_flashinfer.named("ragged.plan")[-1][0][:2]
        want_cu = [0] + [sum(lens[:i + 1]) for i in range(len(lens))]
        assert qo_indptr.tolist() == kv_indptr.tolist() == want_cu == pre.cu_seqlens_q.tolist()
        T = step.input_ids.shape[0]
        q, k = randn(gen, T, 2, 192, dtype=BF16), randn(gen, T, 2, 192, dtype=BF16)
        v = randn(gen, T, 2, 128, dtype=BF16)
        out, lse = torch.ops.mla.prefill_flashinfer(q, k, v, pre.cu_seqlens_q, pre.cu_seqlens_k, 0.1, True,
                                                    pre.plan.plan_id)
        ref_out, ref_lse = prefill_ref64(q, k, v, lens, lens, 0.1, True)
        n = sum(lens)
        assert_close(out[:n].double(), ref_out[:n], **OUT_TOL[BF16])
        assert_close(lse[:n].double(), ref_lse[:n], **LSE_TOL[BF16])
    assert len(fake_flashinfer.named("BatchPrefillWithRaggedKVCacheWrapper")) == 1, "one wrapper, re-planned"
