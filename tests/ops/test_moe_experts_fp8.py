"""``mla::moe_experts_fp8`` against a float64 per-(token, pick) loop written from the math (each weight dequantized
block by block from its e4m3 codes and 128 x 128 scales): the reference backend, the Triton kernels under the
interpreter (NaN-poisoned outputs, repeated ids, T = 1 and 5, widths off the tiles and off the 128 blocks, the
shared experts folded in or not, the V4 swiglu clamp), opcheck, the fake, errors naming the argument, a
compiled call and the "auto" choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mla_compile.ops.moe_experts_fp8 import moe_experts_fp8
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

NAMES = ("x", "weights", "ids", "gate", "gate_scale", "up", "up_scale", "down", "down_scale", "shared_gate",
         "shared_gate_scale", "shared_up", "shared_up_scale", "shared_down", "shared_down_scale")


def fp8_weight(gen, *shape, fan_in):
    """Random e4m3 codes and float32 block scales ``[..., ceil(rows/128), ceil(cols/128)]``, values ~ fan_in**-0.5."""
    codes = (torch.randn(*shape, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    scale = (torch.rand(*blocks, generator=gen) + 0.5) * fan_in ** -0.5 / 64
    return codes, scale


def make(T=5, H=40, I=24, E=6, k=3, S=2, dtype=torch.float32, seed=0, repeat=False):
    """Random inputs in :data:`NAMES` order."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int()
    if repeat:  # the same expert twice in a row counts twice
        ids[0, 1] = ids[0, 0]
    weights = torch.rand(T, k, generator=gen) + 0.1
    x = torch.randn(T, H, generator=gen).to(dtype)
    routed = (*fp8_weight(gen, E, I, H, fan_in=H), *fp8_weight(gen, E, I, H, fan_in=H),
              *fp8_weight(gen, E, H, I, fan_in=I))
    shared = (*fp8_weight(gen, S * I, H, fan_in=H), *fp8_weight(gen, S * I, H, fan_in=H),
              *fp8_weight(gen, H, S * I, fan_in=I)) if S else (None,) * 6
    return (x, weights, ids, *routed, *shared)


def dequant64(codes, scale):
    """``W[n, c] = codes[n, c] * scale[n // 128, c // 128]`` in float64, one element at a time's formula."""
    rows, cols = codes.shape
    n = torch.arange(rows)[:, None] // 128
    c = torch.arange(cols)[None, :] // 128
    return codes.double() * scale.double()[n, c]


def experts64(x, weights, ids, g, gs, u, us, d, ds, sg=None, sgs=None, su=None, sus=None, sd=None, sds=None,
              round_to=None, limit=None):
    """The contract in float64, one (token, pick) at a time; ``round_to``: the activation's rounding dtype."""
    x = x.double()

    def mlp(gw, uw, dw, v):
        gv, uv = gw @ v, uw @ v
        if limit is not None:
            gv, uv = gv.clamp(max=limit), uv.clamp(-limit, limit)
        a = F.silu(gv) * uv
        if round_to is not None:
            a = a.to(round_to).double()
        return dw @ a

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += float(weights[t, j]) * mlp(dequant64(g[e], gs[e]), dequant64(u[e], us[e]),
                                                 dequant64(d[e], ds[e]), x[t])
        if sg is not None:
            out[t] += mlp(dequant64(sg, sgs), dequant64(su, sus), dequant64(sd, sds), x[t])
    return out


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def call(args, **kw):
    return moe_experts_fp8(*args[:9], **dict(zip(NAMES[9:], args[9:])), **kw)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reference_matches_float64_loop(dtype, shared):
    args = make(S=2 if shared else 0, dtype=dtype, repeat=True, H=136, I=24)
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
@pytest.mark.parametrize("T,H,I,E,k,S,limit,dtype", [
    (5, 40, 24, 6, 3, 2, None, torch.bfloat16),  # one 128-block each way, shared experts
    (1, 200, 136, 8, 6, 0, None, torch.float32),  # H and I over two blocks, no shared experts
    (1, 200, 136, 8, 6, 0, None, torch.bfloat16),
    (5, 160, 20, 5, 2, 1, 0.05, torch.float32),  # the V4 clamp
    (1, 130, 18, 4, 2, 8, None, torch.bfloat16),  # 8 shared slices of 18 rows: tiles of 2 rows, blocks straddled
])
def test_interpreter_matches_float64_loop(T, H, I, E, k, S, limit, dtype):
    from mla_compile.ops.triton.moe_experts_fp8 import _launch

    args = make(T, H, I, E, k, S, dtype=dtype, seed=T + H, repeat=True)
    want = experts64(*args, round_to=dtype, limit=limit)
    with poisoned_empty():
        out, again, low = _launch(*args, True, limit), _launch(*args, True, limit), _launch(*args, False, limit)
    assert out.dtype == torch.float32 and not out.isnan().any()
    # bf16: the activation's rounding (the interpreter's float32 -> bf16 cast truncates: up to 1 ulp, 2**-8)
    assert rel(out, want) < (1e-6 if dtype == torch.float32 else 8e-3)
    assert torch.equal(out, again), "the combine must add the picks in one fixed order"
    assert low.dtype == dtype and rel(low, want) < (1e-6 if dtype == torch.float32 else 1e-2)


def zero_picks(args, E, seed=1):
    """``args`` (from :func:`make`) with about half the picks, and all of token 0's, given weight 0 and the last
    expert, which no other pick uses (expert parallelism's picks of other ranks); returns them and the mask."""
    args = list(args)
    T, k = args[2].shape
    dead = torch.rand(T, k, generator=torch.Generator().manual_seed(seed)) < 0.5
    dead[0] = True
    args[1], args[2] = args[1].clone(), args[2].clone()
    args[1][dead] = 0
    args[2][~dead] %= E - 1
    args[2][dead] = E - 1
    return tuple(args), dead


def poison_last_expert(args, E, value):
    """``args`` with the last expert's gate, up and down scales (entries 4, 6, 8) set to ``value`` (NaN), copied."""
    args = list(args)
    for i in (4, 6, 8):
        args[i] = args[i].clone()
        args[i][E - 1] = value
    return args


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("S", [0, 1])
def test_interpreter_skips_picks_of_weight_zero(S):
    """The fused kernels read nothing of a routed weight-0 pick's expert (its scales NaN here): the live picks'
    sum (and the shared experts', which every token keeps)."""
    from mla_compile.ops.triton.moe_experts_fp8 import _launch

    E = 6
    args, dead = zero_picks(make(4, 136, 24, E, 3, S, dtype=torch.bfloat16, seed=11), E)
    want = experts64(*args, round_to=torch.bfloat16)  # the last expert clean here: weight 0 times a finite value
    poisoned = poison_last_expert(args, E, float("nan"))
    with poisoned_empty():
        out = _launch(*poisoned, True, None)
    assert not out.isnan().any() and rel(out, want) < 8e-3
    if S == 0:
        assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert dead.any() and not dead.all()


def test_opcheck_and_fake():
    from tests.ops.test_fp8_block_linear import OPCHECK_UTILS  # test_schema cannot perturb float8 on CPU

    args = make(H=136)
    op = torch.ops.mla.moe_experts_fp8_ref
    torch.library.opcheck(op, (*args, False, None), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(op, (*args[:9], *(None,) * 6, True, 1.5), test_utils=OPCHECK_UTILS)
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = (args[0].bfloat16(), *args[1:9])
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in real] + [None] * 6
        out = torch.ops.mla.moe_experts_fp8_ref(*fake, True, None)
        assert out.shape == args[0].shape and out.dtype == torch.float32
        assert torch.ops.mla.moe_experts_fp8_ref(*fake, False, None).dtype == torch.bfloat16


def test_compiled_call_matches_eager():
    args = make()
    fn = torch.compile(lambda *a: call(a, swiglu_limit=0.5), fullgraph=True)
    assert rel(fn(*args), experts64(*args, limit=0.5)) < 1e-6


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(x=a["x"][0]), "x"),
    (lambda a: a.update(gate=a["gate"].float()), "gate"),
    (lambda a: a.update(gate_scale=a["gate_scale"][:, :, :1]), "gate_scale"),
    (lambda a: a.update(up_scale=a["up_scale"].double()), "up_scale"),
    (lambda a: a.update(up=a["up"][:, :-1]), "up"),
    (lambda a: a.update(down=a["down"].transpose(1, 2)), "down"),
    (lambda a: a.update(down_scale=a["down_scale"][1:]), "down_scale"),
    (lambda a: a.update(ids=a["ids"].float()), "ids"),
    (lambda a: a.update(weights=a["weights"][:, :2]), "weights"),
    (lambda a: a.update(shared_up_scale=None), "shared"),
    (lambda a: a.update(shared_down_scale=a["shared_down_scale"][:, :0]), "shared_down_scale"),
    (lambda a: a.update(shared_gate=a["shared_gate"][:-1]), "shared_gate"),
])
def test_errors_name_the_argument(change, match):
    a = dict(zip(NAMES, make(H=136)))
    change(a)
    with pytest.raises((ValueError, TypeError), match=match):
        call(tuple(a[n] for n in NAMES))


def test_auto_on_cpu_is_the_reference():
    from mla_compile.ops.moe_experts_fp8 import auto_backend
    assert auto_backend("cpu", "bfloat16") == "reference"


def check_auto_split(monkeypatch, op: str, auto_backend, max_tokens: int) -> None:
    """On an (assumed) sm_90 GPU with both of ``op``'s backends GPU-tested, its "auto" is the split: the fused
    kernels up to ``max_tokens`` tokens, the grouped GEMMs above; without a GPU-tested fused kernel, grouped."""
    from mla_compile.ops import select
    from mla_compile.ops.registry import _TABLE, parse_split, split_part

    monkeypatch.setattr(select, "device_capability", lambda device=None: (9, 0))
    table = _TABLE[op]
    for name in ("triton", "grouped"):
        monkeypatch.setitem(table, name, dataclasses.replace(table[name], available=lambda: True, gpu_tested=True))
    tiers = parse_split(auto_backend("cuda", "bfloat16"))
    assert split_part(tiers, 1) == split_part(tiers, max_tokens) == "triton"
    assert split_part(tiers, max_tokens + 1) == "grouped"
    monkeypatch.setitem(table, "triton", dataclasses.replace(table["triton"], gpu_tested=False))
    assert auto_backend("cuda", "bfloat16") == "grouped"


def test_auto_on_a_gpu_splits_fused_and_grouped_by_tokens(monkeypatch):
    from mla_compile.ops.moe_experts import FUSED_MAX_TOKENS_FP8
    from mla_compile.ops.moe_experts_fp8 import auto_backend

    check_auto_split(monkeypatch, "moe_experts_fp8", auto_backend, FUSED_MAX_TOKENS_FP8)
