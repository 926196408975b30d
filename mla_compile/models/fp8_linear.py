"""Modules over DeepSeek's fp8 block-quantized weights; they run through ``mla::fp8_block_linear``.

:class:`FP8BlockLinear` replaces an ``nn.Linear`` whose checkpoint tensors are fp8 (``weight`` e4m3 and
``weight_scale_inv``); :class:`FP8Experts` replaces the fused MoE experts module when the per-expert weights
are fp8; :class:`FP8GroupedLinear` replaces DeepSeek-V4's block-diagonal grouped output projection
(``o_a_proj``). All keep the checkpoint's names so the loader assigns tensors by name.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile import ops
from mla_compile.models.moe import combine_sorted, sort_by_expert, swiglu
from mla_compile.ops.fp8_block_linear import BLOCK


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FP8BlockLinear(nn.Module):
    """``y = x @ W.T`` with ``weight [out, in]`` float8_e4m3fn and ``weight_scale_inv [ceil(out/128),
    ceil(in/128)]`` float32 (``W = weight * weight_scale_inv`` block-wise). No bias (DeepSeek's have none).

    ``act_quant``: quantize the activation per 1 x 128 group as DeepSeek's inference does (default False:
    weight-only, the closest to the bf16 weights); ``backend``: the op's backend (None: auto).
    """

    is_fp8_linear = True  # a plain fp8 linear (MLAMoE folds such shared experts into mla::moe_experts_fp8)

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
    ``swiglu_limit`` (DeepSeek-V4): the gate is clamped to ``<= limit`` and the up projection to
    ``[-limit, limit]`` before ``act(gate) * up``; None (V2/V3) clamps nothing.
    """

    is_fp8_block = True

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn: nn.Module, *,
                 act_quant: bool = False, backend: str | None = None, swiglu_limit: float | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts, self.act_fn, self.swiglu_limit = num_experts, act_fn, swiglu_limit
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

    def _glu(self, gate: Tensor, up: Tensor) -> Tensor:
        return swiglu(self.act_fn, gate, up, self.swiglu_limit)

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor, grouped: bool = False) -> Tensor:
        """``x [T, H]``, routing ``weights [T, k]`` and expert ``ids [T, k]`` -> ``[T, H]`` float32."""
        if grouped:
            return self._grouped(x, weights, ids)
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=torch.float32, device=x.device)
        combine = combine.scatter_add_(1, ids, weights.float())
        h = self._glu(self._linear(x, "gate_proj"), self._linear(x, "up_proj"))  # [E, T, I]
        y = self._linear(h, "down_proj")  # [E, T, H]
        return torch.einsum("eth,te->th", y.float(), combine)

    def _grouped(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        order, offs = sort_by_expert(ids, self.num_experts)
        xs = x[order // ids.shape[1]]
        h = self._glu(self._linear(xs, "gate_proj", offs), self._linear(xs, "up_proj", offs))
        return combine_sorted(self._linear(h, "down_proj", offs), order, weights)


def apply_backend_spec(model: nn.Module, spec: str | dict[str, str] | None) -> int:
    """Give every fp8 module of ``model`` (:class:`FP8BlockLinear` and its subclasses, :class:`FP8Experts`) whose
    ``backend`` is None the backend ``spec`` asks for ``fp8_block_linear`` (a per-op entry such as
    ``"fp8_block_linear=autotune"``; None: ``MLA_COMPILE_BACKEND``); "auto" leaves them as they are. Returns how
    many modules were set."""
    from mla_compile.backends import requested_for

    name = requested_for("fp8_block_linear", spec)
    if name == "auto":
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, (FP8BlockLinear, FP8Experts)) and module.backend is None:
            module.backend = name
            count += 1
    return count


class FP8GroupedLinear(FP8BlockLinear):
    """DeepSeek-V4's block-diagonal grouped projection (HF ``DeepseekV4GroupedLinear``, the attention's
    ``o_a_proj``) over fp8 blocks: ``weight [G * R, K]`` float8_e4m3fn with ``weight_scale_inv [G * R / 128,
    ceil(K / 128)]``; group ``g`` owns rows ``[g R, (g + 1) R)``. ``forward(x [..., G, K]) -> [..., G, R]``.
    ``R`` (rows per group) must be a multiple of 128, so that each group's rows are whole blocks."""

    is_fp8_linear = False  # block-diagonal groups, not a plain linear

    def __init__(self, in_features_per_group: int, out_features: int, n_groups: int, *, act_quant: bool = False,
                 backend: str | None = None, device: torch.device | str | None = None) -> None:
        if out_features % n_groups or (out_features // n_groups) % BLOCK:
            raise ValueError(f"FP8GroupedLinear: out_features {out_features} must be n_groups ({n_groups}) x a "
                             f"multiple of {BLOCK} (each group's rows whole 128-row blocks)")
        super().__init__(in_features_per_group, out_features, act_quant=act_quant, backend=backend, device=device)
        self.n_groups = n_groups

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., G, K]`` -> ``[..., G, R]`` in x's dtype (one batched fp8 matmul over the groups)."""
        G, K = self.n_groups, self.in_features
        lead = x.shape[:-2]
        xg = x.reshape(-1, G, K).transpose(0, 1).contiguous()  # [G, M, K]
        w = self.weight.view(G, -1, K)
        s = self.weight_scale_inv.view(G, -1, self.weight_scale_inv.shape[-1])
        y = ops.fp8_block_linear(xg, w, s, act_quant=self.act_quant, backend=self.backend)  # [G, M, R]
        return y.transpose(0, 1).reshape(*lead, G, -1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", n_groups={self.n_groups}"


def fp8_form(linear: nn.Module, device: torch.device | str | None = None) -> FP8BlockLinear | None:
    """The fp8 module (empty, on ``device``) that takes the place of the bias-free float linear ``linear``:
    :class:`FP8BlockLinear`, or :class:`FP8GroupedLinear` for a grouped one (an ``n_groups`` attribute, DeepSeek-V4's
    ``o_a_proj``) whose groups are whole 128-row blocks; None where it has no fp8 form (a bias, not a linear, or
    groups of partial blocks: such a weight is dequantized instead)."""
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        return None
    n_groups = getattr(linear, "n_groups", None)
    if n_groups is None:
        return FP8BlockLinear(linear.in_features, linear.out_features, device=device)
    if (linear.out_features // n_groups) % BLOCK == 0:
        return FP8GroupedLinear(linear.in_features, linear.out_features, n_groups, device=device)
    return None
