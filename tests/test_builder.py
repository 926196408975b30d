"""MetadataBuilder: persistent buffers, same addresses every step, contents equal to the host plan."""

import pytest
import torch

from mla_compile.serving.builder import MetadataBuilder, step_fields
from mla_compile.models.metadata import SeqChunk, plan_step


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


@pytest.mark.parametrize("query_len", [1, 3])
def test_decode_steps_equal_the_general_plan_and_capture_addresses(query_len):
    """The decode-only fast path writes what plan_step plans (unpadded and padded batches, several
    query lengths) at the addresses padding_decode (the capture step) hands out."""
    b = _builder(query_len=query_len, max_tokens=8 * query_len)
    gen = torch.Generator().manual_seed(query_len)
    for n in (1, 2, 5, 8):
        chunks = []
        for _ in range(n):
            start = int(torch.randint(0, 24 - query_len + 1, (1,), generator=gen))
            blocks = torch.randperm(50, generator=gen)[:int(torch.randint(-(-(start + query_len) // 4), 7, (1,), generator=gen))]
            chunks.append(SeqChunk(blocks.tolist(), torch.randint(0, 99, (query_len,), generator=gen).tolist(), start))
        for batch in (None, 8):
            step = b.build(chunks, decode_batch=batch)
            want = plan_step(chunks, [], 4, max_blocks=6, query_len=query_len, decode_batch=batch)
            got_t = (step.input_ids, step.positions, step.meta.slot_mapping, step.meta.logits_indices,
                     step.meta.decode.block_table, step.meta.decode.seq_lens)
            want_t = (want.input_ids, want.positions, want.meta.slot_mapping, want.meta.logits_indices,
                      want.meta.decode.block_table, want.meta.decode.seq_lens)
            for g, w in zip(got_t, want_t):
                assert g.dtype == w.dtype and torch.equal(g, w)
            assert step.num_rows == want.num_rows == n and step.meta.decode.query_len == query_len
            pad = b.padding_decode(len(step.meta.decode.seq_lens))
            pad_t = (pad.input_ids, pad.positions, pad.meta.slot_mapping, pad.meta.logits_indices,
                     pad.meta.decode.block_table, pad.meta.decode.seq_lens)
            assert [t.data_ptr() for t in got_t] == [t.data_ptr() for t in pad_t]


@pytest.mark.parametrize("chunk, match", [(SeqChunk([1, 2], [5], 8), "need 3 blocks"),
                                          (SeqChunk([1, 2], [5, 6], 1), "query_len"),
                                          (SeqChunk(list(range(7)), [5], 1), "max_blocks")])
def test_bad_decode_steps_raise_the_plan_error_before_writing(chunk, match):
    b = _builder()
    b.build(_decode_chunks(3, 7))
    before = b.arena.clone()
    with pytest.raises(ValueError, match=match):
        b.build(_decode_chunks(2, 8) + [chunk])
    assert torch.equal(b.arena, before)


def test_decode_batch_below_min_batch_raises_before_writing():
    b = _builder()
    b.build(_decode_chunks(3, 7))
    before = b.arena.clone()
    with pytest.raises(ValueError, match="decode_batch=1 must be >= .*min_batch"):
        b.build(_decode_chunks(1, 9), decode_batch=1)
    assert torch.equal(b.arena, before)


def _arena_offsets(b, step):
    """Byte offset into the arena of each view a step hands out, by field name."""
    return {name: v.data_ptr() - b.arena.data_ptr() for name, v in step_fields(step).items()}


def _dec(n, q):
    return [SeqChunk([i, i + 1], list(range(q)), 5) for i in range(n)]


_DEC = ("input_ids", "positions", "slot_mapping", "logits_indices", "block_table", "seq_lens")
_PRE = ("input_ids", "positions", "slot_mapping", "logits_indices", "cu_seqlens_q", "cu_seqlens_k")
_MIX = _DEC + ("cu_seqlens_q", "cu_seqlens_k")


# Offsets recorded on the builder before its layout was declared as data (commit 112e4b9): captured
# CUDA graphs read these addresses, so a change to the layout must be deliberate.
@pytest.mark.parametrize("kw, capacity, steps", [
    (dict(max_batch=8, max_blocks_per_seq=6, max_tokens=40, query_len=1), 1600, [
        ("decode", 3, (0, 32, 64, 96, 128, 208)),
        ("decode", 5, (0, 48, 96, 144, 192, 320)),
        ("all", 5, (0, 48, 96, 144, 192, 320)),
        ("mixed", None, (0, 64, 128, 192, 224, 272, 288, 304)),
        ("prefill", None, (0, 48, 96, 144, 176, 192))]),
    (dict(max_batch=5, max_blocks_per_seq=3, max_tokens=37, query_len=2), 1376, [
        ("decode", 2, (0, 32, 64, 96, 112, 144)),
        ("decode", 5, (0, 80, 160, 240, 288, 352)),
        ("all", 3, (0, 48, 96, 144, 192, 240)),
        ("mixed", None, (0, 80, 160, 240, 272, 304, 320, 336)),
        ("prefill", None, (0, 48, 96, 144, 176, 192))]),
])
def test_arena_offsets_are_pinned(kw, capacity, steps):
    b = _builder(**kw)
    q = kw["query_len"]
    assert b.arena.numel() == capacity
    for kind, batch, want in steps:
        if kind == "decode":
            got = [_arena_offsets(b, b.build(_dec(2, q), decode_batch=batch)),
                   _arena_offsets(b, b.padding_decode(batch))]
            names = _DEC
        elif kind == "all":
            got = [_arena_offsets(b, b.build(_dec(2, q), decode_batch=batch, logits="all"))]
            names = _DEC
        elif kind == "mixed":
            got = [_arena_offsets(b, b.build(_dec(2, q), [SeqChunk([9, 10], [1, 2, 3, 4, 5])]))]
            names = _MIX
        else:
            prefill = [SeqChunk([9, 10], [1, 2, 3]), SeqChunk([11], [4], 1), SeqChunk([7], [3])]
            got = [_arena_offsets(b, b.build([], prefill))]
            names = _PRE
        for offsets in got:
            assert offsets == dict(zip(names, want)), (kind, batch)


@pytest.mark.parametrize("query_len", [1, 2])
def test_decode_fast_path_and_general_path_give_the_same_views(query_len, monkeypatch):
    """The decode-only fast path and the general staging path (forced by disabling the fast path) hand
    out views at the same addresses with the same shapes, dtypes and contents."""
    fast = _builder(query_len=query_len, max_tokens=8 * query_len)
    general = _builder(query_len=query_len, max_tokens=8 * query_len)
    monkeypatch.setattr(general, "_build_decode", lambda decode, n_seq: None)
    for n, batch in ((2, None), (3, 4), (5, 8)):
        chunks = [SeqChunk([i, i + 3], list(range(10, 10 + query_len)), 1 + i) for i in range(n)]
        a, g = fast.build(chunks, decode_batch=batch), general.build(chunks, decode_batch=batch)
        assert _arena_offsets(fast, a) == _arena_offsets(general, g)
        fa, fg = step_fields(a), step_fields(g)
        assert list(fa) == list(fg) == list(_DEC)
        for name in _DEC:
            assert fa[name].dtype == fg[name].dtype and torch.equal(fa[name], fg[name]), name
        assert a.num_rows == g.num_rows == n
