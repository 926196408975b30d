"""The routed experts of one MoE layer over DeepSeek-V4's FP4 weights.

:class:`FP4Experts` replaces the fused MoE experts module when the checkpoint's expert weights are FP4
(``expert_dtype: "fp4"``): packed e2m1 codes (two per byte) with one ue8m0 scale per 32 weights of a row, kept
packed in memory (a quarter of bf16's bytes, plus 1/32 byte per weight of scales). It keeps the checkpoint's
per-projection names (``gate_proj`` / ``up_proj`` / ``down_proj``, DeepSeek's ``w1`` / ``w3`` / ``w2``) so the
loader (:mod:`mla_compile.models.fp4_checkpoint`) assigns tensors expert by expert; they run in
``mla::moe_experts_fp4``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile import ops
from mla_compile.models.moe import _is_silu, combine_sorted, sort_by_expert, swiglu
from mla_compile.ops.fp4_block_linear import BLOCK, SCALE_DTYPES, WEIGHT_DTYPES, as_bytes
from mla_compile.ops.moe_experts_fp4 import moe_experts_fp4

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SCALE_SUFFIX = "_scale_inv"  # ``gate_proj_scale_inv`` beside ``gate_proj``, as FP8Experts and HF name them


class FP4Experts(nn.Module):
    """Routed experts with FP4 weights, stacked per projection.

    ``gate_proj`` / ``up_proj [E, I, H/2]`` and ``down_proj [E, H, I/2]`` uint8 (packed e2m1, element 2j in the
    low nibble of byte j), each with ``*_scale_inv [E, rows, cols/32]`` uint8 ue8m0 scales (``2^(byte - 127)``).
    H and I must be multiples of 32. ``forward(x, weights, ids, grouped=)`` runs the fp4 op either densely
    (every expert on every token, combined by the routing weights; exact, static shapes) or grouped (the
    token copies sorted by expert, each expert's weights read once), as :class:`~mla_compile.models.fp8_linear.FP8Experts`.
    ``swiglu_limit`` (DeepSeek-V4): the gate is clamped to ``<= limit`` and the up projection to
    ``[-limit, limit]`` before ``act(gate) * up``; None (V2/V3) clamps nothing.
    """

    is_fp4_block = True

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn: nn.Module, *,
                 swiglu_limit: float | None = None, backend: str | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        for what, n in (("hidden", hidden), ("intermediate", intermediate)):
            if n % BLOCK:
                raise ValueError(f"FP4Experts: {what} size {n} must be a multiple of {BLOCK} (one ue8m0 scale per "
                                 f"{BLOCK} weights of a row)")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.act_fn, self.swiglu_limit, self.backend = act_fn, swiglu_limit, backend
        for name, (rows, cols) in self.shapes(hidden, intermediate).items():
            w = torch.empty(num_experts, rows, cols // 2, dtype=torch.uint8, device=device)
            s = torch.empty(num_experts, rows, cols // BLOCK, dtype=torch.uint8, device=device)
            setattr(self, name, nn.Parameter(w, requires_grad=False))
            setattr(self, name + SCALE_SUFFIX, nn.Parameter(s, requires_grad=False))

    @staticmethod
    def shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
        """``[rows, cols]`` of one expert's real (unpacked) weight per projection name."""
        return {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                "down_proj": (hidden, intermediate)}

    def expected_shape(self, proj: str, kind: str) -> tuple[int, int]:
        """The checkpoint shape of one expert's ``proj`` tensor: ``kind`` "weight" (packed bytes) or "scale"."""
        rows, cols = self.shapes(self.hidden, self.intermediate)[proj]
        return (rows, cols // 2) if kind == "weight" else (rows, cols // BLOCK)

    def load_expert(self, index: int, proj: str, kind: str, t: Tensor, *,
                    device: torch.device | str | None = None) -> None:
        """Copy one expert's checkpoint tensor into the stacked parameters, bytes unchanged (never dequantized).

        ``proj``: "gate_proj", "up_proj" or "down_proj"; ``kind``: "weight" (packed e2m1 as int8 / uint8 /
        float4_e2m1fn_x2) or "scale" (ue8m0 as uint8 / float8_e8m0fnu). A stacked parameter still on the meta
        device is allocated here (uint8, on ``device``, default ``t``'s). Raises ValueError naming
        what is wrong (the loader adds the file and tensor name).
        """
        if proj not in PROJECTIONS or kind not in ("weight", "scale"):
            raise ValueError(f"FP4Experts: unknown projection/kind {proj!r}/{kind!r}")
        if not 0 <= index < self.num_experts:
            raise ValueError(f"expert index {index} out of range: the module has {self.num_experts} experts")
        dtypes = WEIGHT_DTYPES if kind == "weight" else SCALE_DTYPES
        if t.dtype not in dtypes:
            what = "packed e2m1 bytes" if kind == "weight" else "ue8m0 scale bytes"
            raise ValueError(f"dtype {t.dtype}, expected {what} ({', '.join(str(d) for d in dtypes)}) for "
                             "expert_dtype 'fp4'")
        want = self.expected_shape(proj, kind)
        if tuple(t.shape) != want:
            raise ValueError(f"shape {list(t.shape)}, expected {list(want)} for {proj} {kind} of hidden "
                             f"{self.hidden}, intermediate {self.intermediate} (fp4: K/2 bytes, K/{BLOCK} scales)")
        name = proj if kind == "weight" else proj + SCALE_SUFFIX
        stacked = getattr(self, name)
        if stacked.is_meta:
            stacked = nn.Parameter(torch.empty(stacked.shape, dtype=torch.uint8, device=device or t.device),
                                   requires_grad=False)
            setattr(self, name, stacked)
        with torch.no_grad():
            stacked[index].copy_(as_bytes(t))

    def _linear(self, x: Tensor, name: str, offs: Tensor | None = None) -> Tensor:
        return ops.fp4_block_linear(x, getattr(self, name), getattr(self, name + SCALE_SUFFIX), offs=offs,
                                    backend=self.backend)

    def _glu(self, gate: Tensor, up: Tensor) -> Tensor:
        return swiglu(self.act_fn, gate, up, self.swiglu_limit)

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor, grouped: bool = False) -> Tensor:
        """``x [T, H]``, routing ``weights [T, k]`` (any float dtype: V4's router gives x's) and expert ``ids [T, k]``
        -> ``[T, H]`` float32.

        SiLU experts that ask for no ``fp4_block_linear`` backend of their own run in ``mla::moe_experts_fp4``
        (its "auto": the fused kernels for few tokens and the grouped form above on a GPU, the reference
        elsewhere; ``grouped`` is then not consulted); otherwise ``grouped`` picks the sorted-groups or the dense
        form over ``mla::fp4_block_linear`` with ``backend``."""
        if self.backend is None and _is_silu(self.act_fn):
            return moe_experts_fp4(x, weights.float(), ids, self.gate_proj, self.gate_proj_scale_inv, self.up_proj,
                                   self.up_proj_scale_inv, self.down_proj, self.down_proj_scale_inv,
                                   swiglu_limit=self.swiglu_limit, out_float32=True)
        if grouped:
            order, offs = sort_by_expert(ids, self.num_experts)
            xs = x[order // ids.shape[1]]
            h = self._glu(self._linear(xs, "gate_proj", offs), self._linear(xs, "up_proj", offs))
            return combine_sorted(self._linear(h, "down_proj", offs), order, weights)
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=torch.float32, device=x.device)
        combine = combine.scatter_add_(1, ids, weights.float())
        h = self._glu(self._linear(x, "gate_proj"), self._linear(x, "up_proj"))  # [E, T, I]
        y = self._linear(h, "down_proj")  # [E, T, H]
        return torch.einsum("eth,te->th", y.float(), combine)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"fp4 e2m1 + ue8m0 per {BLOCK}" + (f", swiglu_limit={self.swiglu_limit}" if self.swiglu_limit else ""))
