"""Float64 reference of DeepSeek-V4 sink attention at real dims (not a test module), written from the
paper's / HF's equations, vectorised over heads so 64 heads of 512 over hundreds of rows stay quick.

For each query row t: the rows are the listed slots (window slots of the token-row cache, then compressed
slots of the entry cache; -1 and out-of-range slots skipped, duplicates counted). Per head the logits are
``scale * q . row``; the softmax runs over ``[logits, sink]`` and the sink's column is dropped (HF
``eager_attention_forward`` with sinks); values are the rows themselves; the output's trailing rope
slice is rotated by ``-pos * inv_freq`` as interleaved pairs. LSE: over the rows only (-inf when none).
"""

from __future__ import annotations

import torch

F64 = torch.float64


def rows_of(cache: torch.Tensor, slots: torch.Tensor, t: int) -> torch.Tensor:
    """The float64 rows listed in ``slots[t]`` of ``cache [NB, BS, D]``, in list order."""
    flat = cache.reshape(-1, cache.shape[-1])
    s = slots[t].long()
    s = s[(s >= 0) & (s < flat.shape[0])]
    return flat[s].to(F64)


def rotate_back64(o: torch.Tensor, pos: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """``o [H, D]`` with its trailing ``2 * len(inv_freq)`` channels rotated by ``-pos * inv_freq``:
    pair ``(a, b)`` -> ``(a cos + b sin, b cos - a sin)``."""
    r = 2 * inv_freq.shape[0]
    if r == 0:
        return o
    ang = -pos * inv_freq.to(F64)
    c, s = torch.cos(ang), torch.sin(ang)
    out = o.clone()
    a, b = o[:, o.shape[1] - r::2], o[:, o.shape[1] - r + 1::2]
    out[:, o.shape[1] - r::2] = a * c - b * s
    out[:, o.shape[1] - r + 1::2] = b * c + a * s
    return out


def v4_attention64(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq, scale):
    """``(out [T, H, D], lse [T, H])`` float64 on q's device."""
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=F64, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=F64, device=q.device)
    sink = sinks.to(F64)
    for t in range(T):
        rows = torch.cat([rows_of(kv_cache, window_slots, t), rows_of(comp_cache, comp_slots, t)])
        if rows.shape[0] == 0:
            continue  # only the sink: no mass on any value
        logits = scale * (q[t].to(F64) @ rows.T)  # [H, L]
        probs = torch.softmax(torch.cat([logits, sink[:, None]], dim=1), dim=1)[:, :-1]
        out[t] = rotate_back64(probs @ rows, float(query_pos[t]), inv_freq)
        lse[t] = torch.logsumexp(logits, dim=1)
    return out, lse
