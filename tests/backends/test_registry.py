"""The registry is the single source of backend facts: every ``mla::`` op belongs to a declaration, the
readers (selector, lowerings, inspect, doctor, ``mla_compile.backends``) read it, and ``ops/`` imports
nothing from the core."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import mla_compile.lowerings  # noqa: F401  (registers the lowerings; their ops are declared too)
from mla_compile import backends
from mla_compile.graphs.inspect import op_backend
from mla_compile.lowerings import decode as lowered_decode
from mla_compile.lowerings import prefill as lowered_prefill
from mla_compile.ops import registry, select
from mla_compile.ops.registry import OPS, backends_for, kernel_backend, priority

ROOT = Path(__file__).resolve().parents[2]


def _mla_ops() -> list[str]:
    return sorted({n for n in torch._C._dispatch_get_all_op_names() if n.startswith("mla::")})


def test_every_registered_mla_op_belongs_to_a_declaration():
    names = _mla_ops()
    assert "mla::decode_ref" in names and "mla::decode_flashmla" in names
    assert [n for n in names if kernel_backend(n) == "?"] == []


def test_every_declared_backend_runs_a_registered_op_or_a_lazy_kernel_wrapper():
    names = set(_mla_ops())
    for op in OPS:
        assert backends_for(op), f"{op} has no backend"
        for name, spec in backends_for(op).items():
            own = getattr(spec.fn, "_qualified_op_name", None)
            assert own in names or spec.kernels, (op, name)
            assert own is None or kernel_backend(own) in (name, *(k.partition("=")[2] for k in spec.kernels)), own
    for op in OPS:
        if op != "context_attention":
            assert "reference" in backends_for(op), f"{op}: every op has the torch reference"


def test_the_core_layer_reads_the_live_registry():
    assert set(backends.SPECS) == set(OPS) and {"decode_fp8", "sparse_decode"} <= set(OPS)
    assert backends.SPECS["decode"] is registry._TABLE["decode"]
    assert backends.PRIORITY["decode"] == priority("decode")
    assert backends.OP_KEYS["merge"] == "mla.merge_attn_states" and backends.BackendSpec is registry.Backend
    assert not (ROOT / "ops" / "_dispatch.py").exists()


def test_inspect_names_every_declared_backend_by_its_op():
    for op in OPS:
        for name, spec in backends_for(op).items():
            own = getattr(spec.fn, "_qualified_op_name", None)
            if own is not None and not any(k.startswith(own.split("::")[1] + "=") for k in spec.kernels):
                assert op_backend(own) == name
    assert not hasattr(__import__("mla_compile.graphs.inspect", fromlist=["x"]), "_BACKEND_SUFFIXES")


@pytest.fixture
def hopper(everything_installed, monkeypatch):
    monkeypatch.setattr(select, "device_capability", lambda device=None: (9, 0))


def test_the_lowerings_candidates_are_the_registry_s_autotune_eligible_backends(hopper, monkeypatch):
    dev = torch.device("cuda")
    got = {c.backend for c in lowered_decode.decode_candidates(dev, torch.bfloat16, torch.bfloat16, 64, 16,
                                                               (512, 64), 1)}
    eligible = {n for n, s in backends_for("decode").items() if s.autotune}
    assert eligible == {"triton", "flashmla", "flashinfer-trtllm", "flashinfer-cutlass"}
    assert got == {"triton", "flashmla"}, "the Blackwell paths return no LSE and need sm100"
    got = {c.backend for c in lowered_prefill.prefill_candidates(dev, torch.bfloat16, 16, (192, 128), True)}
    # "triton-tma": the lowering's own TMA-kernel configurations (sm_90+), like "triton"'s
    assert got - {"triton-tma"} == {"triton", "flash-attn"} == {
        n for n, s in backends_for("prefill").items() if s.autotune} - {"flashinfer-trtllm"}
    assert "triton-tma" in got
    monkeypatch.setattr(select, "device_capability", lambda device=None: (10, 0))
    got = {c.backend for c in lowered_prefill.prefill_candidates(dev, torch.bfloat16, 16, (192, 128), True)}
    assert got == {"triton", "triton-tma", "flash-attn", "flashinfer-trtllm"}


def test_ops_imports_nothing_from_the_core():
    core = re.compile(r"^\s*(from|import)\s+mla_compile(\.(?!ops\b)\w+|\s+import|\s*$)", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "ops").rglob("*.py") if core.search(p.read_text())]
    assert offenders == []
