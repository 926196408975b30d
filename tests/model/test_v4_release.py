"""DeepSeek-V4 token-row blocks released as the sliding window moves (:class:`mla_compile.serving.v4_blocks.V4Blocks`):
two sequences of over 10 windows run in a token-row cache far too small for them whole, with the logits of the
fixed-table run that keeps every block; the released entries point at a NaN-filled null block."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from mla_compile.app.v4_toy import toy_v4_model  # noqa: E402
from mla_compile.models.model import patch  # noqa: E402
from mla_compile.models.v4_model import V4Sequences  # noqa: E402
from mla_compile.serving.v4_blocks import V4Blocks  # noqa: E402
from mla_compile.serving.v4_builder import V4DecodeBuilder  # noqa: E402

from test_v4_model import prompts  # noqa: E402

NAN = float("nan")
BS = 2


@torch.no_grad()
def test_long_sequences_release_token_blocks_and_keep_their_logits():
    model = patch(toy_v4_model(5, sliding_window=3))  # the toy's window 6 halved: shorter runs of 10+ windows
    window = model.config.sliding_window
    ps = prompts(5, [9, 4])
    steps = 11 * window  # decode steps: both sequences pass 10 windows
    total = max(map(len, ps)) + steps + 1

    # reference: fixed tables holding every token row (V4Sequences, NaN-filled caches)
    seqs = V4Sequences(model, 2, total, BS, fill=NAN)
    out = seqs.step(model, [0, 1], ps)
    want = [out]
    for _ in range(steps):
        out = seqs.step(model, [0, 1], [[int(t)] for t in out.argmax(-1)])
        want.append(out)

    # windowed: 1 null + 5 (the 9-token prompt) + 3 (a window's 2 blocks + 1) token blocks, far below 2 x 22
    num_blocks, num_entry = 9, 40
    model.allocate_cache(num_blocks, BS, num_entry, 2, fill=NAN)
    blocks = V4Blocks(num_blocks=num_blocks, num_entry_blocks=num_entry, rates=model.rates, block_size=BS,
                      window=window, max_seqs=2)
    assert blocks.tokens.peak_blocks(9, total) == 5 and blocks.tokens.peak_blocks(4, total) == 3
    assert blocks.tokens.null_block == 0
    for i, p in enumerate(ps):
        blocks.add(i, len(p), total)
    with pytest.raises(RuntimeError, match="compressor-state row"):
        blocks.add(2, 1, 10)
    builder = V4DecodeBuilder(max_batch=2, max_blocks_per_seq=-(-total // BS), max_entry_blocks=num_entry,
                              rates=model.rates, block_size=BS, device="cpu")
    chunks = [[*p] for p in ps]
    got, released = [], 0
    for step in range(steps + 1):
        c = [blocks.chunk(i, chunks[i]) for i in range(2)]
        s = builder.build((), c) if step == 0 else builder.build(c, decode_batch=2)
        out = model(s.input_ids, s.positions, s.meta)[:2]
        got.append(out)
        for i in range(2):
            released += blocks.commit(i, len(chunks[i]))
        chunks = [[int(t)] for t in out.argmax(-1)]
        held = sum(b.ref > 0 for b in blocks.tokens.blocks) - 1
        assert held <= 5 + 3  # never more than the two sequences' peaks
    assert released > 30  # the windows moved past most of the blocks
    assert all(torch.isnan(a.kv_cache[0]).all() for a in model.attn)  # the null block was never written
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-5)
    for i in range(2):
        blocks.free(i)
    assert blocks.tokens.num_free == num_blocks - 1 and sorted(blocks.free_slots) == [0, 1]


def test_adding_what_does_not_fit_takes_nothing():
    blocks = V4Blocks(num_blocks=6, num_entry_blocks={4: 3, 8: 2}, rates=[4, 8], block_size=2, window=6, max_seqs=3)
    with pytest.raises(RuntimeError, match="entry cache of rate 4 is full"):
        blocks.add(0, 4, 40)  # 10 entries of rate 4: 5 blocks > 3
    with pytest.raises(RuntimeError, match="paged cache is full"):
        blocks.add(0, 12, 12)  # 6 prompt blocks > 5 usable
    assert blocks.tokens.num_free == 5 and all(m.num_free == n for m, n in zip(blocks.entries.values(), (3, 2)))
    assert blocks.free_slots == [2, 1, 0] and not blocks.seqs
    with pytest.raises(ValueError, match="prompt_len <= capacity"):
        blocks.add(0, 5, 4)
