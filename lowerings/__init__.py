"""Inductor lowerings and graph passes for the MLA ops.

Importing this package registers the lowerings of ``mla::decode_autotune`` and ``mla::prefill_autotune``
(Inductor times every decode / prefill backend that serves the compiled shapes:
:mod:`mla_compile.lowerings.decode`, :mod:`mla_compile.lowerings.prefill`). The fusion passes are
not switched on by the import: pass :func:`compile_options` to ``torch.compile(options=...)``, or wrap
compilation in :func:`mla_passes` (``MLA_COMPILE_PASSES=0`` turns them off for a before/after run).
Core (``mla_compile``) never imports this package.
"""

from mla_compile.lowerings import decode as _decode
from mla_compile.lowerings import prefill as _prefill
from mla_compile.lowerings.absorb import fuse_absorb_out, fuse_absorb_q
from mla_compile.lowerings.passes import (PASS_NAMES, MLAFusionPass, compile_options, fuse_kv_write, mla_passes,
                                         selected_passes)

LOWERING_INSTALLED = _decode.install()  # decode's
PREFILL_LOWERING_INSTALLED = _prefill.install()

__all__ = ["LOWERING_INSTALLED", "PREFILL_LOWERING_INSTALLED", "MLAFusionPass", "PASS_NAMES", "compile_options",
           "fuse_absorb_out", "fuse_absorb_q", "fuse_kv_write", "mla_passes", "selected_passes"]
