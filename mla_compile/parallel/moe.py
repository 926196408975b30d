"""DeepSeek MoE over ranks: routed experts split ``ep`` ways (whole experts) and each expert ``moe_tp`` ways
(its intermediate width); shared experts tensor-parallel over all ranks.

Routing is DeepSeek's (:func:`mla_compile.models.moe.route`, the router replicated); the experts run as in
:class:`mla_compile.models.moe.MLAMoE` (dense on any device, grouped on CUDA bf16) over this rank's experts only.
Two ways to bring tokens to experts (``dispatch``):

- ``"all_to_all"``: each EP rank takes a ``1 / ep`` slice of the step's tokens (padded to a multiple of ``ep``),
  routes it, and sends it with its routing to every EP peer by ``all_to_all_single`` with *equal* splits
  (capacity = the slice: a token may pick experts on every peer, so this is the static worst case, which
  compiles and captures without host syncs); each peer applies its experts with the weights of the experts
  it owns (0 for others) and an ``all_to_all_single`` returns the partial outputs, summed by the sender;
  then the slices are all-gathered.
- ``"all_reduce"``: every rank holds every token of the step, so each applies its own experts to all of them
  and one all-reduce (with the shared experts' partial sums) combines them: fewer bytes moved than
  ``"all_to_all"`` while the dispatch must be the static worst case.

Under data-parallel attention the attention groups' tokens are all-gathered first (so every rank holds the
step's tokens of every group) and each group keeps its own rows of the result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mla_compile.models.consts import freeze, thaw
from mla_compile.models.moe import experts_dense, experts_grouped, route
from mla_compile.parallel.groups import ParallelState
from mla_compile.parallel.layers import ParallelMLP, all_gather, all_reduce, all_to_all, gathered

DISPATCHES = ("all_to_all", "all_reduce")


class ParallelExperts(nn.Module):
    """This rank's routed experts: ``gate_up_proj [E_local, 2 * I_local, H]``, ``down_proj [E_local, H, I_local]``
    (the transformers-5 fused layout, HF names), experts ``first .. first + E_local - 1`` of the model."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, act_fn: nn.Module, first: int) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.first = first

    @property
    def num_local(self) -> int:
        """Experts held here."""
        return self.gate_up_proj.shape[0]

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor, grouped: bool) -> Tensor:
        """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` over the (token, slot) pairs whose expert is held
        here (this rank's part of the intermediate width): ``[T, H]``."""
        weights, local = local_routing(weights, ids, self.first, self.num_local)
        run = experts_grouped if grouped else experts_dense
        return run(x, weights, local, self.gate_up_proj, self.down_proj, self.act_fn)


class ParallelBlockExperts(nn.Module):
    """This rank's routed experts when they are block-quantized: ``local`` an
    :class:`~mla_compile.models.fp8_linear.FP8Experts` or :class:`~mla_compile.models.fp4_linear.FP4Experts` of the
    ``E_local`` experts ``first .. first + E_local - 1`` (this rank's part of their intermediate width), which
    runs itself (dense, or grouped: sorted by expert)."""

    quantized = True

    def __init__(self, local: nn.Module, first: int) -> None:
        super().__init__()
        self.local = local
        self.first = first

    @property
    def num_local(self) -> int:
        """Experts held here."""
        return self.local.num_experts

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor, grouped: bool) -> Tensor:
        """As :meth:`ParallelExperts.forward`: ``[T, H]`` float32."""
        weights, local = local_routing(weights, ids, self.first, self.num_local)
        return self.local(x, weights, local, grouped=grouped)


def local_routing(weights: Tensor, ids: Tensor, first: int, num_local: int) -> tuple[Tensor, Tensor]:
    """Routing ``weights [T, k]`` / global expert ``ids [T, k]`` -> this rank's: weight 0 (and local id 0) for
    the (token, slot) pairs whose expert is not among ``first .. first + num_local - 1``, local ids for the rest."""
    local = ids - first
    mine = (local >= 0) & (local < num_local)
    return (torch.where(mine, weights, torch.zeros_like(weights)),
            torch.where(mine, local, torch.zeros_like(local)))


class ParallelMoE(nn.Module):
    """Drop-in for an HF DeepSeek MoE block on one rank (``gate``, ``experts``, ``shared_experts`` keep their HF
    names); see the module docstring for ``dispatch``. ``impl``: "auto" (grouped on CUDA bf16), "dense" or
    "grouped", as :class:`mla_compile.models.moe.MLAMoE`."""

    def __init__(self, gate: nn.Module, experts: ParallelExperts | ParallelBlockExperts,
                 shared_experts: ParallelMLP | None,
                 state: ParallelState, *, dispatch: str = "all_to_all", impl: str = "auto") -> None:
        super().__init__()
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        if impl not in ("auto", "dense", "grouped"):
            raise ValueError(f"impl must be 'auto', 'dense' or 'grouped', got {impl!r}")
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.tp, self.ep, self.moe_tp, self.dp = state.tp, state.ep, state.moe_tp, state.dp
        self.dispatch = dispatch if state.ep.size > 1 else "all_reduce"
        self.impl = impl
        self._scaling = freeze(gate.routed_scaling_factor)  # a constant of every graph (models/consts.py)

    def _grouped(self, x: Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "grouped"
        if getattr(self.experts, "quantized", False):  # fp8 / fp4 ops take any float activation (MLAMoE's rule)
            return x.is_cuda
        return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``: routed plus shared experts. Under data-parallel attention each
        attention group's tokens are gathered first (``T`` equal on every group) and its rows kept after."""
        return gathered(self._moe, x, self.dp)

    def _moe(self, x: Tensor) -> Tensor:
        """Over tokens that are the same on every rank."""
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.dispatch == "all_reduce":
            weights, ids = route(self.gate, x, thaw(self._scaling))
            y = self.experts(x, weights, ids, self._grouped(x)).to(x.dtype)
            return all_reduce(y if shared is None else y + shared, self.tp)
        routed = self._all_to_all(x)
        return routed if shared is None else routed + all_reduce(shared, self.tp)

    def _all_to_all(self, x: Tensor) -> Tensor:
        """Routed experts by EP dispatch / combine of this rank's token slice; ``[T, hidden]``."""
        P, T = self.ep.size, x.shape[0]
        padded = F.pad(x, (0, 0, 0, (-T) % P))
        C = padded.shape[0] // P
        mine = padded.narrow(0, self.ep.rank * C, C)
        weights, ids = route(self.gate, mine, thaw(self._scaling))
        # the same slice and routing to every peer (equal splits: a static shape)
        recv_x = all_to_all(mine.repeat(P, 1), self.ep)
        recv_w = all_to_all(weights.repeat(P, 1), self.ep)
        recv_ids = all_to_all(ids.repeat(P, 1), self.ep)
        y = self.experts(recv_x, recv_w, recv_ids, self._grouped(x))
        back = all_to_all(y, self.ep).view(P, C, -1).sum(0)  # every peer's experts, for my slice
        back = all_reduce(back, self.moe_tp)
        return all_gather(back.to(x.dtype), 0, self.ep)[:T]
