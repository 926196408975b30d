"""Triton varlen flash-attention forward for ``mla::prefill`` with TMA tiles (sm_90): ``mla::prefill_triton_tma``.

Same contract and program layout as :mod:`mla_compile.ops.triton.prefill` (a program per query block of
``BLOCK_M`` rows and head, its sequence found on the device; causal: unmasked key tiles first, then the
diagonal ones with the bottom-right mask; base-2 softmax with the scale folded into ``log2 e``; the
longest causal blocks start first). What differs: q, k and v tiles come through host-made TMA
descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``) over 2-D views ``[rows, heads' columns]``
of the ragged tensors, so the loads are ``cp.async.bulk.tensor`` into swizzled shared memory feeding
``wgmma`` directly, with no address arithmetic in the loop. ``HEADS_FIRST`` orders the grid heads-fastest,
so every head's longest causal blocks start before any head's short ones.

The unmasked key tiles run first in their own loop, then the diagonal ones. (No warp-specialized
variant: Triton 3.6's automatic warp specialization of this loop hangs on the H200, BENCHMARKS.md run 134;
the warp-specialized prefill is the Gluon one, ``prefill_gluon``.)

A query tile may run past its sequence (TMA bounds are the whole tensor's): those rows are never stored.
A key tile that would run past its sequence is loaded ending at the sequence's last key instead (see
``_masked_tile``), so rows past ``cu_seqlens_k[-1]`` (padding, maybe NaN) are never read.

Served where :func:`eligible`: CUDA, bf16/fp16, qk dim = a power of two (>= 16) plus nothing or a power
of two (>= 16), v dim a power of two (>= 16), 16-byte aligned bases and row strides; elsewhere the op
runs ``mla::prefill_triton``. The launch is a plain call inside an opaque custom op (host-made
descriptors are no ``wrap_triton`` arguments).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mla_compile.ops.prefill import fake, validate
from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.triton._common import causal_bounds, online_softmax_step, prefill_outputs, tiles_started

_LOG2E = 1.4426950408889634
# The default launch (see ``config_name``); the autotune candidates are ``lowerings/prefill.py:TMA_CONFIGS``.
DEFAULT = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, HEADS_FIRST=False)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def split_dims(dqk: int) -> tuple[int, int] | None:
    """``(DA, DB)``: the qk dim as a power-of-two tile and a power-of-two remainder (0 when none), or None."""
    da = 1 << (dqk.bit_length() - 1)
    db = dqk - da
    return (da, db) if _pow2(da) and (db == 0 or _pow2(db)) else None


def eligible(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the TMA kernel serves these tensors (see the module docstring); the checks read no data."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    if split_dims(q.shape[-1]) is None or not _pow2(v.shape[-1]):
        return False
    for t in (q, k, v):
        if t.shape[0] == 0 or t.stride(-1) != 1 or t.data_ptr() % 16 or (t.stride(0) * 2) % 16 \
                or (t.stride(1) * 2) % 16:
            return False
    return True


def _view2d(t: Tensor) -> Tensor:
    """``t [rows, H, D]`` (unit last stride) as ``[rows, (H - 1) * stride_h + D]`` over the same memory:
    head ``h``'s columns start at ``h * stride_h``."""
    rows, H, D = t.shape
    return t.as_strided((rows, (H - 1) * t.stride(1) + D), (t.stride(0), 1))


@triton.jit
def _masked_tile(q_a, q_b, ka_desc, kb_desc, v_desc, n0, k_start, len_k, col_k, col_v, offs_m, off, m_i, l_i, acc,
                 scale_log2, DA: tl.constexpr, DB: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The online-softmax step of key tile ``n0`` with its columns masked: ones before ``n0`` and, causal, past
    each row's diagonal. A tile that would run past the sequence is loaded ending at its last key instead
    (starting at ``k_start + len_k - BLOCK_N``, rows before it masked), so no row past ``cu_seqlens_k[-1]``
    (padding, maybe NaN: ``0 * NaN`` would reach the output) is read; rows of the sequences before it are finite
    and masked, and rows before the tensor's first (a negative coordinate) read as zero."""
    kr = tl.minimum(k_start + n0, k_start + len_k - BLOCK_N)
    n = kr - k_start + tl.arange(0, BLOCK_N)
    s = tl.dot(q_a, ka_desc.load([kr, col_k]).T)
    if DB > 0:
        s = tl.dot(q_b, kb_desc.load([kr, col_k + DA]).T, s)
    v = v_desc.load([kr, col_v])
    if CAUSAL:  # one compare a score: columns before n0 get a bound no row reaches
        visible = tl.where(n >= n0, n, 1 << 30)[None, :] <= (offs_m + off)[:, None]
    else:
        visible = (n >= n0)[None, :]
    s = tl.where(visible, s * scale_log2, float("-inf"))
    return online_softmax_step(s, m_i, l_i, acc, v, True, False)


@triton.jit
def _prefill_tma_kernel(
    qa_desc, qb_desc, ka_desc, kb_desc, v_desc, cu_q_ptr, cu_k_ptr, o_ptr, lse_ptr,
    scale_log2, n_seq, T, H, n_slots, stride_qh, stride_kh, stride_vh,
    DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HEADS_FIRST: tl.constexpr, CHUNK: tl.constexpr,
):
    if HEADS_FIRST:
        h = tl.program_id(0)
        slot = n_slots - 1 - tl.program_id(1)
    else:
        slot = n_slots - 1 - tl.program_id(0)
        h = tl.program_id(1)
    scale_log2 = tl.full([], scale_log2, tl.float32)
    seq = -1
    for c in range(0, n_seq + 1, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        seq += tiles_started(tl.load(cu_q_ptr + idx, mask=idx <= n_seq, other=0), idx, n_seq, slot, BLOCK_M)
    # No early exits: a padding
    # program (seq == n_seq) owns rows up to T and no key; a slot past its sequence's rows runs no tile.
    live = seq < n_seq
    q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
    len_q = tl.load(cu_q_ptr + seq + 1, mask=live, other=T).to(tl.int32) - q_start
    k_start = tl.load(cu_k_ptr + seq, mask=live, other=0).to(tl.int32)
    len_k = tl.load(cu_k_ptr + seq + 1, mask=live, other=0).to(tl.int32) - k_start
    m0 = (slot - (q_start // BLOCK_M + seq)) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, DV)
    rows = (q_start + offs_m).to(tl.int64)
    off = len_k - len_q  # bottom-right alignment: local query j sees local keys <= j + off
    m_ok = offs_m < len_q
    len_k = tl.where(m0 < len_q, len_k, 0)
    q_row = q_start + m0
    q_a = qa_desc.load([q_row, h * stride_qh])
    q_b = q_a  # unused when DB == 0
    if DB > 0:
        q_b = qb_desc.load([q_row, h * stride_qh + DA])
    col_k = h * stride_kh
    col_v = h * stride_vh

    hi, full_end = causal_bounds(m0, off, len_k, BLOCK_M, BLOCK_N, CAUSAL)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)

    for n0 in tl.range(0, full_end, BLOCK_N):  # key tiles every row of the block sees: no mask
        kr = k_start + n0
        s = tl.dot(q_a, ka_desc.load([kr, col_k]).T)
        if DB > 0:
            s = tl.dot(q_b, kb_desc.load([kr, col_k + DA]).T, s)
        v = v_desc.load([kr, col_v])
        m_i, l_i, acc = online_softmax_step(s * scale_log2, m_i, l_i, acc, v, False, False)
    for n0 in tl.range(full_end, hi, BLOCK_N):  # diagonal (causal) and tail (length) tiles
        m_i, l_i, acc = _masked_tile(q_a, q_b, ka_desc, kb_desc, v_desc, n0, k_start, len_k, col_k, col_v,
                                     offs_m, off, m_i, l_i, acc, scale_log2, DA, DB, BLOCK_N, CAUSAL)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_rows = o_ptr + (rows * H + h)[:, None] * DV + offs_v[None, :]
    tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])
    tl.store(lse_ptr + rows * H + h, lse, mask=m_ok)


def config_name(cfg: dict) -> str:
    """A short name of a launch configuration, e.g. ``tma_m128_n128_w8_s2_hf``."""
    c = {**DEFAULT, **cfg}
    return (f"tma_m{c['BLOCK_M']}_n{c['BLOCK_N']}_w{c['num_warps']}_s{c['num_stages']}"
            + ("_hf" if c["HEADS_FIRST"] else ""))


def launch(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
           causal: bool, config: dict | None = None) -> tuple[Tensor, Tensor]:
    """The TMA kernel (the interpreter on CPU tensors too; callers check :func:`eligible` on CUDA).
    ``config``: any of :data:`DEFAULT`'s keys."""
    cfg = {**DEFAULT, **(config or {})}
    T, H, dqk = q.shape
    dv = v.shape[-1]
    out, lse = prefill_outputs(q, v)
    if T == 0 or H == 0:
        return out, lse
    from triton.tools.tensor_descriptor import TensorDescriptor

    da, db = split_dims(dqk)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if k.shape[0] == 0:  # no key rows at all: descriptors need a row; every row's output is empty anyway
        k, v = k.new_zeros(1, H, dqk), v.new_zeros(1, H, dv)
    q2, k2, v2 = _view2d(q), _view2d(k), _view2d(v)
    qa = TensorDescriptor.from_tensor(q2, [bm, da])
    qb = TensorDescriptor.from_tensor(q2, [bm, max(db, 16)])
    ka = TensorDescriptor.from_tensor(k2, [bn, da])
    kb = TensorDescriptor.from_tensor(k2, [bn, max(db, 16)])
    vd = TensorDescriptor.from_tensor(v2, [bn, dv])
    n_seq = cu_seqlens_q.shape[0] - 1
    n_slots = triton.cdiv(T, bm) + n_seq
    grid = (H, n_slots) if cfg["HEADS_FIRST"] else (n_slots, H)
    _prefill_tma_kernel[grid](
        qa, qb, ka, kb, vd, cu_seqlens_q, cu_seqlens_k, out, lse,
        scale * _LOG2E, n_seq, T, H, n_slots, q.stride(1), k.stride(1), v.stride(1),
        DA=da, DB=db, DV=dv, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=bool(causal),
        HEADS_FIRST=bool(cfg["HEADS_FIRST"]), CHUNK=128, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def run(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float, causal: bool,
        config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Validate, then :func:`launch` where :func:`eligible`, else ``mla::prefill_triton``."""
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    if eligible(q, k, v):
        return launch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, config)
    import mla_compile.ops.triton.prefill  # noqa: F401  (registers mla::prefill_triton)
    return torch.ops.mla.prefill_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


@torch.library.custom_op("mla::prefill_triton_tma", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_triton_tma(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                       causal: bool) -> tuple[Tensor, Tensor]:
    """TMA Triton ``mla::prefill`` (same contract as ``mla::prefill_ref``; an opaque call to Inductor) with
    :data:`DEFAULT`'s launch; see :func:`run`."""
    return run(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


prefill_triton_tma.register_fake(fake)
