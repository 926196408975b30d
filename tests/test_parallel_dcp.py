"""Decode context parallelism at the op level: a split cache + all-gather + LSE merge equals unsplit decode."""

import pytest
import torch

from mla_compile.parallel import dcp
from tests import parallel_workers as w
from tests.dist_helpers import run_ranks


@pytest.mark.parametrize("dcp_size,interleave", [(2, 1), (2, 4), (3, 2), (4, 4)])
def test_split_helpers_match_a_token_loop(dcp_size, interleave):
    lens = torch.tensor([0, 1, 3, 4, 5, 8, 9, 17, 33], dtype=torch.int32)
    for L in lens.tolist():
        # independent formulation: deal tokens round robin in runs of `interleave`, count per rank
        owners, local_pos, counts = [], [], [0] * dcp_size
        for t in range(L):
            r = (t // interleave) % dcp_size
            owners.append(r)
            local_pos.append(counts[r])
            counts[r] += 1
        pos = torch.arange(L)
        assert dcp.owner(pos, dcp_size, interleave).tolist() == owners
        assert dcp.local_position(pos, dcp_size, interleave).tolist() == local_pos
        got = [int(dcp.local_seq_lens(torch.tensor([L], dtype=torch.int32), dcp_size, r, interleave)[0])
               for r in range(dcp_size)]
        assert got == counts
    with pytest.raises(ValueError, match="rank must lie"):
        dcp.local_seq_lens(lens, 2, 2, 1)


def test_merge_parts_of_empty_parts_gives_zero_and_minus_inf():
    outs = torch.full((3, 2, 2, 4), float("nan"))
    lses = torch.full((3, 2, 2), float("-inf"))
    outs[1, 0], lses[1, 0] = 1.5, 0.25  # token 0: one part non-empty
    out, lse = dcp.merge_parts(outs, lses)
    assert torch.equal(out[0], torch.full((2, 4), 1.5)) and torch.equal(lse[0], torch.full((2,), 0.25))
    assert torch.equal(out[1], torch.zeros(2, 4)) and bool(torch.isneginf(lse[1]).all())


# seq lens 0 (no tokens anywhere), 1..4 (with interleave 4, rank 1 holds nothing), longer ones split
@pytest.mark.parametrize("interleave", [1, 4])
def test_dcp2_decode_equals_unsplit(interleave):
    lens = [0, 1, 3, 4, 9, 21]
    results = run_ranks(w.dcp_decode_parts, 2, interleave, lens, False)
    for r in results:
        assert r["finite"]
        assert r["err_out"] < 1e-5 and r["err_lse"] < 1e-5, r
        assert r["vs_unsplit"] < 1e-5, r
    split = [results[0]["local_lens"], results[1]["local_lens"]]
    assert [a + b for a, b in zip(*split)] == lens
    if interleave == 4:
        assert split[1][:4] == [0, 0, 0, 0]  # the empty parts this test is about


def test_dcp2_decode_compiles_with_gather_and_merge_in_the_graph():
    results = run_ranks(w.dcp_decode_parts, 2, 4, [0, 2, 7, 12], True)
    for r in results:
        assert r["err_out"] < 1e-5 and r["vs_unsplit"] < 1e-5, r
        assert "_c10d_functional.all_gather_into_tensor.default" in r["ops"], r["ops"]
        assert any("merge_attn_states" in o for o in r["ops"]), r["ops"]


@pytest.mark.parametrize("rank,interleave", [(0, 4), (1, 4), (1, 1)])
def test_localize_equals_plan_dcp_step_with_the_same_blocks(rank, interleave):
    from mla_compile.models.metadata import SeqChunk, plan_step

    bs, blocks = 4, [[7, 3, 9, 1], [2, 8], [5, 0, 6]]  # global blocks; a rank's part uses the first ones
    prefill = [SeqChunk(blocks[0], list(range(13))), SeqChunk(blocks[2], list(range(9)))]
    decode = [SeqChunk(blocks[1], [5], 6)]
    glob = plan_step(decode, prefill, bs)
    got = dcp.localize(glob.meta, glob.positions, bs, 2, rank, interleave)
    local_blocks = lambda c: c.blocks  # noqa: E731  (the same ids: the part fits the first blocks)
    want = dcp.plan_dcp_step([SeqChunk(local_blocks(c), c.tokens, c.start) for c in decode],
                             [SeqChunk(local_blocks(c), c.tokens, c.start) for c in prefill], bs, 2, rank,
                             interleave=interleave).meta
    assert got.slot_mapping.tolist() == want.slot_mapping.tolist()
    assert got.decode.seq_lens.tolist() == want.decode.seq_lens.tolist()
    assert (got.slot_mapping >= 0).sum() < (glob.meta.slot_mapping >= 0).sum()  # only this rank's tokens
    # steps with cached context: tests/test_parallel_dcp_steps.py
