"""torch.compile(fullgraph=True) of the patched model and of the ops on CPU: no breaks, no recompiles."""

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile import ops
from mla_compile.app import toy
from mla_compile.serving.generate import greedy_generate
from mla_compile.models.model import patch
from mla_compile.app.toy import random_prompts

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("kind", toy.KINDS)
def test_whole_model_fullgraph_no_breaks_no_recompiles(kind):
    # one MoE layer keeps the cold compile short while covering attention, routing and experts
    model = patch(toy.toy_hf_model(kind, seed=5, num_hidden_layers=1, first_k_dense_replace=0))
    model.allocate_cache(64, 4)
    prompts = random_prompts(0, [5, 11, 3])
    eager = greedy_generate(model, prompts, 3, block_size=4, num_blocks=64, keep_logits=True)
    compiled = torch.compile(model, fullgraph=True)
    model.allocate_cache(64, 4)
    got = greedy_generate(compiled, prompts, 3, block_size=4, num_blocks=64, keep_logits=True)
    assert got.tokens == eager.tokens
    for a, b in zip(got.step_logits, eager.step_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert dict(counters["graph_break"]) == {}
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2  # one prefill graph, one decode graph
    # batch sizes 1, 2, 4 and other lengths reuse the same two graphs
    with torch.compiler.set_stance("fail_on_recompile"):
        for lens in ([9], [2, 17], [4, 1, 6, 30]):
            model.allocate_cache(64, 4)
            greedy_generate(compiled, random_prompts(len(lens), lens), 3, block_size=4, num_blocks=64)
    assert counters["stats"]["unique_graphs"] == graphs


def _decode_inputs(B, H=2, D=48, Dc=32, bs=4, mb=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(B * mb + 3, bs, D, generator=gen)
    table = torch.randperm(B * mb + 3, generator=gen)[:B * mb].view(B, mb).int()
    seq_lens = torch.randint(0, mb * bs + 1, (B,), generator=gen).int()
    q = torch.randn(B, 1, H, D, generator=gen)
    return q, cache, table, seq_lens, Dc


def test_ops_compile_fullgraph_and_match_eager():
    def step(q, cache, table, seq_lens, latent, k_pe, slots):
        ops.write_latent_cache(latent, k_pe, slots, cache)
        out, lse = ops.decode(q, cache, table, seq_lens, 0.2, kv_lora_rank=32)
        flat = out.flatten(0, 1)
        merged, mlse = ops.merge_attn_states(flat, lse.flatten(0, 1), flat * 2, lse.flatten(0, 1) - 1)
        return merged, mlse

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for B in (3, 5):
        q, cache, table, seq_lens, _ = _decode_inputs(B, seed=B)
        latent, k_pe = torch.randn(B, 32), torch.randn(B, 16)
        slots = torch.arange(B) * 3
        c1, c2 = cache.clone(), cache.clone()
        want = step(q, c1, table, seq_lens, latent, k_pe, slots)
        got = compiled(q, c2, table, seq_lens, latent, k_pe, slots)
        torch.testing.assert_close(got, want)
        assert torch.equal(c1, c2)
    assert dict(counters["graph_break"]) == {}
