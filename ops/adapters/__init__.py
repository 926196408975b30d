"""Adapters that serve the MLA ops through peer libraries: FlashMLA, FlashInfer (and its Blackwell-only
paths), flash-attn and torch SDPA's cuDNN kernel.

Each adapter wraps the library call in our own ``torch.library`` custom op (``mla::decode_flashmla``,
``mla::prefill_flashinfer``, ...) with a fake function, so ``torch.compile(fullgraph=True)`` never meets
a pybind call; converts the LSE to natural log, token-major; and gives queries that see no key
``out = 0``, ``lse = -inf``. The conversion lives in a plain ``*_core`` function that runs on any
tensors, so CPU tests check each call contract against a fake library module.

Importing this package registers the ops and declares each backend (``registry.declare``, beside its
adapter: what it serves, as data); it never imports a peer library (they are imported inside the op
bodies, on first use). Which backend serves a call is decided by ``mla_compile.ops.select``. A new
adapter is one module here plus its import below.
"""

from mla_compile.ops.adapters import flash_attn, flashinfer, flashinfer_sm100, flashmla, flashmla_v4, sdpa  # noqa: F401
from mla_compile.ops.adapters.flashinfer import (FlashInferDecodePlan, FlashInferPrefillPlan, plan_flashinfer_decode,
                                                 plan_flashinfer_prefill)

__all__ = ["FlashInferDecodePlan", "FlashInferPrefillPlan", "plan_flashinfer_decode", "plan_flashinfer_prefill"]
