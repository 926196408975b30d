"""``mla::decode_absorb_out``'s kernels (``ops/triton/decode_absorb.py``): the split merge + W_UV launch on random
partials and after the Triton split kernel under Triton's interpreter (CPU), compiled for sm_90 on the CPU, and on
CUDA (both split kernels, eager, compiled, CUDA-graph replay) against float64 attention and up-projection."""

from __future__ import annotations

import pytest
import torch
from _triton_test_util import paged_cache, sm90_compile

from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

NAN = float("nan")
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _want64(q, cache, table, seq_lens, w_uv, scale, dc):
    """float64 ``absorb_out(decode(q))``: ``[B * s_q, H * V]``."""
    out, _ = torch.ops.mla.decode_ref(q.double().cpu(), cache.double().cpu(), table.cpu(), seq_lens.cpu(), scale, dc)
    return torch.einsum("thc,hvc->thv", out.flatten(0, 1), w_uv.double().cpu()).flatten(1)


def _rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30))


def _case(lens, s_q, H, dc, dr, V, bs, device="cpu", seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens = paged_cache(lens, bs, dc + dr, dtype, device=device, gen=gen)
    q = torch.randn(len(lens), s_q, H, dc + dr, generator=gen).to(device, dtype)
    kvb = (torch.randn(H, 2 * V, dc, generator=gen) / dc ** 0.5).to(device, dtype)
    return q, cache, table, seq_lens, kvb[:, V:]  # W_UV as the model passes it: a strided view of kv_b_proj


@interpret
@pytest.mark.parametrize("direct,tile,block_c,T", [(False, 4096, 64, 2), (False, 128, 64, 2), (True, 4096, 64, 2),
                                                   (False, 4096, 16, 2), (False, 64, 32, 2), (True, 4096, 16, 2),
                                                   (False, 128, 16, 5), (True, 4096, 32, 8)])
def test_reduce_absorb_merges_random_partials(direct, tile, block_c, T, monkeypatch):
    """Random partials (a row of one live split, a row with no key, NaN past the used slots) or, ``direct``, the
    split kernel's own output rows: each token's head rows merged in float64 and multiplied by W_UV (``tile`` 128 or
    64: chunks of 2 splits, the merge's two-pass branch; ``block_c`` 16 / 32: the 64 columns in 4 / 2 slices whose
    shares the head's last program adds; ``T`` 2, 5 or 8 tokens: the kernel's row loop unrolled 2 or 8 times, a
    loop of 8 guarding 3 rows past T); a token past T (the second of a one-token call) writes nothing; the output and
    the shares' scratch poisoned beforehand; the heads' arrival counters 0 after every call."""
    from mla_compile.ops._workspace import workspace
    from mla_compile.ops.triton import decode_absorb as da
    from mla_compile.ops.triton.decode import REDUCE, Split

    monkeypatch.setitem(REDUCE, "tile", tile)
    monkeypatch.setitem(da.ABSORB, "block_c", block_c)

    gen = torch.Generator().manual_seed(int(direct) + T)
    H, V, dc, splits, cap = 3, 20, 64, 6, 4
    rows = T * H
    o = torch.randn(rows, splits, dc, generator=gen)
    lse2 = torch.randn(rows, splits, generator=gen) * 3
    lse2[0, :cap - 1] = float("-inf")
    lse2[4, :cap] = float("-inf")
    o[:, cap:], lse2[:, cap:] = NAN, NAN
    out_rows = torch.randn(rows, dc, generator=gen).bfloat16()
    w_uv = (torch.randn(H, 2 * V, dc, generator=gen) / 8).bfloat16()[:, V:]
    part = Split(out_rows, torch.full((rows,), NAN), o.reshape(-1).clone(), lse2.reshape(-1).clone(), splits, cap,
                 direct, rows)
    with poisoned_empty():
        got = da.reduce_absorb(part, w_uv, T)
    if direct:
        lat = out_rows.double()
    else:
        l64 = lse2[:, :cap].double()
        m = l64.max(1).values.clamp_min(-1e300)
        w = torch.exp2(l64 - m[:, None])
        lat = (o[:, :cap].double() * w[..., None]).sum(1) / w.sum(1).clamp_min(1e-300)[:, None]
    want = torch.einsum("thc,hvc->thv", lat.view(T, H, dc), w_uv.double()).flatten(1)
    assert got.shape == (T, H * V) and not got.isnan().any()
    if not direct:
        assert torch.equal(got[1, V:2 * V], torch.zeros(V, dtype=got.dtype))  # token 1, head 1: row 4, no key
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    one = da.reduce_absorb(part._replace(rows=H), w_uv, 1)
    assert one.shape == (1, H * V) and torch.equal(one, got[:1])
    count = workspace("decode_absorb-arrivals", got.device, 4 * da.MAX_HEADS, zero=True).view(torch.int32)
    assert not count.any()  # every head's last program put its counter back


@interpret
@pytest.mark.parametrize("lens,s_q,config", [([37], 1, {"SPLITS": 3}), ([37, 0], 1, {"SPLITS": 3}),
                                             ([50], 2, {"SPLITS": 1}), ([20, 9], 1, None), ([0], 2, {"SPLITS": 2}),
                                             ([30, 0, 17, 64, 3], 1, None), ([41, 5, 0], 2, {"SPLITS": 2})])
def test_interpreter_triton_split_then_absorb_matches_float64(lens, s_q, config):
    """The Triton split kernel and the merge + W_UV launch: split (3), direct (1) and planned splits, an empty
    sequence (its rows 0), two queries of one sequence, 5 and 6 query rows (loops of 8); outputs poisoned
    beforehand; W_UV strided."""
    from mla_compile.ops.triton import decode_absorb as da

    H, dc, dr, V, bs = 4, 64, 16, 24, 16
    q, cache, table, seq_lens, w_uv = _case(lens, s_q, H, dc, dr, V, bs, seed=sum(lens) + s_q)
    with poisoned_empty():
        got = da.launch(q, cache, table, seq_lens, 0.1, dc, w_uv, "triton", config)
    want = _want64(q, cache, table, seq_lens, w_uv, 0.1, dc)
    assert got.shape == want.shape and not got.isnan().any()
    for t in range(want.shape[0]):
        if want[t].abs().max() == 0:
            assert torch.equal(got[t], torch.zeros_like(got[t]))
    assert _rel(got, want) < 2e-2  # bf16 dots and the interpreter's truncating casts


@sm90_compile
@pytest.mark.parametrize("T", [1, 2, 8])
@pytest.mark.parametrize("direct", [False, True])
def test_reduce_absorb_kernel_compiles_for_sm90(T, direct):
    """V2-Lite / V3's W_UV (128 value rows of 512) after 32 splits or one: one launch of 16 heads x 8 column
    slices, no spills; under PDL the wait before the trigger (W_UV's tile is requested before the wait); the arrival
    count one acquire-release atomic at GPU scope after the barrier."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, decode_absorb
    from mla_compile.ops.triton.decode import Split

    H, V, dc, splits = 16, 128, 512, 1 if direct else 32
    meta = dict(device="meta")
    part = Split(torch.empty(T, 1, H, dc, dtype=torch.bfloat16, **meta), torch.empty(T, 1, H, **meta),
                 torch.empty(T * H * splits * dc, **meta), torch.empty(T * H * splits, **meta), splits, splits,
                 direct, T * H)
    w_uv = torch.empty(H, 2 * V, dc, dtype=torch.bfloat16, **meta)[:, V:]
    launches = _sm90.record(decode_absorb, decode_absorb.reduce_absorb, part, w_uv, T, pdl=True)
    assert len(launches) == 1
    kernel, grid, args, kwargs = launches[0]
    assert tuple(grid) == (H, dc // decode_absorb.ABSORB["block_c"])
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"
    ptx = compiled.asm["ptx"]
    assert kwargs["PDL"] and -1 < ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("atom.global.gpu.acq_rel.add") == 1 and "bar.sync" in ptx


# --- CUDA (the lead's H200 run) ---

@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "gluon"])
@pytest.mark.parametrize("lens,s_q", [([4096], 1), ([4096, 0], 1), ([777, 4000], 1), ([3000], 2),
                                      ([100, 200, 4096, 5, 60], 1), ([100, 200, 4096, 5, 60, 1, 0, 3000, 7], 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_matches_float64_at_deepseek_dims(backend, lens, s_q, dtype):
    """V2-Lite's 16 heads (512 + 64, W_UV 128 x 512), pages of 64: one, two and five query rows (the fused launch,
    a padding sequence of length 0 among them), and nine (past ``MAX_ROWS``: the decode and the absorb GEMV inside
    the op); float16 runs the Triton split kernel under either name."""
    from mla_compile import ops

    q, cache, table, seq_lens, w_uv = _case(lens, s_q, 16, 512, 64, 128, 64, device="cuda", seed=len(lens),
                                            dtype=dtype)
    torch.full((1 << 28,), NAN, device="cuda")  # freed: the op's outputs and workspaces are carved from NaN
    got = ops.decode_absorb_out(q, cache, table, seq_lens, 0.0625, kv_lora_rank=512, w_uv=w_uv, backend=backend)
    want = _want64(q, cache, table, seq_lens, w_uv, 0.0625, 512)
    assert not got.isnan().any() and _rel(got, want) < 1e-2
    out, _ = torch.ops.mla.decode_ref(q, cache, table, seq_lens, 0.0625, 512)
    ref = torch.ops.mla.absorb_out(out.flatten(0, 1), w_uv)
    assert _rel(got, ref.double().cpu()) < 1e-2


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "gluon"])
def test_cuda_compiled_and_graph_replay(backend, fresh_dynamo):
    """Compiled (fullgraph), then a CUDA graph of the compiled call at two sequences replayed with new lengths and
    queries: the replay's output is the float64 one of the new step."""
    from mla_compile import ops

    q, cache, table, seq_lens, w_uv = _case([3000, 4096], 1, 16, 512, 64, 128, 64, device="cuda", seed=3)
    fn = torch.compile(lambda a, lens: ops.decode_absorb_out(a, cache, table, lens, 0.0625, kv_lora_rank=512,
                                                             w_uv=w_uv, backend=backend), fullgraph=True)
    sq, sl = q.clone(), seq_lens.clone()
    torch.testing.assert_close(fn(sq, sl).double().cpu(), _want64(sq, cache, table, sl, w_uv, 0.0625, 512),
                               atol=2e-2, rtol=2e-2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(sq, sl)
    sq.copy_(torch.randn_like(q))
    sl.copy_(torch.tensor([17, 2500], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, _want64(sq, cache, table, sl, w_uv, 0.0625, 512)) < 1e-2


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("split", ["triton", "gluon"])
@pytest.mark.parametrize("splits", [1, 2, 24, 64])
@pytest.mark.parametrize("tile", [4096, 512])
def test_cuda_split_counts_take_every_merge_branch(split, splits, tile, monkeypatch):
    """The fused launch after 1 split (the split kernel's own rows), 2, 24 and 64 (at the default tile one chunk of
    the merge: its one-pass loads; at ``tile`` 512, chunks of 8 splits of a 64-column slice: the two-pass branch)
    against float64; 20 more calls bit for bit the first, the arrival counters 0 after."""
    from mla_compile.ops.triton import decode_absorb as da
    from mla_compile.ops.triton.decode import REDUCE

    monkeypatch.setitem(REDUCE, "tile", tile)

    q, cache, table, seq_lens, w_uv = _case([4096, 3000], 1, 16, 512, 64, 128, 64, device="cuda", seed=splits)
    got = da.launch(q, cache, table, seq_lens, 0.0625, 512, w_uv, split, {"SPLITS": splits})
    assert not got.isnan().any() and _rel(got, _want64(q, cache, table, seq_lens, w_uv, 0.0625, 512)) < 1e-2
    for _ in range(20):  # whichever column slice of a head comes last, the same sum; the counters back at 0
        assert torch.equal(da.launch(q, cache, table, seq_lens, 0.0625, 512, w_uv, split, {"SPLITS": splits}), got)
    from mla_compile.ops._workspace import workspace
    assert not workspace("decode_absorb-arrivals", got.device, 4 * da.MAX_HEADS, zero=True).any()
