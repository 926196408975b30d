"""DeepSeek-V4's projections through ``models.attention.linears`` (one ``mla::skinny_linear`` launch for the plain
bf16 linears that share an input: the GEMV kernel for up to two rows on CUDA, ``F.linear`` above): on the CPU the
float model runs each module as before (bit for bit HF's modules); on CUDA in bf16 ``V4Attention.project``, the
output projection and the shared expert of every layer kind against the same modules in float64."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from mla_compile import ops  # noqa: E402
from mla_compile.app.v4_toy import toy_v4_model  # noqa: E402
from mla_compile.models.model import patch  # noqa: E402
from mla_compile.models.v4_model import rope_rotation, shared_mlp  # noqa: E402


def _inputs(model, T: int, seed: int, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, model.config.hidden_size, generator=gen, dtype=torch.float64)
    pos = torch.randint(0, 500, (T,), generator=gen)
    return x.to(device, dtype), pos.to(device)


def _rot(model, attn, pos):
    return rope_rotation(pos, getattr(model, f"{attn.rope_kind}_inv_freq"))


def _outputs(model, layer: int, x, pos) -> list[torch.Tensor]:
    attn = model.attn[layer]
    q, kv, comp_in, q_idx, w_idx = attn.project(x, _rot(model, attn, pos))
    outs = [q, kv, *comp_in] + [t for t in (q_idx, w_idx) if t is not None]
    outs.append(shared_mlp(model.moe[layer].hf.shared_experts, x))
    return outs


def test_cpu_float_projections_equal_the_modules():
    """Float32 on the CPU: ``linears`` runs each module, so ``project`` and the shared expert are HF's modules'."""
    model = patch(toy_v4_model(3))
    x, pos = _inputs(model, 3, 0, torch.float32, "cpu")
    for layer in range(len(model.attn)):
        mlp = model.moe[layer].hf.shared_experts
        torch.testing.assert_close(shared_mlp(mlp, x), mlp(x), rtol=0, atol=0)
        a = model.attn[layer].hf
        q, kv, comp_in, _, w_idx = model.attn[layer].project(x, _rot(model, model.attn[layer], pos))
        assert q.shape == (3, a.num_heads, a.head_dim) and kv.shape == (3, a.head_dim)
        if w_idx is not None:
            torch.testing.assert_close(w_idx, a.compressor.indexer.scorer.weights_proj(x), rtol=0, atol=0)
        if comp_in:
            torch.testing.assert_close(comp_in[0], a.compressor.kv_proj(x), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 2, 5])
def test_cuda_bf16_projections_match_float64(T, monkeypatch):
    hf = toy_v4_model(3)
    model64 = patch(copy.deepcopy(hf).double())
    model = patch(hf.to("cuda", torch.bfloat16))
    calls = []
    real = ops.skinny_linear
    monkeypatch.setattr(ops, "skinny_linear", lambda x, w, *a, **k: calls.append(len(w)) or real(x, w, *a, **k))
    assert ops.resolve("skinny_linear", torch.device("cuda"), None, dtype=torch.bfloat16).name == "triton"
    x, pos = _inputs(model, T, T, torch.bfloat16, "cuda")
    with torch.no_grad():
        for layer in range(len(model.attn)):
            got = _outputs(model, layer, x, pos)
            want = _outputs(model64, layer, x.double().cpu(), pos.cpu())
            for g, w in zip(got, want, strict=True):
                g = g.double().cpu()
                assert torch.isfinite(g).all()
                err = (g - w).norm() / w.norm()
                assert err < 2e-2, (layer, tuple(w.shape), err.item())
    assert calls and 2 in calls  # the op served them, pairs in one launch
