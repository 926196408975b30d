"""One launch for each boundary of the FlashMLA V4 attention adapter (``ops/adapters/flashmla_v4.py``).

``sparse_indices_triton`` turns one slot list, or two side by side, into FlashMLA's index list, ``topk_length`` and
each row's liveness (what the adapter's torch path does with about a dozen kernels a list).

``v4_finish_triton`` does what the adapter's torch path does with a dozen kernels: merge one or two partial
results ``(out, lse)`` (natural log) over disjoint slot lists, where a part that is not live in a row
contributes nothing whatever it holds there; apply the sink's share ``sigmoid(lse - sink)`` unless the
library already did; rows live in no part get ``out = 0``, ``lse = -inf``; rotate the output's trailing
rope slice back by ``-pos * inv_freq`` (interleaved pairs). Float32 math; writes into given (possibly
strided) ``out [T, h, D]`` and ``lse [T, h]`` views, so each head group of the adapter lands in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mla_compile.ops.triton._common import pow2


@triton.jit
def _sparse_indices_kernel(a_ptr, b_ptr, idx_ptr, len_ptr, live_ptr, LA, LB, LP, n_rows, s_a, s_b,
                           BLOCK: tl.constexpr):
    """Row ``t``: columns ``[0, LA)`` from list a, ``[LA, LA + LB)`` from list b, -1 up to ``LP``; a slot outside
    ``[0, n_rows)`` becomes -1. Stores the ``LP`` indices, the last valid column + 1 and whether there is one."""
    t = tl.program_id(0).to(tl.int64)
    last = tl.zeros([BLOCK], dtype=tl.int32)
    for c0 in range(0, LP, BLOCK):
        col = c0 + tl.arange(0, BLOCK)
        in_a = col < LA
        in_b = (col >= LA) & (col < LA + LB)
        slot = tl.load(a_ptr + t * s_a + col, mask=in_a, other=-1).to(tl.int64)
        slot = tl.where(in_b, tl.load(b_ptr + t * s_b + (col - LA), mask=in_b, other=-1).to(tl.int64), slot)
        valid = (slot >= 0) & (slot < n_rows)
        tl.store(idx_ptr + t * LP + col, tl.where(valid, slot, -1).to(tl.int32), mask=col < LP)
        last = tl.maximum(last, tl.where(valid, col + 1, 0))
    length = tl.max(last, axis=0)
    tl.store(len_ptr + t, length)
    tl.store(live_ptr + t, (length > 0).to(tl.int8))


def sparse_indices_triton(a: Tensor, n_rows: int, b: Tensor | None, padded: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(indices [T, 1, padded] int32, topk_length [T] int32, live [T] bool)`` of the slot lists ``a [T, LA]``
    and ``b [T, LB]`` (None: none) side by side over a cache of ``n_rows`` rows, in one launch: the contract of
    ``flashmla_v4.sparse_indices``, with ``padded`` its padded width (at least ``LA + LB``)."""
    T, la = a.shape
    lb = 0 if b is None else b.shape[1]
    assert padded >= la + lb and a.stride(-1) == 1 and (b is None or b.stride(-1) == 1)
    idx = torch.empty(T, 1, padded, dtype=torch.int32, device=a.device)
    length = torch.empty(T, dtype=torch.int32, device=a.device)
    live = torch.empty(T, dtype=torch.int8, device=a.device)
    if T:
        _sparse_indices_kernel[(T,)](a, a if b is None else b, idx, length, live, la, lb, padded, n_rows,
                                     a.stride(0), 0 if b is None else b.stride(0), BLOCK=128, num_warps=4)
    return idx, length, live.view(torch.bool)


@triton.jit
def _load_part(o_ptr, l_ptr, live_ptr, t, heads, h_ok, offs_n, offs_r, n_ok, r_ok, s_ot, s_oh, s_lt, s_lh,
               DN: tl.constexpr):
    """One part's (lse, nope tile, even rope tile, odd rope tile) of row ``t``; zeros / -inf when not live."""
    live = tl.load(live_ptr + t) != 0
    hm = h_ok & live
    lse = tl.load(l_ptr + t * s_lt + heads * s_lh, mask=hm, other=float("-inf")).to(tl.float32)
    row = o_ptr + t * s_ot + heads.to(tl.int64) * s_oh
    o_n = tl.load(row[:, None] + offs_n[None, :], mask=hm[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    o_e = tl.load(row[:, None] + DN + 2 * offs_r[None, :], mask=hm[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    o_o = tl.load(row[:, None] + DN + 2 * offs_r[None, :] + 1, mask=hm[:, None] & r_ok[None, :],
                  other=0.0).to(tl.float32)
    return lse, o_n, o_e, o_o


@triton.jit
def _v4_finish_kernel(oa_ptr, la_ptr, live_a_ptr, ob_ptr, lb_ptr, live_b_ptr, sink_ptr, pos_ptr, freq_ptr, out_ptr,
                      lse_ptr, H, s_oa_t, s_oa_h, s_la_t, s_la_h, s_ob_t, s_ob_h, s_lb_t, s_lb_h, s_out_t, s_out_h,
                      s_lse_t, s_lse_h,
                      TWO: tl.constexpr, SINK: tl.constexpr, DN: tl.constexpr, R2: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R2: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_n = tl.arange(0, BLOCK_DN)
    offs_r = tl.arange(0, BLOCK_R2)
    n_ok = offs_n < DN
    r_ok = offs_r < R2
    la, a_n, a_e, a_o = _load_part(oa_ptr, la_ptr, live_a_ptr, t, heads, h_ok, offs_n, offs_r, n_ok, r_ok, s_oa_t,
                                   s_oa_h, s_la_t, s_la_h, DN)
    if TWO:
        lb, b_n, b_e, b_o = _load_part(ob_ptr, lb_ptr, live_b_ptr, t, heads, h_ok, offs_n, offs_r, n_ok, r_ok,
                                       s_ob_t, s_ob_h, s_lb_t, s_lb_h, DN)
        m = tl.maximum(la, lb)
        shift = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - shift)
        wb = tl.exp(lb - shift)
        total = wa + wb
        some = total > 0.0
        lse = tl.where(some, shift + tl.log(tl.where(some, total, 1.0)), float("-inf"))
        fa = tl.where(some, wa / tl.where(some, total, 1.0), 0.0)
        fb = tl.where(some, wb / tl.where(some, total, 1.0), 0.0)
    else:
        lse = la
        fa = tl.where(la == float("-inf"), 0.0, 1.0)
        fb = fa
    if SINK:
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
        empty = lse == float("-inf")
        share = tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse))))
        fa = fa * share
        fb = fb * share
    out_n = a_n * fa[:, None]
    e = a_e * fa[:, None]
    o = a_o * fa[:, None]
    if TWO:
        out_n += b_n * fb[:, None]
        e += b_e * fb[:, None]
        o += b_o * fb[:, None]
    pos = tl.load(pos_ptr + t).to(tl.float32)
    ang = pos * tl.load(freq_ptr + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    c, s = tl.cos(ang)[None, :], tl.sin(ang)[None, :]
    out_e = e * c + o * s  # rotation by -angle: (a, b) -> (a cos + b sin, b cos - a sin)
    out_o = o * c - e * s
    row = out_ptr + t * s_out_t + heads.to(tl.int64) * s_out_h
    ty = out_ptr.dtype.element_ty
    tl.store(row[:, None] + offs_n[None, :], out_n.to(ty), mask=h_ok[:, None] & n_ok[None, :])
    tl.store(row[:, None] + DN + 2 * offs_r[None, :], out_e.to(ty), mask=h_ok[:, None] & r_ok[None, :])
    tl.store(row[:, None] + DN + 2 * offs_r[None, :] + 1, out_o.to(ty), mask=h_ok[:, None] & r_ok[None, :])
    tl.store(lse_ptr + t * s_lse_t + heads * s_lse_h, lse, mask=h_ok)


def v4_finish_triton(parts: list[tuple[Tensor, Tensor, Tensor]], sinks: Tensor, sink_applied: bool, query_pos: Tensor,
                     inv_freq: Tensor, out: Tensor, lse: Tensor) -> None:
    """Write the finished result of ``parts`` (one or two ``(out [T, h, D], lse [T, h] natural log, live [T] bool)``,
    any strides with a contiguous last dim) into ``out [T, h, D]`` and ``lse [T, h]`` float32 (views that may
    be strided); ``sinks [h]``; ``query_pos [T]``; ``inv_freq [rope_dim / 2]``."""
    T, h, D = out.shape
    if T * h == 0:
        return
    assert len(parts) in (1, 2) and out.stride(-1) == 1 and all(p[0].stride(-1) == 1 for p in parts)
    (oa, la, live_a), (ob, lb, live_b) = parts[0], parts[-1]
    live_a, live_b = live_a.view(torch.int8), live_b.view(torch.int8)  # bool bytes read as int8: no copy
    r2 = inv_freq.shape[0]
    dn = D - 2 * r2
    block_h = min(8, pow2(h, low=1))
    _v4_finish_kernel[(T, triton.cdiv(h, block_h))](
        oa, la, live_a, ob, lb, live_b, sinks.float().contiguous(), query_pos.contiguous(), inv_freq.contiguous(),
        out, lse, h, oa.stride(0), oa.stride(1), la.stride(0), la.stride(1), ob.stride(0), ob.stride(1),
        lb.stride(0), lb.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        TWO=len(parts) == 2, SINK=not sink_applied, DN=dn, R2=r2, BLOCK_H=block_h, BLOCK_DN=pow2(dn, low=1),
        BLOCK_R2=pow2(r2, low=1), num_warps=4)
