"""Triton kernels for the MLA ops (CUDA path); imported lazily so CPU machines need no Triton.

Each module here defines the kernels of one op, an internal ``_launch`` (the kernel path on any tensors,
used directly by the interpreter tests) and a ``torch.library.triton_op`` named ``mla::<op>_triton``
with the reference op's signature. ``ops/<op>.py`` declares it as backend "triton" through a lazy
function, so importing ``mla_compile`` never imports Triton. One exception to the ``triton_op`` rule:
``fp8_decode_gluon``, ``fp8_decode_tma`` and ``fp8_decode_wgmma`` (sm_90) are Gluon kernels (Triton's
lower-level dialect, which Inductor cannot re-emit) behind a plain ``torch.library.custom_op``,
``mla::decode_fp8_gluon`` (backend "gluon" of ``decode_fp8``); likewise ``fp8_decode_gluon64``
(``mla::decode_fp8_gluon64``, backend "gluon64" of ``decode_fp8``), the sm_90 bf16 decodes ``decode_gluon``,
``decode_gluon_swap``, ``decode_gluon_ws`` and ``decode_gluon_seesaw`` (``mla::decode_gluon`` /
``mla::decode_gluon_ws`` / ``mla::decode_gluon_seesaw``, backends "gluon" / "gluon-ws" / "gluon-seesaw" of
``decode``) and the sm_90 prefills ``prefill_gluon`` / ``prefill_gluon_ws`` (backends "gluon" / "gluon-ws" of
``prefill``) and the fp4 experts' ``moe_experts_fp4_mma`` (``mla::moe_experts_fp4_gluon``, backend "gluon" of
``moe_experts_fp4``). ``skinny_linear``, ``skinny_absorb`` and ``moe_gate_route`` sit behind plain custom ops
too: their kernels serve a few rows, and the op chooses between the kernel and torch by the row count at run time
(inside a ``triton_op`` that branch would be traced, and a dynamic-shape graph would guard on the row count).
"""

from __future__ import annotations

import importlib.util

# find_spec locates the package without importing it.
_AVAILABLE = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """Whether Triton is installed here (found without importing it)."""
    return _AVAILABLE
