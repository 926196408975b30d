"""``mla::v4_compress_write``: DeepSeek-V4's KV compressor, written straight into a paged entry cache.

Every ``rate`` tokens of a sequence close one window and produce one compressed entry (paper §2.3.1-2):

    entry_w = RoPE_{w * rate}( RMSNorm( sum_j softmax_j(gate_j + bias_j) * kv_j ) )

softmax over the window's source rows j, per channel. Without overlap (HCA, ``overlap=False``) the
sources are the ``rate`` rows of window w: ``kv, gate [*, C]``, ``position_bias [rate, C]``. With overlap
(CSA and the CSA indexer, ``overlap=True``) each token projects two series, ``kv, gate [*, 2C]``: the first
C channels (Ca) of window w-1 and the last C channels (Cb) of window w form ``2 * rate`` sources (width
``2 * rate``, stride ``rate``), with ``position_bias [rate, 2C]`` split the same way; window 0 has no
predecessor (its Ca sources have gate -inf, weight 0). RMSNorm uses ``norm_weight [C]`` and ``eps``; RoPE
rotates the trailing ``2 * len(inv_freq)`` channels as interleaved pairs at position ``w * rate``.

Tokens arrive flat (``kv/gate [T, Cin]``, ``query_seq [T]`` the batch row, -1 padding, ``query_pos [T]``);
a sequence's tokens in one call are consecutive rows with consecutive positions (a decode token, or a
prefill chunk). Sources before the call come from the persistent partial-window state ``state_kv,
state_gate [S, R, Cin]`` (R = ``2 * rate`` with overlap, else ``rate``; row ``state_slot[b]`` belongs to
batch row b, ring index ``pos % R``), which this op then updates with the call's last R tokens of each
sequence. The token that closes window w (``pos % rate == rate - 1``) writes entry w to ``cache
[NB, BS, C]`` at slot ``block_table[b, w // BS] * BS + w % BS``. Nothing else is written; no host reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import FLOAT_DTYPES, INDEX_DTYPES, check_range, check_same_device, check_tensor, \
    data_checks_enabled
from mla_compile.ops._paged import scatter_rows
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("v4_compress_write", "mla.v4_compress_write", cache=True)


def validate(kv: Tensor, gate: Tensor, query_seq: Tensor, query_pos: Tensor, state_slot: Tensor, state_kv: Tensor,
             state_gate: Tensor, position_bias: Tensor, norm_weight: Tensor, inv_freq: Tensor, cache: Tensor,
             block_table: Tensor, rate: int, overlap: bool) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode. Raises before anything is written."""
    if rate <= 0:
        raise ValueError(f"{OP}: rate must be positive, got {rate}")
    check_tensor(OP, "kv", kv, ndim=2, dtypes=FLOAT_DTYPES, expected="[T, Cin] (Cin = 2C with overlap, else C)")
    T, Cin = kv.shape
    C = Cin // 2 if overlap else Cin
    if overlap and Cin % 2:
        raise ValueError(f"{OP}: with overlap kv's last dim must be even (two series of C), got {Cin}")
    R = 2 * rate if overlap else rate
    check_tensor(OP, "gate", gate, ndim=2, dtypes=FLOAT_DTYPES, shape=(T, Cin), expected=f"[{T}, {Cin}] like kv")
    check_tensor(OP, "query_seq", query_seq, ndim=1, dtypes=INDEX_DTYPES, shape=(T,),
                 expected=f"[{T}] batch row of each token, -1 = padding")
    check_tensor(OP, "query_pos", query_pos, ndim=1, dtypes=INDEX_DTYPES, shape=(T,), expected=f"[{T}] positions")
    check_tensor(OP, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, expected="[B, max_blocks] entry blocks")
    B = block_table.shape[0]
    check_tensor(OP, "state_slot", state_slot, ndim=1, dtypes=INDEX_DTYPES, shape=(B,),
                 expected=f"[{B}] state row of each batch row")
    check_tensor(OP, "state_kv", state_kv, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, R, Cin),
                 expected=f"[S, {R}, {Cin}] partial-window state")
    check_tensor(OP, "state_gate", state_gate, ndim=3, dtypes=FLOAT_DTYPES, shape=state_kv.shape,
                 expected=f"[S, {R}, {Cin}] like state_kv")
    check_tensor(OP, "position_bias", position_bias, ndim=2, dtypes=FLOAT_DTYPES, shape=(rate, Cin),
                 expected=f"[{rate}, {Cin}]")
    check_tensor(OP, "norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, shape=(C,), expected=f"[{C}]")
    check_tensor(OP, "inv_freq", inv_freq, ndim=1, dtypes=FLOAT_DTYPES, expected="[rope_dim / 2]")
    if 2 * inv_freq.shape[0] > C:
        raise ValueError(f"{OP}: inv_freq must have at most C / 2 = {C // 2} entries, got {inv_freq.shape[0]}")
    check_tensor(OP, "cache", cache, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, None, C),
                 expected=f"[num_blocks, block_size, {C}] compressed entries")
    check_same_device(OP, kv=kv, gate=gate, query_seq=query_seq, query_pos=query_pos, state_slot=state_slot,
                      state_kv=state_kv, state_gate=state_gate, position_bias=position_bias,
                      norm_weight=norm_weight, inv_freq=inv_freq, cache=cache, block_table=block_table)
    if data_checks_enabled(query_seq):
        check_range(OP, "query_seq", query_seq, -1, max(B, 0), what=f"batch rows < B = {B}, or -1")
        check_range(OP, "state_slot", state_slot, 0, state_kv.shape[0], what=f"state rows < S = {state_kv.shape[0]}")
        live = query_seq >= 0
        check_range(OP, "query_pos", query_pos[live], 0, 2**62, what="positions >= 0")
        closes = live & (query_pos.long() % rate == rate - 1)  # only these write, so only their blocks matter
        cap = block_table.shape[1] * cache.shape[1] * rate
        check_range(OP, "query_pos", query_pos[closes], 0, cap,
                    what=f"positions that close a window < max_blocks * block_size * rate = {cap}")
        if B:
            used = block_table[query_seq[closes].long(), (query_pos[closes].long() // rate) // cache.shape[1]]
            check_range(OP, "block_table", used, 0, cache.shape[0], what=f"block ids < num_blocks = {cache.shape[0]}")


def compress_rows(kv: Tensor, gate: Tensor, query_seq: Tensor, query_pos: Tensor, state_slot: Tensor,
                  state_kv: Tensor, state_gate: Tensor, position_bias: Tensor, norm_weight: Tensor, eps: float,
                  inv_freq: Tensor, rate: int, overlap: bool) -> Tensor:
    """The entry of every token's window as if the token closed it: ``[T, C]`` in float32 (float64 for
    float64 inputs). Only rows with ``pos % rate == rate - 1`` are real entries."""
    acc = torch.float64 if kv.dtype == torch.float64 else torch.float32
    T, Cin = kv.shape
    C = Cin // 2 if overlap else Cin
    R = 2 * rate if overlap else rate
    dev = kv.device
    live = query_seq >= 0
    seq = torch.where(live, query_seq.long(), 0)
    pos = query_pos.long()
    w = pos // rate
    j = torch.arange(R, device=dev)
    src = (w * rate - (rate if overlap else 0))[:, None] + j[None, :]  # [T, R] source positions
    row = torch.arange(T, device=dev)[:, None] - (pos[:, None] - src)  # the source's row if it is in this call
    rc = row.clamp(0, max(T - 1, 0))
    in_call = (row >= 0) & (query_seq.long()[rc] == query_seq.long()[:, None]) & (pos[rc] == src)
    if state_slot.shape[0]:
        srow = state_slot.long()[seq]
    else:
        srow = torch.zeros_like(seq)
    ring = src.clamp(min=0) % R
    skv = state_kv[srow[:, None], ring].to(acc)  # [T, R, Cin]
    sg = state_gate[srow[:, None], ring].to(acc)
    ckv = torch.where(in_call[..., None], kv.to(acc)[rc], skv)
    cg = torch.where(in_call[..., None], gate.to(acc)[rc], sg)
    bias = position_bias.to(acc)
    if overlap:  # sources 0..rate-1: Ca (first C channels) of window w-1; rate..2rate-1: Cb of window w
        first = j[None, :, None] < rate
        ckv = torch.where(first, ckv[..., :C], ckv[..., C:])
        cg = torch.where(first, cg[..., :C] + bias[:, :C].repeat(2, 1)[None], cg[..., C:] + bias[:, C:].repeat(2, 1)[None])
    else:
        cg = cg + bias[None]
    cg = cg.masked_fill((src < 0)[..., None], float("-inf"))
    ckv = torch.where((src < 0)[..., None], 0.0, ckv)
    pooled = (ckv * torch.softmax(cg, dim=1)).sum(dim=1)  # [T, C]
    normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.to(acc)
    freqs = (w * rate).to(acc)[:, None] * inv_freq.to(acc)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    r = 2 * inv_freq.shape[0]
    if r == 0:
        return normed
    nope, rope = normed[:, : C - r], normed[:, C - r:]
    a, b = rope[:, 0::2], rope[:, 1::2]
    return torch.cat([nope, torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)], dim=-1)


def state_targets(query_seq: Tensor, query_pos: Tensor, state_slot: Tensor, R: int) -> Tensor:
    """Flat state rows ``state_slot[b] * R + pos % R`` of the tokens that stay in the ring (each sequence's
    last R tokens of the call), -1 for the others and for padding."""
    T = query_seq.shape[0]
    live = query_seq >= 0
    seq = torch.where(live, query_seq.long(), 0)
    pos = query_pos.long()
    later = torch.arange(T, device=query_seq.device) + R
    lc = later.clamp(max=max(T - 1, 0))
    overwritten = (later < T) & (query_seq.long()[lc] == query_seq.long()) & (pos[lc] == pos + R)
    srow = state_slot.long()[seq] if state_slot.shape[0] else torch.zeros_like(seq)
    return torch.where(live & ~overwritten, srow * R + pos % R, -1)


@torch.library.custom_op("mla::v4_compress_write_ref", mutates_args=("state_kv", "state_gate", "cache"),
                         tags=LAYOUT_TAGS)
def v4_compress_write_ref(kv: Tensor, gate: Tensor, query_seq: Tensor, query_pos: Tensor, state_slot: Tensor,
                          state_kv: Tensor, state_gate: Tensor, position_bias: Tensor, norm_weight: Tensor,
                          inv_freq: Tensor, cache: Tensor, block_table: Tensor, rate: int, eps: float,
                          overlap: bool) -> None:
    """Reference (plain torch, any device, no host sync): every row's would-be entry, written where a window
    closes; then the ring state update."""
    validate(kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate, position_bias, norm_weight,
             inv_freq, cache, block_table, rate, overlap)
    T = kv.shape[0]
    if T == 0:
        return
    R = state_kv.shape[1]
    entries = compress_rows(kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate, position_bias,
                            norm_weight, eps, inv_freq, rate, overlap)
    live = query_seq >= 0
    pos = query_pos.long()
    closes = live & (pos % rate == rate - 1)
    if block_table.shape[0] and block_table.shape[1]:
        seq = torch.where(live, query_seq.long(), 0)
        e = pos // rate
        bs = cache.shape[1]
        blocks = block_table.long()[seq, (e // bs).clamp(0, block_table.shape[1] - 1)]
        slots = torch.where(closes, blocks * bs + e % bs, -1)
        scatter_rows(cache, slots, entries.to(cache.dtype))
    targets = state_targets(query_seq, query_pos, state_slot, R)
    scatter_rows(state_kv, targets, kv.to(state_kv.dtype))
    scatter_rows(state_gate, targets, gate.to(state_gate.dtype))


@v4_compress_write_ref.register_fake
def _(kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate, position_bias, norm_weight, inv_freq,
      cache, block_table, rate, eps, overlap):
    validate(kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate, position_bias, norm_weight,
             inv_freq, cache, block_table, rate, overlap)
    return None


declare(OP, "reference", torch.ops.mla.v4_compress_write_ref, rank=100, devices=("any",), dtypes=FLOATS,
        cache_dtypes=FLOATS, gpu_tested=True, note="plain torch")


def v4_compress_write(kv: Tensor, gate: Tensor, query_seq: Tensor, query_pos: Tensor, state_slot: Tensor,
                      state_kv: Tensor, state_gate: Tensor, position_bias: Tensor, norm_weight: Tensor,
                      inv_freq: Tensor, cache: Tensor, block_table: Tensor, *, rate: int, eps: float,
                      overlap: bool, backend: str | None = None) -> None:
    """Compress this call's tokens into ``cache``; see the module docstring. Mutates ``cache``, ``state_kv``,
    ``state_gate``; returns None."""
    impl = resolve(OP, kv.device, backend, dtype=kv.dtype, cache=cache)
    impl.fn(kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate, position_bias, norm_weight,
            inv_freq, cache, block_table, rate, eps, overlap)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(kv: Tensor, gate: Tensor, query_seq: Tensor, query_pos: Tensor, state_slot: Tensor, state_kv: Tensor,
            state_gate: Tensor, position_bias: Tensor, norm_weight: Tensor, inv_freq: Tensor, cache: Tensor,
            block_table: Tensor, rate: int, eps: float, overlap: bool) -> None:
    import mla_compile.ops.triton.v4_compress  # noqa: F401  (registers mla::v4_compress_write_triton)
    torch.ops.mla.v4_compress_write_triton(kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate,
                                           position_bias, norm_weight, inv_freq, cache, block_table, rate, eps,
                                           overlap)


declare(OP, "triton", _triton, rank=10, available=_triton_available, dtypes=FLOATS, cache_dtypes=FLOATS,
        package="triton", gpu_tested=True,
        kernels=("v4_compress_write_triton", "_compress_entry_kernel", "_state_write_kernel"),
        note="ours; entries then ring state, two launches")
