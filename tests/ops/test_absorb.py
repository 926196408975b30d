"""``mla::absorb_q`` / ``mla::absorb_out`` against float64 loops on fresh random inputs (strided operands as
the model passes them), opcheck, errors naming the argument, and the claim that the matmul writes into the
final buffer: no ``copy_``/``clone`` beyond absorb_q's copy of q_pe (profiler, CPU and CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile.ops.absorb import absorb_out_reference, absorb_q_reference
from tests.ops.ref64 import generator, randn

F64 = torch.float64


def _q_inputs(seed, dtype, T=5, H=3, N=16, C=24, R=8, pe_dtype=None, device="cpu"):
    """q_nope / q_pe split from one [T, H, N + R] q (strided), W_UK a slice of a [H, N + V, C] kv_b weight."""
    gen = generator(seed)
    q = randn(gen, T, H, N + R, dtype=dtype)
    w = randn(gen, H, N + 6, C, dtype=dtype)
    q_pe = q[..., N:] if pe_dtype is None else randn(gen, T, H, R, dtype=pe_dtype)
    return [t.to(device) for t in (q[..., :N], w[:, :N], q_pe)]


def _out_inputs(seed, dtype, T=5, H=3, C=24, V=6, device="cpu"):
    gen = generator(seed)
    out_lat = randn(gen, T, 1, H, C, dtype=dtype).reshape(T, H, C)
    w = randn(gen, H, 7 + V, C, dtype=dtype)
    return [t.to(device) for t in (out_lat, w[:, 7:])]


def _q64(q_nope, w_uk, q_pe):
    T, H, _ = q_nope.shape
    want = torch.empty(T, H, w_uk.shape[2] + q_pe.shape[2], dtype=F64)
    for t in range(T):
        for h in range(H):
            want[t, h] = torch.cat([q_nope[t, h].cpu().to(F64) @ w_uk[h].cpu().to(F64), q_pe[t, h].cpu().to(F64)])
    return want


def _out64(out_lat, w_uv):
    T, H, _ = out_lat.shape
    rows = [[w_uv[h].cpu().to(F64) @ out_lat[t, h].cpu().to(F64) for h in range(H)] for t in range(T)]
    return torch.stack([torch.cat(r) for r in rows])


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=6e-2, rtol=2e-2),
       torch.float64: dict(atol=1e-12, rtol=1e-12)}


@pytest.mark.parametrize("dtype,pe_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float64, None),
                                            (torch.bfloat16, torch.float32)])
def test_absorb_q_matches_a_float64_loop(dtype, pe_dtype):
    q_nope, w_uk, q_pe = _q_inputs(1, dtype, pe_dtype=pe_dtype)
    got = torch.ops.mla.absorb_q(q_nope, w_uk, q_pe)
    assert got.dtype == dtype and got.shape == (5, 3, 32) and got.is_contiguous()
    want = _q64(q_nope, w_uk, q_pe)
    torch.testing.assert_close(got.to(F64), want, **TOL[dtype])
    torch.testing.assert_close(got[..., 24:], q_pe.to(dtype), atol=0, rtol=0)  # the tail is q_pe, cast
    torch.testing.assert_close(got, absorb_q_reference(q_nope, w_uk, q_pe), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_absorb_out_matches_a_float64_loop(dtype):
    out_lat, w_uv = _out_inputs(2, dtype)
    got = torch.ops.mla.absorb_out(out_lat, w_uv)
    assert got.dtype == dtype and got.shape == (5, 18) and got.is_contiguous()
    torch.testing.assert_close(got.to(F64), _out64(out_lat, w_uv), **TOL[dtype])
    torch.testing.assert_close(got, absorb_out_reference(out_lat, w_uv), **TOL[dtype])


def test_opcheck_cpu():
    torch.library.opcheck(torch.ops.mla.absorb_q.default, tuple(_q_inputs(3, torch.float32)))
    torch.library.opcheck(torch.ops.mla.absorb_q.default, tuple(_q_inputs(4, torch.bfloat16, pe_dtype=torch.float32)))
    torch.library.opcheck(torch.ops.mla.absorb_out.default, tuple(_out_inputs(5, torch.float32)))


@pytest.mark.parametrize("case,match", [
    ("w_uk_heads", r"mla\.absorb_q: w_uk must have shape \[3, 16, \*\]"),
    ("w_uk_dtype", r"mla\.absorb_q: w_uk must have dtype in \['torch.float32'\]"),
    ("q_pe_tokens", r"mla\.absorb_q: q_pe must have shape \[5, 3, \*\]"),
    ("q_nope_2d", r"mla\.absorb_q: q_nope must have 3 dims"),
    ("w_uv_latent", r"mla\.absorb_out: w_uv must have shape \[3, \*, 24\]"),
])
def test_bad_inputs_name_the_argument(case, match):
    q_nope, w_uk, q_pe = _q_inputs(6, torch.float32)
    out_lat, w_uv = _out_inputs(7, torch.float32)
    calls = {
        "w_uk_heads": lambda: torch.ops.mla.absorb_q(q_nope, w_uk[:2], q_pe),
        "w_uk_dtype": lambda: torch.ops.mla.absorb_q(q_nope, w_uk.double(), q_pe),
        "q_pe_tokens": lambda: torch.ops.mla.absorb_q(q_nope, w_uk, q_pe[:4]),
        "q_nope_2d": lambda: torch.ops.mla.absorb_q(q_nope[0], w_uk, q_pe),
        "w_uv_latent": lambda: torch.ops.mla.absorb_out(out_lat, w_uv[..., :20]),
    }
    with pytest.raises((ValueError, TypeError), match=match):
        calls[case]()


def _aten_calls(fn, device):
    """The profiler events of the ops ``fn`` runs."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    return list(prof.events())


def _under(events, parent):
    """Sorted names of the ops called directly by the op named ``parent``."""
    return sorted(c.name for e in events if e.name == parent for c in e.cpu_children)


def _inside_bmm(events):
    """Sorted names of the allocations and copies ``aten::bmm`` runs (views left out: a strided result
    takes a loop over the batch): the BLAS path's choice (a bf16 path on some CPUs
    makes its strided inputs contiguous first), to compare with a bmm of the same operands into a fresh
    contiguous buffer."""
    stack = [c for e in events if e.name == "aten::bmm" for c in e.cpu_children]
    names = []
    while stack:
        e = stack.pop()
        names.append(e.name)
        stack.extend(e.cpu_children)
    return sorted(n for n in names if n in _MOVES)


_MOVES = ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::copy_", "aten::clone")  # no views


def _check_no_temporaries(device, dtype):
    """The bmm writes into the returned buffer: the op itself runs one empty (the result), one bmm and, in
    absorb_q, one copy_ (the q_pe tail), no clone; and the bmm runs exactly what a bmm of the same operands
    into a fresh contiguous buffer runs (a temporary result + copy back would add an empty and a copy_)."""
    q_nope, w_uk, q_pe = _q_inputs(8, dtype, T=9, H=4, N=32, C=64, R=16, device=device)
    out_lat, w_uv = _out_inputs(9, dtype, T=9, H=4, C=64, V=32, device=device)
    calls = _aten_calls(lambda: torch.ops.mla.absorb_q(q_nope, w_uk, q_pe), device)
    own = _under(calls, "mla::absorb_q")
    assert [own.count(n) for n in ("aten::empty", "aten::bmm", "aten::copy_", "aten::clone")] == [1, 1, 1, 0], own
    fresh = torch.empty(4, 9, 64, dtype=dtype, device=device)
    ref = _aten_calls(lambda: torch.bmm(q_nope.transpose(0, 1), w_uk, out=fresh), device)
    assert _inside_bmm(calls) == _inside_bmm(ref), (_inside_bmm(calls), _inside_bmm(ref))
    calls = _aten_calls(lambda: torch.ops.mla.absorb_out(out_lat, w_uv), device)
    own = _under(calls, "mla::absorb_out")
    assert [own.count(n) for n in ("aten::empty", "aten::bmm", "aten::copy_", "aten::clone")] == [1, 1, 0, 0], own
    fresh = torch.empty(4, 9, 32, dtype=dtype, device=device)
    ref = _aten_calls(lambda: torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2), out=fresh), device)
    assert _inside_bmm(calls) == _inside_bmm(ref), (_inside_bmm(calls), _inside_bmm(ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_writes_in_place_cpu(dtype):
    _check_no_temporaries("cpu", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_ops_match_float64_and_make_no_temporaries(dtype):
    args = _q_inputs(10, dtype, T=33, H=16, N=128, C=512, R=64, device="cuda")
    got = torch.ops.mla.absorb_q(*args)
    tol = TOL.get(dtype, TOL[torch.bfloat16])
    torch.testing.assert_close(got.cpu().to(F64), _q64(*args), atol=tol["atol"] * 8, rtol=tol["rtol"])
    o_args = _out_inputs(11, dtype, T=33, H=16, C=512, V=128, device="cuda")
    got = torch.ops.mla.absorb_out(*o_args)
    torch.testing.assert_close(got.cpu().to(F64), _out64(*o_args), atol=tol["atol"] * 8, rtol=tol["rtol"])
    _check_no_temporaries("cuda", dtype)
    torch.library.opcheck(torch.ops.mla.absorb_q.default, tuple(_q_inputs(12, dtype, device="cuda")))
    torch.library.opcheck(torch.ops.mla.absorb_out.default, tuple(_out_inputs(13, dtype, device="cuda")))
