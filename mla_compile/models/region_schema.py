"""Nested compile regions: :func:`compile_region` marks a function as one, and one schema per region, not one per
call, on torches that do not cache it (2.11 at least).

AOTAutograd functionalizes every ``invoke_subgraph`` call of a regionally compiled model, and torch 2.11's rule
for it asks the HOP for the call's schema each time (``InvokeSubgraphHOP.gen_schema``), which re-traces the whole
region with ``make_fx`` (``materialize_as_graph``): once per layer in the metadata pass and again in the graph
capture, so AOTAutograd's time grows with depth. torch 2.13 keeps that schema in the compile's invoke_subgraph
cache (``get_functionalize_schema_entry``); :func:`cache_region_schemas` gives an older torch the same, keyed by
what the schema depends on: the subgraph, its identifier and the operands' types (a schema holds argument and
return types and which arguments the subgraph mutates, no shapes).
"""

from __future__ import annotations

import importlib

import torch
import torch._guards

_CACHE_ATTR = "_mla_region_schemas"  # on the compile's InvokeSubgraphCache: dies with the compile


def torch_caches_region_schemas() -> bool:
    """Whether this torch caches a region call's schema itself (2.13 does; 2.11 re-traces the region)."""
    cache_type = getattr(torch._guards, "InvokeSubgraphCache", None)
    return hasattr(cache_type, "get_functionalize_schema_entry")


def cache_region_schemas() -> bool:
    """Make ``invoke_subgraph``'s schema generation reuse the schema of an earlier call of the same region in the
    same compile, where torch does not already; returns whether the cache is in place (installed now or before).

    Idempotent and process-wide (a HOP is a process-wide object); outside a compile (no tracing context) and for
    calls without an identifier the schema is generated as before."""
    if torch_caches_region_schemas():
        return False
    module = importlib.import_module("torch._higher_order_ops.invoke_subgraph")
    hop_type = type(module.invoke_subgraph)
    generate = hop_type.gen_schema
    if getattr(generate, "_mla_cached", False):
        return True

    def gen_schema(self, subgraph, identifier, *operands):
        compile_cache = module.get_invoke_subgraph_cache()
        if compile_cache is None or identifier is None:
            return generate(self, subgraph, identifier, *operands)
        schemas = compile_cache.__dict__.setdefault(_CACHE_ATTR, {})
        key = (id(subgraph), identifier, tuple(type(o) for o in operands))
        if key not in schemas:  # the entry holds the subgraph too, so its id is not reused while the entry lives
            schemas[key] = (subgraph, generate(self, subgraph, identifier, *operands))
        return schemas[key][1]

    gen_schema._mla_cached = True
    gen_schema.__doc__ = generate.__doc__
    hop_type.gen_schema = gen_schema
    return True


def compile_region(fn):
    """``fn`` as a nested compile region (``torch.compiler.nested_compile_region``: ``torch.compile`` traces and
    compiles it once and calls the same subgraph wherever it is called with inputs of the same kind); a no-op outside
    ``torch.compile`` and on a torch without the API."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region(fn) if region is not None else fn


class RegionalCompile:
    """A model's ``regional_compile`` flag (a mixin of the model classes: what their ``forward`` does with it is
    theirs). Turning it on also makes a torch that re-traces a region for every call's schema reuse the first one
    (:func:`cache_region_schemas`; torch 2.11)."""

    _regional_compile = False

    @property
    def regional_compile(self) -> bool:
        """Whether ``forward`` runs the layers as nested compile regions (set by ``patch``)."""
        return self._regional_compile

    @regional_compile.setter
    def regional_compile(self, on: bool) -> None:
        if on:
            cache_region_schemas()
        self._regional_compile = bool(on)
