"""Modules over DeepSeek's fp8 block-quantized weights; they run through ``mla::fp8_block_linear``.

:class:`FP8BlockLinear` replaces an ``nn.Linear`` whose checkpoint tensors are fp8 (``weight`` e4m3 and
``weight_scale_inv``); :class:`FP8Experts` replaces the fused MoE experts module when the per-expert weights
are fp8. Both keep the checkpoint's names so the loader assigns tensors by name.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile import ops
from mla_compile.models.moe import combine_sorted, sort_by_expert
from mla_compile.ops.fp8_block_linear import BLOCK


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FP8BlockLinear(nn.Module):
    """``y = x @ W.T`` with ``weight [out, in]`` float8_e4m3fn and ``weight_scale_inv [ceil(out/128),
    ceil(in/128)]`` float32 (``W = weight * weight_scale_inv`` block-wise). No bias (DeepSeek's have none).

    ``act_quant``: quantize the activation per 1 x 128 group as DeepSeek's inference does (default False:
    weight-only, the closest to the bf16 weights); ``backend``: the op's backend (None: auto).
    """

    def __init__(self, in_features: int, out_features: int, *, act_quant: bool = False,
                 backend: str | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_quant, self.backend = act_quant, backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        scale_shape = (_cdiv(out_features, BLOCK), _cdiv(in_features, BLOCK))
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device),
                                             requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., in]`` -> ``[..., out]`` in x's dtype."""
        return ops.fp8_block_linear(x, self.weight, self.weight_scale_inv, act_quant=self.act_quant,
                                    backend=self.backend)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128 blocks"


class FP8Experts(nn.Module):
    """The routed experts of one MoE layer with fp8 weights, stacked per projection.

    ``gate_proj``/``up_proj [E, I, H]`` and ``down_proj [E, H, I]`` float8_e4m3fn, each with
    ``*_scale_inv [E, ceil(rows/128), ceil(cols/128)]`` float32. Gate and up stay separate (their block
    rows would not line up in one ``[E, 2I, H]`` tensor unless I is a multiple of 128).
    ``forward(x, weights, ids, grouped=)`` runs the fp8 op either densely (every expert on every token,
    combined by the routing weights; exact, static shapes) or grouped (the token copies sorted by expert,
    each expert's weights read once: ``offs``, like ``moe.experts_grouped``).
    """

    is_fp8_block = True

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn: nn.Module, *,
                 act_quant: bool = False, backend: str | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts, self.act_fn = num_experts, act_fn
        self.act_quant, self.backend = act_quant, backend
        for name, (rows, cols) in self.shapes(hidden, intermediate).items():
            w = torch.empty(num_experts, rows, cols, dtype=torch.float8_e4m3fn, device=device)
            s = torch.empty(num_experts, _cdiv(rows, BLOCK), _cdiv(cols, BLOCK), dtype=torch.float32, device=device)
            setattr(self, name, nn.Parameter(w, requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(s, requires_grad=False))

    @staticmethod
    def shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
        """``[rows, cols]`` of one expert's weight per projection name."""
        return {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                "down_proj": (hidden, intermediate)}

    def _linear(self, x: Tensor, name: str, offs: Tensor | None = None) -> Tensor:
        return ops.fp8_block_linear(x, getattr(self, name), getattr(self, f"{name}_scale_inv"),
                                    act_quant=self.act_quant, offs=offs, backend=self.backend)

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor, grouped: bool = False) -> Tensor:
        """``x [T, H]``, routing ``weights [T, k]`` and expert ``ids [T, k]`` -> ``[T, H]`` float32."""
        if grouped:
            return self._grouped(x, weights, ids)
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=torch.float32, device=x.device)
        combine = combine.scatter_add_(1, ids, weights.float())
        h = self.act_fn(self._linear(x, "gate_proj")) * self._linear(x, "up_proj")  # [E, T, I]
        y = self._linear(h, "down_proj")  # [E, T, H]
        return torch.einsum("eth,te->th", y.float(), combine)

    def _grouped(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        order, offs = sort_by_expert(ids, self.num_experts)
        xs = x[order // ids.shape[1]]
        h = self.act_fn(self._linear(xs, "gate_proj", offs)) * self._linear(xs, "up_proj", offs)
        return combine_sorted(self._linear(h, "down_proj", offs), order, weights)
