"""``mla::decode_absorb_out``'s kernels: a split-KV decode's partials merged and multiplied by ``W_UV`` in one launch.

The split kernel is ``mla::decode``'s own (``decode.split_launch``: the Triton one; ``decode_gluon.split_launch``: the
sm_90 Gluon one), unchanged: it leaves each query row's normalized partial outputs and base-2 LSEs
(``decode.Split``). ``_reduce_absorb_kernel`` then takes the place of the split merge (``decode._decode_reduce_kernel``)
and of ``mla::absorb_out``'s GEMV, split over the latent columns: grid ``(H, cdiv(DC, BLOCK_C))``, program ``(h, c)``
holds ``W_UV[h, :, c * BLOCK_C : (c + 1) * BLOCK_C]`` (requested before its PDL wait: no kernel of the step writes
it) and, for each of the call's ``T`` tokens (an unrolled loop of ``ROWS``, T rounded up to a power of two), merges
columns ``c`` of that token's head-``h`` row from the partials (``decode.merge_splits``, in float32; where the split
kernel ran one split, ``DIRECT``, it reads the split kernel's output row) and stores the column slice's share of the
row times ``W_UV[h]``: ``V`` float32 sums in a scratch ``[cdiv(DC, BLOCK_C), ROWS, H, BLOCK_V]``. So every partial is read once, by one program. Each program then
counts itself in on head ``h``'s arrival counter (a barrier of its threads, then one acquire-release atomic at GPU
scope, as ``mla::moe_gate_route``'s kernel does); the head's last program adds the column slices' shares in a fixed
order (the result does not depend on which program came last), stores the head's ``V`` outputs of each token and
puts the counter back to 0 for the next call. The counters are a persistent zeroed buffer per device
(:func:`~mla_compile.ops._workspace.workspace`, allocated by the first call: a warm-up before any CUDA-graph capture),
so calls on one device must not run concurrently on two streams. Launched with PDL on sm_90 (``_pdl.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops._workspace import workspace
from mla_compile.ops.decode_absorb_out import MAX_ROWS, fake, validate
from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.triton._common import last_dim_contiguous, pow2, split_count
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait
from mla_compile.ops.triton.decode import REDUCE, Split, merge_splits

# ``block_c``: latent columns a program merges (its W_UV tile is ``[V, block_c]``, in registers); ``num_warps``;
# ``splits``: the split kernel's split count (None: its own plan). A benchmark may swap them; timings in BENCHMARKS.md.
ABSORB = dict(block_c=64, num_warps=4, splits=None)
MAX_HEADS = 1024  # heads the arrival counters cover (one int32 each; a fixed size, so the buffer is never replaced)


@triton.jit
def _reduce_absorb_kernel(ws_ptr, wl_ptr, w_ptr, y_ptr, count_ptr, out_ptr, T, H, V, n_splits, split_cap, s_wh,
                          s_wv, s_o, DC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCK_N: tl.constexpr, CHUNK_S: tl.constexpr, ROWS: tl.constexpr, DIRECT: tl.constexpr,
                          ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    """See the module docstring. ``ws_ptr``/``wl_ptr``: the partials and base-2 LSEs (``DIRECT``: the split kernel's
    output rows ``[T * H, DC]`` of out's dtype, no LSE read); token ``t``'s head-``h`` row is ``t * H + h``.
    ``y_ptr``: the float32 scratch ``[n_c, ROWS, H, BLOCK_V]`` (``n_c`` the grid's column slices, at most
    ``BLOCK_N``); ``count_ptr``: ``[H]`` int32 counters, 0 on entry and on exit."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    n_c = tl.num_programs(1)
    offs_v = tl.arange(0, BLOCK_V)
    v_ok = offs_v < V
    offs_c = c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < DC
    w = tl.load(w_ptr + h.to(tl.int64) * s_wh + offs_v[:, None].to(tl.int64) * s_wv + offs_c[None, :],
                mask=v_ok[:, None] & c_ok[None, :], other=0.0)
    pdl_wait(PDL)  # W_UV's tile is in flight before the partials, the split kernel's outputs, are read
    pdl_launch_dependents(PDL)
    offs_s = tl.arange(0, CHUNK_S)
    n_used = split_count(n_splits, split_cap)
    for t in tl.static_range(ROWS):
        if t < T:
            row = (t * H + h).to(tl.int64)
            if DIRECT:
                lat = tl.load(ws_ptr + row * DC + offs_c, mask=c_ok, other=0.0).to(tl.float32)
            else:
                acc, tot, _ = merge_splits(ws_ptr, wl_ptr, row, n_splits, n_used, offs_s, offs_c, c_ok, DC, CHUNK_S,
                                           BLOCK_C, ONE_PASS)
                lat = acc / tl.where(tot == 0.0, 1.0, tot)  # no key: acc is 0, so is the row
            share = tl.sum(w.to(tl.float32) * lat[None, :], axis=1)
            tl.store(y_ptr + ((c * ROWS + t) * H + h).to(tl.int64) * BLOCK_V + offs_v, share)
    tl.debug_barrier()  # every thread's shares stored before the program counts itself in (release, GPU scope)
    arrived = tl.atomic_add(count_ptr + h, 1, sem="acq_rel", scope="gpu")
    if arrived == n_c - 1:  # the head's last program: every slice's shares are visible
        tl.atomic_xchg(count_ptr + h, 0, sem="relaxed", scope="gpu")  # zero again for the next call (stream order)
        offs_n = tl.arange(0, BLOCK_N)
        for t in tl.static_range(ROWS):
            if t < T:
                parts = tl.load(y_ptr + ((offs_n[:, None] * ROWS + t) * H + h).to(tl.int64) * BLOCK_V
                                + offs_v[None, :], mask=(offs_n < n_c)[:, None], other=0.0, volatile=True)
                tl.store(out_ptr + t * s_o + h * V + offs_v, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty),
                         mask=v_ok)


def reduce_absorb(part: Split, w_uv: Tensor, T: int) -> Tensor:
    """``[T, H * V]`` of the split launch ``part``'s rows (``T`` tokens of ``H`` heads, at most ``MAX_ROWS`` tokens
    and ``MAX_HEADS`` heads) merged and multiplied by ``w_uv [H, V, DC]`` (the interpreter on CPU tensors too)."""
    H, V, DC = w_uv.shape
    assert T <= MAX_ROWS and H <= MAX_HEADS, (T, H)
    out = torch.empty(T, H * V, dtype=part.out.dtype, device=part.out.device)
    if T == 0 or H * V == 0:
        return out
    w_uv = last_dim_contiguous(w_uv)
    block_c = min(ABSORB["block_c"], pow2(DC))
    n_c, block_v = triton.cdiv(DC, block_c), pow2(V)
    rows = triton.next_power_of_2(T)  # the kernel's unrolled row loop: 1, 2, 4 or 8 (T <= MAX_ROWS)
    shares = torch.empty(n_c * rows * H * block_v, dtype=torch.float32, device=out.device)
    count = workspace("decode_absorb-arrivals", out.device, 4 * MAX_HEADS, zero=True).view(torch.int32)
    ws, wl = (part.out, part.lse) if part.direct else (part.o_buf, part.l_buf)
    wrap_triton(_reduce_absorb_kernel)[(H, n_c)](
        ws, wl, w_uv, shares, count, out, T, H, V, part.splits, part.split_cap, w_uv.stride(0), w_uv.stride(1),
        out.stride(0), DC=DC, BLOCK_C=block_c, BLOCK_V=block_v, BLOCK_N=pow2(n_c),
        CHUNK_S=max(1, min(64, REDUCE["tile"] // block_c)), ROWS=rows, DIRECT=part.direct,
        ONE_PASS=REDUCE["one_pass"], num_warps=ABSORB["num_warps"], **launch_kwargs(out.device, DC > 0),
    )
    return out


def _kernel_serves(q: Tensor) -> bool:
    return (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[0] * q.shape[1] <= MAX_ROWS and q.shape[2] <= MAX_HEADS)


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
        config = None if ABSORB["splits"] is None else {"SPLITS": ABSORB["splits"]}
        return launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv, split, config)
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
