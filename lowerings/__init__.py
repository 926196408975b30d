"""Inductor-side code for the MLA ops: autotune lowerings and post-grad fusion passes.

What it holds:

- :mod:`~mla_compile.lowerings.decode`, :mod:`~mla_compile.lowerings.prefill`,
  :mod:`~mla_compile.lowerings.fp8_linear`: Inductor lowerings of ``mla::decode_autotune``,
  ``mla::prefill_autotune`` and ``mla::fp8_block_linear_autotune`` (the ops behind backend ``"autotune"``):
  at compile time Inductor times every implementation that serves the compiled shapes and emits the
  fastest (shared machinery in ``_autotune``).
- :mod:`~mla_compile.lowerings.passes`, :mod:`~mla_compile.lowerings.absorb`: FX post-grad passes that
  rewrite MLA graphs into fused ops (``fuse_kv_write``, ``fuse_absorb_q``, ``fuse_absorb_out``).

How it plugs in: importing the package installs the three lowerings; ``LOWERING_INSTALLED`` /
``PREFILL_LOWERING_INSTALLED`` / ``FP8_LINEAR_LOWERING_INSTALLED`` are False (with a warning) where Inductor's private API is unusable,
and compiled graphs then call the ops' eager kernels (the static default backend). Without the import
the same holds. The passes are not switched on by the import: pass :func:`compile_options` to
``torch.compile(options=...)`` or compile inside :func:`mla_passes`; ``MLA_COMPILE_PASSES`` (read in
:mod:`mla_compile.envs`) turns them off or selects some of ``PASS_NAMES``. The package depends on
core (``mla_compile``, ``mla_compile.ops``); ``import mla_compile`` does not import it (the CLI does,
on request).
"""

from mla_compile.lowerings import decode as _decode
from mla_compile.lowerings import fp8_linear as _fp8_linear
from mla_compile.lowerings import prefill as _prefill
from mla_compile.lowerings.absorb import fuse_absorb_out, fuse_absorb_q
from mla_compile.lowerings.passes import (PASS_NAMES, MLAFusionPass, compile_options, fuse_kv_write, mla_passes,
                                         selected_passes)

LOWERING_INSTALLED = _decode.install()  # decode's
PREFILL_LOWERING_INSTALLED = _prefill.install()
FP8_LINEAR_LOWERING_INSTALLED = _fp8_linear.install()

__all__ = ["FP8_LINEAR_LOWERING_INSTALLED", "LOWERING_INSTALLED", "PREFILL_LOWERING_INSTALLED", "MLAFusionPass", "PASS_NAMES", "compile_options",
           "fuse_absorb_out", "fuse_absorb_q", "fuse_kv_write", "mla_passes", "selected_passes"]
