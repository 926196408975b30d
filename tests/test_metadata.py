"""Step planning: slots, tables, padding to the minimum batch, and host-side validation."""

import pytest
import torch

from mla_compile.models.metadata import MLAMetadata, SeqChunk, plan_step


def test_prefill_plan_slots_and_cu_seqlens():
    step = plan_step([], [SeqChunk([5, 2], [11, 12, 13, 14, 15]), SeqChunk([7], [21, 22])], 4)
    assert step.input_ids.tolist() == [11, 12, 13, 14, 15, 21, 22]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert step.meta.slot_mapping.tolist() == [20, 21, 22, 23, 8, 28, 29]
    assert step.meta.prefill.cu_seqlens_q.tolist() == [0, 5, 7]
    assert step.meta.logits_indices.tolist() == [4, 6]
    assert step.num_rows == 2 and step.meta.decode is None


def test_decode_plan_with_padding_to_min_batch():
    step = plan_step([SeqChunk([3, 9], [42], 5)], [], 4, max_blocks=3)
    d = step.meta.decode
    assert d.block_table.tolist() == [[3, 9, 0], [0, 0, 0]]
    assert d.seq_lens.tolist() == [6, 0]  # the padding sequence reads nothing
    assert step.input_ids.tolist() == [42, 0]
    assert step.meta.slot_mapping.tolist() == [37, -1]  # and writes nothing
    assert step.num_rows == 1 and step.meta.logits_indices.shape[0] == 2


def test_mixed_step_orders_decode_first():
    step = plan_step([SeqChunk([1], [7], 2), SeqChunk([2], [8], 0)], [SeqChunk([3], [9, 10, 11])], 4, logits="all")
    assert step.input_ids.tolist() == [7, 8, 9, 10, 11]
    assert step.meta.decode.num_tokens == 2
    assert step.meta.logits_indices.tolist() == [0, 1, 2, 3, 4]


def test_single_prompt_pads_prefill_batch_and_tokens():
    step = plan_step([], [SeqChunk([0], [5])], 4)
    assert step.meta.prefill.cu_seqlens_q.tolist() == [0, 1, 1]
    assert step.input_ids.shape[0] == 2 and step.meta.slot_mapping.tolist() == [0, -1]


@pytest.mark.parametrize("kwargs, chunk, match", [
    ({}, SeqChunk([0], [1, 2, 3, 4, 5]), "blocks"),
    ({"num_blocks": 4}, SeqChunk([4], [1]), r"\[0, 4\)"),
    ({"max_blocks": 1}, SeqChunk([0, 1], [1] * 5), "max_blocks"),
])
def test_plan_rejects_bad_host_metadata(kwargs, chunk, match):
    with pytest.raises(ValueError, match=match):
        plan_step([], [chunk], 4, **kwargs)


def test_decode_chunk_must_match_query_len():
    with pytest.raises(ValueError, match="query_len"):
        plan_step([SeqChunk([0], [1, 2], 1)], [], 4)


def test_metadata_tensors_and_to():
    step = plan_step([SeqChunk([1], [7], 2)], [SeqChunk([3], [9, 10])], 4)
    moved = step.meta.to("cpu")
    assert isinstance(moved, MLAMetadata)
    assert len(step.meta.tensors()) == 7  # slots, logits rows, decode table + lens, cu_q, cu_k, prefill table
