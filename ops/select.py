"""The one "auto": which backend serves an op call, from the registry's declarations and measured timings.

:func:`select` judges every declared backend of an op against a call's static facts (:class:`Facts`),
and returns a :class:`Choice` (the name, why, and why every other backend was rejected). "auto" takes,
among the GPU-tested backends that serve the call, the fastest in the timing table of this GPU for the
call's shape class (:mod:`mla_compile.ops.timings`), else the first in the declared static order. An
explicit backend that cannot serve the call raises a ValueError saying why and what would work; nothing
is swapped silently. Selection is plain Python run while tracing: under ``torch.compile`` the choice is a
constant of the graph. The public op functions call :func:`resolve`; ``mla_compile.backends`` adds the
``MLA_COMPILE_BACKEND`` override and per-layer caching on top of :func:`select`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mla_compile.ops import timings
from mla_compile.ops.registry import (OPS, Backend, backends_for, declare_split, device_capability, op_name,
                                      priority, split_rows)

AUTO_CAP = object()  # describe()/facts_for(): the device's own compute capability


@dataclass(frozen=True)
class Facts:
    """The static facts of a call that decide which backends can serve it (None: unknown / any)."""

    device: torch.device
    dtype: torch.dtype | None
    cache_dtype: torch.dtype | None = None
    block_size: int | None = None
    num_heads: int | None = None
    head_dims: tuple[int, ...] | None = None
    query_len: int = 1
    sparse: bool = False
    need_lse: bool = True
    planned: bool = False
    cuda_graph: bool = False
    cap: tuple[int, int] | None = None
    cache_align: int | None = None
    packed_rows: bool | None = None
    batch: int | None = None
    context: int | None = None
    capacity: int | None = None  # the most tokens a sequence's block table holds (ranks by rows up to it only)
    act_quant: bool | None = None
    grouped: bool | None = None
    k: int | None = None


@dataclass(frozen=True)
class Choice:
    """The selector's answer: ``name``, the ``reason`` it was chosen, and why each other backend was rejected."""

    name: str
    reason: str
    rejected: dict[str, str] = field(default_factory=dict)


def _fmt_cap(cap: tuple[int, int]) -> str:
    return f"sm{cap[0]}{cap[1]}"


def _names(dtypes) -> list[str]:
    return [str(d).replace("torch.", "") for d in dtypes]


def _why_not_device(spec: Backend, f: Facts) -> list[str]:
    if "any" in spec.devices:
        return []
    if f.device.type not in spec.devices:
        return [f"runs on {'/'.join(spec.devices)}, not {f.device.type}"]
    lo, hi = spec.min_capability, spec.max_capability
    if f.device.type != "cuda":
        return []
    if f.cap is None:
        return ["no CUDA GPU visible"]
    if lo is not None and f.cap < lo or (hi is not None and f.cap > hi):
        want = _fmt_cap(lo) + ("+" if hi is None else "" if hi == lo else f"-{_fmt_cap(hi)}")
        return [f"needs {want} (this GPU is {_fmt_cap(f.cap)})"]
    return []


def _why_not_cache(spec: Backend, f: Facts) -> list[str]:
    why = []
    if OPS[spec.op].cache and f.cache_dtype is not None and f.cache_dtype not in (spec.cache_dtypes or spec.dtypes):
        why.append(f"cache dtype {f.cache_dtype} not supported")
    if spec.block_sizes is not None and f.block_size is not None and f.block_size not in spec.block_sizes:
        why.append(f"block size {f.block_size} not in {list(spec.block_sizes)}")
    if spec.block_multiple and f.block_size is not None and f.block_size % spec.block_multiple:
        why.append(f"block size {f.block_size} not a multiple of {spec.block_multiple}")
    if spec.stride_align and f.cache_align is not None and f.cache_align < spec.stride_align:
        why.append(f"cache page and row strides not {spec.stride_align}-aligned with contiguous rows")
    if spec.packed_rows and f.packed_rows is False:
        why.append("cache rows not densely packed")
    return why


def why_not_form(spec: Backend, act_quant: bool | None, grouped: bool | None, k: int | None) -> list[str]:
    """Why ``spec`` (a block linear's backend) cannot serve a call of this form: ``act_quant`` (the activation
    quantized), ``grouped`` (a 3-D weight or sorted groups), ``k`` (the reduction dim); None: unknown."""
    why = []
    if spec.act_quant_only and act_quant is False:
        why.append("runs only act_quant=True (the activation quantized per 1 x 128 group)")
    if not spec.grouped and grouped:
        why.append("runs 2-D weights only (no grouped / offs form)")
    if spec.k_multiple and k is not None and k % spec.k_multiple:
        why.append(f"K {k} not a multiple of {spec.k_multiple}")
    return why


def cache_layout(strides, row_width) -> tuple[int, bool]:
    """``(align, packed)`` of a paged cache ``[NB, BS, W]`` from its strides: the largest power of two up to
    256 dividing the page and row strides (0 when rows are not contiguous), and whether rows are dense.
    Comparisons only, so symbolic strides under Dynamo become guards, never values."""
    if strides[-1] != 1:
        return 0, False
    align = next(a for a in (256, 128, 64, 32, 16, 8, 4, 2, 1) if strides[0] % a == 0 and strides[1] % a == 0)
    return align, True if strides[1] == row_width else False  # `if`, not bool(): Dynamo then guards


def why_not(spec: Backend, f: Facts) -> str | None:
    """Every reason ``spec`` cannot serve a call with facts ``f``, joined; None when it can (a split: its
    parts' reasons)."""
    if spec.derived:
        table = backends_for(spec.op)
        reasons = (why_not(table[n], f) for _, n in spec.tiers)
        return "; ".join(dict.fromkeys(r for r in reasons if r)) or None
    why = _why_not_device(spec, f)
    if not spec.available():
        why.append("this torch build has no CUDA/cuDNN" if spec.package == "torch"
                   else f"not installed (pip install {spec.package})")
    if f.dtype is not None and f.dtype not in spec.dtypes:
        why.append(f"dtype {f.dtype} not in {_names(spec.dtypes)}")
    why += _why_not_cache(spec, f)
    if spec.num_heads is not None and f.num_heads is not None and f.num_heads not in spec.num_heads:
        why.append(f"{f.num_heads} heads not in {list(spec.num_heads)}")
    dims = f.head_dims
    if dims is not None and spec.head_dims is not None and tuple(dims) not in spec.head_dims:
        why.append(f"head dims {tuple(dims)} not in {list(spec.head_dims)}")
    if dims is not None and spec.max_head_dim is not None and (
            max(dims) > spec.max_head_dim or (spec.op == "prefill" and dims[-1] > dims[0])):
        why.append(f"head dims {tuple(dims)} exceed {spec.max_head_dim} or have v > qk")
    if f.query_len > 1 and not spec.multi_query:
        why.append(f"query_len {f.query_len} > 1 not supported")
    if f.sparse and not spec.sparse:
        why.append("no sparse (index-list) path")
    why += why_not_form(spec, f.act_quant, f.grouped, f.k)
    if f.need_lse and not spec.lse:
        why.append("returns no LSE and the caller needs it")
    if spec.needs_plan and not f.planned:
        hint = ("; give MetadataBuilder(decode_planner=FlashInferDecodePlanner(...)) to plan every step"
                if spec.op == "decode" else "")
        why.append(f"needs a host-side plan (plan_flashinfer_{spec.op}) and the caller supplies none{hint}")
    if f.cuda_graph and (spec.cuda_graph == "none" or (spec.cuda_graph == "planned" and not f.planned)):
        why.append("cannot be captured in a CUDA graph" + (" without a plan" if spec.cuda_graph == "planned" else ""))
    return "; ".join(why) or None


def auto_skip(spec: Backend) -> str | None:
    """Why "auto" passes over ``spec`` although it serves the call (None: it may pick it)."""
    if spec.name == "autotune":
        return "chosen by Inductor's timing at compile time: 'auto' skips it, ask for it by name"
    if not spec.gpu_tested:
        return "not yet tested on a GPU: 'auto' skips it, ask for it by name"
    if spec.host_sync:
        return "reads lengths on the host (a sync every call): 'auto' skips it, ask for it by name"
    return spec.auto_skip or None


def _capacity_skip(spec: Backend, f: Facts) -> str | None:
    """Why "auto" passes over a backend whose time follows the block table's capacity (``Backend.cost``): the call
    names no capacity (None: it names one, and the timings rank the backend at it)."""
    if spec.cost == "capacity" and f.capacity is None:
        return ("its time follows the block table's capacity, not the lengths, and the call names no capacity: "
                "'auto' passes over it, ask for it by name")
    return None


def _config(f: Facts) -> str:
    where = f"{f.device.type} ({_fmt_cap(f.cap)})" if f.cap and f.device.type == "cuda" else f.device.type
    return (f"[{where}, {str(f.dtype).replace('torch.', '')}, block size {f.block_size}, {f.num_heads} heads, "
            f"head dims {f.head_dims}, s_q {f.query_len}]")


def select(op: str, facts: Facts, requested: str = "auto", source: str = "argument") -> Choice:
    """Pick the backend of ``op`` (a registry op name) for ``facts``; ``requested``: a name or "auto"."""
    table = backends_for(op)
    order = priority(op)
    reasons = {n: why_not(table[n], facts) for n in order}
    usable = [n for n in order if reasons[n] is None]
    rejected = {n: r for n, r in reasons.items() if r is not None}
    if requested == "auto":
        eligible = []
        for n in usable:
            skip = auto_skip(table[n]) or _capacity_skip(table[n], facts)
            if skip:
                rejected[n] = skip
            else:
                eligible.append(n)
        if not eligible:
            raise ValueError(f"{op}: no GPU-tested backend serves {_config(facts)}: {rejected}")
        tiers = {n: table[n].tiers for n in eligible if table[n].tiers}
        context, capacity = facts.context, facts.capacity
        at_capacity = frozenset(n for n in eligible if table[n].cost == "capacity")

        def rank():
            return timings.rank(op, eligible, capability=facts.cap, dtype=facts.dtype,
                                cache_dtype=facts.cache_dtype or facts.dtype, num_heads=facts.num_heads,
                                batch=facts.batch, context=context, capacity=capacity, tiers=tiers,
                                at_capacity=at_capacity)
        ranked, why = rank()
        note = ""
        if why.startswith("static order") and capacity is not None:
            # no rows at the contexts the block tables can hold: the rows at every context decide (without the
            # backends whose time follows the capacity, which those rows cannot price)
            capacity = None
            for n in sorted(at_capacity):
                eligible.remove(n)
                rejected[n] = f"its time follows the block table's capacity ({facts.capacity}), at which the " \
                              f"timings have no rows: 'auto' passes over it, ask for it by name"
            at_capacity = frozenset()
            if not eligible:
                raise ValueError(f"{op}: no GPU-tested backend serves {_config(facts)}: {rejected}")
            ranked, wider = rank()
            if not wider.startswith("static order"):
                note = f" (no rows up to capacity {facts.capacity}: the rows at every context)"
                why = wider + note
        if why.startswith("static order") and facts.batch is None and context is not None:
            # a graph's static context (v4_attention's listed slots) the table has no rows at: its rows at
            # every context decide, as for a graph that names none
            context = None
            ranked, wider = rank()
            if not wider.startswith("static order"):
                note = f" (no rows at context {facts.context}: the rows at every context)"
                why = wider + note
        if why.startswith("static order"):
            why = f"first GPU-tested backend of the {op} priority {list(order)} ({why})"
        elif facts.batch is None and (counts := split_rows(op)):  # a graph serves every size: split where it pays
            split, split_why = timings.tiers_by_batch(
                op, eligible, capability=facts.cap, dtype=facts.dtype, cache_dtype=facts.cache_dtype or facts.dtype,
                num_heads=facts.num_heads, context=context, capacity=capacity, tiers=tiers, prefer=ranked[0],
                counts=counts, at_capacity=at_capacity)
            if split:
                return Choice(declare_split(op, split).name, f"auto: {split_why}{note}; serves {_config(facts)}",
                              rejected)
        return Choice(ranked[0], f"auto: {why}; serves {_config(facts)}", rejected)
    if requested not in table:
        raise ValueError(f"{op}: unknown backend {requested!r} (from the {source}); {op} backends: {list(order)}")
    if requested not in reasons:  # a split "auto" made earlier: as able as its parts
        reasons[requested] = why_not(table[requested], facts)
    if reasons[requested] is not None:
        raise ValueError(f"{op}: backend {requested!r} (from the {source}) cannot serve {_config(facts)}: "
                         f"{reasons[requested]}. Backends that can: {usable}; or ask for 'auto'")
    return Choice(requested, f"requested by the {source}", rejected)


def facts_for(device: torch.device | str, dtype: torch.dtype, **kw) -> Facts:
    """:class:`Facts` with the device's own compute capability unless ``cap=`` is given."""
    device = torch.device(device)
    if "cap" not in kw:
        kw["cap"] = device_capability(device)
    return Facts(device=device, dtype=dtype, **kw)


@torch.compiler.assume_constant_result
def _auto(op: str, device: str, dtype: str, cache_dtype: str, block_size: int, num_heads: int, dim_a: int,
          dim_b: int, multi: bool, planned: bool, align: int, packed: bool, context: int = -1,
          capacity: int = -1) -> str:
    """"auto" for a public op function's call, from constants (a constant of the graph under Dynamo)."""
    f = facts_for(device, getattr(torch, dtype) if dtype else None,
                  cache_dtype=getattr(torch, cache_dtype) if cache_dtype else None,
                  block_size=block_size or None, num_heads=num_heads or None,
                  head_dims=None if dim_a < 0 else (dim_a,) if dim_b < 0 else (dim_a, dim_b),
                  query_len=2 if multi else 1, planned=planned, cache_align=None if align < 0 else align,
                  packed_rows=packed if align >= 0 else None, context=None if context < 0 else context,
                  capacity=None if capacity < 0 else capacity)
    return select(op, f).name


def static_int(value) -> int:
    """``value`` as a Python int. A symbolic size (a dynamic-shape trace) is specialized, with a guard, by
    ``len([0] * value)`` (Dynamo turns neither ``int()`` nor ``str()`` of it into a constant). For the model's
    static dimensions (heads, head dims, page size) that a backend choice depends on; never the batch."""
    return len([0] * value)  # no type test: under Dynamo a symbolic size passes isinstance(_, int), fails SymInt


def context_bound(op: str, value) -> int:
    """The bound of ``value``'s context bucket (:func:`~mla_compile.ops.timings.bucket`) as a Python int. The bucket
    is found by comparisons, so a symbolic size (a block table's width under dynamic shapes) is guarded by its
    bucket's range, not specialized to one value (a new width in the same bucket does not recompile)."""
    return timings.bucket("context", value, op)


def resolve(op: str, device: torch.device, backend: str | None, *, dtype: torch.dtype | None = None,
            cache: torch.Tensor | None = None, shape: Callable[[], tuple] | None = None,
            planned: bool = False) -> Backend:
    """The backend of ``op`` for a public function's call: ``backend`` by name, or (None/"auto") the one
    :func:`select` picks from the call's facts: ``cache`` (the paged cache the op reads, if any) and
    ``shape() -> (num_heads, head_dims, query_len[, context[, capacity]])`` (called only for "auto", so a malformed
    call reaches the op's own validation; ``context``: a static size of the timing class, ``capacity``: the most
    tokens a sequence's block table holds (:attr:`Facts.capacity`); None when unknown)."""
    name = op_name(op)
    if backend in (None, "auto"):
        try:
            num_heads, head_dims, query_len, *rest = shape() if shape is not None else (0, (), 1)
            context, capacity = (list(rest) + [None, None])[:2]
            backend = _auto_for(name, device, dtype, cache, num_heads, head_dims, query_len, planned, context,
                                capacity)
        except (IndexError, ValueError):
            # a malformed call (wrong rank or dtype: no backend serves it, the facts may not even exist); the
            # reference, which serves every well-formed call, validates it and names the problem
            backend = "reference"
    return _explicit(name, device, backend)


def _auto_for(name: str, device: torch.device, dtype: torch.dtype | None, cache: torch.Tensor | None,
              num_heads, head_dims: tuple, query_len, planned: bool, context=None, capacity=None) -> str:
    cache_dtype = _dtype_name(cache.dtype if cache is not None else dtype)
    align, packed = cache_layout(cache.stride(), cache.shape[-1]) if cache is not None else (-1, False)
    dims = tuple(static_int(d) for d in head_dims) + (-1, -1)
    block_size = static_int(cache.shape[1]) if cache is not None and cache.dim() == 3 else 0
    return _auto(name, str(device), _dtype_name(dtype), cache_dtype, block_size, static_int(num_heads), dims[0],
                 dims[1], True if query_len > 1 else False, bool(planned), align, packed,
                 -1 if context is None else static_int(context),
                 -1 if capacity is None else context_bound(name, capacity))


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "" if dtype is None else str(dtype).replace("torch.", "")


def _explicit(op: str, device: torch.device, backend: str) -> Backend:
    impls = backends_for(op)
    key = OPS[op].key
    impl = impls.get(backend)
    if impl is None:
        raise ValueError(f"{key}: unknown backend {backend!r}; registered: {sorted(impls)}")
    if device.type not in impl.devices and "any" not in impl.devices:
        usable = sorted(b for b, i in impls.items() if device.type in i.devices or "any" in i.devices)
        raise ValueError(f"{key}: backend {backend!r} runs on {list(impl.devices)}, not on {device.type}; "
                         f"backends for {device.type}: {usable}")
    if not impl.available():
        raise ValueError(f"{key}: backend {backend!r} is not importable here; use backend='reference' or install it")
    return impl


def describe(device: torch.device | str | None = None, capability=AUTO_CAP) -> list[dict]:
    """Every backend of every op with ``available`` (installed, right device and GPU) and ``why`` not, and
    ``auto_skip``: why "auto" passes over it wherever it serves (:func:`auto_skip`; "" where "auto" may take it).

    Shape-independent: dtype, block size and heads are left to :func:`select`. Peer backends are judged
    as on a CUDA device when ``device`` is the CPU.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    probe = torch.device("cuda") if dev.type == "cpu" else dev
    cap = device_capability(probe) if capability is AUTO_CAP else capability
    rows = []
    for op in OPS:
        for name in priority(op):
            spec = backends_for(op)[name]
            f = Facts(device=probe if "any" not in spec.devices else dev, dtype=spec.dtypes[0], need_lse=False,
                      planned=True, cap=cap)
            why = why_not(spec, f)
            rows.append(dict(op=op, backend=name, available=why is None, why=why or "", cuda_graph=spec.cuda_graph,
                             lse=spec.lse, gpu_tested=spec.gpu_tested, auto_skip=auto_skip(spec) or "",
                             note=spec.note))
    return rows


def parse_backend_spec(spec: str | None) -> dict[str, str]:
    """``"triton"`` -> ``{"*": "triton"}``; ``"decode=flashmla,prefill=sdpa-cudnn"`` -> per-op names; ""/"auto" -> {}.

    Raises ValueError for an unknown op key or a name no op has.
    """
    spec = (spec or "").strip()
    if spec in ("", "auto"):
        return {}
    known = sorted({n for op in OPS for n in backends_for(op)} | {"auto"})
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        key, sep, name = part.partition("=")
        op, name = (key.strip(), name.strip()) if sep else ("*", key.strip())
        if op != "*" and op not in OPS:
            raise ValueError(f"backend spec {spec!r}: unknown op {op!r}; expected one of {sorted(OPS)} "
                             f"(e.g. 'decode=flashmla,prefill=sdpa-cudnn') or a single backend name")
        if name not in known:
            raise ValueError(f"backend spec {spec!r}: unknown backend {name!r}; known: {known}")
        out[op] = name
    return out


def requested_in(op: str, parsed: dict[str, str]) -> str:
    """The backend a parsed spec asks for ``op``; "auto" when none is. A single name applies to the ops
    declared ``env="all"`` (decode, prefill, merge), to ``env="if_present"`` ops only when they have that
    backend, and never to ``env="named"`` ops (only ``op=name`` does)."""
    if op in parsed:
        return parsed[op]
    name = parsed.get("*", "auto")
    mode = OPS[op].env
    if mode == "named" or (name not in backends_for(op) and (mode == "if_present" or name == "autotune")):
        return "auto"  # ops without that backend (merge has no "autotune") keep their own choice
    return name


__all__ = ["Choice", "Facts", "auto_skip", "cache_layout", "context_bound", "describe", "facts_for",
           "parse_backend_spec", "requested_in", "resolve", "select", "static_int", "why_not", "why_not_form"]
