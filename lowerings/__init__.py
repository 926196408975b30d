"""Inductor lowerings and graph passes for the MLA ops.

Importing this package registers the lowering of ``mla::decode_autotune`` (Inductor times every decode
backend that serves the compiled shapes: :mod:`mla_compile.lowerings.decode`). The fusion passes are
not switched on by the import: pass :func:`compile_options` to ``torch.compile(options=...)``, or wrap
compilation in :func:`mla_passes` (``MLA_COMPILE_PASSES=0`` turns them off for a before/after run).
Core (``mla_compile``) never imports this package.
"""

from mla_compile.lowerings import decode as _decode
from mla_compile.lowerings.passes import PASS_NAMES, MLAFusionPass, compile_options, fuse_kv_write, mla_passes

LOWERING_INSTALLED = _decode.install()

__all__ = ["LOWERING_INSTALLED", "MLAFusionPass", "PASS_NAMES", "compile_options", "fuse_kv_write", "mla_passes"]
