"""The ops together: rows written through slot_mapping are the rows decode and gather read back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import mla_compile
from mla_compile.ops import decode, gather_latent_cache, write_latent_cache
from .ref64 import DEVICES, LSE_TOL, OUT_TOL, NAN, RANK, ROPE, decode_ref64, generator, paged, randn, seeds


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(layout=paged(min_seqs=1), n_pad=st.integers(0, 3), seed=seeds)
def test_write_then_decode_and_gather(device, dtype, layout, n_pad, seed):
    gen = generator(seed)
    config = mla_compile.MLAConfig(hidden_size=64, num_heads=2, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    cache = mla_compile.allocate_latent_cache(layout.num_blocks, layout.block_size, config, dtype=dtype,
                                              device=device, fill=NAN)
    # Every token of every sequence, in a shuffled order with padding slots mixed in.
    tokens = [(b, p) for b, n_tok in enumerate(layout.seq_lens) for p in range(n_tok)] + [None] * n_pad
    tokens = [tokens[i] for i in torch.randperm(len(tokens), generator=gen).tolist()]
    slots = [-1 if t is None else layout.where(*t)[0] * layout.block_size + layout.where(*t)[1] for t in tokens]
    rows = randn(gen, len(tokens), RANK + ROPE, dtype=dtype, device=device)
    write_latent_cache(rows[:, :RANK], rows[:, RANK:], torch.tensor(slots, dtype=torch.int32, device=device), cache)

    # What the cache should hold, built from the source rows alone.
    by_token = {t: rows[i].cpu() for i, t in enumerate(tokens) if t is not None}
    expected = torch.full_like(cache.cpu(), NAN)
    for (b, p), row in by_token.items():
        expected[layout.where(b, p)] = row

    q = randn(gen, len(layout.seq_lens), 1, 2, RANK + ROPE, dtype=dtype, device=device)
    out, lse = decode(q, cache, layout.block_table(device=device), layout.seq_lens_tensor(device=device), 0.2,
                      kv_lora_rank=RANK)
    ref_out, ref_lse = decode_ref64(q, expected, layout, 0.2, RANK)
    assert_close(out.cpu().double(), ref_out, **OUT_TOL[dtype])
    assert_close(lse.cpu().double(), ref_lse, **LSE_TOL[dtype])

    total = sum(layout.seq_lens)
    workspace = torch.full((total + 2, RANK + ROPE), NAN, dtype=dtype, device=device)
    cu = torch.tensor([0, *torch.tensor(layout.seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gather_latent_cache(cache, layout.block_table(device=device), cu,
                        torch.zeros(len(layout.seq_lens), dtype=torch.int32, device=device), workspace)
    packed = [by_token[(b, p)] for b, n_tok in enumerate(layout.seq_lens) for p in range(n_tok)]
    want = torch.cat([torch.stack(packed) if packed else rows.new_empty(0, RANK + ROPE).cpu(),
                      torch.zeros(2, RANK + ROPE, dtype=dtype)])
    assert torch.equal(workspace.cpu(), want)
