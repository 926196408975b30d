"""GPU: ``torch.compile(patched_model, mode="reduce-overhead", fullgraph=True)``, the first thing a user
tries, takes Inductor's CUDA graphs (no ``cudagraph_skips``) and gives the eager tokens."""

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.serving.generate import greedy_generate
from mla_compile.models.model import patch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("fresh_dynamo")]

# DeepSeek-V3's attention dims (hidden 7168, 128 heads, q_lora 1536), two layers, a small MoE
V3_ATTENTION = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                    intermediate_size=1024, num_hidden_layers=2)


@pytest.mark.parametrize("kind,dims", [("v3", V3_ATTENTION), ("v2-lite", {})], ids=["v3-dims", "v2-lite-toy"])
def test_reduce_overhead_captures_and_matches_eager(kind, dims):
    hf = toy.toy_hf_model(kind, seed=6, device="cuda", dtype=torch.bfloat16, **dims)
    model = patch(hf)
    prompts = toy.random_prompts(3, [7, 30, 12])
    model.allocate_cache(64, 16)
    eager = greedy_generate(model, prompts, 6, block_size=16, num_blocks=64, device="cuda")
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    model.allocate_cache(64, 16)
    got = greedy_generate(compiled, prompts, 6, block_size=16, num_blocks=64, device="cuda")
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert got.tokens == eager.tokens
    assert dict(counters["graph_break"]) == {}
