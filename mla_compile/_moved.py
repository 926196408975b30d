"""The module names users import from before the modules moved into floors (``mla_compile.engine`` is
``mla_compile.serving.engine``): an import of an old name gives the very module object of the new one (one
module, so patches, registrations and ``isinstance`` agree), and ``python -m mla_compile.cli`` still runs
the command line."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

FLOORS = {
    "models": ("attention", "cache", "checkpoint", "config", "fp4_checkpoint", "fp4_linear", "fp8_linear",
               "indexer", "loader", "metadata", "model", "moe", "rope", "v4_cache", "v4_loader", "v4_model"),
    "serving": ("admission", "block_manager", "builder", "engine", "generate", "memory_plan", "sampling",
                "v4_builder"),
    "app": ("cli", "demo", "doctor", "textgen", "toy", "v4_toy"),
}
MOVED = {f"mla_compile.{name}": f"mla_compile.{floor}.{name}" for floor, names in FLOORS.items() for name in names}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module of its new name (imported once, under the new name)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        """Nothing to run: the new module already ran under its own name."""

    def get_code(self, fullname: str):
        """The new module's code (``runpy`` asks for it: ``python -m mla_compile.cli``)."""
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Answer the old names (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
