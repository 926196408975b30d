"""``mla::decode_autotune`` and its Inductor lowering on CPU: without candidates it compiles to a plain
fallback call; with test candidates (``autotune_on_cpu``) Inductor times them, the faster one is emitted
(and only it), the choice is recorded, and outputs equal a float64 reference. The test candidates charge
their cost to an injected benchmarker (``tests/lowerings/conftest.py``): nothing here measures time. The
CUDA tests at the end run on a GPU only, with real timings."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import mla_compile
import mla_compile.lowerings  # noqa: F401  (installs the lowering)
from mla_compile.lowerings import decode as lowering
from mla_compile.lowerings.decode import Candidate, autotune_on_cpu
from mla_compile.ops import _compile_log
from mla_compile.ops.decode import fake as decode_fake
from tests.lowerings._timings import charge
from tests.ops.ref64 import Paged, decode_ref64, fill_paged_cache, generator, randn

SCALE = 0.125
RANK = 32
LAYOUT = Paged(block_size=4, num_blocks=7, seq_lens=(9, 3, 0), tables=((5, 0, 3), (6,), ()), max_blocks=3, unused=-1)


@torch.library.custom_op("mla_lower_test::costed_decode", mutates_args=())
def costed_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  scale: float, kv_lora_rank: int, cost_us: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, charging ``cost_us`` to the injected benchmarker: a candidate with the same numbers
    that the timing calls slower or faster."""
    charge(cost_us)
    out, lse = torch.ops.mla.decode_ref(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return out.clone(), lse.clone()


costed_decode.register_fake(decode_fake)


SIZE_CALLS: list[tuple[int, ...]] = []


@torch.library.custom_op("mla_lower_test::size_costed_decode", mutates_args=())
def size_costed_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       scale: float, kv_lora_rank: int, tiny_us: int, small_us: int,
                       large_us: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``costed_decode`` whose cost depends on the batch: ``tiny_us`` up to 2 sequences, ``small_us`` up to
    16, else ``large_us`` (a candidate that wins some batch classes and loses others); logs each call."""
    SIZE_CALLS.append((tiny_us, small_us, large_us, q.shape[0]))
    cost = tiny_us if q.shape[0] <= 2 else small_us if q.shape[0] <= 16 else large_us
    return costed_decode(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, cost)


size_costed_decode.register_fake(lambda *a: decode_fake(*a[:6]))


def _inputs(seed: int, dtype=torch.float32):
    gen = generator(seed)
    q = randn(gen, 3, 1, 2, RANK + 16, dtype=dtype)
    cache = fill_paged_cache(LAYOUT, RANK + 16, dtype, gen)
    return q, cache, LAYOUT.block_table(), LAYOUT.seq_lens_tensor()


def _step(q, kv, bt, sl):
    out, lse = mla_compile.ops.decode(q, kv, bt, sl, SCALE, kv_lora_rank=RANK, backend="autotune")
    return out * 2, lse


def _compile_run(args):
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        (out, lse), code = run_and_get_code(torch.compile(_step, fullgraph=True), *args)
    torch._dynamo.reset()
    return out, lse, "\n".join(code)


def _check(out, lse, args):
    q, kv, _, _ = args
    ref_out, ref_lse = decode_ref64(q, kv, LAYOUT, SCALE, RANK)
    torch.testing.assert_close(out.double(), 2 * ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_cpu_without_candidates_is_a_plain_fallback_call():
    args = _inputs(1)
    before = _compile_log.mark()
    out, lse, code = _compile_run(args)
    _check(out, lse, args)
    assert "torch.ops.mla.decode_autotune.default(" in code
    assert _compile_log.records_since(before) == []  # nothing was timed on CPU


@pytest.mark.parametrize("slow_first", [True, False])
def test_autotune_emits_the_faster_candidate_only(slow_first):
    tag = int(slow_first)  # fresh choice names per case: no autotune-cache hit from the other case
    fast = Candidate(f"mla_t_fast{tag}", "fast", torch.ops.mla_lower_test.costed_decode.default, (0,))
    slow = Candidate(f"mla_t_slow{tag}", "slow", torch.ops.mla_lower_test.costed_decode.default, (20000,))
    # the two share an op: tell them apart by the cost argument in the output code
    cands = [slow, fast] if slow_first else [fast, slow]
    args = _inputs(2)
    before = _compile_log.mark()
    with autotune_on_cpu(lambda **facts: cands):
        out, lse, code = _compile_run(args)
    _check(out, lse, args)
    (rec,) = _compile_log.records_since(before)
    assert rec.op == "mla::decode_autotune" and rec.winner == fast.name and rec.winner_backend == "fast", rec
    assert rec.timings_ms == {slow.name: 20.0, fast.name: 0.0}, rec  # the charged costs, in ms
    calls = [ln for ln in code.splitlines() if "torch.ops.mla_lower_test.costed_decode.default(" in ln]
    assert len(calls) == 1 and calls[0].rstrip().endswith(", 0)"), calls  # the fast one, once
    assert "mla_decode_autotune" not in code and "extern_kernels.mla_t_" not in code  # the timing node is gone


def _batch(args, B: int, seed: int):
    """``args`` with ``B`` sequences: fresh q, the layout's block-table rows and lengths repeated."""
    q, kv, bt, sl = args
    reps = -(-B // bt.shape[0])
    return randn(generator(seed), B, 1, 2, RANK + 16, dtype=q.dtype), kv, bt.repeat(reps, 1)[:B], sl.repeat(reps)[:B]


_W = "mla_lower_test::size_costed_decode"


@pytest.mark.parametrize("a_us,b_us,bounds,winners,names", [
    # a wins 2 and 16 sequences, b wins 128: one split after 16 rows
    ((0, 0, 20000), (20000, 20000, 0), [16], "aab", f"'{_W},{_W}', [0, 0, 20000, 20000, 20000, 0], [3, 3]"),
    # a wins 2, b wins 16, a wins 128 again: three ranges, each batch runs its own class's winner
    ((0, 20000, 0), (20000, 0, 20000), [2, 16], "aba",
     f"'{_W},{_W},{_W}', [0, 20000, 0, 20000, 0, 20000, 0, 20000, 0], [3, 3, 3]"),
], ids=["two-ranges", "three-ranges"])
def test_dynamic_batch_splits_where_the_winner_changes(a_us, b_us, bounds, winners, names):
    """A dynamic batch is timed at BATCH_CLASSES; where the winner changes, the graph holds the winners
    behind mla::decode_by_rows and each call runs the one of its size range, without recompiling."""
    a = Candidate(f"mla_t_a{len(bounds)}", "a", torch.ops.mla_lower_test.size_costed_decode.default, a_us)
    b = Candidate(f"mla_t_b{len(bounds)}", "b", torch.ops.mla_lower_test.size_costed_decode.default, b_us)
    sizes = (2, 3, 20)
    batches = [_batch(_inputs(4), n, 5 + i) for i, n in enumerate(sizes)]
    for q, _, bt, sl in batches:
        for t in (q, bt, sl):
            torch._dynamo.mark_dynamic(t, 0)
    before = _compile_log.mark()
    torch._dynamo.reset()
    with autotune_on_cpu(lambda **facts: [a, b]), torch._inductor.config.patch(force_disable_caches=True):
        fn = torch.compile(_step, fullgraph=True)
        _, code = run_and_get_code(fn, *batches[1])
        SIZE_CALLS.clear()
        results = [fn(*args) for args in batches]
    calls, SIZE_CALLS[:] = list(SIZE_CALLS), []
    torch._dynamo.reset()
    code = "\n".join(code)
    assert "torch.ops.mla.decode_by_rows.default(" in code, code
    assert f"{bounds}, {names})" in code, code  # one query row per sequence: bounds in sequences
    wins = {"a": a, "b": b}
    want_calls = [(*wins[winners[0] if n <= 2 else winners[1] if n <= 16 else winners[2]].extra, n) for n in sizes]
    assert calls == want_calls, calls  # each size ran its range's winner, no re-autotuning
    recs = _compile_log.records_since(before)
    assert [r.winner for r in recs] == [wins[w].name for w in winners], recs
    want_ms = [{a.name: a_us[i] / 1000, b.name: b_us[i] / 1000} for i in range(len(lowering.BATCH_CLASSES))]
    assert [r.timings_ms for r in recs] == want_ms, recs  # each class timed at its charged costs
    assert all("dynamic batch, timed at" in r.shapes for r in recs)
    for (q, kv, bt, sl), (out, lse) in zip(batches, results):
        ref_out, ref_lse = torch.ops.mla.decode_ref(q.double(), kv.double(), bt, sl, SCALE, RANK)
        torch.testing.assert_close(out.double(), 2 * ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-5, rtol=1e-5)


def test_failure_inside_autotuning_warns_and_falls_back(monkeypatch):
    def broken(*a, **k):
        raise AttributeError("simulated private API change")

    monkeypatch.setattr(lowering, "_autotuned", broken)
    monkeypatch.setattr(lowering, "_WARNED", set())
    args = _inputs(3)
    with autotune_on_cpu(lambda **facts: [Candidate("mla_t_x", "x", torch.ops.mla.decode_ref.default)]):
        with pytest.warns(UserWarning, match="autotuning failed .*simulated private API change"):
            out, lse, code = _compile_run(args)
    _check(out, lse, args)
    assert "torch.ops.mla.decode_autotune.default(" in code


def test_autotune_is_a_backend_name_for_decode():
    from mla_compile.backends import requested_for, select_backend

    assert mla_compile.ops.decode_autotune.lowering_installed()
    assert select_backend("decode", device="cpu", dtype=torch.bfloat16, requested="autotune").name == "autotune"
    assert requested_for("merge", "autotune") == "auto" and requested_for("decode", "autotune") == "autotune"
    args = _inputs(4)
    out, lse = mla_compile.ops.decode(*args, SCALE, kv_lora_rank=RANK, backend="autotune")  # eager: the default
    _check(out * 2, lse, args)


# ------------------------------------------------------------------------------------------------ CUDA

def _cuda_inputs(B: int, H: int, L: int, dtype=torch.bfloat16, block_size: int = 64):
    gen = torch.Generator(device="cuda").manual_seed(B * 1000 + H)
    max_blocks = -(-L // block_size)
    num_blocks = B * max_blocks + 3
    q = torch.randn(B, 1, H, 576, device="cuda", generator=gen).to(dtype)
    kv = torch.randn(num_blocks, block_size, 576, device="cuda", generator=gen).to(dtype)
    bt = torch.randperm(num_blocks, device="cuda", generator=gen)[:B * max_blocks].view(B, max_blocks).int()
    sl = torch.randint(1, L + 1, (B,), device="cuda", generator=gen, dtype=torch.int32)
    return q, kv, bt, sl


@pytest.mark.cuda
@pytest.mark.parametrize("B,H,L", [(4, 16, 1024), (64, 16, 4096), (128, 128, 2048)])
def test_cuda_autotune_picks_a_backend_per_shape_and_matches_the_reference(B, H, L):
    args = _cuda_inputs(B, H, L)
    before = _compile_log.mark()

    def step(q, kv, bt, sl):
        return mla_compile.ops.decode(q, kv, bt, sl, 0.1, kv_lora_rank=512, backend="autotune")

    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        (out, lse), code = run_and_get_code(torch.compile(step, fullgraph=True), *args)
    recs = _compile_log.records_since(before)
    assert len(recs) == 1, recs
    rec = recs[0]
    print(f"B={B} H={H} L={L}: winner {rec.winner} ({rec.winner_backend}); timings {rec.timings_ms}")
    assert rec.winner_backend in ("triton", "flashmla")
    assert len(rec.timings_ms) >= 2 and all(t is not None and t > 0 for t in rec.timings_ms.values()), rec
    ref_out, ref_lse = torch.ops.mla.decode_ref(*[a.float() if a.is_floating_point() else a for a in args], 0.1, 512)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)
    assert "mla_decode_autotune" not in "\n".join(code)  # only the winner's op is emitted


def test_cuda_timing_replays_one_captured_call_per_choice_and_inputs(monkeypatch):
    """The benchmark callable on CUDA: one warm-up call and one captured call per (choice, inputs), then
    only replays (the host work of a peer's call is not timed); graphs are keyed by the inputs. CUDA's
    graph API is faked here: the logic is what runs on CPU."""
    from mla_compile.lowerings import _autotune

    calls, replays = [], []

    class Graph:
        def replay(self):
            replays.append(1)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def op(x, scale, n):
        calls.append(n)
        return x * scale, x

    x, y = torch.randn(3), torch.randn(4)
    outs = [_autotune._replayed("c", op, (x, 2.0, 7)) for _ in range(3)]
    assert calls == [7, 7] and len(replays) == 3  # warm-up + capture, then replays only
    assert all(o is outs[0] for o in outs)  # the static outputs of the capture
    _autotune._replayed("c", op, (y, 2.0, 7))
    _autotune._replayed("d", op, (x, 2.0, 7))
    assert calls == [7] * 6 and len(_autotune._GRAPHS) == 3
    _autotune._GRAPHS.clear()
