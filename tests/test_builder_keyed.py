"""Keyed decode steps (SeqChunk.key): the builder's persistent host block tables give exactly the tensors of
a from-scratch plan, step after step, while sequences join, leave, reorder, grow, shrink and share blocks."""

import random

import numpy as np
import pytest
import torch

from mla_compile.models.metadata import SeqChunk, plan_step
from mla_compile.serving.builder import MetadataBuilder, step_fields
from mla_compile.serving.decode_rows import DecodeRows, RowState
from mla_compile.serving.sampling import SamplingParams
from mla_compile.serving.host_tables import HostBlockTables

BS, MAX_BLOCKS, MAX_BATCH = 4, 6, 8


def _builder(query_len=1, cls=None, **kw):
    args = dict(max_batch=MAX_BATCH, max_blocks_per_seq=MAX_BLOCKS, max_tokens=64, block_size=BS, device="cpu",
                query_len=query_len)
    args.update(kw)
    return (cls or MetadataBuilder)(**args)


class _TwoBuffers(MetadataBuilder):
    """A builder that packs each step into one of two host buffers in turn and copies it to the arena, as a
    CUDA builder does with its pinned staging buffers; the buffers start poisoned, so a field the builder
    wrongly trusts to be still written from an earlier step shows."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.buffers = [torch.full_like(self.arena, 0xA5) for _ in range(2)]
        self.turn = 0

    def _host(self, end):
        turn, self.turn = self.turn, self.turn ^ 1
        return self.buffers[turn][:end], turn

    def _send(self, host, turn, end):
        self.arena[:end].copy_(host)


def _unkeyed(chunks):
    return [SeqChunk(list(c.blocks), list(c.tokens), c.start) for c in chunks]


def _check(b, decode, prefill=(), decode_batch=None, query_len=1):
    """Build the keyed step; assert every tensor equals the from-scratch plan's and an unkeyed builder's
    (same dtypes, same arena offsets), and return the step."""
    ref = _builder(query_len)
    got = b.build(decode, prefill, decode_batch=decode_batch)
    plain_dec, plain_pre = _unkeyed(decode), _unkeyed(prefill)
    fresh = ref.build(plain_dec, plain_pre, decode_batch=decode_batch)
    want = plan_step(plain_dec, plain_pre, BS, max_blocks=MAX_BLOCKS, query_len=query_len,
                     decode_batch=decode_batch if decode else None)
    g, f, w = step_fields(got), step_fields(fresh), step_fields(want)
    assert g.keys() == f.keys() == w.keys()
    for name in g:
        assert g[name].dtype == w[name].dtype and torch.equal(g[name], w[name]), name
        assert torch.equal(g[name], f[name]), name
        assert g[name].data_ptr() - b.arena.data_ptr() == f[name].data_ptr() - ref.arena.data_ptr(), name
    assert got.num_rows == want.num_rows
    return got


class _Seq:
    def __init__(self, key, blocks, length, prompt_left, token=0):
        self.key, self.blocks, self.length, self.prompt_left = key, blocks, length, prompt_left
        self.token, self.changed = token, False  # its next decode input; whether its block list changed


def _check_rows(b, rows, want, want_builder, prefill=(), decode_batch=None):
    """Build the step of a DecodeRows batch; assert every tensor equals the step ``want`` that ``want_builder``
    built from chunks, at the same arena offsets."""
    got = b.build(rows, prefill, decode_batch=decode_batch)
    g, w = step_fields(got), step_fields(want)
    assert g.keys() == w.keys()
    for name in g:
        assert g[name].dtype == w[name].dtype and torch.equal(g[name], w[name]), name
        assert g[name].data_ptr() - b.arena.data_ptr() == w[name].data_ptr() - want_builder.arena.data_ptr(), name
    assert got.num_rows == want.num_rows
    return got


def _need(tokens):
    return -(-tokens // BS)


@pytest.mark.parametrize("seed, query_len, steps, staging",
                         [(0, 1, 2000, False), (1, 1, 600, False), (2, 2, 600, False), (3, 1, 1000, True),
                          (4, 2, 400, True)])
def test_long_random_trace_equals_a_from_scratch_build_every_step(seed, query_len, steps, staging):
    """Hundreds of steps of sequences joining (some sharing a prefix of another's blocks, some under a key a
    finished sequence had), prefilling in chunks mixed with decodes, decoding in a shuffled order, leaving;
    block lists appended to in place, now and then by several blocks, truncated in place, or replaced by
    another list object; with ``staging``, each step packed into one of two poisoned host buffers in turn.
    Every step equals a from-scratch plan and an unkeyed builder's step."""
    rng = random.Random(seed)
    b = _builder(query_len, _TwoBuffers if staging else None)
    # one token per row: a DecodeRows batch kept beside the chunks, updated as an engine updates it
    by_rows = _builder(query_len, _TwoBuffers if staging else None) if query_len == 1 else None
    rows, params = DecodeRows(MAX_BATCH, MAX_BLOCKS, BS), SamplingParams(seed=0)
    live: list[_Seq] = []
    left_keys: list[int] = []
    next_key, next_block = 0, 0
    seen = dict.fromkeys(("join", "share", "key_reuse", "leave", "reorder", "append", "append_many", "shrink",
                          "replace", "mixed", "decode_only", "padded", "min_batch"), 0)

    def fresh_blocks(k):
        nonlocal next_block
        next_block += k
        return [(next_block - i) * 7 % 1009 for i in range(k)]

    for _ in range(steps):
        for s in [s for s in live if rng.random() < 0.06 or s.length + 2 * query_len > MAX_BLOCKS * BS]:
            live.remove(s)
            left_keys.append(s.key)
            seen["leave"] += 1
        while len(live) < MAX_BATCH and rng.random() < 0.25:
            if left_keys and rng.random() < 0.2:
                key = left_keys.pop(rng.randrange(len(left_keys)))
                seen["key_reuse"] += 1
            else:
                key, next_key = next_key, next_key + 1
            prompt = rng.randint(1, 10)
            blocks = []
            donors = [s for s in live if len(s.blocks) > 1]
            if donors and rng.random() < 0.4:
                donor = rng.choice(donors)
                blocks = donor.blocks[:rng.randint(1, len(donor.blocks) - 1)]
                prompt = max(prompt, len(blocks) * BS + 1)
                seen["share"] += 1
            blocks = blocks + fresh_blocks(_need(prompt) - len(blocks))
            live.append(_Seq(key, blocks, 0, prompt, rng.randrange(1000)))
            seen["join"] += 1
        decoding = [s for s in live if not s.prompt_left]
        if rng.random() < 0.3:
            rng.shuffle(decoding)
            seen["reorder"] += 1
        for s in decoding:
            need = _need(s.length + query_len)
            if rng.random() < 0.05 and len(s.blocks) > need:  # e.g. a rolled-back reservation
                del s.blocks[need:]
                seen["shrink"] += 1
            elif rng.random() < 0.05 and len(s.blocks) < MAX_BLOCKS:  # reserve ahead: several blocks at once
                s.blocks.extend(fresh_blocks(MAX_BLOCKS - len(s.blocks)))
                seen["append_many"] += 1
            if len(s.blocks) < need:
                s.blocks.append(fresh_blocks(1)[0])
                seen["append"] += 1
            if rng.random() < 0.03:  # another list object with another last block
                s.blocks = s.blocks[:-1] + fresh_blocks(1)
                seen["replace"] += 1
            s.changed = True  # (an unchanged row rewritten is still right; the check is that it is enough)
        prefilling = [s for s in live if s.prompt_left]
        chunks = [(s, min(s.prompt_left, rng.randint(1, 6))) for s in prefilling if rng.random() < 0.8]
        dec = [SeqChunk(s.blocks, [s.token] + [rng.randrange(1000) for _ in range(query_len - 1)], s.length,
                        key=s.key) for s in decoding]
        pre = [SeqChunk(s.blocks, [rng.randrange(1000) for _ in range(n)], s.length, key=s.key) for s, n in chunks]
        if not dec and not pre:
            continue
        batch = None
        if dec and rng.random() < 0.4:
            batch = next(size for size in (2, 4, 8) if size >= len(dec))
            seen["padded"] += 1
        seen["mixed" if pre else "decode_only"] += 1
        seen["min_batch"] += len(dec) == 1 and not pre
        want = _check(b, dec, pre, batch, query_len)
        if by_rows is not None:
            rows.arrange([s.key for s in decoding],
                         lambda i: RowState(decoding[i].blocks, decoding[i].token, decoding[i].length, 0, params))
            for i, s in enumerate(decoding):
                if s.changed:
                    rows.set_blocks(i, s.blocks)
            _check_rows(by_rows, rows, want, b, pre, batch)
            if not pre:  # built from the arrays (the keyed chunk path would have filled the keyed tables)
                assert len(by_rows.host_tables) == 0
            rows.advance(np.array([rng.randrange(1000) for _ in decoding], dtype=np.int64))
            for i, s in enumerate(decoding):
                s.token, s.changed = int(rows.tokens[i]), False
        if dec and not pre:  # the keyed path ran: its tables hold exactly this step's sequences
            assert len(b.host_tables) == len(dec) and all(c.key in b.host_tables for c in dec)
        for s in decoding:
            s.length += query_len
        for s, n in chunks:
            s.length += n
            s.prompt_left -= n
    assert all(seen.values()), seen


def test_steady_decode_reads_only_the_new_block_ids():
    """A decode step whose sequences only appended reads no block list whole (it indexes the new id)."""

    class Watched(list):
        iterations = 0

        def __iter__(self):
            Watched.iterations += 1
            return super().__iter__()

    seqs = [Watched([10 * i + j for j in range(2)]) for i in range(5)]
    b = _builder()
    for step in range(12):
        length = 5 + step
        for s in seqs:
            if len(s) < _need(length + 1):
                s.append(100 + len(s))
        Watched.iterations = 0
        _check(b, [SeqChunk(s, [step], length, key=i) for i, s in enumerate(seqs)])
        if step == 0:
            continue
        # _check copies each list once for its references; the keyed build never iterates one
        assert Watched.iterations == len(seqs), step


def test_a_row_freed_by_a_longer_sequence_is_reused_by_a_shorter_one():
    b = _builder()
    long = SeqChunk([1, 2, 3, 4, 5], [7], 17, key="a")
    other = SeqChunk([6], [8], 2, key="b")
    _check(b, [long, other])
    _check(b, [SeqChunk([9, 10], [3], 6, key="c"), other])  # "a" left; "c" takes its row, zero past 2 blocks
    _check(b, [other, SeqChunk([11], [4], 0, key="d"), SeqChunk([9, 10], [3], 7, key="c")])


def test_a_key_reused_by_another_sequence_is_rewritten():
    b = _builder()
    _check(b, [SeqChunk([1, 2, 3], [7], 9, key=0), SeqChunk([4], [8], 0, key=1)])
    # another engine (ids from 0 again) or a new request under an old key: another list, same length
    _check(b, [SeqChunk([5, 6, 7], [7], 9, key=0), SeqChunk([4], [8], 1, key=1)])


def test_a_block_table_shrinking_in_place_clears_its_tail():
    b = _builder()
    blocks = [3, 4, 5, 6]
    _check(b, [SeqChunk(blocks, [1], 5, key=0), SeqChunk([8], [2], 0, key=1)])
    del blocks[2:]
    _check(b, [SeqChunk(blocks, [1], 6, key=0), SeqChunk([8], [2], 1, key=1)])
    blocks.append(9)  # grows again, past its old length, only by appending: still incremental
    blocks.append(10)
    _check(b, [SeqChunk(blocks, [1], 7, key=0), SeqChunk([8], [2], 2, key=1)])


def test_forget_after_an_in_place_overwrite():
    """Overwriting an id in place is outside the contract; forget(key) makes the next step rewrite the row."""
    b = _builder()
    blocks = [3, 4]
    _check(b, [SeqChunk(blocks, [1], 5, key=0)])
    blocks[0] = 42
    b.host_tables.forget(0)
    _check(b, [SeqChunk(blocks, [1], 6, key=0)])
    b.host_tables.forget("never seen")  # ignored


@pytest.mark.parametrize("query_len", [1, 3])
def test_min_batch_padding_and_capture_sizes(query_len):
    b = _builder(query_len, max_tokens=MAX_BATCH * query_len)
    rows = [SeqChunk([i, i + 10], list(range(query_len)), 4, key=i) for i in range(5)]
    _check(b, rows[:1], query_len=query_len)  # one sequence, padded to min_batch=2
    for n, batch in ((5, None), (5, 8), (3, 4), (2, 2), (4, 8)):
        got = _check(b, rows[:n], decode_batch=batch, query_len=query_len)
        pad = b.padding_decode(got.meta.decode.seq_lens.shape[0])
        assert [t.data_ptr() for t in step_fields(got).values()] == [t.data_ptr() for t in step_fields(pad).values()]
    _check(b, rows[:1], query_len=query_len)


def test_keys_on_only_some_chunks_build_as_unkeyed():
    b = _builder()
    _check(b, [SeqChunk([1, 2], [5], 6, key=0), SeqChunk([3], [6], 1)])
    assert len(b.host_tables) == 0
    _check(b, [SeqChunk([3], [6], 1), SeqChunk([1, 2], [5], 6, key=0)])


def test_repeated_or_unhashable_keys_raise_before_writing():
    b = _builder()
    _check(b, [SeqChunk([1], [5], 0, key=0), SeqChunk([2], [6], 0, key=1)])
    before = b.arena.clone()
    with pytest.raises(ValueError, match="decode sequence 2 repeats the key 1"):
        b.build([SeqChunk([1], [5], 1, key=0), SeqChunk([2], [6], 1, key=1), SeqChunk([3], [6], 1, key=1)])
    with pytest.raises(ValueError, match="hashable"):
        b.build([SeqChunk([1], [5], 1, key=0), SeqChunk([2], [6], 1, key=[1])])
    assert torch.equal(b.arena, before)
    _check(b, [SeqChunk([1], [5], 1, key=0), SeqChunk([2], [6], 1, key=1)])


def test_a_step_that_fails_its_checks_leaves_the_tables_alone():
    b = _builder()
    blocks = [1, 2]
    _check(b, [SeqChunk(blocks, [5], 6, key=0), SeqChunk([3], [6], 0, key=1)])
    with pytest.raises(ValueError, match="max_blocks"):
        b.build([SeqChunk(list(range(7)), [5], 6, key=0), SeqChunk([3], [6], 1, key=1)])
    with pytest.raises(ValueError, match="need 3 blocks"):
        b.build([SeqChunk(blocks, [5], 8, key=0), SeqChunk([3], [6], 1, key=1)])
    blocks.append(4)
    _check(b, [SeqChunk(blocks, [5], 8, key=0), SeqChunk([3], [6], 1, key=1)])


def test_a_bad_block_id_clears_the_tables_and_the_next_step_is_right():
    b = _builder()
    blocks = [1, 2]
    _check(b, [SeqChunk(blocks, [5], 6, key=0), SeqChunk([3], [6], 0, key=1)])
    blocks.append(2 ** 40)  # not an int32
    with pytest.raises(OverflowError):
        b.build([SeqChunk(blocks, [5], 8, key=0), SeqChunk([3], [6], 1, key=1)])
    assert len(b.host_tables) == 0
    blocks[-1] = 4  # the caller fixed its list in place: the cleared tables rewrite every row
    _check(b, [SeqChunk(blocks, [5], 8, key=0), SeqChunk([3], [6], 1, key=1)])


def test_host_tables_hold_at_most_their_rows():
    t = HostBlockTables(2, 3)
    counts = np.array([1, 1, 1])
    with pytest.raises(ValueError, match="3 keyed sequences exceed the tables' 2 rows"):
        t.update([0, 1, 2], [[1], [2], [3]], counts)
    rows = t.update([0, 1], [[1], [2]], counts[:2])
    assert sorted(rows.tolist()) == [0, 1] and t.table[rows, 0].tolist() == [1, 2]
    assert t.update([0, None], [[1], [2]], counts[:2]) is None


@pytest.mark.parametrize("between", ["mixed", "unkeyed", "prefill_only", "raises"])
def test_a_list_truncated_and_regrown_across_any_build_is_rewritten(between):
    """The tables follow every build: a list truncated in place before one build and grown back past
    its old length before the next is seen as truncated, whatever that build was (a mixed step, unkeyed
    chunks, no decode chunk, or a build that raised)."""
    b = _builder()
    blocks, other = [1, 2, 3, 4], [5]
    _check(b, [SeqChunk(blocks, [1], 9, key=0), SeqChunk(other, [2], 0, key=1)])
    del blocks[2:]
    dec = [SeqChunk(blocks, [1], 6, key=0), SeqChunk(other, [2], 1, key=1)]
    if between == "mixed":
        _check(b, dec, [SeqChunk([7, 8], [3, 4, 5], 0, key=2)])
    elif between == "unkeyed":
        _check(b, _unkeyed(dec))
    elif between == "prefill_only":
        _check(b, [], [SeqChunk([7, 8], [3, 4, 5], 0, key=2)])
    else:
        with pytest.raises(ValueError, match="query_len"):
            b.build(dec[:1] + [SeqChunk(other, [2, 3], 1, key=1)])
    blocks += [9, 10]
    _check(b, [SeqChunk(blocks, [1], 12, key=0), SeqChunk(other, [2], 2, key=1)])


def test_engine_steps_are_keyed_by_request_id():
    """The engine names its decode rows by request id: its decode-only steps take the keyed path (the
    tables hold exactly the decoding requests) and every step equals the from-scratch plan."""
    from mla_compile.serving.engine import Engine

    class CheckingRunner:
        def __init__(self, builder):
            self.builder, self.keyed_steps = builder, 0

        def run(self, decode, prefill=()):
            _check(self.builder, decode, prefill)
            if decode and not prefill:
                assert sorted(c.key for c in decode) == sorted(r.id for r in engine.running if not r.prefilling)
                assert len(self.builder.host_tables) == len(decode)
                self.keyed_steps += 1
            chunks = [*decode, *prefill]
            return torch.nn.functional.one_hot(torch.tensor([(c.start * 7 + len(c.tokens)) % 50 for c in chunks]), 50)

        def decode(self, chunks):
            return self.run(chunks)

    runner = CheckingRunner(_builder())
    engine = Engine(runner, num_blocks=30, vocab_size=50)
    rng = random.Random(3)
    for step in range(60):
        if step < 40 and rng.random() < 0.4:
            engine.add_request([rng.randrange(50) for _ in range(rng.randint(1, 9))], rng.randint(1, 12))
        engine.step()
    engine.run()
    assert runner.keyed_steps > 20 and len(engine.finished) == len(engine.requests)


def test_the_host_time_benchmark_times_equal_work(monkeypatch, capsys):
    """benchmarks/bench_builder_host.py: its keyed trace (with churn) builds what its unkeyed trace builds,
    step for step, and its command line runs (no timing is checked)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_builder_host.py"
    spec = importlib.util.spec_from_file_location("bench_builder_host", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for churn in (False, True):
        keyed, plain = bench.Trace(6, 12, 4, 30, True, churn), bench.Trace(6, 12, 4, 30, False, churn)
        kb, pb = (MetadataBuilder(max_batch=6, max_blocks_per_seq=12, max_tokens=6, block_size=4, device="cpu")
                  for _ in range(2))
        for _ in range(30):
            k_chunks, p_chunks = keyed.step(), plain.step()
            assert all(c.key is not None for c in k_chunks) and all(c.key is None for c in p_chunks)
            got, want = step_fields(kb.build(k_chunks)), step_fields(pb.build(p_chunks))
            assert all(torch.equal(got[name], want[name]) for name in want)
    # its DecodeRows trace builds what its keyed trace builds (positions, tokens and blocks as they grow)
    rows_trace, keyed = bench.RowsTrace(6, 12, 4, 30), bench.Trace(6, 12, 4, 30, True, False)
    rb, kb = (MetadataBuilder(max_batch=6, max_blocks_per_seq=12, max_tokens=6, block_size=4, device="cpu")
              for _ in range(2))
    for _ in range(30):
        got, want = step_fields(rb.build(rows_trace.update())), step_fields(kb.build(keyed.step()))
        assert all(torch.equal(got[name], want[name]) for name in want)
        rows_trace.advance()
    monkeypatch.setattr("sys.argv", ["bench_builder_host.py", "--batches", "2", "--calls", "3", "--warmup", "1"])
    bench.main()
    out = capsys.readouterr().out
    assert "B=   2: full" in out and "rows" in out and "overlap rows" in out
