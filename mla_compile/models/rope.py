"""Rotary embedding for the MLA rope part (DeepSeek interleaved pairs, or rotate-half halves)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def default_inv_freq(rope_dim: int, theta: float) -> Tensor:
    """Plain RoPE inverse frequencies ``theta ** (-2i / rope_dim)`` (float32)."""
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, attention_scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """``cos, sin [T, rope_dim/2]`` (float32) for ``positions [T]``, computed as HF does (float32 product)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """Rotate ``x [T, ..., rope_dim]`` by ``cos/sin [T, rope_dim/2]``.

    ``interleave=True`` (DeepSeek's layout, HF ``rope_interleave`` / V2): pairs ``(x0, x1), (x2, x3)...``
    are rotated and the output is written de-interleaved ``[evens' | odds']``, as HF does, so the
    rotated k_pe in the cache and q_pe agree. ``False``: rotate-half on ``[first half | second half]``.
    """
    c, s = cos, sin
    for _ in range(x.dim() - 2):  # broadcast over the head dims (unsqueeze: no symbolic size for Dynamo to trace)
        c, s = c.unsqueeze(1), s.unsqueeze(1)
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rotate_part(x: Tensor, cos: Tensor, sin: Tensor, *, interleave: bool, leading: bool) -> Tensor:
    """``x [T, ..., D]`` with ``r = 2 * cos.shape[-1]`` of its channels rotated by ``cos/sin [T, r/2]`` (float32 or
    wider) and the others unchanged, computed in float32 or x's wider dtype, x's dtype out. ``leading``: the first
    ``r`` channels rotate, else the last ``r``. ``interleave``: pairs ``(x0, x1), (x2, x3)...`` in place (V4's
    layout); else rotate-half on ``[first half | second half]``, which needs ``r`` to divide ``D`` and ``leading``.

    One element-wise expression over all D channels (cos 1 and sin 0 on the unrotated ones; each channel's rotation
    partner read through a flip: of the two channels of a pair, or of the half blocks of every r-block), so that
    Inductor fuses it, with a norm or a projection's output before it, into one kernel instead of a rotation, a cast
    and a concatenation."""
    D, half = x.shape[-1], cos.shape[-1]
    r = 2 * half
    if r > D or (D % 2 if interleave else (not leading or r == 0 or D % r)):
        raise ValueError(f"rotate_part: x.shape[-1] = {D} with 2 * cos.shape[-1] = {r} rotated channels: interleaved "
                         "pairs need an even width; rotate-half needs the leading channels and r to divide the width")
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (D,)
    pad = (0, D - r) if leading else (D - r, 0)

    def widen(t: Tensor, fill: float) -> Tensor:  # [T, r/2] -> [T, D]: each value on both channels it turns
        both = t.unsqueeze(-1).expand(*t.shape, 2) if interleave else t.unsqueeze(-2).expand(t.shape[0], 2, half)
        return F.pad(both.flatten(-2), pad, value=fill).view(shape)

    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    channel = torch.arange(D, device=x.device)
    if interleave:  # (a, b) -> (b, a) in each pair; a's partner enters with -sin
        partner, minus = xf.unflatten(-1, (D // 2, 2)).flip(-1).flatten(-2), channel % 2 == 0
    else:  # [a | b] -> [b | a] in every r-block; the first half's partner enters with -sin
        partner, minus = xf.unflatten(-1, (D // r, 2, half)).flip(-2).flatten(-3), channel < half
    s = widen(sin, 0.0)
    return (xf * widen(cos, 1.0) + partner * torch.where(minus, -s, s)).to(x.dtype)


def apply_rope_leading(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [T, ..., D]`` with its first ``r = 2 * cos.shape[-1]`` channels rotated rotate-half (``[first half | second
    half]``) by ``cos/sin [T, r/2]`` and the others unchanged: ``cat([apply_rope(x[..., :r], cos, sin, False),
    x[..., r:]])``, the same values. For half and float32 x where ``r`` divides ``D``, :func:`rotate_part`'s one
    element-wise expression; else (float64 x: apply_rope's float32 rotation, as the V3.2 indexer always had) that
    concatenation."""
    D, r = x.shape[-1], 2 * cos.shape[-1]
    if r == 0 or D % r or x.dtype == torch.float64:
        return torch.cat([apply_rope(x[..., :r], cos, sin, False), x[..., r:]], dim=-1)
    return rotate_part(x, cos, sin, interleave=False, leading=True)
