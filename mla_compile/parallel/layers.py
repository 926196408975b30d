"""Sharded layers whose collectives are functional collectives, hence nodes of a compiled graph.

``torch.distributed._functional_collectives`` returns tensors that Inductor waits on (``_c10d_functional``
ops in the graph, reorderable, capturable in CUDA graphs). A :class:`~mla_compile.parallel.groups.Group` of
one rank has ``group is None``: the collective is skipped when the module is built, not at run time.

Run eagerly over a gloo group (the CPU path), the same collectives are c10d's synchronous ones: torch's gloo
backend corrupts the heap now and then under functional collectives left in flight (a native abort or
segfault of the process; BENCHMARKS.md's CPU table), and not under the synchronous calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from mla_compile import ops
from mla_compile.parallel.groups import Group


def _eager_gloo(group: Group) -> bool:
    """Whether this call runs outside a trace on a gloo process group (see the module docstring)."""
    return not torch.compiler.is_compiling() and dist.get_backend(group.group) == "gloo"


def all_reduce(x: Tensor, group: Group) -> Tensor:
    """Sum ``x`` over ``group`` (identity for one rank)."""
    if group.group is None:
        return x
    if _eager_gloo(group):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group.group)
        return out
    return funcol.all_reduce(x, "sum", group.group)


# torch 2.13 renamed all_gather_tensor (deprecated there) to all_gather_single; 2.11 has only the old name
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group order (identity for one rank).

    Gathers along dim 0 and concatenates the chunks here: torch 2.11's ``all_gather_tensor`` does a
    ``gather_dim != 0`` through a helper Dynamo refuses to trace (a graph break under ``fullgraph``)."""
    if group.group is None:
        return x
    x = x.contiguous()
    if _eager_gloo(group):
        out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group.group)
    else:
        out = _all_gather(x, 0, group.group)
    dim = dim % x.dim()
    return out if dim == 0 else torch.cat(out.chunk(group.size, 0), dim)


def all_to_all(x: Tensor, group: Group) -> Tensor:
    """``x [P * C, ...]``: block ``q`` of ``C`` rows goes to rank ``q``; returns the blocks received, block ``q``
    from rank ``q`` (equal splits: a static shape; identity for one rank)."""
    if group.group is None:
        return x
    if _eager_gloo(group):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group.group)
        return out
    return funcol.all_to_all_single(x.contiguous(), None, None, group.group)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ W[:, shard].T) + bias``: the input features are split over ``group``.

    ``weight [out, in / P]`` (this rank's columns), ``bias`` whole (added once, after the sum) or None.
    ``weight_scale_inv``: given, ``weight`` is DeepSeek's fp8 (e4m3) with this float32 scale per 128 x 128 block
    of the local columns (``[ceil(out/128), ceil(in_local/128)]``), run by ``mla::fp8_block_linear``
    (``act_quant`` / ``backend`` as :class:`~mla_compile.models.fp8_linear.FP8BlockLinear`'s).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: Group, *,
                 weight_scale_inv: nn.Parameter | None = None, act_quant: bool = False,
                 backend: str | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.weight_scale_inv = weight_scale_inv
        self.act_quant, self.backend = act_quant, backend
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        if self.weight_scale_inv is None:
            local = F.linear(x, self.weight)
        else:
            local = ops.fp8_block_linear(x, self.weight, self.weight_scale_inv, act_quant=self.act_quant,
                                         backend=self.backend)
        y = all_reduce(local, self.group)
        return y if self.bias is None else y + self.bias


def gathered(fn, x: Tensor, dp: Group | None, *more: Tensor) -> Tensor:
    """``fn`` over every data-parallel attention group's tokens: ``x [T, ...]`` (``T`` equal on every group) and each
    per-token tensor of ``more`` (``[T, ...]`` too) are all-gathered over ``dp``, ``fn(x, *more)`` applied, and this
    group's ``T`` rows returned (``fn(x, *more)`` without ``dp``)."""
    if dp is None or dp.group is None:
        return fn(x, *more)
    T = x.shape[0]
    return fn(all_gather(x, 0, dp), *(all_gather(t, 0, dp) for t in more)).narrow(0, dp.rank * T, T)


class ParallelMLP(nn.Module):
    """DeepSeek's gated MLP (``down(act(gate(x)) * up(x))``) with the intermediate width split over ``group``.

    ``gate_proj``/``up_proj`` hold this rank's rows, ``down_proj`` its columns (HF names kept). With
    ``reduce=False`` the partial sum is returned (the caller adds it to other partials before one all-reduce).
    ``dp``: under data-parallel attention, the group whose tokens are gathered first (:func:`gathered`).
    """

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act_fn: nn.Module,
                 group: Group, reduce: bool = True, dp: Group | None = None) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = gate_proj, up_proj, down_proj, act_fn
        self.group = group
        self.reduce = reduce
        self.dp = dp

    def forward(self, x: Tensor) -> Tensor:
        return gathered(self._mlp, x, self.dp)

    def _mlp(self, x: Tensor) -> Tensor:
        y = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return all_reduce(y, self.group) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are split over ``group``: rank ``p`` holds ids
    ``[p * shard, (p + 1) * shard)`` (the last shard zero-padded); out-of-shard ids give 0, then one all-reduce."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: Group) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.group = group
        self.start = group.rank * weight.shape[0]

    def forward(self, ids: Tensor) -> Tensor:
        n = self.weight.shape[0]
        local = ids - self.start
        outside = (local < 0) | (local >= n)
        out = F.embedding(local.clamp(0, n - 1), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.group)


class ParallelLMHead(nn.Module):
    """``lm_head`` split by vocabulary rows over ``group``; the logits are all-gathered (``[R, vocab]`` on
    every rank, for sampling) and the padding of the last shard dropped. ``dp``: as for :class:`ParallelMLP`
    (every attention group must then ask for the same number of rows)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: Group, dp: Group | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.group = group
        self.dp = dp

    def forward(self, h: Tensor) -> Tensor:
        return gathered(self._logits, h, self.dp)

    def _logits(self, h: Tensor) -> Tensor:
        logits = all_gather(F.linear(h, self.weight), -1, self.group)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size]


def shard_range(total: int, group: Group, *, pad: bool = False) -> tuple[int, int]:
    """This rank's ``[start, stop)`` of ``total`` items split evenly over ``group``; with ``pad`` the shard is
    ``ceil(total / size)`` and ``stop`` may pass ``total`` (the caller zero-pads). Raises when not divisible
    and ``pad`` is False."""
    size = group.size
    if total % size and not pad:
        raise ValueError(f"{total} does not split over {size} ranks")
    shard = -(-total // size)
    return group.rank * shard, (group.rank + 1) * shard


def take_rows(full: Tensor, start: int, stop: int) -> Tensor:
    """``full[start:stop]`` as a fresh tensor, zero-padded when ``stop`` passes the end (vocab shards)."""
    part = full[start:min(stop, full.shape[0])]
    part = torch.as_tensor(part)
    if part.shape[0] < stop - start:
        pad = part.new_zeros((stop - start - part.shape[0],) + tuple(part.shape[1:]))
        part = torch.cat([part, pad])
    return part.clone()
