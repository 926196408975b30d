"""Prefill over cached context (prefix-cache hits, chunked prefill) against one uncached HF prefill."""

import copy
import sys

import pytest
import torch

from mla_compile.app import toy
from mla_compile.models.metadata import SeqChunk, plan_step
from mla_compile.models.model import patch
from mla_compile.app.toy import random_prompts

pytest.importorskip("transformers")
BS = 4


@pytest.fixture(scope="module", params=toy.KINDS)
def models(request):
    hf = toy.toy_hf_model(request.param, seed=21)
    return copy.deepcopy(hf), patch(hf)


def _blocks(lens, seed):
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in lens:
        need = -(-n // BS)
        out.append(perm[at:at + need])
        at += need
    return out


def _run(model, chunks_by_step, **plan_kw):
    """Run steps of prefill chunks; returns the logits (all rows) of the last step."""
    for i, chunks in enumerate(chunks_by_step):
        last = i == len(chunks_by_step) - 1
        step = plan_step([], chunks, BS, logits="all" if last else "last", **plan_kw)
        with torch.no_grad():
            out = model(step.input_ids, step.positions, step.meta)[:step.num_rows]
    return out


@pytest.mark.parametrize("cached", ["none", "partial", "all_but_one_block"])
def test_prefix_hit_gives_uncached_logits(models, cached):
    ref, model = models
    prompts = random_prompts(1, [14, 9, 17])
    blocks = _blocks([len(p) for p in prompts], 2)
    hits = {"none": [0, 0, 0], "partial": [4, 8, 0],
            "all_but_one_block": [(len(p) - 1) // BS * BS for p in prompts]}[cached]
    model.allocate_cache(96, BS, fill=float("nan"))
    warm = [SeqChunk(b, p[:h]) for b, p, h in zip(blocks, prompts, hits) if h]  # the cached prefixes
    steps = ([warm] if warm else []) + [[SeqChunk(b, p[h:], h) for b, p, h in zip(blocks, prompts, hits)]]
    got = _run(model, steps)
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([p])).logits[0, h:] for p, h in zip(prompts, hits)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_chunked_prefill_mixed_with_running_decodes(models):
    ref, model = models
    model.allocate_cache(96, BS, fill=float("nan"))
    running = random_prompts(3, [6, 10])
    long_prompt = random_prompts(4, [23])[0]
    blocks = _blocks([12, 16, 24], 5)
    first = plan_step([], [SeqChunk(b, p) for b, p in zip(blocks, running)], BS)
    with torch.no_grad():
        toks = model(first.input_ids, first.positions, first.meta)[:first.num_rows].argmax(-1).tolist()
    done = 0
    seqs = [list(p) + [t] for p, t in zip(running, toks)]
    for budget in (7, 9, 7):  # the long prompt in three chunks, each step also decoding the running two
        decode = [SeqChunk(b, [s[-1]], len(s) - 1) for b, s in zip(blocks, seqs)]
        chunk = SeqChunk(blocks[2], long_prompt[done:done + budget], done)
        step = plan_step(decode, [chunk], BS, context_chunk_tokens=5)
        with torch.no_grad():
            logits = model(step.input_ids, step.positions, step.meta)[:step.num_rows]
        with torch.no_grad():
            want_dec = torch.stack([ref(torch.tensor([s])).logits[0, -1] for s in seqs])
            want_pre = ref(torch.tensor([long_prompt[:done + budget]])).logits[0, -1]
        torch.testing.assert_close(logits[:2], want_dec, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(logits[2], want_pre, atol=2e-5, rtol=1e-4)
        for s, t in zip(seqs, logits[:2].argmax(-1).tolist()):
            s.append(t)
        done += budget


def test_context_workspace_stays_bounded(models, monkeypatch):
    """However long the cached prefix, the gather workspace never exceeds the chunk budget."""
    ref, model = models
    model.allocate_cache(96, BS, fill=float("nan"))
    prompt = random_prompts(6, [61])[0]
    blocks = _blocks([64], 7)
    sizes = []
    op_module = sys.modules["mla_compile.ops.context_attention"]
    real = op_module.gather_latent_cache

    def spy(kv_cache, block_table, cu_seqlens, seq_starts, out, **kw):
        sizes.append(out.shape[0])
        return real(kv_cache, block_table, cu_seqlens, seq_starts, out, **kw)

    monkeypatch.setattr(op_module, "gather_latent_cache", spy)
    got = _run(model, [[SeqChunk(blocks[0], prompt[:56])], [SeqChunk(blocks[0], prompt[56:], 56)]],
               context_chunk_tokens=8)
    assert sizes and max(sizes) == 8 and len(sizes) == 7 * len(model.attentions)  # 56 context rows / 8
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0, 56:]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_context_chunks_cover_each_sequence_once():
    step = plan_step([], [SeqChunk([0, 1, 2], [5], 9), SeqChunk([3], [6], 0), SeqChunk([4, 5], [7], 5)], BS,
                     context_chunk_tokens=6)
    ctx = step.meta.prefill.context
    covered = [[] for _ in range(3)]
    assert ctx.rows.device.type == "cpu" and ctx.rows.tolist() == [6, 6, 2]
    for cu, starts, rows in zip(ctx.cu_seqlens, ctx.starts, ctx.rows):
        for i in range(3):
            n = int(cu[i + 1] - cu[i])
            assert 0 <= int(starts[i]) <= [9, 0, 5][i]
            covered[i] += list(range(int(starts[i]), int(starts[i]) + n))
        assert int(cu[-1]) == int(rows) <= 6
    assert covered == [list(range(9)), [], list(range(5))]


def test_one_short_context_is_padded_to_two_slices():
    """A count of 1 would specialise a compiled graph (0/1 specialisation): an empty slice pads it."""
    ctx = plan_step([], [SeqChunk([0, 1], [5], 3)], BS, context_chunk_tokens=8).meta.prefill.context
    assert ctx.rows.tolist() == [3, 0] and ctx.cu_seqlens.shape == (2, 3) and ctx.cu_seqlens[1].tolist() == [0, 0, 0]
