"""``mla::moe_experts`` against a float64 per-(token, pick) loop of the SiLU experts: the reference backend (float64,
float32, bf16; with and without the shared experts, an expert picked twice), opcheck, the fake, errors naming
the argument, a compiled call and the "auto" choice. The Triton kernels under the interpreter:
tests/ops/triton/test_triton_interpret_moe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mla_compile import ops


def make(T=5, H=40, I=24, E=6, k=3, S=2, dtype=torch.float32, seed=0, repeat=False):
    """Random inputs: ``(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down)``."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int()
    if repeat:  # the same expert twice in a row counts twice
        ids[0, 1] = ids[0, 0]
    weights = torch.rand(T, k, generator=gen) + 0.1
    shared = (rnd(S * I, H, scale=H ** -0.5), rnd(S * I, H, scale=H ** -0.5), rnd(H, S * I, scale=I ** -0.5)) \
        if S else (None, None, None)
    return (rnd(T, H), weights, ids, rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5), *shared)


def experts64(x, weights, ids, gate_up, down, sg=None, su=None, sd=None, round_to=None):
    """The contract in float64, one (token, pick) at a time; ``round_to``: the dtype the activation is
    rounded to before the down projection."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    I = gate_up.shape[1] // 2

    def mlp(g_w, u_w, d_w, v):
        a = F.silu(g_w @ v) * (u_w @ v)
        if round_to is not None:
            a = a.to(round_to).double()
        return d_w @ a

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += float(weights[t, j]) * mlp(gate_up[e, :I], gate_up[e, I:], down[e], x[t])
        if sg is not None:
            out[t] += mlp(sg.double(), su.double(), sd.double(), x[t])
    return out


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reference_matches_float64_loop(dtype, shared):
    args = make(S=2 if shared else 0, dtype=dtype, repeat=True)
    want = experts64(*args, round_to=dtype)
    out = ops.moe_experts(*args[:5], shared_gate=args[5], shared_up=args[6], shared_down=args[7],
                          backend="reference")
    assert out.dtype == dtype and out.shape == args[0].shape
    assert rel(out, want) < {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    out32 = ops.moe_experts(*args[:5], shared_gate=args[5], shared_up=args[6], shared_down=args[7],
                            out_float32=True, backend="reference")
    assert out32.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel(out32, want) < {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 1e-5}[dtype]


def test_reference_equals_dense_experts_with_shared_mlp():
    """The op's shared experts are the HF shared MLP; its routed part is ``models.moe.experts_dense``."""
    from mla_compile.models.moe import experts_dense

    x, w, ids, gu, dn, sg, su, sd = make(dtype=torch.float64)
    want = experts_dense(x, w.double(), ids.long(), gu, dn, F.silu) + F.linear(
        F.silu(F.linear(x, sg)) * F.linear(x, su), sd)
    torch.testing.assert_close(ops.moe_experts(x, w, ids, gu, dn, shared_gate=sg, shared_up=su, shared_down=sd),
                               want, rtol=1e-12, atol=1e-12)


def test_opcheck_and_fake():
    x, w, ids, gu, dn, sg, su, sd = make()
    torch.library.opcheck(torch.ops.mla.moe_experts_ref, (x, w, ids, gu, dn, sg, su, sd, False))
    torch.library.opcheck(torch.ops.mla.moe_experts_ref, (x, w, ids.long(), gu, dn, None, None, None, True))
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = (x.bfloat16(), w, ids, gu.bfloat16(), dn.bfloat16())
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in real] + [None, None, None]
        out = torch.ops.mla.moe_experts_ref(*fake, True)
        assert out.shape == x.shape and out.dtype == torch.float32
        assert torch.ops.mla.moe_experts_ref(*fake, False).dtype == torch.bfloat16


def test_compiled_call_matches_eager():
    args = make()
    fn = torch.compile(lambda *a: ops.moe_experts(*a[:5], shared_gate=a[5], shared_up=a[6], shared_down=a[7]),
                       fullgraph=True)
    assert rel(fn(*args), experts64(*args)) < 1e-6


def test_auto_on_cpu_is_the_reference():
    from mla_compile.ops.moe_experts import auto_backend
    assert auto_backend("cpu", "bfloat16", 2048) == "reference"


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(x=a["x"][0]), "x"),
    (lambda a: a.update(gate_up=a["gate_up"][:, :-1]), "gate_up"),
    (lambda a: a.update(down=a["down"].transpose(1, 2)), "down"),
    (lambda a: a.update(ids=a["ids"].float()), "ids"),
    (lambda a: a.update(weights=a["weights"][:, :2]), "weights"),
    (lambda a: a.update(shared_up=None), "shared"),
    (lambda a: a.update(shared_gate=a["shared_gate"][:-1], shared_up=a["shared_up"][:-1],
                        shared_down=a["shared_down"][:, :-1]), "shared_gate"),
    (lambda a: a.update(down=a["down"].double()), "down"),
])
def test_errors_name_the_argument(change, match):
    names = ("x", "weights", "ids", "gate_up", "down", "shared_gate", "shared_up", "shared_down")
    a = dict(zip(names, make()))
    change(a)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.moe_experts(a["x"], a["weights"], a["ids"], a["gate_up"], a["down"], shared_gate=a["shared_gate"],
                        shared_up=a["shared_up"], shared_down=a["shared_down"])


def test_auto_on_a_gpu_splits_fused_and_grouped_by_tokens(monkeypatch):
    """On an (assumed) H200 with the backends GPU-tested, "auto" is the split: the fused kernels up to
    FUSED_MAX_TOKENS tokens, our grouped kernels above (torch's grouped GEMMs where ours are not usable), up to
    FUSED_MAX_HIDDEN columns, the grouped kernels alone above; without a GPU-tested fused kernel, the first
    grouped backend alone."""
    import dataclasses

    from mla_compile.ops import select
    from mla_compile.ops.moe_experts import FUSED_MAX_HIDDEN, FUSED_MAX_TOKENS, auto_backend
    from mla_compile.ops.registry import _TABLE, parse_split, split_part

    monkeypatch.setattr(select, "device_capability", lambda device=None: (9, 0))
    table = _TABLE["moe_experts"]
    for name in ("triton", "triton-grouped", "grouped"):
        monkeypatch.setitem(table, name, dataclasses.replace(table[name], available=lambda: True, gpu_tested=True))

    def tiers_of(dtype, hidden=FUSED_MAX_HIDDEN):
        tiers = parse_split(auto_backend("cuda", dtype, hidden))
        return split_part(tiers, 1), split_part(tiers, FUSED_MAX_TOKENS), split_part(tiers, FUSED_MAX_TOKENS + 1)

    assert tiers_of("bfloat16") == ("triton", "triton", "triton-grouped")
    assert tiers_of("float32") == ("triton", "triton", "triton-grouped")  # torch's grouped runs bf16 only
    assert auto_backend("cuda", "bfloat16", FUSED_MAX_HIDDEN + 1) == "triton-grouped"  # wide: grouped at any T
    monkeypatch.setitem(table, "triton-grouped", dataclasses.replace(table["triton-grouped"], gpu_tested=False))
    assert tiers_of("bfloat16") == ("triton", "triton", "grouped")
    assert auto_backend("cuda", "bfloat16", 7168) == "grouped"
    assert auto_backend("cuda", "float32", 2048) == "triton"
    monkeypatch.setitem(table, "triton", dataclasses.replace(table["triton"], gpu_tested=False))
    assert auto_backend("cuda", "bfloat16", 2048) == "grouped"
