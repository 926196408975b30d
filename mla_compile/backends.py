"""Backend selection as the model asks for it: the ``MLA_COMPILE_BACKEND`` override and per-layer caching of
choices, on top of the registry and the one selector in :mod:`mla_compile.ops` (re-exported here).

What each backend serves is declared beside its kernel or adapter (:mod:`mla_compile.ops.registry`);
"auto" (:func:`mla_compile.ops.select.select`) takes, among the GPU-tested backends that serve a call,
the fastest in the measured timings of this GPU for the call's shape class, else the first in the
declared static order. ``select_backend(op, device=..., dtype=..., ...)`` returns a :class:`Choice` (the
name, why, and why every other backend was rejected); an explicit backend (argument, or
``MLA_COMPILE_BACKEND`` read through :mod:`mla_compile.envs`) that cannot serve the call raises a
ValueError saying why and what would work. Selection is plain Python run while tracing: under
``torch.compile`` the choice is a constant of the graph (see :func:`cached_backend`).

``MLA_COMPILE_BACKEND`` / ``backend=`` take one name (``"triton"``) or per-op names
(``"decode=flashmla,prefill=sdpa-cudnn"``). A single name must serve every attention op (decode,
prefill, merge); the cache write and gather use it only if they have it; the fp8, sparse and index ops
take only a per-op name (``"decode_fp8=triton"``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping

import torch

from mla_compile import envs
from mla_compile.ops import registry
from mla_compile.ops.registry import GRAPH_LEVELS, OPS, BackendSpec, backends_for, priority  # noqa: F401
from mla_compile.ops.select import (AUTO_CAP, Choice, Facts, cache_layout, context_bound, facts_for,  # noqa: F401
                                    parse_backend_spec, requested_in, select)
from mla_compile.ops.select import describe as _describe


class _OpView(Mapping):
    """A read-only mapping over the registry's ops, computed on access (so it never drifts from it)."""

    def __init__(self, value) -> None:
        self._value = value

    def __getitem__(self, op: str):
        if op not in OPS:
            raise KeyError(op)
        return self._value(op)

    def __iter__(self):
        return iter(OPS)

    def __len__(self) -> int:
        return len(OPS)


SPECS = _OpView(lambda op: registry._TABLE[op])  # op -> {name: BackendSpec}, the live table
PRIORITY = _OpView(priority)  # op -> backend names in the declared static order
OP_KEYS = _OpView(lambda op: OPS[op].key)  # op -> the op's name in errors ("mla.decode")
ATTENTION_OPS = tuple(op for op, info in OPS.items() if info.env == "all")  # a single name must serve these
KERNEL_OPS = tuple(op for op, info in OPS.items() if info.env == "if_present")  # ... and these when they have it


def requested_for(op: str, spec: str | dict[str, str] | None) -> str:
    """The backend asked for ``op`` by ``spec`` (None: ``MLA_COMPILE_BACKEND``); "auto" when none is."""
    parsed = spec if isinstance(spec, dict) else parse_backend_spec(envs.backend() if spec is None else spec)
    return requested_in(op, parsed)


def select_backend(op: str, *, device: torch.device | str, dtype: torch.dtype, block_size: int | None = None,
                   num_heads: int | None = None, head_dims: tuple[int, ...] | None = None, query_len: int = 1,
                   requested: str | None = None, cache_dtype: torch.dtype | None = None, sparse: bool = False,
                   need_lse: bool = True, planned: bool = False, cuda_graph: bool = False,
                   cache_strides: tuple[int, ...] | None = None, row_width: int | None = None,
                   cache_align: int | None = None, packed_rows: bool | None = None,
                   batch: int | None = None, context: int | None = None, capacity: int | None = None,
                   capability=AUTO_CAP) -> Choice:
    """Pick the backend of ``op`` (a registry op: "decode", "prefill", "merge", "decode_fp8", ...) for one
    static configuration.

    ``requested``: a backend name, a per-op spec, "auto", or None (``MLA_COMPILE_BACKEND``).
    ``head_dims``: decode ``(kv_lora_rank, rope_dim)``, prefill ``(qk, v)``, merge ``(D,)``.
    ``need_lse``: the caller uses the LSE; ``planned``: it supplies FlashInfer host plans;
    ``cuda_graph``: the call will be captured. ``cache_strides``/``row_width``: the paged cache's strides
    and row width (backends that need aligned or packed rows), or their summary ``cache_align`` /
    ``packed_rows`` (:func:`~mla_compile.ops.select.cache_layout`). ``batch``/``context``: known sizes narrow
    the timing class (a compiled graph leaves them None); ``capacity``: the most tokens a sequence's block table
    holds (a paged decode's; see :attr:`~mla_compile.ops.select.Facts.capacity`). ``capability``: ``(major,
    minor)`` to assume for a CUDA device (tests), default: the device's own (None without a GPU).
    """
    if op not in OPS:
        raise ValueError(f"select_backend: op must be one of {list(OPS)}, got {op!r}")
    source = "argument" if requested is not None else "MLA_COMPILE_BACKEND"
    cap = {} if capability is AUTO_CAP else dict(cap=capability)
    if cache_strides is not None:
        cache_align, packed_rows = cache_layout(cache_strides, row_width)
    facts = facts_for(device, dtype, cache_dtype=cache_dtype or dtype, block_size=block_size, num_heads=num_heads,
                      head_dims=None if head_dims is None else tuple(head_dims), query_len=query_len, sparse=sparse,
                      need_lse=need_lse, planned=planned, cuda_graph=cuda_graph, cache_align=cache_align,
                      packed_rows=packed_rows, batch=batch, context=context, capacity=capacity, **cap)
    return select(op, facts, requested_for(op, requested), source)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


class ChoiceCache(dict):
    """The selections of one owner (an :class:`~mla_compile.models.attention.MLAAttention`), keyed by the static
    configuration; made by :func:`new_choice_cache`, read and filled only by :func:`cached_backend`."""


_CACHES: "weakref.WeakValueDictionary[int, ChoiceCache]" = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


def new_choice_cache() -> tuple[int, ChoiceCache]:
    """A fresh cache and its int token; keep both on the owner (the token is what compiled code sees)."""
    cache = ChoiceCache()
    token = next(_TOKENS)
    _CACHES[token] = cache
    return token, cache


@torch.compiler.assume_constant_result
def _choose(token: int, op: str, requested: str, device: str, dtype: str, cache_dtype: str, block_size: int,
            num_heads: int, dim_a: int, dim_b: int, query_len: int, need_lse: bool, planned: bool,
            cuda_graph: bool, align: int, packed: bool, capacity: int = -1) -> str:
    """:func:`select_backend` once per (owner, configuration). Under Dynamo it runs at trace time with
    constant arguments and its result is a constant of the graph; the cache is invisible to Dynamo, so
    filling it adds no guards and no recompiles."""
    key = (op, requested, device, dtype, cache_dtype, block_size, num_heads, dim_a, dim_b, query_len, need_lse,
           planned, cuda_graph, align, packed, capacity)
    cache = _CACHES.get(token)
    if cache is not None and key in cache:
        return cache[key]
    dims = (dim_a,) if dim_b < 0 else (dim_a, dim_b)
    name = select_backend(op, device=device, dtype=_dtype(dtype), cache_dtype=_dtype(cache_dtype),
                          block_size=block_size if block_size > 0 else None, num_heads=num_heads, head_dims=dims,
                          query_len=query_len, requested=requested, need_lse=need_lse, planned=planned,
                          cuda_graph=cuda_graph, cache_align=None if align < 0 else align,
                          packed_rows=None if align < 0 else packed,
                          capacity=None if capacity < 0 else capacity).name
    if cache is not None:
        cache[key] = name
    return name


def cached_backend(token: int, op: str, requested: str, *, device: torch.device, dtype: torch.dtype,
                   cache_dtype: torch.dtype | None = None, block_size: int | None, num_heads: int,
                   head_dims: tuple[int, ...], query_len: int = 1, need_lse: bool = True, planned: bool = False,
                   cuda_graph: bool = False, cache_strides: tuple[int, ...] | None = None,
                   row_width: int | None = None, capacity: int | None = None) -> str:
    """The backend name for one static configuration, selected once per owner (``token`` from
    :func:`new_choice_cache`) and reused. Dynamo-friendly: the selection runs at trace time and is a
    constant of the graph; eager calls after the first are a dict lookup. ``capacity``: the most tokens a
    sequence's block table holds (a paged decode's width times its page size; only its context bucket is kept,
    see :func:`~mla_compile.ops.select.context_bound`)."""
    multi = 2 if query_len > 1 else 1  # only "s_q > 1" matters; keeps a symbolic query_len out of the key
    dims = tuple(int(d) for d in head_dims)
    align, packed = cache_layout(cache_strides, row_width) if cache_strides is not None else (-1, False)
    return _choose(int(token), op, requested, str(device), str(dtype), str(cache_dtype or dtype),
                   int(block_size or 0), int(num_heads), dims[0], dims[1] if len(dims) > 1 else -1, multi,
                   bool(need_lse), bool(planned), bool(cuda_graph), align, packed,
                   -1 if capacity is None else context_bound(op, capacity))


def takes_plan(op: str, name: str) -> bool:
    """Whether backend ``name`` of ``op`` needs a host-side plan passed as ``plan=``."""
    spec = backends_for(op).get(name)
    return spec is not None and spec.needs_plan


def takes_schedule(op: str, name: str) -> bool:
    """Whether backend ``name`` of ``op`` takes a step schedule passed as ``schedule=``."""
    return registry.takes_schedule(op, name)


def describe(device: torch.device | str | None = None, capability=AUTO_CAP) -> list[dict]:
    """Every backend of every op with ``available`` (installed, right device and GPU) and ``why`` not."""
    return _describe(device, capability)
