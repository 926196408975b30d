"""The MLA parts of the inspect report: source lines of breaks, guards, compile phases, which fusion
passes fired, the autotune decision with its timings, and the backend of each ``mla::`` op."""

from __future__ import annotations

import json

import torch

import mla_compile
import mla_compile.lowerings as lowerings
from mla_compile.graphs import inspect_compile
from mla_compile.graphs.inspect import op_backend
from mla_compile.lowerings.decode import Candidate, autotune_on_cpu
from mla_compile.ops.fused_kv_write import rms_norm
from mla_compile.models.rope import apply_rope


def with_break(x):
    y = x.cos()
    torch._dynamo.graph_break()  # planted-break-marker
    return y + 1


def kv_step(kv_a, w, cos, sin, slots, cache):
    latent, k_pe = kv_a.split([16, 8], -1)
    mla_compile.ops.write_latent_cache(rms_norm(latent, w, 1e-6), apply_rope(k_pe, cos, sin, True), slots, cache)
    return kv_a.sum()


def absorb_step(q_nope, q_pe, w_uk, w_uv, w_o):
    q_abs = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_pe], dim=-1)
    out = torch.einsum("thc,hvc->thv", q_abs[..., :8].tanh(), w_uv)
    return out.reshape(out.shape[0], -1) @ w_o


def test_break_source_line_guards_and_phases():
    report = inspect_compile(with_break, lambda f: f(torch.randn(4)), backend="aot_eager")
    (brk,) = report.graph_breaks
    assert brk.source_lines == ["torch._dynamo.graph_break()  # planted-break-marker"]
    assert "> torch._dynamo.graph_break()" in report.to_text()
    assert report.guard_count > 0  # the input's shape/dtype guards at least
    assert report.compile_phases_s.get("dynamo", 0) > 0
    assert report.passes_fired == {} and report.autotune == []


def test_passes_fired_and_ops_with_backends_are_reported(tmp_path):
    T = 3
    args = (torch.randn(T, 24), torch.randn(16), torch.randn(T, 4), torch.randn(T, 4), torch.arange(T),
            torch.zeros(2, 4, 24))
    report = inspect_compile(kv_step, lambda f: f(*args), str(tmp_path), fresh=True, dump=False,
                             options=lowerings.compile_options(True))
    assert report.error is None, report.error
    assert report.passes_fired == {"fuse_kv_write": 1}
    assert {"op": "mla::write_latent_cache_fused", "backend": "fused (triton/reference)"} in report.mla_ops
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["passes_fired"] == {"fuse_kv_write": 1}
    assert "fusion passes fired: fuse_kv_write x1" in (tmp_path / "report.txt").read_text()


def test_absorb_passes_are_reported(tmp_path):
    T, H = 3, 2
    args = (torch.randn(T, H, 4), torch.randn(T, H, 2), torch.randn(H, 4, 8), torch.randn(H, 5, 8), torch.randn(H * 5, 3))
    report = inspect_compile(absorb_step, lambda f: f(*args), str(tmp_path), fresh=True, dump=False,
                             options=lowerings.compile_options(True))
    assert report.error is None, report.error
    assert report.passes_fired == {"fuse_absorb_q": 1, "fuse_absorb_out": 1}
    for op in ("mla::absorb_q", "mla::absorb_out"):
        assert {"op": op, "backend": "torch bmm into place (fusion pass)"} in report.mla_ops
    assert "fusion passes fired: fuse_absorb_q x1, fuse_absorb_out x1" in (tmp_path / "report.txt").read_text()


def test_autotune_decision_is_reported_with_timings():
    q, kv = torch.randn(2, 1, 2, 24), torch.randn(3, 4, 24)
    bt, sl = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32)

    def step(q, kv, bt, sl):
        return mla_compile.ops.decode(q, kv, bt, sl, 0.3, kv_lora_rank=16, backend="autotune")[0]

    cands = [Candidate("mla_t_ref", "reference", torch.ops.mla.decode_ref.default)]
    with autotune_on_cpu(lambda **facts: cands):
        report = inspect_compile(step, lambda f: f(q, kv, bt, sl), fresh=True, dump=False)
    (rec,) = report.autotune
    assert rec["winner"] == "mla_t_ref" and rec["winner_backend"] == "reference" and "[2, 1, 2, 24]" in rec["shapes"]
    assert {"op": "mla::decode_ref", "backend": "reference"} in report.mla_ops
    assert "autotune mla::decode_autotune" in report.to_text()


def test_op_backend_names():
    assert op_backend("mla::decode_flashmla") == "flashmla"
    assert op_backend("mla::decode_triton_config") == "triton (autotuned config)"
    assert op_backend("mla::prefill_flashinfer") == "flashinfer"
    assert op_backend("mla::decode_fp8_gluon") == "gluon (opaque kernel)"
    assert op_backend("_decode_split_kernel") == "triton" and op_backend("mla::unknown") == "?"
    assert op_backend("_fp8_write_kernel") == "triton" and op_backend("_fused_kv_write_kernel") == "triton"
    assert op_backend("mla::absorb_q") == op_backend("mla::absorb_out.default") == "torch bmm into place (fusion pass)"
