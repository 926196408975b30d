"""Inductor-side code for the MLA ops: autotune lowerings and post-grad fusion passes.

What it holds:

- :mod:`~mla_compile.lowerings.decode`, :mod:`~mla_compile.lowerings.prefill`: Inductor lowerings of
  ``mla::decode_autotune`` and ``mla::prefill_autotune`` (the ops behind backend ``"autotune"``): at
  compile time Inductor times every implementation that serves the compiled shapes and emits the
  fastest (shared machinery in ``_autotune``).
- :mod:`~mla_compile.lowerings.passes`, :mod:`~mla_compile.lowerings.absorb`: FX post-grad passes that
  rewrite MLA graphs into fused ops (``fuse_kv_write``, ``fuse_absorb_q``, ``fuse_absorb_out``).

How it plugs in: importing the package installs both lowerings; ``LOWERING_INSTALLED`` /
``PREFILL_LOWERING_INSTALLED`` are False (with a warning) where Inductor's private API is unusable,
and compiled graphs then call the ops' eager kernels (the static default backend). Without the import
the same holds. The passes are not switched on by the import: pass :func:`compile_options` to
``torch.compile(options=...)`` or compile inside :func:`mla_passes`; ``MLA_COMPILE_PASSES`` (read in
:mod:`mla_compile.envs`) turns them off or selects some of ``PASS_NAMES``. The package depends on
core (``mla_compile``, ``mla_compile.ops``); ``import mla_compile`` does not import it (the CLI does,
on request).
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
