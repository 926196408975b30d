"""Every environment variable mla_compile reads, in one place.

- ``MLA_COMPILE_BACKEND``: default backend for the attention ops: "auto", one name ("triton",
  "reference", "flashmla", ...) or per-op names ("decode=flashmla,prefill=sdpa-cudnn"); parsed and
  checked by :func:`mla_compile.backends.parse_backend_spec`.
- ``MLA_COMPILE_CHECKED``: "1" turns on data checks (host syncs) for accelerator tensors.
- ``MLA_COMPILE_PASSES``: "0" turns the MLA post-grad fusion passes of ``mla_compile.lowerings`` into
  no-ops (default on), for before/after comparisons.
"""

from __future__ import annotations

import os


def backend() -> str:
    """The backend override from ``MLA_COMPILE_BACKEND`` ("auto" when unset)."""
    return os.environ.get("MLA_COMPILE_BACKEND", "auto").strip() or "auto"


def checked() -> bool:
    """Whether ``MLA_COMPILE_CHECKED`` asks for data checks on accelerator tensors."""
    return os.environ.get("MLA_COMPILE_CHECKED", "0").strip().lower() in ("1", "true", "yes", "on")


def passes_enabled() -> bool:
    """Whether ``MLA_COMPILE_PASSES`` leaves the MLA fusion passes on (default: on)."""
    return os.environ.get("MLA_COMPILE_PASSES", "1").strip().lower() not in ("0", "false", "no", "off")
