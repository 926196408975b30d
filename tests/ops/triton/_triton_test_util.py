"""Input builders and float64 references shared by the CUDA kernel tests (not a test module)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

# The sm_90 compile checks: Triton's compiler and bundled ptxas, no GPU; under the interpreter the kernels
# are interpreter objects. CI runs them in a child process without it (test_sm90_compile_subprocess.py).
SM90_COMPILE = [pytest.mark.sm90_compile, pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs Triton's compiler, not the interpreter: run by test_sm90_compile_subprocess.py (CI) and "
           "by gpu_session.sh's sm90_compile step")]


def sm90_compile(test):
    """Mark one test function with :data:`SM90_COMPILE` (a module takes ``pytestmark = SM90_COMPILE``)."""
    for mark in SM90_COMPILE:
        test = mark(test)
    return test


def gluon_sm90(kernel, consts: dict, warps: int, types: dict, divisible: tuple[str, ...] = ()):
    """The sm_90 compile of a Gluon kernel (Triton's compiler, no GPU): ``consts`` its constexprs (a parameter named
    in neither, with a constexpr or None default, takes that default), ``types`` the signature types of its other
    arguments ("i32" where absent); pointers and the arguments whose names start
    with one of ``divisible`` 16-byte divisible, as the JIT specializes them for a real launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    # parameters left out take their defaults where the kernel declares one (a constexpr's, or None), as the JIT binds
    consts = dict(consts, **{p.name: p.default for p in kernel.params if p.name not in consts and p.name not in types
                             and p.has_default and (p.is_constexpr or p.default is None)})
    sig = {p.name: "constexpr" if p.name in consts else types.get(p.name, "i32") for p in kernel.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if sig[p.name].startswith("*") or (divisible and p.name.startswith(divisible))}
    return triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def record_gluon_launches(monkeypatch, module, kernel_name: str) -> list[tuple]:
    """Record instead of run: ``module``'s Gluon kernel ``kernel_name`` (called as ``kernel[grid](...)``) and its
    ``wrap_triton`` launches (the split reduce) append ``(kernel, grid, args, kwargs)`` to the returned list, so a
    CPU test can check a launch's arguments and compile it for sm_90 (``_sm90.signature``)."""
    from mla_compile.ops.triton._sm90 import recorder

    launches: list[tuple] = []
    Recorder = recorder(launches)
    monkeypatch.setattr(module, kernel_name, Recorder(getattr(module, kernel_name)))
    if hasattr(module, "wrap_triton"):
        monkeypatch.setattr(module, "wrap_triton", Recorder)
    return launches


def longest_load_run(ptx: str) -> int:
    """The most vector global loads (``ld.global.v4``) a kernel's PTX issues with no barrier (``bar.sync`` /
    ``barrier.sync``) between them: a tile staged through registers in one load is one run, one staged a slice at a
    time with a store and a compiler-placed barrier after each is one run per slice (a round trip each)."""
    best = run = 0
    for line in ptx.splitlines():
        if "ld.global.v4" in line:
            run += 1
            best = max(best, run)
        elif "bar.sync" in line or "barrier.sync" in line:
            run = 0
    return best


def assert_pdl_order(ptx: str, pdl: bool, where: str = "") -> None:
    """A kernel's sm_90 PTX under programmatic dependent launch: with ``pdl`` (the launch an sm_90 device gets) it
    waits for the kernel before it (``griddepcontrol.wait``) ahead of every global read (``ld.global``,
    ``cp.async``: plain loads, async and TMA copies) and then lets the next kernel be scheduled
    (``griddepcontrol.launch_dependents``); without ``pdl`` neither instruction is there. ``where`` names the
    kernel in the failure."""
    for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
        assert (instruction in ptx) is pdl, (where, instruction)
    if pdl:
        before = ptx[:ptx.index("griddepcontrol.wait")]
        assert "ld.global" not in before and "cp.async" not in before, (where, "a global read before the PDL wait")


NAN = float("nan")
DEVICE = "cuda"  # a CPU dry run of the test code (interpreter) sets this to "cpu"


def assert_fp32_under_fp64_floats(kernel, args, kwargs) -> None:
    """Compile a recorded launch for sm_90 with its Python float arguments typed fp64, as Inductor's launch of a
    ``triton_op``'s kernel types them (torch's ``_use_fp64_for_unbacked_floats``), and assert that no fp64 arithmetic
    follows from them (a float used as is would make every tile it touches fp64: the kernel must cast it first)."""
    from mla_compile.ops.triton import _sm90

    ptx = _sm90.compile_sm90(kernel, args, kwargs, floats="fp64").asm["ptx"]
    f64 = [line.strip() for line in ptx.splitlines()
           if ".f64" in line and not any(ok in line for ok in ("cvt.", ".param", "ld.param"))]
    assert not f64, f"fp64 arithmetic in {kernel.fn.__name__}: {f64[:3]}"


def poison_allocator(nbytes: int = 1 << 30, device: str | None = None) -> None:
    """Fill a large block of the caching allocator with NaN and free it: the op's next ``torch.empty``
    outputs and workspaces are carved from it, so an element the kernel never writes stays NaN."""
    device = device or DEVICE
    if torch.device(device).type == "cuda":
        torch.full((nbytes // 4,), NAN, dtype=torch.float32, device=device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` over the finite entries of ``b`` (float64)."""
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    return float((a - b)[fin].norm() / b[fin].norm().clamp_min(1e-30))


def assert_attention_close(out, lse, ref, ref_lse, dtype, *, tol=None, lse_atol=2e-3):
    """Outputs fully written, the same -inf LSE pattern, and errors within ``dtype``'s budget."""
    assert not out.isnan().any(), "output holds NaN: some element was never written"
    assert not lse.isnan().any(), "LSE holds NaN"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "-inf LSE pattern differs from the reference"
    empty = torch.isinf(ref_lse)
    assert (out[empty] == 0).all(), "a query that sees nothing must give out = 0"
    tol = tol or {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    atol = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=atol)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=lse_atol, rtol=1e-3)


def paged_cache(lens, block_size, D, dtype, device=None, spare_blocks=5, table_cols=None, gen=None):
    """A NaN-poisoned paged cache ``[nb, bs, D]`` with random rows at the used positions of each
    sequence, a shuffled ``block_table`` (unused entries hold a huge invalid id that must never be
    read) and ``seq_lens`` (int32)."""
    device = device or DEVICE
    lens_t = torch.as_tensor(lens, dtype=torch.int64)
    B = len(lens)
    need = max(1, math.ceil(int(lens_t.max()) / block_size)) if B else 1
    cols = max(need, table_cols or 0)
    nb = B * need + spare_blocks
    cache = torch.full((nb, block_size, D), NAN, dtype=dtype, device=device)
    perm = torch.randperm(nb, generator=gen)[: B * need].view(B, need)
    table = torch.full((B, cols), 1 << 30, dtype=torch.int32)
    table[:, :need] = perm.to(torch.int32)
    pos = torch.arange(need * block_size)
    used = pos[None, :] < lens_t[:, None]
    blocks = table[:, :need].long()[:, pos // block_size][used]
    offs = (pos % block_size)[None, :].expand(B, -1)[used]
    cache[blocks.to(device), offs.to(device)] = (torch.randn(int(used.sum()), D, generator=gen) * 0.5).to(device, dtype)
    return cache, table.to(device), lens_t.to(torch.int32).to(device)


def prefill_ref64(q, k, v, cu_q, cu_k, scale, causal, head_chunk=8):
    """float64 varlen attention, one sequence and a few heads at a time (bounded memory)."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq == 0:
            continue
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            mask = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        for h0 in range(0, H, head_chunk):
            qs = q[cq[i]:cq[i + 1], h0:h0 + head_chunk].double()
            ks = k[ck[i]:ck[i + 1], h0:h0 + head_chunk].double()
            vs = v[ck[i]:ck[i + 1], h0:h0 + head_chunk].double()
            s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
            s = s.masked_fill(~mask[None], float("-inf"))
            m = torch.logsumexp(s, dim=-1)
            p = torch.where(mask[None], torch.exp(s - m[..., None]), 0.0)
            out[cq[i]:cq[i + 1], h0:h0 + head_chunk] = torch.einsum("hqk,khd->qhd", p, vs)
            lse[cq[i]:cq[i + 1], h0:h0 + head_chunk] = m.transpose(0, 1)
    return out, lse


def cu_from_lens(lens, device=None):
    """``[0, cumsum(lens)]`` as int32."""
    device = device or DEVICE
    cum = torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()
    return torch.tensor([0] + cum, dtype=torch.int32, device=device)


BAD_BLOCK = 1 << 30  # the block id of unused block-table entries: never read


def shuffled_table(lens, bs, gen, spare, cols=None):
    """A shuffled block table for sequences of ``lens`` tokens in blocks of ``bs``: ``(table int32 [B, cols]``
    (unused entries ``BAD_BLOCK``), ``num_blocks``, ``blocks``, ``offsets``)``, the last two the block and
    in-block offset of every used position, sequence by sequence."""
    B = len(lens)
    need = max(1, max((math.ceil(n / bs) for n in lens), default=1))
    nb = B * need + spare
    table = torch.full((B, max(need, cols or 0)), BAD_BLOCK, dtype=torch.int32)
    table[:, :need] = torch.randperm(nb, generator=gen)[: B * need].view(B, need).to(torch.int32)
    pos = torch.arange(need * bs)
    used = pos[None, :] < torch.tensor(lens, dtype=torch.int64)[:, None]
    blocks = table[:, :need].long()[:, pos // bs][used]
    offs = (pos % bs)[None, :].expand(B, -1)[used]
    return table, nb, blocks, offs


def opcheck_and_compile(op, ref, args, mutated: int | None = None):
    """``opcheck`` of ``op`` on ``args``, then ``op`` compiled (aot_eager, fullgraph) against ``ref`` on fresh
    clones: the mutated argument ``mutated`` equal, else outputs equal (closely, for float outputs)."""
    from torch.library import opcheck

    clone = lambda: tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)  # noqa: E731
    opcheck(op, clone())
    torch._dynamo.reset()
    a1, a2 = clone(), clone()
    got = torch.compile(lambda *x: op(*x), fullgraph=True, backend="aot_eager")(*a1)
    want = ref(*a2)
    if mutated is not None:
        assert torch.equal(a1[mutated], a2[mutated])
        return
    for g, w in zip(*((got, want) if isinstance(got, tuple) else ((got,), (want,)))):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def sm90_facts(**kw):
    """The selector's facts of a DeepSeek decode call on an (assumed) sm_90 (no GPU needed): bf16 q, 128 heads,
    512 + 64, one query row, pages of 64 of the 656-byte fp8 rows, 16-byte aligned and packed; ``kw`` overrides
    any of them (``dtype``: q's)."""
    from mla_compile.ops.select import facts_for

    base = dict(cap=(9, 0), cache_dtype=torch.uint8, block_size=64, num_heads=128, head_dims=(512, 64), query_len=1,
                cache_align=16, packed_rows=True)
    base.update(kw)
    dtype = base.pop("dtype", torch.bfloat16)
    return facts_for("cuda", dtype, **base)


def check_tma_out(plain, tma) -> None:
    """A 64-row Gluon decode's sm_90 compiles without and with ``TMA_OUT``: with it, one TMA store (the ``[8, 64, 64]``
    box of the output rows) and fewer plain global stores (the output's gone, the LSE's left), the same shared
    memory, no spills, at most 255 registers; without it, no TMA store."""
    from mla_compile.ops.triton._sm90 import resources

    bulk = ".global.shared::cta.bulk_group"
    assert plain.asm["ptx"].count(bulk) == 0 and tma.asm["ptx"].count(bulk) == 1
    assert tma.asm["ptx"].count("st.global") < plain.asm["ptx"].count("st.global")
    assert tma.metadata.shared == plain.metadata.shared
    res = resources(tma)
    assert res["stack"] == 0 and res["LDL"] == 0 and res["STL"] == 0 and res["regs"] <= 255, res
