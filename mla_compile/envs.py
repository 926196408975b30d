"""Every environment variable mla_compile reads, in one place.

- ``MLA_COMPILE_BACKEND``: default backend for the attention ops: "auto", one name ("triton",
  "reference", "flashmla", ...) or per-op names ("decode=flashmla,prefill=sdpa-cudnn"); parsed and
  checked by :func:`mla_compile.backends.parse_backend_spec`.
- ``MLA_COMPILE_CHECKED``: "1" turns on data checks (host syncs) for accelerator tensors.
- ``MLA_COMPILE_PASSES``: "0" turns the MLA post-grad fusion passes of ``mla_compile.lowerings`` into
  no-ops (default on), for before/after comparisons; a comma-separated list of pass names
  (``mla_compile.lowerings.PASS_NAMES``) runs just those.
"""

from __future__ import annotations

import os


def backend() -> str:
    """The backend override from ``MLA_COMPILE_BACKEND`` ("auto" when unset)."""
    return os.environ.get("MLA_COMPILE_BACKEND", "auto").strip() or "auto"


def checked() -> bool:
    """Whether ``MLA_COMPILE_CHECKED`` asks for data checks on accelerator tensors."""
    return os.environ.get("MLA_COMPILE_CHECKED", "0").strip().lower() in ("1", "true", "yes", "on")


def passes() -> str:
    """``MLA_COMPILE_PASSES`` lower-cased ("1" when unset): "0"/"1" or a comma-separated list of pass names."""
    return os.environ.get("MLA_COMPILE_PASSES", "1").strip().lower()


def passes_enabled() -> bool:
    """Whether ``MLA_COMPILE_PASSES`` leaves the MLA fusion passes on (default: on)."""
    return passes() not in ("0", "false", "no", "off")
