"""``mla::decode_absorb_out``: the absorbed decode over the paged latent cache and the ``W_UV`` up-projection of its
output, in one op.

Contract. ``q [B, s_q, H, kv_lora_rank + rope_dim]``, the paged ``kv_cache``, ``block_table``, ``seq_lens``, ``scale``
and ``kv_lora_rank`` as ``mla::decode`` (:mod:`mla_compile.ops.decode`), and ``w_uv [H, V, kv_lora_rank]`` of q's dtype
(``kv_b_proj``'s value rows, any strides) give ``[B * s_q, H * V]`` of q's dtype: ``mla::absorb_out`` of
``mla::decode``'s output, token-major as ``o_proj`` reads it. Rows that see no key give 0. A backend may keep the
latent output in float32 between the two (no rounding to q's dtype); the LSE is not returned.

Backends: "reference" (``mla::decode_ref``, then ``mla::absorb_out``, any device), "triton" and "gluon" (ours, CUDA
half precision, for up to :data:`MAX_ROWS` query rows ``B * s_q``: ``mla::decode``'s split-KV kernel of that name
writes its partials, then one launch merges each row's splits and multiplies the merged row by its head's ``W_UV``,
its programs split over heads and latent columns, the head's last program adding the column slices' shares
(``ops/triton/decode_absorb.py``): the split merge's launch and the latent row's round trip through memory gone;
more rows: the two ops inside). GPU-tested, but slower than the two ops apart (BENCHMARKS.md run 228), so "auto"
skips the kernels (:data:`SLOWER`) and takes the reference, and the model takes one only by name
(``patch(..., backend="decode_absorb_out=gluon")``); were "auto" to take a kernel, the model would fold its decode into
this op only where the layer's own decode choice is that kernel (``MLAAttention._decode_absorb_backend``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import check_same_device, check_tensor
from mla_compile.ops.decode import validate as validate_decode
from mla_compile.ops.registry import FLOATS, HALF, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("decode_absorb_out", "mla.decode_absorb_out")
MAX_ROWS = 8  # query rows (B * s_q) the fused launch serves: decode steps of up to 8 sequences (1 padded to 2)


def validate(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, kv_lora_rank: int,
             w_uv: Tensor) -> None:
    """Shape/dtype checks (no sync): ``mla::decode``'s, then ``w_uv``'s."""
    validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    H = q.shape[2]
    check_tensor(OP, "w_uv", w_uv, ndim=3, dtypes=(q.dtype,), shape=(H, None, kv_lora_rank),
                 expected=f"[{H}, v_head_dim, {kv_lora_rank}] {q.dtype} (q's heads, kv_lora_rank and dtype)")
    check_same_device(OP, q=q, w_uv=w_uv)


@torch.library.custom_op("mla::decode_absorb_out_ref", mutates_args=(), tags=LAYOUT_TAGS)
def decode_absorb_out_ref(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                          kv_lora_rank: int, w_uv: Tensor) -> Tensor:
    """Reference (plain torch, any device): ``mla::decode_ref``, then ``mla::absorb_out``."""
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank, w_uv)
    out, _ = torch.ops.mla.decode_ref(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return torch.ops.mla.absorb_out(out.flatten(0, 1), w_uv)


def fake(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv):
    """Fake output shared by every implementation: ``[B * s_q, H * V]`` of q's dtype."""
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank, w_uv)
    B, s_q, H, _ = q.shape
    return q.new_empty(B * s_q, H * w_uv.shape[1])


decode_absorb_out_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.decode_absorb_out_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="mla::decode_ref, then mla::absorb_out")


def decode_absorb_out(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, *,
                      kv_lora_rank: int, w_uv: Tensor, backend: str | None = None) -> Tensor:
    """``mla::absorb_out(mla::decode(q, ...)[0], w_uv)``: ``[B * s_q, H * V]``; see the module docstring.
    ``backend``: None/"auto", "reference", "triton" or "gluon"."""
    impl = resolve(OP, q.device, backend, dtype=q.dtype)
    return impl.fn(q, kv_cache, block_table, seq_lens, float(scale), int(kv_lora_rank), w_uv)


# Triton backends: their module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv):
    import mla_compile.ops.triton.decode_absorb  # noqa: F401  (registers mla::decode_absorb_out_triton)
    return torch.ops.mla.decode_absorb_out_triton(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv)


def _gluon(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv):
    import mla_compile.ops.triton.decode_absorb  # noqa: F401  (registers mla::decode_absorb_out_gluon)
    return torch.ops.mla.decode_absorb_out_gluon(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, w_uv)


# why "auto" passes over the kernels: measured slower than mla::decode and mla::absorb_out apart
SLOWER = ("slower than mla::decode and absorb_out apart (BENCHMARKS.md run 228): 'auto' skips it, ask for it by "
          "name")
declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=HALF, package="triton", gpu_tested=True,
        auto_skip=SLOWER,
        kernels=("decode_absorb_out_triton", "_reduce_absorb_kernel"),
        note=f"ours: mla::decode's Triton split kernel, then the split merge and W_UV in one launch (up to "
             f"{MAX_ROWS} query rows)")
declare(OP, "gluon", _gluon, rank=40, available=_triton_available, dtypes=HALF, package="triton",
        gpu_tested=True, auto_skip=SLOWER, kernels=("decode_absorb_out_gluon",),
        note=f"ours: mla::decode's Gluon split kernel (sm_90 bf16; else the Triton one), then the split merge and W_UV "
             f"in one launch (up to {MAX_ROWS} query rows)")
