"""MetadataBuilder's DecodeRows path (the engine's decode-only step): the same tensors as the keyed chunk path
step after step while the batch's sizes change (rows joining and leaving, padded sizes, a narrower batch table,
block boundaries crossed), the decode planner called with each step's host table and lengths, and the views of a
step of the same sizes reused."""

import random

import numpy as np
import pytest
import torch

from mla_compile.models.metadata import SeqChunk
from mla_compile.serving.builder import MetadataBuilder, step_fields
from mla_compile.serving.decode_rows import DecodeRows, RowState
from mla_compile.serving.sampling import SamplingParams

BS, MAX_BLOCKS, MAX_BATCH = 4, 9, 7


class Planner:
    """A decode planner that keeps a copy of what it was called with."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, table, lens):
        self.calls.append((table.clone(), lens.clone()))
        return self


def test_rows_steps_equal_the_chunk_steps_as_the_batch_changes():
    rng = random.Random(3)
    planner_rows, planner_chunks = Planner(), Planner()
    by_rows = MetadataBuilder(max_batch=MAX_BATCH, max_blocks_per_seq=MAX_BLOCKS, max_tokens=MAX_BATCH, block_size=BS,
                              device="cpu", decode_planner=planner_rows)
    plain = MetadataBuilder(max_batch=MAX_BATCH, max_blocks_per_seq=MAX_BLOCKS, max_tokens=MAX_BATCH, block_size=BS,
                            device="cpu")
    planned = MetadataBuilder(max_batch=MAX_BATCH, max_blocks_per_seq=MAX_BLOCKS, max_tokens=MAX_BATCH,
                              block_size=BS, device="cpu", decode_planner=planner_chunks)
    rows = DecodeRows(MAX_BATCH, MAX_BLOCKS - 2, BS)  # a narrower table than the builder's: zero-filled past it
    params = SamplingParams(seed=0)
    seqs: dict[int, list] = {}  # key -> [blocks, position, token]
    next_key, next_block, sizes, reused = 0, 1, set(), 0
    seen_views = {}
    for step in range(300):
        for key in [k for k in seqs if rng.random() < 0.08 or seqs[k][1] + 1 >= (MAX_BLOCKS - 2) * BS]:
            del seqs[key]
        while len(seqs) < MAX_BATCH and rng.random() < 0.3:
            pos = rng.randrange(0, 12)
            blocks = list(range(next_block, next_block + pos // BS + 1))
            next_block += len(blocks)
            seqs[next_key] = [blocks, pos, rng.randrange(1000)]
            next_key += 1
        if not seqs:
            continue
        keys = list(seqs)
        if rng.random() < 0.2:
            rng.shuffle(keys)
        rows.arrange(keys, lambda i: RowState(seqs[keys[i]][0], seqs[keys[i]][2], seqs[keys[i]][1], 0, params))
        for i in rows.short().tolist():  # a block for each row at a block boundary, as an engine gives it
            blocks = seqs[keys[i]][0]
            blocks.append(next_block)
            next_block += 1
            rows.set_blocks(i, blocks)
        chunks = [SeqChunk(seqs[k][0], [seqs[k][2]], seqs[k][1], key=k) for k in keys]
        pad = rng.choice([None, None, max(len(keys), 2) + rng.randrange(0, MAX_BATCH - max(len(keys), 2) + 1)])
        got = by_rows.build(rows, decode_batch=pad)
        want = plain.build(chunks, decode_batch=pad)
        planned.build(chunks, decode_batch=pad)
        assert got.num_rows == want.num_rows == len(keys)
        g, w = step_fields(got), step_fields(want)
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), (step, name)
        assert got.meta.decode.plan is planner_rows
        t, lens = planner_rows.calls[-1]
        t_want, lens_want = planner_chunks.calls[-1]
        assert torch.equal(t, t_want) and torch.equal(lens, lens_want)
        size = (g["input_ids"].shape[0], len(keys))
        sizes.add(size)
        if size in seen_views:  # a step of the same sizes hands out the same arena addresses
            reused += 1
            assert all(g[n].data_ptr() == seen_views[size][n] for n in g)
        seen_views[size] = {n: g[n].data_ptr() for n in g}
        sampled = np.array([rng.randrange(1000) for _ in keys], dtype=np.int64)
        rows.advance(sampled)
        for k, t in zip(keys, sampled.tolist()):
            seqs[k][1] += 1
            seqs[k][2] = t
    assert len(sizes) > 10 and reused > 100


def test_rows_step_without_a_planner_is_reused_and_still_right():
    """With no decode planner a step of the same sizes returns the same StepInputs object, whose views hold the
    new step's values."""
    b = MetadataBuilder(max_batch=4, max_blocks_per_seq=3, max_tokens=4, block_size=BS, device="cpu")
    rows = DecodeRows(4, 3, BS)
    params = SamplingParams(seed=0)
    rows.arrange([0, 1], lambda i: RowState([5 + i, 9 + i], 7 + i, 4 + i, 0, params))
    first = b.build(rows)
    assert first.input_ids.tolist() == [7, 8] and first.positions.tolist() == [4, 5]
    assert first.meta.slot_mapping.tolist() == [9 * BS, 10 * BS + 1]
    rows.advance(np.array([3, 2]))
    second = b.build(rows)
    assert second is first and second.input_ids.tolist() == [3, 2] and second.positions.tolist() == [5, 6]
    assert second.meta.slot_mapping.tolist() == [9 * BS + 1, 10 * BS + 2]
    assert second.meta.decode.seq_lens.tolist() == [6, 7]
    third = b.build(rows, decode_batch=3)  # another padded size: other views
    assert third is not first and third.num_rows == 2 and third.meta.slot_mapping.tolist() == [37, 42, -1]


def test_set_blocks_follows_a_list_appended_to_or_truncated_in_place():
    rows = DecodeRows(3, 6, BS)
    params = SamplingParams(seed=0)
    lists = [[11, 12], [21], [31, 32, 33]]
    rows.arrange([0, 1, 2], lambda i: RowState(lists[i], 0, 0, 0, params))
    rows.table[:] = -7  # poison: every later id must be written by set_blocks (the rest re-zeroed by a rewrite)
    rows.set_blocks(0, lists[0])  # unchanged: rewritten whole
    lists[1].append(22)  # the same list, one block on: only the new id is written
    rows.set_blocks(1, lists[1])
    assert rows.table[0].tolist() == [11, 12, 0, 0, 0, 0] and rows.table[1].tolist() == [-7, 22, -7, -7, -7, -7]
    rows.table[1] = [21, 22, 0, 0, 0, 0]
    lists[1].extend([23, 24])  # two on: rewritten
    rows.set_blocks(1, lists[1])
    del lists[2][1:]  # truncated in place
    rows.set_blocks(2, lists[2])
    assert rows.table[1].tolist() == [21, 22, 23, 24, 0, 0] and rows.table[2].tolist() == [31, 0, 0, 0, 0, 0]
    lists[2].append(35)  # one on after the truncation was written
    rows.set_blocks(2, lists[2])
    assert rows.table[2].tolist() == [31, 35, 0, 0, 0, 0]
    assert rows.block_counts[:3].tolist() == [2, 4, 2] and rows.capacity[:3].tolist() == [2 * BS, 4 * BS, 2 * BS]
    other = list(lists[0]) + [13]  # another list object one longer: rewritten whole
    rows.table[0] = -7
    rows.set_blocks(0, other)
    assert rows.table[0].tolist() == [11, 12, 13, 0, 0, 0] and rows.block_lists[0] is other
    lists[1].append(2**31)  # not an int32 id: an error, nothing changed
    with pytest.raises(OverflowError):
        rows.set_blocks(1, lists[1])
    assert rows.table[1].tolist() == [21, 22, 23, 24, 0, 0] and rows.block_counts[1] == 4
