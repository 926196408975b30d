"""A compiled ``fullgraph=True`` model over ever longer cached contexts: one graph for any slice count.

The cached context of a chunked prefill is attended in bounded slices; the slice count is a tensor
dimension (``mla::context_attention``), so it never becomes a Python value the graph guards on.
"""

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.models.metadata import SeqChunk, mark_dynamic, plan_step
from mla_compile.models.model import patch
from mla_compile.app.toy import random_prompts

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
pytest.importorskip("transformers")
BS = 4


def _models(seed):
    hf = toy.toy_hf_model("v3", seed=seed, num_hidden_layers=1, first_k_dense_replace=0)
    ref = copy.deepcopy(hf)
    model = patch(hf)
    model.allocate_cache(96, BS, fill=float("nan"))
    return ref, model


def _step(model, step):
    mark_dynamic(step.input_ids, step.positions, step.meta)
    with torch.no_grad():
        return model(step.input_ids, step.positions, step.meta)[:step.num_rows]


def test_growing_context_beside_a_decode_needs_no_new_graph():
    """The issue's repro at 2-row slices: a prompt fed 4 tokens a step beside a decoding sequence, its
    context growing to 46 slices; after the first context step no graph is added (fail_on_recompile)."""
    ref, model = _models(31)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    prompt = random_prompts(7, [96])[0]
    long_blocks, dec_blocks = list(range(0, 24)), list(range(24, 40))
    seq = random_prompts(8, [5])[0]
    _step(compiled, plan_step([], [SeqChunk(dec_blocks, seq)], BS))
    graphs = []
    for i, done in enumerate(range(0, len(prompt), 4)):
        decode = SeqChunk(dec_blocks, [seq[-1]], len(seq) - 1)
        step = plan_step([decode], [SeqChunk(long_blocks, prompt[done:done + 4], done)], BS, context_chunk_tokens=2)
        with torch.compiler.set_stance("fail_on_recompile" if i >= 2 else "default"):
            logits = _step(compiled, step)
        graphs.append(cnt.frame_count)
        seq.append(int(logits[0].argmax()))
    assert step.meta.prefill.context.num_slices == 46  # 92 context rows / 2
    assert graphs == [2, 3] + [3] * (len(graphs) - 2)  # prefill; decode + prefill; + context: then none
    assert dict(counters["graph_break"]) == {}
    with torch.no_grad():
        want_long = ref(torch.tensor([prompt])).logits[0, -1]
        want_dec = ref(torch.tensor([seq[:-1]])).logits[0, -1]
    torch.testing.assert_close(logits[1], want_long, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits[0], want_dec, atol=2e-5, rtol=1e-4)


def test_chunked_prompt_graph_counts_are_1_2_2_2():
    """No per-step Python int in the metadata: the chunk budget is not guarded on (was 1, 2, 3, 3)."""
    _, model = _models(32)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    prompt = random_prompts(9, [16])[0]
    counts = []
    for done in range(0, 16, 4):
        _step(compiled, plan_step([], [SeqChunk(list(range(4)), prompt[done:done + 4], done)], BS))
        counts.append(cnt.frame_count)
    assert counts == [1, 2, 2, 2]
