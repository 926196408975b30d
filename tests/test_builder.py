"""MetadataBuilder: persistent buffers, same addresses every step, contents equal to the host plan."""

import pytest
import torch

from mla_compile.builder import MetadataBuilder
from mla_compile.metadata import SeqChunk, plan_step


def _builder(**kw):
    args = dict(max_batch=8, max_blocks_per_seq=6, max_tokens=40, block_size=4, device="cpu")
    args.update(kw)
    return MetadataBuilder(**args)


def _decode_chunks(n, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 23, (1,), generator=gen))
        blocks = torch.randperm(50, generator=gen)[:6].tolist()
        out.append(SeqChunk(blocks, [int(torch.randint(0, 99, (1,), generator=gen))], length - 1))
    return out


def test_build_matches_plan_and_reuses_buffers():
    b = _builder()
    ptrs = None
    for n, seed in ((3, 0), (5, 1), (2, 2)):
        chunks = _decode_chunks(n, seed)
        step = b.build(chunks, decode_batch=8)
        want = plan_step(chunks, [], 4, max_blocks=6, decode_batch=8)
        assert torch.equal(step.input_ids, want.input_ids) and torch.equal(step.positions, want.positions)
        assert torch.equal(step.meta.slot_mapping, want.meta.slot_mapping)
        assert torch.equal(step.meta.decode.block_table, want.meta.decode.block_table)
        assert torch.equal(step.meta.decode.seq_lens, want.meta.decode.seq_lens)
        assert torch.equal(step.meta.logits_indices, want.meta.logits_indices)
        assert step.num_rows == n
        now = [t.data_ptr() for t in (step.input_ids, step.meta.decode.block_table, step.meta.logits_indices)]
        assert ptrs is None or now == ptrs  # a captured graph sees the same addresses every step
        ptrs = now


def test_padding_rows_read_and_write_nothing():
    step = _builder().build(_decode_chunks(3, 4), decode_batch=8)
    assert step.meta.decode.seq_lens[3:].tolist() == [0] * 5
    assert step.meta.slot_mapping[3:].tolist() == [-1] * 5
    assert step.meta.logits_indices.tolist() == list(range(8))


def test_padding_decode_has_capture_shapes():
    b = _builder()
    pad = b.padding_decode(8)
    real = b.build(_decode_chunks(5, 3), decode_batch=8)
    for x, y in ((pad.input_ids, real.input_ids), (pad.meta.decode.block_table, real.meta.decode.block_table),
                 (pad.meta.logits_indices, real.meta.logits_indices), (pad.meta.slot_mapping, real.meta.slot_mapping)):
        assert x.shape == y.shape and x.data_ptr() == y.data_ptr()


def test_prefill_and_mixed_steps():
    b = _builder()
    step = b.build(_decode_chunks(2, 5), [SeqChunk([9, 10], [1, 2, 3, 4, 5])])
    assert step.meta.prefill.cu_seqlens_q.tolist() == [0, 5, 5]
    assert step.num_rows == 3


def test_oversize_steps_raise_before_writing():
    b = _builder()
    b.build(_decode_chunks(3, 7))
    before = b.arena.clone()
    with pytest.raises(ValueError, match="max_batch"):
        b.build(_decode_chunks(9, 6))
    with pytest.raises(ValueError, match="max_tokens"):
        b.build([], [SeqChunk(list(range(6)), list(range(21))), SeqChunk(list(range(6, 12)), list(range(20)))])
    assert torch.equal(b.arena, before)


@pytest.mark.parametrize("kw, match", [({"max_batch": 0}, "max_batch"), ({"max_tokens": 4}, "max_tokens"),
                                       ({"block_size": -1}, "block_size")])
def test_constructor_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        _builder(**kw)
