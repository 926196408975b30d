"""``from_pretrained`` of tiny on-disk checkpoints (tests/checkpoints.py) in both formats, V2-Lite-, V3- and
V3.2-shaped: the bf16 one against ``transformers`` ``from_pretrained`` of the same directory (float32), the
fp8 one against HF loading a float64 dequantization of the stored blocks. Logits within 1e-4 relative,
greedy tokens identical, the fp8 model compiled whole without breaks."""

from __future__ import annotations

import logging

import pytest
import torch

from mla_compile import from_pretrained
from mla_compile.app import toy
from mla_compile.models.fp8_linear import FP8BlockLinear, FP8Experts
from mla_compile.serving.generate import greedy_generate, hf_greedy_reference
from tests.checkpoints import write_checkpoint, write_dequantized

pytest.importorskip("transformers")
KINDS = toy.KINDS + (toy.SPARSE_KINDS if toy.has_sparse_kinds() else ())
PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 10], [100, 200, 300, 400, 500]]


@pytest.fixture(scope="module", params=[(k, f) for k in KINDS for f in ("bf16", "fp8")], ids=lambda p: "-".join(p))
def checkpoint(request, tmp_path_factory):
    kind, fmt = request.param
    root = tmp_path_factory.mktemp(f"{kind}-{fmt}")
    write_checkpoint(root, kind, fmt, seed=5)
    return kind, fmt, root


def _hf_reference(fmt, root, tmp_path):
    from transformers import AutoModelForCausalLM

    src, dtype = root, torch.float32
    if fmt == "fp8":
        src, dtype = tmp_path / "dequantized", torch.float64
        write_dequantized(root, src)
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype, attn_implementation="eager",
                                                experts_implementation="eager").eval()


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_matches_hf(checkpoint, tmp_path, caplog):
    kind, fmt, root = checkpoint
    with caplog.at_level(logging.INFO, logger="mla_compile.models.loader"):
        model = from_pretrained(root, dtype=torch.float32)
    if kind != "v2-lite":
        assert "MTP" in caplog.text  # the checkpoint's extra layer was skipped, with a note
    fp8 = fmt == "fp8"
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert isinstance(attn.o_proj, FP8BlockLinear) == fp8 and isinstance(moe.experts, FP8Experts) == fp8
    assert attn.kv_b_proj.weight.dtype == torch.float32  # dequantized once for W_UK / W_UV
    if fp8:
        assert attn.o_proj.weight.dtype == torch.float8_e4m3fn and moe.experts.down_proj.dtype == torch.float8_e4m3fn
    ref = _hf_reference(fmt, root, tmp_path)
    steps = 4
    want_tokens, want_logits = hf_greedy_reference(ref, PROMPTS, steps)
    model.allocate_cache(32, 4, fill=float("nan"))
    res = greedy_generate(model, PROMPTS, steps, block_size=4, num_blocks=32, keep_logits=True, dynamic=False)
    assert res.tokens == want_tokens
    for s in range(steps):
        assert _rel(res.step_logits[s], torch.stack([want_logits[i][s] for i in range(len(PROMPTS))])) < 1e-4


def test_fp8_compiles_whole(tmp_path):
    from torch._dynamo.utils import counters

    root = tmp_path / "v3-fp8"
    write_checkpoint(root, "v3", "fp8", seed=5)
    model = from_pretrained(root, dtype=torch.float32)
    model.allocate_cache(32, 4)
    eager = greedy_generate(model, PROMPTS, 3, block_size=4, num_blocks=32, keep_logits=True)
    torch._dynamo.reset()
    counters.clear()
    model.allocate_cache(32, 4)
    compiled = greedy_generate(torch.compile(model, fullgraph=True), PROMPTS, 3, block_size=4, num_blocks=32,
                               keep_logits=True)
    assert dict(counters["graph_break"]) == {}
    assert compiled.tokens == eager.tokens
    for a, b in zip(compiled.step_logits, eager.step_logits):
        assert _rel(a, b) < 1e-5


def test_fp8_experts_grouped_equal_dense(tmp_path):
    """The sorted-token path of the fp8 experts (the CUDA default) against the dense one, eager (prefill and decode
    steps) and compiled (the prefill step: its graph runs the grouped code on symbolic token counts, as the decode
    graph would; the decode graph compiles in test_fp8_compiles_whole)."""
    root = tmp_path / "v3-fp8"
    write_checkpoint(root, "v3", "fp8", seed=5)
    results = []
    for impl, compile, steps in (("dense", False, 3), ("grouped", False, 3), ("grouped", True, 1)):
        model = from_pretrained(root, dtype=torch.float32, moe_impl=impl)
        model.allocate_cache(32, 4)
        step = torch.compile(model, fullgraph=True) if compile else model
        results.append(greedy_generate(step, PROMPTS, steps, block_size=4, num_blocks=32, keep_logits=True))
    for res in results[1:]:
        steps = len(res.step_logits)
        assert res.tokens == [t[:steps] for t in results[0].tokens]
        for a, b in zip(res.step_logits, results[0].step_logits):
            assert _rel(a, b) < 1e-5


def test_options(tmp_path):
    root = tmp_path / "v2-lite"
    write_checkpoint(root, "v2-lite", "fp8")
    model = from_pretrained(root, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.allocate_cache(4, 16)[0].dtype == torch.uint8  # the 656-byte fp8 rows


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_fp8_on_cuda_matches_cpu(tmp_path, dtype, tol):
    """The fp8 checkpoint on the GPU (fp8_block_linear's Triton kernel, compiled whole) against the CPU reference."""
    root = tmp_path / "v3-fp8"
    write_checkpoint(root, "v3", "fp8", seed=5)
    cpu = from_pretrained(root, dtype=torch.float32)
    cpu.allocate_cache(32, 4)
    want = greedy_generate(cpu, PROMPTS, 3, block_size=4, num_blocks=32, keep_logits=True)
    gpu = from_pretrained(root, device="cuda", dtype=dtype)
    assert gpu.model.layers[1].self_attn.o_proj.weight.device.type == "cuda"
    gpu.allocate_cache(32, 4)
    got = greedy_generate(torch.compile(gpu, fullgraph=True), PROMPTS, 3, block_size=4, num_blocks=32,
                          device="cuda", keep_logits=True)
    assert _rel(got.step_logits[0], want.step_logits[0]) < tol
    if dtype == torch.float32:
        assert got.tokens == want.tokens
