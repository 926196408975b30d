"""``mla::moe_experts_fp4`` against a float64 per-(token, pick) loop written from the math (each weight decoded by
the independent float64 model of the fp4 format in ``tests/checkpoints.py``): the reference backend, the Triton
kernels under the interpreter (NaN-poisoned outputs, repeated ids, T = 1 and 5, widths off the tiles, every code in
both nibbles, the V4 swiglu clamp), opcheck, the fake, errors naming the argument, a compiled call and the "auto"
choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mla_compile.ops.moe_experts_fp4 import moe_experts_fp4
from tests.checkpoints import dequantize_fp4_64, quantize_fp4
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

NAMES = ("x", "weights", "ids", "gate", "gate_scale", "up", "up_scale", "down", "down_scale")


def fp4_weight(gen, *shape, fan_in):
    """Random fp4 codes and ue8m0 scales of a ``[..., N, K]`` weight of values ~ fan_in**-0.5."""
    return quantize_fp4(torch.randn(*shape, generator=gen) * fan_in ** -0.5)


def make(T=5, H=64, I=96, E=6, k=3, dtype=torch.float32, seed=0, repeat=False, every_code=False):
    """Random inputs in :data:`NAMES` order; ``every_code``: expert 0's gate bytes run through all 256 values."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int()
    if repeat:  # the same expert twice in a row counts twice
        ids[0, 1] = ids[0, 0]
    weights = torch.rand(T, k, generator=gen) + 0.1
    x = torch.randn(T, H, generator=gen).to(dtype)
    gate = fp4_weight(gen, E, I, H, fan_in=H)
    if every_code:
        ids[:, 0] = 0
        flat = gate[0][0].view(torch.uint8).view(-1)
        flat.copy_(torch.arange(flat.numel()) % 256)
    return (x, weights, ids, *gate, *fp4_weight(gen, E, I, H, fan_in=H), *fp4_weight(gen, E, H, I, fan_in=I))


def experts64(x, weights, ids, g, gs, u, us, d, ds, round_to=None, limit=None):
    """The contract in float64, one (token, pick) at a time; ``round_to``: the activation's rounding dtype."""
    x = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gv, uv = dequantize_fp4_64(g[e], gs[e]) @ x[t], dequantize_fp4_64(u[e], us[e]) @ x[t]
            if limit is not None:
                gv, uv = gv.clamp(max=limit), uv.clamp(-limit, limit)
            a = F.silu(gv) * uv
            if round_to is not None:
                a = a.to(round_to).double()
            out[t] += float(weights[t, j]) * (dequantize_fp4_64(d[e], ds[e]) @ a)
    return out


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def call(args, **kw):
    return moe_experts_fp4(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reference_matches_float64_loop(dtype):
    args = make(dtype=dtype, repeat=True)
    want = experts64(*args, round_to=dtype)
    out = call(args, backend="reference")
    assert out.dtype == dtype and out.shape == args[0].shape
    assert rel(out, want) < {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    out32 = call(args, out_float32=True, backend="reference")
    assert out32.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_reference_swiglu_limit():
    args = make(dtype=torch.float64, seed=3)
    want = experts64(*args, limit=0.05)
    assert rel(call(args, swiglu_limit=0.05, backend="reference"), want) < 1e-13
    assert rel(experts64(*args), want) > 1e-3, "the limit must bind for this test to mean anything"


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("T,H,I,E,k,limit,dtype,every_code", [
    (5, 64, 96, 6, 3, None, torch.bfloat16, False),  # I off the 16-row tiles: masked rows
    (1, 1056, 160, 8, 3, None, torch.float32, True),  # H over two 512-column steps, the second partial
    (1, 1056, 160, 8, 3, None, torch.bfloat16, False),
    (3, 96, 544, 5, 2, 0.05, torch.float32, False),  # the V4 clamp; I over two steps of the down kernel
    (2, 32, 32, 4, 2, None, torch.float16, True),  # one block each way
])
def test_interpreter_matches_float64_loop(T, H, I, E, k, limit, dtype, every_code):
    from mla_compile.ops.triton.moe_experts_fp4 import _launch

    args = make(T, H, I, E, k, dtype=dtype, seed=T + H, repeat=True, every_code=every_code)
    want = experts64(*args, round_to=dtype, limit=limit)
    if limit is not None:
        assert rel(experts64(*args, round_to=dtype), want) > 1e-3, "the limit must bind"
    with poisoned_empty():
        out = _launch(*args, True, limit)
        assert out.dtype == torch.float32 and not out.isnan().any()
        # half precision: the activation's rounding (the interpreter's float32 -> bf16 cast truncates: up to 2**-8)
        assert rel(out, want) < (1e-6 if dtype == torch.float32 else 8e-3)
        if H * I <= 32 * 32:  # the repeat on the smallest case (the GPU test repeats every case)
            assert torch.equal(out, _launch(*args, True, limit)), "the combine must add the picks in one fixed order"
        low = _launch(*args, False, limit)
        assert low.dtype == dtype and rel(low, want) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
def test_interpreter_skips_picks_of_weight_zero():
    """The fused kernels read nothing of a weight-0 pick's expert (its scales NaN here): the live picks' sum,
    exactly 0 for a token with none."""
    from mla_compile.ops.triton.moe_experts_fp4 import _launch
    from tests.ops.test_moe_experts_fp8 import poison_last_expert, zero_picks

    E = 6
    args, dead = zero_picks(make(4, 64, 96, E, 3, dtype=torch.bfloat16, seed=11), E)
    want = experts64(*args, round_to=torch.bfloat16)  # the last expert clean here: weight 0 times a finite value
    poisoned = poison_last_expert(args, E, 255)  # ue8m0 byte 255: NaN scales
    with poisoned_empty():
        out = _launch(*poisoned, True, None)
        assert not out.isnan().any() and rel(out, want) < 8e-3
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert dead.any() and not dead.all()


def test_opcheck_and_fake():
    args = make()
    op = torch.ops.mla.moe_experts_fp4_ref
    torch.library.opcheck(op, (*args, False, None))
    torch.library.opcheck(op, (*args, True, 1.5))
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = (args[0].bfloat16(), *args[1:])
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in real]
        out = torch.ops.mla.moe_experts_fp4_ref(*fake, True, None)
        assert out.shape == args[0].shape and out.dtype == torch.float32
        assert torch.ops.mla.moe_experts_fp4_ref(*fake, False, None).dtype == torch.bfloat16


def test_compiled_call_matches_eager():
    args = make()
    fn = torch.compile(lambda *a: call(a, swiglu_limit=0.5), fullgraph=True)
    assert rel(fn(*args), experts64(*args, limit=0.5)) < 1e-6


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(x=a["x"][0]), "x"),
    (lambda a: a.update(x=a["x"][:, :48]), "x's hidden size"),
    (lambda a: a.update(gate=a["gate"].float()), "gate"),
    (lambda a: a.update(gate_scale=a["gate_scale"][:, :, :1]), "gate_scale"),
    (lambda a: a.update(up_scale=a["up_scale"].int()), "up_scale"),
    (lambda a: a.update(up=a["up"][:, :-1]), "up"),
    (lambda a: a.update(down=a["down"].transpose(1, 2)), "down"),
    (lambda a: a.update(down_scale=a["down_scale"][1:]), "down_scale"),
    (lambda a: a.update(ids=a["ids"].float()), "ids"),
    (lambda a: a.update(weights=a["weights"][:, :2]), "weights"),
])
def test_errors_name_the_argument(change, match):
    a = dict(zip(NAMES, make()))
    change(a)
    with pytest.raises((ValueError, TypeError), match=match):
        call(tuple(a[n] for n in NAMES))


def test_auto_on_cpu_is_the_reference():
    from mla_compile.ops.moe_experts_fp4 import auto_backend
    assert auto_backend("cpu", "bfloat16") == "reference"


def test_auto_on_a_gpu_takes_gluon_where_it_serves_else_splits_fused_and_grouped(monkeypatch):
    """On an (assumed) sm_90 GPU "auto" for bf16 x is the split of "gluon" up to ``GLUON_MAX_TOKENS_FP4`` tokens and
    the grouped GEMMs above; where "gluon" does not serve (float16 x, another architecture, not GPU-tested) the
    split of the Triton fused kernels and the grouped GEMMs."""
    import dataclasses

    from mla_compile.ops import select
    from mla_compile.ops.moe_experts_fp4 import FUSED_MAX_TOKENS_FP4, GLUON_MAX_TOKENS_FP4, auto_backend
    from mla_compile.ops.registry import _TABLE, parse_split, split_part
    from tests.ops.test_moe_experts_fp8 import check_auto_split

    table = _TABLE["moe_experts_fp4"]
    for name in ("gluon", "triton", "grouped"):
        monkeypatch.setitem(table, name, dataclasses.replace(table[name], available=lambda: True, gpu_tested=True))
    monkeypatch.setattr(select, "device_capability", lambda device=None: (9, 0))
    tiers = parse_split(auto_backend("cuda", "bfloat16"))
    assert split_part(tiers, 1) == split_part(tiers, GLUON_MAX_TOKENS_FP4) == "gluon"
    assert split_part(tiers, GLUON_MAX_TOKENS_FP4 + 1) == "grouped"
    assert split_part(parse_split(auto_backend("cuda", "float16")), 1) == "triton"
    monkeypatch.setattr(select, "device_capability", lambda device=None: (10, 0))
    assert split_part(parse_split(auto_backend("cuda", "bfloat16")), 1) == "triton"
    monkeypatch.setitem(table, "gluon", dataclasses.replace(table["gluon"], gpu_tested=False))
    check_auto_split(monkeypatch, "moe_experts_fp4", auto_backend, FUSED_MAX_TOKENS_FP4)


def test_gluon_operand_orders_agree():
    """The Gluon kernels' K order (ops/triton/moe_experts_fp4_mma.py): a step's words decoded pair by pair (codes i
    and i + 4 of each word joined, then the pairs of i = 0, 1 and 2, 3, then those) and reshaped / permuted by
    ``A_ORDER`` put at each of A's 128 columns the same weight column that x's natural step permuted by ``X_ORDER``
    puts there (the joins and reshapes as torch's stack and row-major views), and every column exactly once."""
    pytest.importorskip("triton")
    from mla_compile.ops.triton.moe_experts_fp4_mma import A_ORDER, X_ORDER

    code = torch.arange(128).view(16, 8)  # [word, code]: column 8 j + i of the step
    pair = [torch.stack([code[:, i], code[:, i + 4]], -1) for i in range(4)]
    d = torch.stack([torch.stack([pair[0], pair[1]], -1), torch.stack([pair[2], pair[3]], -1)], -1)
    a_cols = d.view(1, 1, 4, 4, 2, 2, 2).permute(*A_ORDER.value).reshape(128)
    x_cols = torch.arange(128).view(1, 1, 4, 4, 2, 2, 2).permute(*X_ORDER.value).reshape(128)
    assert torch.equal(a_cols, x_cols)
    assert torch.equal(a_cols.sort().values, torch.arange(128)) and not torch.equal(a_cols, torch.arange(128))


def test_gluon_launch_parameters_by_token_count():
    """The Gluon kernels' launch parameters: ``per_pick``'s entry for the tokens where the dims take it (one token's
    8 down warps need I a multiple of 2048), ``CONFIG["sorted"]`` above ``sorted_above`` (the sorted kernels),
    ``CONFIG``'s own otherwise; which calls the kernels serve does not depend on the token count."""
    pytest.importorskip("triton")
    from mla_compile.ops.triton.moe_experts_fp4_mma import CONFIG, eligible, tiles

    base = (CONFIG["rows"], CONFIG["gate_up_warps"], CONFIG["down_warps"])
    per_pick = {bound: tuple(c) for bound, *c in CONFIG["per_pick"]}
    assert tiles(1, 4096, 2048) == per_pick[1] != base  # V4-Flash's dims
    assert tiles(1, 1024, 1024) == base  # 8 down warps do not fit I = 1024
    for T in range(2, CONFIG["sorted_above"] + 1):
        bound = min(b for b in per_pick if b >= T)
        assert tiles(T, 4096, 2048) == per_pick[bound] == tiles(T, 1024, 1024)
    above = CONFIG["sorted_above"] + 1
    assert tiles(above, 4096, 2048) == tiles(256, 1024, 1024) == CONFIG["sorted"] != base
    assert tiles(above, 4096, 256 * 3) == base  # I = 768: not a multiple of 2 warps x 256 columns
    for T in (1, 8, 40):
        x = torch.empty(T, 1024, dtype=torch.bfloat16)
        assert eligible(x, 1024) and not eligible(x, 1056) and not eligible(x.float(), 1024)


def test_gluon_op_opcheck_and_fallback_on_cpu():
    """``mla::moe_experts_fp4_gluon`` off the GPU: the fake and opcheck, and the reference's result."""
    pytest.importorskip("triton")
    import mla_compile.ops.triton.moe_experts_fp4_mma  # noqa: F401

    args = make(dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.mla.moe_experts_fp4_gluon, (*args, True, 1.5))
    want = call(args, out_float32=True, swiglu_limit=1.5, backend="reference")
    assert torch.equal(torch.ops.mla.moe_experts_fp4_gluon(*args, True, 1.5), want)
