"""A regionally compiled model's AOTAutograd pass generates each region's schema once, not once per layer
(``mla_compile.models.region_schema``: torch 2.11 re-traces the region for every call's schema by itself)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.models.model import patch
from mla_compile.models.region_schema import cache_region_schemas, torch_caches_region_schemas
from mla_compile.serving.generate import greedy_generate

pytest.importorskip("transformers")


def _schema_traces(layers: int, monkeypatch) -> int:
    """How many times compiling one prefill step of a ``layers``-deep regional toy (AOTAutograd, no Inductor)
    re-traced a subgraph for a HOP's schema (``materialize_as_graph``)."""
    hop_utils = importlib.import_module("torch._higher_order_ops.utils")
    materialize = hop_utils.materialize_as_graph
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return materialize(*args, **kwargs)

    monkeypatch.setattr(hop_utils, "materialize_as_graph", counted)
    torch._dynamo.reset()
    counters.clear()
    hf = toy.toy_hf_model("v2-lite", seed=3, num_hidden_layers=layers, first_k_dense_replace=1)
    model = patch(hf, regional_compile=True)
    model.allocate_cache(32, 4)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    greedy_generate(compiled, toy.random_prompts(3, [7, 5]), 1, block_size=4, num_blocks=32)
    assert dict(counters["graph_break"]) == {}
    torch._dynamo.reset()
    monkeypatch.setattr(hop_utils, "materialize_as_graph", materialize)
    return len(calls)


def test_region_schemas_are_traced_once_per_region_not_per_layer(monkeypatch):
    assert _schema_traces(3, monkeypatch) == _schema_traces(6, monkeypatch)


def test_cache_region_schemas_is_idempotent_and_a_no_op_where_torch_caches_them():
    hop_type = type(importlib.import_module("torch._higher_order_ops.invoke_subgraph").invoke_subgraph)
    before = hop_type.gen_schema
    installed = cache_region_schemas()
    assert installed is not torch_caches_region_schemas()
    assert cache_region_schemas() is installed
    if installed:
        assert getattr(hop_type.gen_schema, "_mla_cached", False)
    else:
        assert hop_type.gen_schema is before
