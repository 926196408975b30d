"""DeepSeek-V4 ops against float64 references written from the paper's / HF's equations.

The references loop over tokens and heads in Python: the attention softmax takes the sink as one more
logit and drops its column (HF ``eager_attention_forward``); the compressor pools each window of a whole
sequence at once, laid out as HF's ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` do; the
indexer scores ``sum_h w_h relu(q_h . k_s) / sqrt(d) / sqrt(H)``. Caches are NaN-poisoned.
"""

from __future__ import annotations

import math

import pytest
import torch

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile.ops import v4_attention, v4_compress_write, v4_index_topk
from mla_compile.ops.v4_attention import compressed_slots, window_slots

F64 = torch.float64
I32 = torch.int32
NAN = float("nan")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(g, *shape, dtype=F64):
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


def rot64(x, angle):
    """Interleaved rotation of the trailing 2*len(angle) channels of a 1-d float64 vector by ``angle``."""
    x = x.clone()
    r = 2 * len(angle)
    D = x.shape[0]
    for i, a in enumerate(angle.tolist()):
        u, v = x[D - r + 2 * i].item(), x[D - r + 2 * i + 1].item()
        x[D - r + 2 * i] = u * math.cos(a) - v * math.sin(a)
        x[D - r + 2 * i + 1] = v * math.cos(a) + u * math.sin(a)
    return x


def attention64(q, rows_per_token, sinks, pos, inv_freq, scale):
    """HF's eager V4 attention for one token at a time: softmax over [scores, sink], sink column dropped,
    values = keys = the rows, output rope slice rotated by -pos. LSE over the rows only."""
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=F64)
    lse = torch.full((T, H), float("-inf"), dtype=F64)
    for t in range(T):
        rows = rows_per_token[t]
        for h in range(H):
            logits = [scale * float(q[t, h].double() @ r.double()) for r in rows]
            m = max(logits + [float(sinks[h])])
            den = sum(math.exp(s - m) for s in logits) + math.exp(float(sinks[h]) - m)
            o = torch.zeros(D, dtype=F64)
            for s, r in zip(logits, rows):
                o += math.exp(s - m) / den * r.double()
            out[t, h] = rot64(o, -(float(pos[t]) * inv_freq.double()))
            if logits:
                lse[t, h] = m + math.log(sum(math.exp(s - m) for s in logits))
    return out, lse


def test_window_and_compressed_slots_match_a_loop():
    g = gen(1)
    bs, W, rate = 4, 6, 3
    table = torch.randperm(20, generator=g)[:15].reshape(3, 5).to(I32)
    seq = torch.tensor([0, 2, -1, 1, 2], dtype=I32)
    pos = torch.tensor([0, 5, 7, 19, 13], dtype=I32)
    ws = window_slots(table, seq, pos, block_size=bs, window=W)
    cs = compressed_slots(table, seq, pos, block_size=bs, rate=rate)
    assert ws.shape == (5, W) and cs.shape == (5, 20)
    for t in range(5):
        s, p = int(seq[t]), int(pos[t])
        for j in range(W):
            q = p - W + 1 + j
            want = -1 if s < 0 or q < 0 else int(table[s, q // bs]) * bs + q % bs
            assert int(ws[t, j]) == want
        for j in range(20):
            want = -1 if s < 0 or j >= (p + 1) // rate else int(table[s, j // bs]) * bs + j % bs
            assert int(cs[t, j]) == want


def _attention_case(seed, dtype, T=5, H=3, D=16, rope=4, nb=6, bs=4):
    g = gen(seed)
    q = rnd(g, T, H, D, dtype=dtype)
    kv = rnd(g, nb, bs, D, dtype=dtype)
    comp = rnd(g, nb, bs, D, dtype=dtype)
    ws = torch.randperm(nb * bs, generator=g)[: T * 4].reshape(T, 4).to(I32)
    ws[0, :2] = -1  # a window that starts before position 0
    cs = torch.randperm(nb * bs, generator=g)[: T * 3].reshape(T, 3).to(I32)
    cs[1] = -1  # no compressed entry yet
    cs[2, 1] = -1
    used_kv = torch.zeros(nb * bs, dtype=torch.bool)
    used_kv[ws[ws >= 0].long()] = True
    kv.view(-1, D)[~used_kv] = NAN  # a read of an unlisted row shows up
    used_c = torch.zeros(nb * bs, dtype=torch.bool)
    used_c[cs[cs >= 0].long()] = True
    comp.view(-1, D)[~used_c] = NAN
    sinks = rnd(g, H, dtype=torch.float32)
    pos = torch.tensor([3, 17, 40, 0, 9], dtype=I32)[:T]
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    return q, kv, ws, comp, cs, sinks, pos, inv_freq


def _rows(kv, ws, comp, cs):
    D = kv.shape[-1]
    fk, fc = kv.reshape(-1, D), comp.reshape(-1, D)
    return [[fk[i] for i in ws[t].tolist() if i >= 0] + [fc[i] for i in cs[t].tolist() if i >= 0]
            for t in range(ws.shape[0])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("impl", ["public", "raw"])
def test_v4_attention_matches_reference(dtype, impl, device):
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _attention_case(3, dtype)
    scale = 16 ** -0.5
    fn = v4_attention if impl == "public" else torch.ops.mla.v4_attention_ref
    out, lse = fn(*(t.to(device) for t in (q, kv, ws, comp, cs, sinks, pos, inv_freq)), scale)
    out, lse = out.cpu(), lse.cpu()
    ref_out, ref_lse = attention64(q.double(), _rows(kv, ws, comp, cs), sinks.double(), pos, inv_freq, scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_v4_attention_empty_set_is_zero_and_lse_minus_inf(device):
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _attention_case(4, torch.float32)
    ws[2] = -1
    cs[2] = -1
    out, lse = v4_attention(*(t.to(device) for t in (q, kv, ws, comp, cs, sinks, pos, inv_freq)), 0.25)
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isneginf(lse[2]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[[0, 1, 3, 4]]).all()
    no_sink = torch.full_like(sinks, float("-inf")).to(device)  # plain attention: still 0, not NaN
    out, lse = v4_attention(*(t.to(device) for t in (q, kv, ws, comp, cs)), no_sink,
                            *(t.to(device) for t in (pos, inv_freq)), 0.25)
    assert torch.equal(out[2].cpu(), torch.zeros_like(out[2].cpu())) and torch.isfinite(out).all()


def test_v4_attention_dominant_sink_and_no_sink():
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _attention_case(5, torch.float64)
    scale = 0.25
    plain_out, plain_lse = v4_attention(q, kv, ws, comp, cs, torch.full_like(sinks, float("-inf")), pos, inv_freq,
                                        scale)
    big = torch.full_like(sinks, 40.0)
    out, lse = v4_attention(q, kv, ws, comp, cs, big, pos, inv_freq, scale)
    ref_out, _ = attention64(q, _rows(kv, ws, comp, cs), big.double(), pos, inv_freq, scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-25)
    torch.testing.assert_close(lse, plain_lse)  # the LSE never includes the sink
    assert out.abs().max() < 1e-8 * plain_out.abs().max()  # the sink takes almost all the mass
    # the LSE-level identity: out = out_without_sink * sigmoid(lse - sink)
    torch.testing.assert_close(out, plain_out * torch.sigmoid(lse.double() - 40.0)[..., None], rtol=1e-6, atol=0)  # lse is float32
    ref_plain, _ = attention64(q, _rows(kv, ws, comp, cs), torch.full((3,), -1e300, dtype=F64), pos, inv_freq, scale)
    torch.testing.assert_close(plain_out, ref_plain, rtol=1e-10, atol=1e-10)


def test_v4_attention_rejects_bad_shapes_naming_the_argument():
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _attention_case(6, torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        v4_attention(q, kv, ws, comp, cs, sinks[:2], pos, inv_freq, 0.25)
    with pytest.raises(ValueError, match="comp_cache"):
        v4_attention(q, kv, ws, comp[..., :8], cs, sinks, pos, inv_freq, 0.25)
    with pytest.raises(ValueError, match="window_slots"):
        v4_attention(q, kv, ws.clone().fill_(10_000), comp, cs, sinks, pos, inv_freq, 0.25)


# ------------------------------------------------------------------------------------------- compressor

def rms64(x, w, eps):
    return x / torch.sqrt((x * x).mean() + eps) * w


def compress64(kv, gate, bias, norm_w, eps, inv_freq, rate, overlap):
    """HF's compressor over a whole sequence ``kv, gate [L, Cin]`` (no cache): entry w for every closed window."""
    L, Cin = kv.shape
    C = Cin // 2 if overlap else Cin
    entries = []
    for w in range(L // rate):
        src_kv, src_g = [], []
        if overlap:
            for i in range(rate):  # Ca of window w-1 (absent for w = 0: weight 0)
                if w > 0:
                    src_kv.append(kv[(w - 1) * rate + i, :C])
                    src_g.append(gate[(w - 1) * rate + i, :C] + bias[i, :C])
            for i in range(rate):  # Cb of window w
                src_kv.append(kv[w * rate + i, C:])
                src_g.append(gate[w * rate + i, C:] + bias[i, C:])
        else:
            for i in range(rate):
                src_kv.append(kv[w * rate + i])
                src_g.append(gate[w * rate + i] + bias[i])
        k, gg = torch.stack(src_kv), torch.stack(src_g)
        pooled = (k * torch.softmax(gg, dim=0)).sum(0)
        entries.append(rot64(rms64(pooled, norm_w, eps), float(w * rate) * inv_freq.double()))
    return torch.stack(entries) if entries else torch.zeros(0, C, dtype=F64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap,rate", [(True, 4), (False, 4), (False, 3), (True, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_v4_compress_write_chunked_matches_whole_sequence(overlap, rate, dtype, device):
    """Three sequences fed in uneven chunks (steps mix decode tokens and chunks crossing window
    boundaries, plus padding rows); the entry cache then equals HF's whole-sequence compression, and
    nothing else in the cache was written."""
    g = gen(10 + rate + 7 * overlap)
    C, rope, bs, eps = 8, 4, 3, 1e-6
    Cin = 2 * C if overlap else C
    lens = [23, 9, 2]
    data = [(rnd(g, L, Cin, dtype=dtype), rnd(g, L, Cin, dtype=dtype)) for L in lens]
    bias = rnd(g, rate, Cin, dtype=torch.float32)
    norm_w = rnd(g, C, dtype=torch.float32)
    inv_freq = 1.0 / (50.0 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    table = torch.randperm(12, generator=g).reshape(3, 4).to(I32)
    cache = torch.full((12, bs, C), NAN, dtype=dtype, device=device)
    R = 2 * rate if overlap else rate
    state_slot = torch.tensor([2, 0, 3], dtype=I32, device=device)  # state rows need not equal batch rows
    state_kv = torch.full((4, R, Cin), NAN, dtype=dtype, device=device)
    state_gate = torch.full((4, R, Cin), NAN, dtype=dtype, device=device)
    bias_d, norm_d, inv_d, table_d = (t.to(device) for t in (bias, norm_w, inv_freq, table))
    chunks = [[5, 1, 2], [1, 4, 0], [7, 1, 0], [1, 3, 0], [9, 0, 0]]  # per step, tokens of each sequence
    done = [0, 0, 0]
    for step in chunks:
        seq, pos, kvs, gates = [], [], [], []
        for b, n in enumerate(step):
            for p in range(done[b], done[b] + n):
                seq.append(b), pos.append(p), kvs.append(data[b][0][p]), gates.append(data[b][1][p])
            done[b] += n
        seq.append(-1), pos.append(0), kvs.append(torch.full((Cin,), NAN, dtype=dtype)), gates.append(kvs[-1])
        v4_compress_write(torch.stack(kvs).to(device), torch.stack(gates).to(device),
                          torch.tensor(seq, dtype=I32, device=device), torch.tensor(pos, dtype=I32, device=device),
                          state_slot, state_kv, state_gate, bias_d, norm_d, inv_d, cache, table_d, rate=rate,
                          eps=eps, overlap=overlap)
    assert done == lens
    cache = cache.cpu()
    written = torch.zeros(12 * bs, dtype=torch.bool)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    for b, L in enumerate(lens):
        ref = compress64(data[b][0].double(), data[b][1].double(), bias.double(), norm_w.double(), eps, inv_freq,
                         rate, overlap)
        for w in range(L // rate):
            slot = int(table[b, w // bs]) * bs + w % bs
            written[slot] = True
            torch.testing.assert_close(cache.view(-1, C)[slot].double(), ref[w], **tol)
    assert torch.isnan(cache.view(-1, C)[~written]).all()


def test_v4_compress_write_needs_blocks_only_for_closed_windows():
    """Entry blocks of windows still open may be unallocated (-1); a closing token needs a real one."""
    g = gen(21)
    C, rate = 4, 2
    cache = torch.full((2, 2, C), NAN)
    args = lambda n: (rnd(g, n, C, dtype=torch.float32), rnd(g, n, C, dtype=torch.float32),  # noqa: E731
                      torch.zeros(n, dtype=I32), torch.arange(n, dtype=I32), torch.zeros(1, dtype=I32),
                      torch.zeros(1, rate, C), torch.zeros(1, rate, C), rnd(g, rate, C, dtype=torch.float32),
                      torch.ones(C), torch.ones(1), cache)
    table = torch.tensor([[1, -1]], dtype=I32)  # entries 0-1 in block 1; block for entries 2-3 not allocated
    v4_compress_write(*args(5), table, rate=rate, eps=1e-6, overlap=False)  # closes entries 0 and 1 only
    assert not torch.isnan(cache[1]).any() and torch.isnan(cache[0]).all()
    with pytest.raises(ValueError, match="block_table"):
        v4_compress_write(*args(6), table, rate=rate, eps=1e-6, overlap=False)  # position 5 closes entry 2


def test_v4_compress_write_rejects_bad_bias_before_writing():
    g = gen(20)
    cache = rnd(g, 2, 2, 4, dtype=torch.float32)
    before = cache.clone()
    with pytest.raises(ValueError, match="position_bias"):
        v4_compress_write(rnd(g, 3, 8, dtype=torch.float32), rnd(g, 3, 8, dtype=torch.float32),
                          torch.zeros(3, dtype=I32), torch.arange(3, dtype=I32), torch.zeros(1, dtype=I32),
                          torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), torch.zeros(3, 8), torch.ones(4),
                          torch.ones(1), cache, torch.zeros(1, 2, dtype=I32), rate=2, eps=1e-6, overlap=True)
    assert torch.equal(cache, before)


# ------------------------------------------------------------------------------------------- indexer

def index64(q, w, keys, pos, rate, topk):
    """The top-``topk`` entry ids (as a set) of one query at position ``pos`` over ``keys [E, d]``."""
    H, d = q.shape
    visible = min(keys.shape[0], (pos + 1) // rate)
    scores = []
    for s in range(visible):
        sc = sum(float(w[h]) * max(float(q[h].double() @ keys[s].double()), 0.0) for h in range(H))
        scores.append(sc * d ** -0.5 * H ** -0.5)
    order = sorted(range(visible), key=lambda s: -scores[s])
    return set(order[:topk])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("topk", [3, 50])  # 50: more than any query's entries
def test_v4_index_topk_matches_reference(topk, device):
    g = gen(30 + topk)
    H, d, bs, rate = 4, 8, 4, 4
    lens = [30, 7, 3]
    table = torch.randperm(9, generator=g).reshape(3, 3).to(I32)
    cache = torch.full((9, bs, d), NAN)
    keys = []
    for b, L in enumerate(lens):
        k = rnd(g, L // rate, d, dtype=torch.float32)
        keys.append(k)
        for e in range(L // rate):
            cache[table[b, e // bs], e % bs] = k[e]
    seq = torch.tensor([0, 0, 0, 1, 2, -1, 1], dtype=I32)
    pos = torch.tensor([29, 10, 2, 6, 2, 0, 3], dtype=I32)
    q = rnd(g, 7, H, d, dtype=torch.float32)
    w = rnd(g, 7, H, dtype=torch.float32)
    got = v4_index_topk(*(t.to(device) for t in (q, w, cache, table, torch.tensor(lens, dtype=I32), seq, pos)),
                        rate=rate, topk=topk).cpu()
    assert got.shape == (7, topk) and got.dtype == I32
    for t in range(7):
        b, p = int(seq[t]), int(pos[t])
        want = set() if b < 0 else index64(q[t], w[t], keys[b], p, rate, topk)
        chosen = [int(x) for x in got[t] if x >= 0]
        assert len(chosen) == len(set(chosen))
        inv = {int(table[b, e // bs]) * bs + e % bs: e for e in range(lens[b] // rate)} if b >= 0 else {}
        assert {inv[x] for x in chosen} == want
        assert (got[t, len(chosen):] == -1).all()


# ------------------------------------------------------------------------------------------- opcheck

def test_opcheck_v4_ops():
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _attention_case(7, torch.float32)
    torch.library.opcheck(torch.ops.mla.v4_attention_ref.default, (q, kv, ws, comp, cs, sinks, pos, inv_freq, 0.3))
    g = gen(8)
    rate, C = 2, 4
    args = (rnd(g, 5, 2 * C, dtype=torch.float32), rnd(g, 5, 2 * C, dtype=torch.float32),
            torch.tensor([0, 0, 0, 1, -1], dtype=I32), torch.tensor([0, 1, 2, 3, 0], dtype=I32),
            torch.tensor([1, 0], dtype=I32), rnd(g, 2, 2 * rate, 2 * C, dtype=torch.float32),
            rnd(g, 2, 2 * rate, 2 * C, dtype=torch.float32), rnd(g, rate, 2 * C, dtype=torch.float32),
            rnd(g, C, dtype=torch.float32), torch.ones(1), rnd(g, 4, 2, C, dtype=torch.float32),
            torch.tensor([[0, 1], [2, 3]], dtype=I32), rate, 1e-6, True)
    torch.library.opcheck(torch.ops.mla.v4_compress_write_ref.default, args)


# ------------------------------------------------------------------------------------------- no host reads

from .test_no_host_reads import NoHostReads, body, no_data_checks  # noqa: E402,F401  (a fixture)


def test_v4_references_and_slot_lists_read_nothing_on_the_host(no_data_checks):
    """What a captured V4 decode step runs: the slot builders, the compressor write and the attention
    reference bodies (inside the custom ops) never read device values on the host."""
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _attention_case(9, torch.float32)
    table = torch.randperm(6, generator=gen(9)).reshape(2, 3).to(I32)
    seq = torch.tensor([0, 1, -1, 1, 0], dtype=I32)
    with NoHostReads():
        window_slots(table, seq, pos, block_size=4, window=5)
        compressed_slots(table, seq, pos, block_size=4, rate=4)
        body("v4_attention", "v4_attention_ref")(q, kv, ws, comp, cs, sinks, pos, inv_freq, 0.3)
        g = gen(10)
        body("v4_compress", "v4_compress_write_ref")(
            rnd(g, 5, 8, dtype=torch.float32), rnd(g, 5, 8, dtype=torch.float32), seq,
            torch.tensor([3, 7, 0, 8, 4], dtype=I32), torch.tensor([1, 0], dtype=I32),
            rnd(g, 2, 4, 8, dtype=torch.float32), rnd(g, 2, 4, 8, dtype=torch.float32),
            rnd(g, 2, 8, dtype=torch.float32), torch.ones(4), torch.ones(1), rnd(g, 6, 4, 4, dtype=torch.float32),
            table, 2, 1e-6, True)


def test_v4_model_step_reads_nothing_on_the_host(no_data_checks):
    """A whole V4 step (mHC, routing, experts, norms, the ops' calls) under the host-read trap."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("no DeepseekV4ForCausalLM")
    from mla_compile.models.model import patch
    from mla_compile.models.v4_model import V4Sequences
    from mla_compile.app.v4_toy import toy_v4_model

    model = patch(toy_v4_model(11))
    seqs = V4Sequences(model, 2, 32, 4)
    ids, pos, meta = seqs.metadata([0, 1], [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5, 6]])
    with torch.no_grad(), NoHostReads():
        model(ids, pos, meta)


# ------------------------------------------------------------------------------------------- random schedules

from hypothesis import given, strategies as st  # noqa: E402


@given(overlap=st.booleans(), rate=st.integers(1, 5), seed=st.integers(0, 2**16),
       steps=st.lists(st.lists(st.integers(0, 11), min_size=2, max_size=2), min_size=1, max_size=6))
def test_v4_compress_write_random_schedules(overlap, rate, seed, steps):
    """Any split of two sequences into calls (empty, single-token and long chunks, in any mix) writes the
    whole-sequence entries of HF's compressor."""
    g = gen(seed)
    C, rope, bs = 4, 2, 2
    cin = 2 * C if overlap else C
    R = 2 * rate if overlap else rate
    lens = [sum(s[b] for s in steps) for b in range(2)]
    data = [(rnd(g, max(L, 1), cin), rnd(g, max(L, 1), cin)) for L in lens]
    bias, norm_w = rnd(g, rate, cin), 1 + 0.1 * rnd(g, C)
    inv_freq = 1.0 / (20.0 ** (torch.arange(0, rope, 2, dtype=F64) / rope))
    nb = max(1, -(-(max(lens) // rate) // bs))
    table = torch.randperm(2 * nb, generator=g).reshape(2, nb).to(I32)
    cache = torch.full((2 * nb, bs, C), NAN, dtype=F64)
    state = [torch.full((2, R, cin), NAN, dtype=F64) for _ in range(2)]
    done = [0, 0]
    for step in steps:
        seq, pos, kvs, gates = [], [], [], []
        for b in (1, 0):  # batch row order need not follow the state rows
            for p in range(done[b], done[b] + step[b]):
                seq.append(b), pos.append(p), kvs.append(data[b][0][p]), gates.append(data[b][1][p])
            done[b] += step[b]
        if not seq:
            continue
        v4_compress_write(torch.stack(kvs), torch.stack(gates), torch.tensor(seq, dtype=I32),
                          torch.tensor(pos, dtype=I32), torch.tensor([1, 0], dtype=I32), state[0], state[1], bias,
                          norm_w, inv_freq, cache, table, rate=rate, eps=1e-6, overlap=overlap)
    written = torch.zeros(2 * nb * bs, dtype=torch.bool)
    for b, L in enumerate(lens):
        ref = compress64(data[b][0][:L], data[b][1][:L], bias, norm_w, 1e-6, inv_freq, rate, overlap)
        for w in range(L // rate):
            slot = int(table[b, w // bs]) * bs + w % bs
            written[slot] = True
            torch.testing.assert_close(cache.view(-1, C)[slot], ref[w], rtol=1e-10, atol=1e-10)
    assert torch.isnan(cache.view(-1, C)[~written]).all()
