"""The "triton-grouped" ``mla::moe_experts`` kernels under Triton's interpreter (CPU): the block layout of the
routed pairs (every pair once, one expert per block, stable order, static sizes), then the four kernels
against the float64 per-(token, pick) loop with experts hit by no, one and many tokens (more than a block),
token counts off the block size, tiles off the widths, the shared experts folded in or not, NaN weights of the
experts nobody picks, NaN-poisoned outputs and workspaces, run-to-run equality; no host read in the launch
code; opcheck. References and inputs: tests/ops/test_moe_experts.py. GPU twins:
tests/ops/triton/test_triton_moe_grouped.py; sm_90 compile: test_triton_sm90_compile_moe.py."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_moe_experts import experts64, make, rel
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

pytestmark = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")

SMALL_TILES = dict(gate_up_n=16, gate_up_k=16, down_n=16, down_k=16, num_stages=2)


def routed_case(T, H, I, E, k, S, dtype, seed):
    """Inputs where expert 0 is every token's first pick (many tokens: more than a block of 16 or 32 when T is),
    expert 1 is picked once (token 0's last pick), experts ``E-2`` and ``E-1`` never: their weights are NaN
    (a leak shows), the other picks random among the rest (token 1 picks one of them twice)."""
    x, w, ids, gu, dn, sg, su, sd = make(T, H, I, E, k, S, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), 2 + torch.randperm(E - 4, generator=gen)[:k - 1]])
                       for _ in range(T)]).int()
    ids[0, -1] = 1
    if T > 1 and k > 2:
        ids[1, 2] = ids[1, 1]
    gu[E - 2:] = float("nan")
    dn[E - 2:] = float("nan")
    return x, w, ids, gu, dn, sg, su, sd


def _check(args, dtype):
    from mla_compile.ops.triton.moe_grouped import _launch

    clean = list(args)
    E = args[3].shape[0]
    clean[3], clean[4] = args[3][:E - 2], args[4][:E - 2]  # the reference never sees the unpicked NaN experts
    want = experts64(*clean, round_to=dtype)
    with poisoned_empty():
        out = _launch(*args, True)
        assert out.dtype == torch.float32 and not out.isnan().any()
        # bf16: the activation's rounding (the interpreter's float32 -> bf16 cast truncates: up to 1 ulp, 2**-8)
        assert rel(out, want) < (1e-6 if dtype == torch.float32 else 8e-3), rel(out, want)
        assert torch.equal(out, _launch(*args, True)), "two calls must give the same bits"
        low = _launch(*args, False)
        assert low.dtype == dtype and rel(low, want) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,I,E,k,S,bm", [(21, 40, 24, 8, 3, 2, 16), (37, 40, 24, 8, 3, 1, 32),
                                            (5, 48, 40, 6, 3, 0, 0), (1, 24, 16, 6, 2, 1, 0),
                                            (70, 32, 16, 7, 3, 1, 64)])
def test_interpreter_matches_float64_loop_small_tiles(T, H, I, E, k, S, bm, dtype, monkeypatch):
    """Tiles of 16 (several K steps and N tiles, the last ones partial); ``bm`` 0: BLOCK_M chosen from T*k/E."""
    from mla_compile.ops.triton import moe_grouped

    monkeypatch.setattr(moe_grouped, "CONFIG", dict(moe_grouped.CONFIG, **SMALL_TILES, block_m=bm))
    _check(routed_case(T, H, I, E, k, S, dtype, seed=T + E), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreter_matches_float64_loop_default_config(dtype):
    """The default (sm_90) tiles, wider than these widths: one masked step."""
    _check(routed_case(20, 72, 40, 9, 4, 2, dtype, seed=3), dtype)


def test_interpreter_float16_and_int64_ids():
    x, w, ids, gu, dn, sg, su, sd = make(9, 40, 24, 5, 2, 1, dtype=torch.float16, seed=4, repeat=True)
    want = experts64(x, w, ids, gu, dn, sg, su, sd, round_to=torch.float16)
    from mla_compile.ops.triton.moe_grouped import _launch

    with poisoned_empty():
        out = _launch(x, w, ids.long(), gu, dn, sg, su, sd, True)
        assert not out.isnan().any() and rel(out, want) < 2e-3, rel(out, want)


@pytest.mark.parametrize("T,k,E,bm", [(37, 3, 8, 16), (5, 6, 64, 16), (64, 6, 64, 32), (3, 2, 4, 64), (1, 1, 1, 16)])
def test_block_layout(T, k, E, bm):
    """Every routed pair in exactly one used row; each block one expert (rows in token order within it: stable),
    its used rows a prefix; the experts' blocks in expert order; the unused blocks past the end empty."""
    from mla_compile.ops.triton.moe_grouped import align_blocks

    gen = torch.Generator().manual_seed(T * k + E)
    ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
    with poisoned_empty():
        rows, bexp, bcnt = align_blocks(ids, E, bm)
        nb = bexp.shape[0]
        assert nb * bm == rows.shape[0] and nb == -(-(T * k + min(E, T * k) * (bm - 1)) // bm)
        flat = ids.reshape(-1).long()
        seen = []
        for b in range(nb):
            used = int(bcnt[b])
            assert 0 <= used <= bm
            if used == 0:
                assert int(bexp[b]) == E and all(int(c) == 0 for c in bcnt[b:]), "empty blocks only at the end"
                break
            e = int(bexp[b])
            pairs = rows[b * bm: b * bm + used].long().tolist()
            assert all(int(flat[p]) == e for p in pairs), (b, e, pairs)
            seen += pairs
            if used < bm:
                assert b + 1 == nb or int(bcnt[b + 1]) == 0 or int(bexp[b + 1]) > e, "a partial block ends an expert"
        assert seen == sorted(range(T * k), key=lambda p: (int(flat[p]), p)), "pairs by expert, stable"


@pytest.mark.parametrize("masked", [False, True])
def test_launch_reads_nothing_on_the_host(masked, monkeypatch):
    """The host code of a launch (routing prep, buffers) never reads device data: no ``.item()``-style read or
    data-dependent shape under a dispatch mode (kernel launches recorded, not run)."""
    from mla_compile.ops.triton import moe_grouped
    from tests.ops.test_no_host_reads import NoHostReads

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append(self.kernel)

    monkeypatch.setattr(moe_grouped, "wrap_triton", Recorder)
    args = make(12, 40, 24, 6, 3, 2, dtype=torch.bfloat16)
    mask = torch.arange(12) < 9 if masked else None
    with NoHostReads():
        moe_grouped._launch(*args, False, mask)
    assert len(launches) == 5  # sort, align, gate_up, down, combine


def test_opcheck():
    import mla_compile.ops.triton.moe_grouped  # noqa: F401

    x, w, ids, gu, dn, sg, su, sd = make(6, 40, 24, 6, 3, 2)
    torch.library.opcheck(torch.ops.mla.moe_experts_grouped_triton, (x, w, ids, gu, dn, sg, su, sd, False))
    torch.library.opcheck(torch.ops.mla.moe_experts_grouped_triton, (x, w, ids.long(), gu, dn, None, None, None, True))


def test_declared_gpu_tested_for_cuda():
    """Declared for CUDA and GPU-tested, so "auto"'s split may take it above the fused kernels' token bound (the
    split's choice: tests/ops/test_moe_experts.py)."""
    from mla_compile.ops.registry import backends_for
    from mla_compile.ops.select import auto_skip

    spec = backends_for("moe_experts")["triton-grouped"]
    assert spec.devices == ("cuda",) and torch.bfloat16 in spec.dtypes and auto_skip(spec) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreter_token_mask(dtype, monkeypatch):
    """Masked tokens (one in the middle, the last block's worth at the end) hold NaN x and weights and alone pick
    the NaN experts: their rows are exactly 0, the others equal the float64 loop over the real tokens."""
    from mla_compile.ops.triton import moe_grouped

    monkeypatch.setattr(moe_grouped, "CONFIG", dict(moe_grouped.CONFIG, **SMALL_TILES, block_m=16))
    T, E = 37, 8
    x, w, ids, gu, dn, sg, su, sd = routed_case(T, 40, 24, E, 3, 2, dtype, seed=11)
    mask = torch.ones(T, dtype=torch.bool)
    mask[5] = False
    mask[32:] = False
    ids[~mask, 1] = E - 1  # only masked tokens pick the NaN experts
    ids[~mask, 2] = E - 2
    x[~mask] = float("nan")
    w[~mask] = float("nan")
    real = mask.nonzero().squeeze(1)
    want = experts64(x[real], w[real], ids[real], gu[:E - 2], dn[:E - 2], sg, su, sd, round_to=dtype)
    with poisoned_empty():
        out = moe_grouped._launch(x, w, ids, gu, dn, sg, su, sd, True, mask)
        assert (out[~mask] == 0).all() and not out.isnan().any()
        assert rel(out[real], want) < (1e-6 if dtype == torch.float32 else 8e-3), rel(out[real], want)
        assert torch.equal(out, moe_grouped._launch(x, w, ids, gu, dn, sg, su, sd, True, mask))


@pytest.mark.parametrize("P,E,masked", [(1, 1, False), (300, 7, False), (600, 64, True), (257, 3, True)])
def test_counting_sort_is_argsort_by_expert_stable(P, E, masked):
    """``_moe_sort_kernel`` (2 pairs a token) against torch's stable argsort: the order, each sorted pair's
    expert and the segments' cumulative ends; a masked token's picks count as expert E, sorted last."""
    from mla_compile.ops.triton import moe_grouped

    k = 2
    gen = torch.Generator().manual_seed(P + E)
    ids = torch.randint(0, E, (P,), generator=gen, dtype=torch.int64)
    mask = torch.rand(P // k + 1, generator=gen) < 0.7
    eff = torch.where(mask[torch.arange(P) // k], ids, E) if masked else ids
    n = E + masked
    order = torch.full((P,), -7, dtype=torch.int32)
    sorted_e = torch.full((P,), -7, dtype=torch.int32)
    offs = torch.full((n,), -7, dtype=torch.int32)
    moe_grouped._moe_sort_kernel[(n,)](ids, mask if masked else ids, order, sorted_e, offs, P, k, E,
                                       HAS_MASK=masked, CHUNK=128)
    want = torch.argsort(eff, stable=True)
    assert torch.equal(order.long(), want) and torch.equal(sorted_e.long(), eff[want])
    assert torch.equal(offs.long(), torch.cumsum(torch.bincount(eff, minlength=n), 0))


@pytest.mark.parametrize("T,k,E", [(1, 6, 256), (64, 6, 256), (37, 2, 5), (0, 6, 8)])
def test_sort_by_expert_triton_equals_sort_by_expert(T, k, E):
    """The counting-sort launch the Gluon fp4 experts sort with against ``sort_by_expert`` (torch's stable argsort):
    the same order (int64) and segment ends, whatever the outputs held."""
    from mla_compile.ops.moe_experts import sort_by_expert
    from mla_compile.ops.triton.moe_grouped import sort_by_expert_triton

    gen = torch.Generator().manual_seed(T * k + E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else torch.empty(0, k)
    ids = ids.to(torch.int32)
    with poisoned_empty():
        order, offs = sort_by_expert_triton(ids, E)
    want_order, want_offs = sort_by_expert(ids, E)
    assert order.dtype == torch.int64 and offs.dtype == torch.int32
    assert torch.equal(order, want_order) and torch.equal(offs, want_offs)


def test_token_mask_drops_the_masked_picks_from_the_blocks():
    from mla_compile.ops.triton.moe_grouped import align_blocks

    ids = torch.tensor([[0, 1], [2, 3], [0, 3]], dtype=torch.int32)
    rows, bexp, bcnt = align_blocks(ids, 4, 16, torch.tensor([True, False, True]))
    used = [(int(bexp[b]), rows[b * 16: b * 16 + int(bcnt[b])].tolist()) for b in range(bexp.shape[0]) if bcnt[b]]
    assert used == [(0, [0, 4]), (1, [1]), (3, [5])]


def test_op_checks_the_mask_and_falls_back_on_cpu():
    import mla_compile.ops.triton.moe_grouped  # noqa: F401

    x, w, ids, gu, dn, sg, su, sd = make(6, 40, 24, 6, 3, 2)
    with pytest.raises((ValueError, TypeError), match="token_mask"):
        torch.ops.mla.moe_experts_grouped_triton(x, w, ids, gu, dn, sg, su, sd, False, torch.ones(5, dtype=torch.bool))
    mask = torch.tensor([True, False, True, True, False, True])
    out = torch.ops.mla.moe_experts_grouped_triton(x, w, ids, gu, dn, sg, su, sd, False, mask)
    assert (out[~mask] == 0).all() and rel(out[mask], experts64(x, w, ids, gu, dn, sg, su, sd)[mask]) < 1e-6
    torch.library.opcheck(torch.ops.mla.moe_experts_grouped_triton, (x, w, ids, gu, dn, sg, su, sd, False, mask))
