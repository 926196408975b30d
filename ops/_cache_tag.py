"""Compile caches keyed by this package's ops.

torch's compile caches (Inductor's FX graph cache, AOTAutograd's cache) key a graph by its nodes, which name a custom
op but not its schema. A graph cached by one version of these ops then serves another whose schema changed: the
cached code calls ``mla::decode_split`` with the arguments of the schema it was traced with, and fails (or worse)
under the new one. ``torch.compiler.config.cache_key_tag`` is torch's documented place for what else a key must
follow ("different versions of a custom op"), so importing the ops appends to it a digest of their sources.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

import torch.compiler.config

PREFIX = "mla_compile.ops:"
_ROOT = Path(__file__).resolve().parent


def ops_digest(files: Iterable[Path] | None = None) -> str:
    """A short digest of the ops' Python sources (default: every ``.py`` under this package, in path order)."""
    files = sorted(_ROOT.rglob("*.py")) if files is None else list(files)
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(_ROOT) if f.is_relative_to(_ROOT) else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def tagged(tag: str, digest: str) -> str:
    """``tag`` with this package's part set to ``digest`` (a user's own tag kept, an earlier part of ours replaced)."""
    kept = [p for p in tag.split("|") if p and not p.startswith(PREFIX)]
    return "|".join(kept + [PREFIX + digest])


def tag_compile_caches() -> str:
    """Key torch's compile caches by the ops' sources (``torch.compiler.config.cache_key_tag``); returns the tag."""
    torch.compiler.config.cache_key_tag = tagged(torch.compiler.config.cache_key_tag, ops_digest())
    return torch.compiler.config.cache_key_tag
