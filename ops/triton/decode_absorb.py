"""``mla::decode_absorb_out``'s kernels: a split-KV decode's partials merged and multiplied by ``W_UV`` in one launch.

The split kernel is ``mla::decode``'s own (``decode.split_launch``: the Triton one; ``decode_gluon.split_launch``: the
sm_90 Gluon one), unchanged: it leaves each query row's normalized partial outputs and base-2 LSEs
(``decode.Split``). ``_reduce_absorb_kernel`` then takes the place of the split merge (``decode._decode_reduce_kernel``)
and of ``mla::absorb_out``'s GEMV: grid ``(H, cdiv(V, BLOCK_V))``, program ``(h, j)`` holds ``W_UV[h, j * BLOCK_V :
(j + 1) * BLOCK_V, :]`` (requested before its PDL wait: no kernel of the step writes it) and, for each of the call's
(at most ``ROWS``) tokens, merges that token's head-``h`` row from the partials (``decode.merge_splits``, all of its
``DC`` columns, in float32) and stores the row times the tile: ``BLOCK_V`` outputs. Each program merges its rows
again (``cdiv(V, BLOCK_V)`` times a row in all, from L2), so the merged latent row is never written; where the split
kernel ran one split (``DIRECT``) the row is read from its output. Launched with PDL on sm_90 (``_pdl.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops.decode_absorb_out import MAX_ROWS, fake, validate
from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.triton._common import last_dim_contiguous, pow2, split_count
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait
from mla_compile.ops.triton.decode import REDUCE, Split, merge_splits

# ``block_v``: value rows of W_UV a program (its tile ``[block_v, DC]`` stays in registers); ``num_warps``. A
# benchmark may swap them; timings in BENCHMARKS.md.
ABSORB = dict(block_v=32, num_warps=8)


@triton.jit
def _reduce_absorb_kernel(ws_ptr, wl_ptr, w_ptr, out_ptr, T, H, V, n_splits, split_cap, s_wh, s_wv, s_o,
                          DC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK_S: tl.constexpr,
                          ROWS: tl.constexpr, DIRECT: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    """See the module docstring. ``ws_ptr``/``wl_ptr``: the partials and base-2 LSEs (``DIRECT``: the split kernel's
    output rows ``[T * H, DC]`` of out's dtype, no LSE read); token ``t``'s head-``h`` row is ``t * H + h``."""
    h = tl.program_id(0)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < DC
    w = tl.load(w_ptr + h.to(tl.int64) * s_wh + v[:, None].to(tl.int64) * s_wv + offs_c[None, :],
                mask=v_ok[:, None] & c_ok[None, :], other=0.0)
    pdl_wait(PDL)  # W_UV's tile is in flight before the partials, the split kernel's outputs, are read
    pdl_launch_dependents(PDL)
    offs_s = tl.arange(0, CHUNK_S)
    n_used = split_count(n_splits, split_cap)
    for t in tl.static_range(ROWS):
        live = t < T
        row = tl.where(live, t * H + h, h).to(tl.int64)  # a token past T merges token 0's row again, never stored
        if DIRECT:
            lat = tl.load(ws_ptr + row * DC + offs_c, mask=c_ok, other=0.0).to(tl.float32)
        else:
            acc, tot, _ = merge_splits(ws_ptr, wl_ptr, row, n_splits, n_used, offs_s, offs_c, c_ok, DC, CHUNK_S,
                                       BLOCK_C, ONE_PASS)
            lat = acc / tl.where(tot == 0.0, 1.0, tot)  # no key: acc is 0, so is the row
        y = tl.sum(w.to(tl.float32) * lat[None, :], axis=1)
        tl.store(out_ptr + t * s_o + h * V + v, y.to(out_ptr.dtype.element_ty), mask=v_ok & live)


def reduce_absorb(part: Split, w_uv: Tensor, T: int) -> Tensor:
    """``[T, H * V]`` of the split launch ``part``'s rows (``T`` tokens of ``H`` heads, at most ``MAX_ROWS``)
    merged and multiplied by ``w_uv [H, V, DC]`` (the interpreter on CPU tensors too)."""
    H, V, DC = w_uv.shape
    assert T <= MAX_ROWS, T
    out = torch.empty(T, H * V, dtype=part.out.dtype, device=part.out.device)
    if T == 0 or H * V == 0:
        return out
    w_uv = last_dim_contiguous(w_uv)
    block_c = pow2(DC)
    ws, wl = (part.out, part.lse) if part.direct else (part.o_buf, part.l_buf)
    wrap_triton(_reduce_absorb_kernel)[(H, triton.cdiv(V, ABSORB["block_v"]))](
        ws, wl, w_uv, out, T, H, V, part.splits, part.split_cap, w_uv.stride(0), w_uv.stride(1), out.stride(0),
        DC=DC, BLOCK_C=block_c, BLOCK_V=ABSORB["block_v"], CHUNK_S=max(1, min(64, REDUCE["tile"] // block_c)),
        ROWS=MAX_ROWS, DIRECT=part.direct, ONE_PASS=REDUCE["one_pass"], num_warps=ABSORB["num_warps"],
        **launch_kwargs(out.device, DC > 0),
    )
    return out


def _kernel_serves(q: Tensor) -> bool:
    return (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[0] * q.shape[1] <= MAX_ROWS)


def launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
           w_uv: Tensor, split: str, config: dict | None = None) -> Tensor:
    """The fused path for at most ``MAX_ROWS`` query rows (the interpreter on CPU tensors too, ``split="triton"``):
    the split kernel (``split``: "triton", or "gluon" where ``decode_gluon.eligible``; ``config``: its launch
    settings, e.g. ``{"SPLITS": 3}``), then :func:`reduce_absorb`."""
    B, s_q = q.shape[:2]
    if split == "gluon":
        from mla_compile.ops.triton import decode_gluon

        part = decode_gluon.split_launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, config)
    else:
        from mla_compile.ops.triton import decode

        part = decode.split_launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, config)
    return reduce_absorb(part, w_uv, B * s_q)


def _run(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv, split: str) -> Tensor:
    """A backend's body: :func:`launch` where the fused path serves (Gluon's split kernel only where
    ``decode_gluon.eligible``, else Triton's); else the reference off CUDA, or that backend's ``mla::decode`` and
    ``mla::absorb_out`` (its skinny GEMV where it serves)."""
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank, w_uv)
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return torch.ops.mla.decode_absorb_out_ref(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv)
    if split == "gluon":
        from mla_compile.ops.triton import decode_gluon

        if not decode_gluon.eligible(q, kv_cache, kv_lora_rank):
            split = "triton"
    if _kernel_serves(q):
        return launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv, split)
    import mla_compile.ops.triton.skinny_absorb  # noqa: F401  (registers mla::skinny_absorb_out_triton)
    decode_op = torch.ops.mla.decode_gluon if split == "gluon" else torch.ops.mla.decode_triton
    out, _ = decode_op(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return torch.ops.mla.skinny_absorb_out_triton(out.flatten(0, 1), w_uv)


@torch.library.custom_op("mla::decode_absorb_out_triton", mutates_args=(), tags=LAYOUT_TAGS)
def decode_absorb_out_triton(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                             kv_lora_rank: int, w_uv: Tensor) -> Tensor:
    """Triton ``mla::decode_absorb_out`` (contract of the ``_ref`` op): :func:`_run` with ``mla::decode``'s Triton
    split kernel."""
    return _run(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv, "triton")


@torch.library.custom_op("mla::decode_absorb_out_gluon", mutates_args=(), tags=LAYOUT_TAGS)
def decode_absorb_out_gluon(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                            kv_lora_rank: int, w_uv: Tensor) -> Tensor:
    """Gluon ``mla::decode_absorb_out`` (contract of the ``_ref`` op): :func:`_run` with ``mla::decode``'s Gluon
    split kernel (sm_90 bf16, the swapped kernel at these few rows; else Triton's)."""
    return _run(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv, "gluon")


decode_absorb_out_triton.register_fake(fake)
decode_absorb_out_gluon.register_fake(fake)
