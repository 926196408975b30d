"""Independent float64 references for the MLA ops and the input builders the op tests share.

The references loop in Python over sequences and tokens and read block tables one entry at a time;
nothing here reuses the ops' vectorised code, so a shared mistake cannot hide. Builders make fresh
random (never zero) data and poison with NaN whatever an op must not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st
from torch import Tensor

NAN = float("nan")
NEG_INF = float("-inf")
F64 = torch.float64

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
IMPLS = ["public", "raw"]  # the mla_compile.ops function (backend "auto") and the torch.ops.mla.*_ref op
BLOCK_SIZES = [1, 16, 64]

# Small dims for hypothesis cases; DeepSeek's real ones (512/64, H=16) get their own tests.
RANK, ROPE = 32, 16
DS_RANK, DS_ROPE, DS_HEADS = 512, 64, 16

OUT_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
}
# LSE is float32 whatever the input dtype; bf16 inputs are exact in float32, so it stays tight.
LSE_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-3, atol=2e-3),
    torch.float64: dict(rtol=1e-6, atol=1e-6),
}

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: Tensor) -> Tensor:
    """The raw bits of ``t`` as integers: equality of these is NaN-aware and exact."""
    return t.detach().cpu().contiguous().view(_INT_OF_SIZE[t.element_size()])


def assert_bitwise_equal(actual: Tensor, expected: Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if not torch.equal(bits(actual), bits(expected)):
        diff = (bits(actual) != bits(expected)).nonzero()
        raise AssertionError(f"{what}: {diff.shape[0]} elements differ, first at {diff[:4].tolist()}")


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str = "cpu") -> Tensor:
    """Standard-normal values rounded to ``dtype`` (fresh, never all zero)."""
    return torch.randn(shape, generator=gen, dtype=F64).to(dtype).to(device)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------- paging

@dataclass(frozen=True)
class Paged:
    """A paged batch: sequence b's token p lives in physical block ``tables[b][p // block_size]``."""

    block_size: int
    num_blocks: int
    seq_lens: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]  # the used blocks of each sequence (shuffled physical ids)
    max_blocks: int
    unused: int  # what fills the table past a sequence's used blocks (-1, out of range, or a real id)

    @property
    def capacity(self) -> int:
        return self.max_blocks * self.block_size

    def block_table(self, dtype: torch.dtype = torch.int32, device: str = "cpu") -> Tensor:
        rows = [list(t) + [self.unused] * (self.max_blocks - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=dtype, device=device).reshape(len(rows), self.max_blocks)

    def seq_lens_tensor(self, dtype: torch.dtype = torch.int32, device: str = "cpu") -> Tensor:
        return torch.tensor(self.seq_lens, dtype=dtype, device=device)

    def where(self, b: int, pos: int) -> tuple[int, int]:
        """(physical block, offset) of token ``pos`` of sequence ``b``."""
        return self.tables[b][pos // self.block_size], pos % self.block_size


@st.composite
def paged(draw, min_seqs: int = 0, max_seqs: int = 3) -> Paged:
    """Block size 1/16/64, lengths 0 and across block edges, shuffled block ids, spare blocks."""
    bs = draw(st.sampled_from(BLOCK_SIZES))
    longest = {1: 24, 16: 80, 64: 150}[bs]
    n = draw(st.integers(min_seqs, max_seqs))
    length = st.one_of(st.just(0), st.integers(1, longest), st.sampled_from([bs - 1, bs, bs + 1, 2 * bs + 3]))
    lens = draw(st.lists(length, min_size=n, max_size=n))
    needed = [-(-n_tok // bs) for n_tok in lens]
    max_blocks = max(max(needed, default=0) + draw(st.integers(0, 2)), 1)
    num_blocks = max(sum(needed) + draw(st.integers(0, 3)), 1)
    perm = draw(st.permutations(range(num_blocks)))
    tables, k = [], 0
    for m in needed:
        tables.append(tuple(perm[k:k + m]))
        k += m
    unused = draw(st.sampled_from([-1, num_blocks + 7, perm[-1]]))
    return Paged(bs, num_blocks, tuple(lens), tuple(tables), max_blocks, unused)


def fill_paged_cache(layout: Paged, dim: int, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """A NaN cache whose rows of every sequence's tokens ``< seq_len`` are random; nothing else is real."""
    cache = torch.full((layout.num_blocks, layout.block_size, dim), NAN, dtype=dtype)
    for b, n_tok in enumerate(layout.seq_lens):
        rows = randn(gen, n_tok, dim, dtype=dtype)
        for p in range(n_tok):
            blk, off = layout.where(b, p)
            cache[blk, off] = rows[p]
    return cache


# ---------------------------------------------------------------------------------------------- references

def _softmax_attend(keys: Tensor, values: Tensor, q: Tensor, scale: float) -> tuple[Tensor, float]:
    """Float64 attention of one query over ``keys [n, D]`` (n >= 1); returns (out, natural-log lse)."""
    scores = (keys @ q) * scale
    m = float(scores.max())
    weights = torch.exp(scores - m)
    total = float(weights.sum())
    return (weights @ values) / total, m + math.log(total)


def write_ref64(cache: Tensor, latent: Tensor, k_pe: Tensor, slots: list[int]) -> Tensor:
    """The cache after writing: ``[latent | k_pe]`` cast to the cache dtype at each slot != -1."""
    out = cache.detach().cpu().clone()
    bs = cache.shape[1]
    for t, slot in enumerate(slots):
        if slot == -1:
            continue
        row = torch.cat([latent[t].cpu().to(F64), k_pe[t].cpu().to(F64)])
        out[slot // bs, slot % bs] = row.to(cache.dtype)
    return out


def decode_ref64(q: Tensor, cache: Tensor, layout: Paged, scale: float, rank: int) -> tuple[Tensor, Tensor]:
    """``out [B, s_q, H, rank]``, ``lse [B, s_q, H]`` in float64; query i sees ``seq_len - (s_q - 1 - i)`` rows."""
    q64, c64 = q.detach().cpu().to(F64), cache.detach().cpu().to(F64)
    B, s_q, H, D = q.shape
    out = torch.zeros(B, s_q, H, rank, dtype=F64)
    lse = torch.full((B, s_q, H), NEG_INF, dtype=F64)
    for b in range(B):
        n_tok = layout.seq_lens[b]
        keys = [c64[layout.where(b, p)] for p in range(n_tok)]
        for i in range(s_q):
            visible = n_tok - (s_q - 1 - i)
            if visible <= 0:
                continue
            k = torch.stack(keys[:visible])
            for h in range(H):
                out[b, i, h], lse[b, i, h] = _softmax_attend(k, k[:, :rank], q64[b, i, h], scale)
    return out, lse


def prefill_ref64(q: Tensor, k: Tensor, v: Tensor, lens_q: list[int], lens_k: list[int], scale: float,
                  causal: bool) -> tuple[Tensor, Tensor]:
    """``out [T, H, Dv]``, ``lse [T, H]`` in float64; bottom-right causal; padding rows 0 / -inf."""
    q64, k64, v64 = (x.detach().cpu().to(F64) for x in (q, k, v))
    T, H, _ = q.shape
    out = torch.zeros(T, H, v.shape[-1], dtype=F64)
    lse = torch.full((T, H), NEG_INF, dtype=F64)
    start_q = start_k = 0
    for lq, lk in zip(lens_q, lens_k):
        for j in range(lq):
            n_keys = min(lk, j + lk - lq + 1) if causal else lk
            if n_keys <= 0:
                continue
            for h in range(H):
                keys = k64[start_k:start_k + n_keys, h]
                vals = v64[start_k:start_k + n_keys, h]
                out[start_q + j, h], lse[start_q + j, h] = _softmax_attend(keys, vals, q64[start_q + j, h], scale)
        start_q += lq
        start_k += lk
    return out, lse


def merge_ref64(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Exact LSE merge in float64; a part with lse -inf is skipped (its out is never touched)."""
    T, H, D = out_a.shape
    oa, ob = out_a.detach().cpu().to(F64), out_b.detach().cpu().to(F64)
    out = torch.zeros(T, H, D, dtype=F64)
    lse = torch.full((T, H), NEG_INF, dtype=F64)
    for t in range(T):
        for h in range(H):
            la, lb = float(lse_a[t, h]), float(lse_b[t, h])
            parts = [(l, o) for l, o in ((la, oa[t, h]), (lb, ob[t, h])) if l != NEG_INF]
            if not parts:
                continue
            m = max(l for l, _ in parts)
            weights = [math.exp(l - m) for l, _ in parts]
            total = math.fsum(weights)
            out[t, h] = sum(w * o for w, (_, o) in zip(weights, parts)) / total
            lse[t, h] = m + math.log(total)
    return out, lse


def gather_ref64(cache: Tensor, layout: Paged, starts: list[int], lengths: list[int], rows: int,
                 out_dtype: torch.dtype) -> Tensor:
    """Workspace ``[rows, D]``: sequence i's tokens ``starts[i] ...`` packed in order, the rest 0."""
    c = cache.detach().cpu()
    out = torch.zeros(rows, cache.shape[-1], dtype=out_dtype)
    r = 0
    for b, (start, n_tok) in enumerate(zip(starts, lengths)):
        for p in range(start, start + n_tok):
            out[r] = c[layout.where(b, p)].to(out_dtype)
            r += 1
    return out
