"""Input builders and a float64 reference for the lightning-indexer kernel tests (interpreter and CUDA;
not a test module).

Index caches are poisoned (NaN, or 0xFF bytes for fp8) wherever no token was written; block tables are
shuffled and their unused entries hold a huge invalid id. ``ints=True`` builds exact inputs: integer
queries in [-2, 2], integer keys in [-7, 7] with one element of each key at +-7 (so the fp8 scale is
7 / 448 = 2**-6 and the dequantized key is exact) and weights in halves: every score is exact in float32
whatever the summation order, so equal scores are real ties and the selection must match exactly.
"""

from __future__ import annotations

import math

import torch

from _triton_test_util import BAD_BLOCK, shuffled_table
from mla_compile.ops.fp8_index import dequantize_fp8_index, quantize_fp8_index



def index_paged(lens, bs, d, kind, device, gen, ints=False, spare=2):
    """``(cache, table int32 [B, cols], seq_lens int32 [B], keys float32 [nb, bs, d])``.

    ``kind``: a float dtype, or "fp8" (``uint8 [nb, bs, d + 4]`` index rows). ``keys`` holds what a kernel
    should read (the dequantized rows for fp8), NaN where nothing was written.
    """
    need = max(1, max((math.ceil(n / bs) for n in lens), default=1))
    table, nb, blocks, offs = shuffled_table(lens, bs, gen, spare, cols=need + 1)  # one unused column: never read
    n = blocks.numel()
    if ints:
        new = torch.randint(-7, 8, (n, d), generator=gen).float()
        pick = torch.randint(0, d, (n,), generator=gen)
        new[torch.arange(n), pick] = torch.where(torch.rand(n, generator=gen) < 0.5, -7.0, 7.0)
    else:
        new = torch.randn(n, d, generator=gen)
    keys = torch.full((nb, bs, d), float("nan"))
    if kind == "fp8":
        cache = torch.full((nb, bs, d + 4), 0xFF, dtype=torch.uint8)
        cache[blocks, offs] = quantize_fp8_index(new)
        keys[blocks, offs] = dequantize_fp8_index(cache[blocks, offs])
    else:
        cache = torch.full((nb, bs, d), float("nan"), dtype=kind)
        cache[blocks, offs] = new.to(kind)
        keys[blocks, offs] = cache[blocks, offs].float()
    return (cache.to(device), table.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
            keys.to(device))


def index_queries(lens, per_seq, heads, d, dtype, device, gen, ints=False, pad_tokens=2):
    """``(q_idx [T, heads, d], weights float32 [T, heads], query_seq int32 [T], query_pos int32 [T])``: the
    last ``per_seq[b]`` positions of sequence b (a causal chunk; an empty sequence gets one token at position 0,
    which sees nothing), one token placed past sequence 0's end (seq_len bounds what it sees), and ``pad_tokens`` padding tokens (query_seq -1)."""
    seqs, poss = [], []
    for b, (n, m) in enumerate(zip(lens, per_seq)):
        for p in range(max(n - m, 0), n) if n else range(min(m, 1)):  # an empty sequence: one token, sees nothing
            seqs.append(b)
            poss.append(p)
    if lens:
        seqs.append(0)
        poss.append(lens[0] + 3)
    seqs += [-1] * pad_tokens
    poss += [0] * pad_tokens
    T = len(seqs)
    if ints:
        q = torch.randint(-2, 3, (T, heads, d), generator=gen).float()
        w = torch.randint(-2, 4, (T, heads), generator=gen).float() / 2
    else:
        q = torch.randn(T, heads, d, generator=gen)
        w = torch.randn(T, heads, generator=gen) * heads ** -0.5
    return (q.to(device, dtype), w.to(device), torch.tensor(seqs, dtype=torch.int32, device=device),
            torch.tensor(poss, dtype=torch.int32, device=device))


def lightning_scores64(q, w, keys, table, lens, qseq, qpos, chunk=64):
    """float64 scores ``[T, max_blocks * bs]`` (-inf where not visible), by sequence and token chunk,
    from ``keys [nb, bs, d]`` (what the kernel reads)."""
    T = q.shape[0]
    bs = keys.shape[1]
    out = torch.full((T, table.shape[1] * bs), float("-inf"), dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        k = keys[table[b, pos // bs].long(), pos % bs].double()
        toks = (qseq == b).nonzero()[:, 0]
        for c in range(0, len(toks), chunk):
            tt = toks[c:c + chunk]
            s = (torch.relu(torch.einsum("thd,nd->thn", q[tt].double(), k)) * w[tt].double()[..., None]).sum(1)
            out[tt, :n] = torch.where(pos[None, :] <= qpos[tt].long()[:, None], s, float("-inf"))
    return out


def assert_valid_topk(got, scores64, table, lens, qseq, bs, topk, tol):
    """``got int32 [T, topk]`` is a top-k of the float64 scores up to ``tol``: the visible count (then -1),
    no duplicates, chosen in descending order (within tol), nothing left out that beats a chosen one by
    more than tol, and exactly the float64 top set wherever the k-th and (k+1)-th scores differ by more."""
    assert got.dtype == torch.int32 and got.shape == (scores64.shape[0], topk)
    nb = int(table[table < BAD_BLOCK].max()) + 1
    L = scores64.shape[1]
    pos_of = torch.full((table.shape[0], nb * bs), -1, dtype=torch.long, device=got.device)
    for b, n in enumerate(lens.tolist()):
        p = torch.arange(n, device=got.device)
        pos_of[b, table[b, p // bs].long() * bs + p % bs] = p
    seq = qseq.long().clamp(min=0)
    visible = torch.isfinite(scores64)
    count = visible.sum(1).clamp(max=topk)
    j = torch.arange(topk, device=got.device)
    assert torch.equal(got >= 0, j[None, :] < count[:, None]), "wrong number of slots or -1 inside a row"
    pos = torch.where(got >= 0, pos_of[seq[:, None], got.long().clamp(min=0)], -1)
    assert (pos[got >= 0] >= 0).all(), "a slot outside the query's sequence"
    chosen = torch.where(pos >= 0, scores64.gather(1, pos.clamp(min=0)), float("inf"))
    assert torch.isfinite(chosen[got >= 0]).all(), "an invisible position was chosen"
    picked = torch.zeros(scores64.shape[0], L + 1, dtype=torch.bool, device=got.device)
    picked.scatter_(1, torch.where(pos >= 0, pos, L), True)
    assert torch.equal(picked[:, :L].sum(1), count), "duplicate slots"
    diffs = chosen[:, 1:] - chosen[:, :-1]
    assert (diffs[(got[:, 1:] >= 0)] <= tol).all(), "not in descending score order"
    rest = torch.where(picked[:, :L] | ~visible, float("-inf"), scores64).amax(1)
    low = torch.where(got >= 0, chosen, float("inf")).amin(1)
    assert (rest <= low + tol).all(), "a better position was left out"
    top = torch.sort(scores64, dim=1, descending=True).values
    k = min(topk, L)
    if k < L:
        clear = (top[:, k - 1] - top[:, k] > tol) | ~torch.isfinite(top[:, k])
        exact = torch.zeros_like(picked[:, :L])
        exact.scatter_(1, torch.sort(scores64, dim=1, descending=True, stable=True).indices[:, :k], True)
        exact &= visible
        assert torch.equal(picked[clear, :L], exact[clear]), "not the float64 top set where it is clear"
        return int(clear.sum())
    return scores64.shape[0]
