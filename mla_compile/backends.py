"""Which backend serves each MLA attention op: what every backend supports, a measured priority, and
a selector that explains its choice.

``select_backend(op, device=..., dtype=..., ...)`` returns a :class:`Choice` (the name, why, and why
every other backend was rejected). ``"auto"`` takes the first backend of the op's priority list that
can serve the configuration; an explicit backend (argument, or ``MLA_COMPILE_BACKEND`` read through
:mod:`mla_compile.envs`) that cannot serve it raises a ValueError saying why and what would work.
Nothing is ever silently swapped. Selection is plain Python run while tracing: under
``torch.compile`` the choice is a constant of the graph (see :func:`cached_backend`).

Everything here is host-side Python: a backend's support list is a declaration checked against the
static configuration, never a probe of the GPU beyond its compute capability.

``MLA_COMPILE_BACKEND`` / ``backend=`` take one name (``"triton"``) or per-op names
(``"decode=flashmla,prefill=sdpa-cudnn"``). A single name must serve every attention op (decode,
prefill, merge); the cache write and gather use it only if they have it (they have no peer backends).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch

from mla_compile import envs
from mla_compile.ops._dispatch import backends_for
from mla_compile.ops.adapters._common import capability as _device_capability

ATTENTION_OPS = ("decode", "prefill", "merge")
KERNEL_OPS = ("cache_write", "gather")
OP_KEYS = {"decode": "mla.decode", "prefill": "mla.prefill", "merge": "mla.merge_attn_states",
           "cache_write": "mla.write_latent_cache", "gather": "mla.gather_latent_cache"}

# CUDA-graph support: "full" = captured once, replays with any lengths (nothing read on the host);
# "planned" = capturable when its host-side plan (use_cuda_graph=True) is redone before each replay;
# "none" = reads lengths on the host, never captured.
GRAPH_LEVELS = ("full", "planned", "none")

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SM80, _SM90, _SM100, _SM103 = (8, 0), (9, 0), (10, 0), (10, 3)
_DEEPSEEK_DECODE = ((512, 64),)  # (kv_lora_rank, rope_dim)
_DEEPSEEK_PREFILL = ((192, 128),)  # (qk_head_dim, v_head_dim)


@dataclass(frozen=True)
class BackendSpec:
    """What one backend of one op supports. ``None`` for a constraint means "any".

    ``head_dims``: decode ``(kv_lora_rank, rope_dim)``, prefill ``(qk_head_dim, v_head_dim)``, merge ``(D,)``.
    ``gpu_tested``: the path has passed its CUDA tests on a GPU (the peer adapters have not yet).
    """

    name: str
    op: str
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = _HALF
    cache_dtypes: tuple[torch.dtype, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    num_heads: tuple[int, ...] | None = None
    head_dims: tuple[tuple[int, ...], ...] | None = None
    max_head_dim: int | None = None
    multi_query: bool = True
    sparse: bool = False
    lse: bool = True
    needs_plan: bool = False
    cuda_graph: str = "full"
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    package: str | None = None
    gpu_tested: bool = False
    note: str = ""


def _spec(name: str, op: str, **kw) -> BackendSpec:
    return BackendSpec(name, op, **kw)


_REF = dict(devices=("any",), dtypes=_FLOATS, gpu_tested=True, note="plain torch, the numerical ground truth")
_TRITON = dict(dtypes=_FLOATS, package="triton", gpu_tested=True, note="ours; portable path for ROCm/XPU")
SPECS: dict[str, dict[str, BackendSpec]] = {
    "decode": {s.name: s for s in (
        _spec("flashmla-tiered", "decode", dtypes=(torch.bfloat16,), block_sizes=(64,), head_dims=_DEEPSEEK_DECODE,
              min_capability=_SM90, max_capability=_SM90, package="sgl-flash-mla", gpu_tested=True,
              note="FlashMLA, with steps of <= 16 query rows (B * s_q) on our Triton kernel (faster there)"),
        _spec("flashmla", "decode", dtypes=(torch.bfloat16,), block_sizes=(64,), head_dims=_DEEPSEEK_DECODE,
              min_capability=_SM90, max_capability=_SM90, package="sgl-flash-mla", gpu_tested=True,
              note="dense bf16, Hopper kernels (use_legacy=True); fp8 and sparse not wired"),
        _spec("flashinfer", "decode", head_dims=_DEEPSEEK_DECODE, needs_plan=True, cuda_graph="planned",
              min_capability=_SM80, package="flashinfer-python", gpu_tested=True,
              note="plan_flashinfer_decode() on the host before each step"),
        _spec("flashinfer-trtllm", "decode", dtypes=(torch.bfloat16,), block_sizes=(32, 64), head_dims=_DEEPSEEK_DECODE,
              lse=False, min_capability=_SM100, max_capability=_SM103, package="flashinfer-python",
              note="Blackwell trtllm-gen kernels; returns no LSE"),
        _spec("triton", "decode", **_TRITON),
        _spec("flashinfer-cutlass", "decode", dtypes=(torch.bfloat16,), block_sizes=(32, 64, 128), num_heads=(128,),
              head_dims=_DEEPSEEK_DECODE, multi_query=False, lse=False, min_capability=_SM100,
              max_capability=_SM103, package="flashinfer-python",
              note="Blackwell CUTLASS kernel; no LSE; FlashInfer's wrapper copies the cache per call"),
        _spec("autotune", "decode", devices=("any",), dtypes=_FLOATS, gpu_tested=True,
              note="Inductor times every decode backend that serves the compiled shapes and emits the fastest "
                   "(needs `import mla_compile.lowerings`; eager and CPU run the static default); never picked by 'auto'"),
        _spec("reference", "decode", **_REF),
    )},
    "prefill": {s.name: s for s in (
        _spec("flashinfer", "prefill", head_dims=_DEEPSEEK_PREFILL, needs_plan=True, cuda_graph="none",
              min_capability=_SM80, package="flashinfer-python", gpu_tested=True,
              note="plan_flashinfer_prefill() on the host before each step"),
        _spec("flashinfer-trtllm", "prefill", dtypes=(torch.bfloat16,), head_dims=_DEEPSEEK_PREFILL,
              min_capability=_SM100, max_capability=_SM103, package="flashinfer-python",
              note="Blackwell trtllm-gen ragged prefill"),
        _spec("flash-attn", "prefill", max_head_dim=256, min_capability=_SM80, package="flash-attn",
              note="FA2, v padded to the qk dim; no wheel for the H200 test machine"),
        _spec("triton", "prefill", **_TRITON),
        _spec("sdpa-cudnn", "prefill", max_head_dim=256, cuda_graph="none", min_capability=_SM80, package="torch",
              gpu_tested=True, note="one cuDNN call per sequence; reads cu_seqlens on the host (a sync)"),
        _spec("autotune", "prefill", devices=("any",), dtypes=_FLOATS, gpu_tested=False,
              note="Inductor times our Triton configs and the plan-free peers (flash-attn, trtllm-gen) that serve the "
                   "compiled shapes and emits the fastest (needs `import mla_compile.lowerings`; eager and CPU run "
                   "the static default); never picked by 'auto'"),
        _spec("reference", "prefill", **_REF),
    )},
    "merge": {s.name: s for s in (
        _spec("triton", "merge", **_TRITON),
        _spec("flashinfer", "merge", min_capability=_SM80, package="flashinfer-python", gpu_tested=True, max_head_dim=256,
              note="merge_state (base-2 LSE converted at the boundary)"),
        _spec("reference", "merge", **_REF),
    )},
}

# Priority = the order of SPECS above, from the GPU timings in BENCHMARKS.md and
# shared/notes/mla-anchors.md:
# - decode: "flashmla-tiered" (FlashMLA above ``SMALL_ROWS`` query rows, Triton at or below; see
#   ops/adapters/flashmla.py: Triton is ahead on whole captured steps at small batches, FlashMLA at
#   large ones), then flashmla (block size 64 only), then flashinfer, then triton, then the reference.
#   The Blackwell paths have no timings (no sm100 machine): trtllm-gen after flashinfer; the CUTLASS
#   path, which copies the cache per call, after triton.
# - prefill: flashinfer, then trtllm-gen (Blackwell), flash-attn (untimed: not installable on the
#   test machine), triton, then SDPA cuDNN: it beats Triton on long sequences but loops over sequences
#   on the host and reads cu_seqlens there (a host sync per call), so "auto" puts it after Triton;
#   ask for it by name for long prompts.
# - merge: Triton first; FlashInfer's merge_state (untimed) pays two extra passes at our boundary
#   (empty parts), so it comes second.
# gpu_tested (per spec above) says which backends passed their CUDA tests on a GPU; "auto" skips the
# others.
PRIORITY: dict[str, tuple[str, ...]] = {op: tuple(specs) for op, specs in SPECS.items()}


@dataclass(frozen=True)
class Choice:
    """The selector's answer: ``name``, the ``reason`` it was chosen, and why each other backend was rejected."""

    name: str
    reason: str
    rejected: dict[str, str] = field(default_factory=dict)


def parse_backend_spec(spec: str | None) -> dict[str, str]:
    """``"triton"`` -> ``{"*": "triton"}``; ``"decode=flashmla,prefill=sdpa-cudnn"`` -> per-op names; ""/"auto" -> {}.

    Raises ValueError for an unknown op key or a name no op has.
    """
    spec = (spec or "").strip()
    if spec in ("", "auto"):
        return {}
    known = sorted({n for op in OP_KEYS.values() for n in backends_for(op)} | {"auto"})
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        key, sep, name = part.partition("=")
        op, name = (key.strip(), name.strip()) if sep else ("*", key.strip())
        if op != "*" and op not in OP_KEYS:
            raise ValueError(f"backend spec {spec!r}: unknown op {op!r}; expected one of {sorted(OP_KEYS)} "
                             f"(e.g. 'decode=flashmla,prefill=sdpa-cudnn') or a single backend name")
        if name not in known:
            raise ValueError(f"backend spec {spec!r}: unknown backend {name!r}; known: {known}")
        out[op] = name
    return out


def requested_for(op: str, spec: str | dict[str, str] | None) -> str:
    """The backend asked for ``op`` by ``spec`` (None: ``MLA_COMPILE_BACKEND``); "auto" when none is."""
    parsed = parse_backend_spec(envs.backend() if spec is None else spec) if not isinstance(spec, dict) else spec
    if op in parsed:
        return parsed[op]
    name = parsed.get("*", "auto")
    if op in KERNEL_OPS and name not in backends_for(OP_KEYS[op]):
        return "auto"  # a single peer name is about attention; the cache write/gather have no peer backends
    if name == "autotune" and name not in backends_for(OP_KEYS[op]):
        return "auto"  # ops without an autotuned variant (merge) keep the static choice
    return name


def _fmt_cap(cap: tuple[int, int]) -> str:
    return f"sm{cap[0]}{cap[1]}"


def _why_not(spec: BackendSpec, *, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype,
             block_size: int | None, num_heads: int | None, head_dims: tuple[int, ...] | None, query_len: int,
             sparse: bool, need_lse: bool, planned: bool, cuda_graph: bool, cap: tuple[int, int] | None) -> str | None:
    """Every reason ``spec`` cannot serve the configuration, joined; None when it can."""
    impl = backends_for(OP_KEYS[spec.op]).get(spec.name)
    if impl is None:
        return "not registered in mla_compile.ops"
    why: list[str] = []
    if "any" not in spec.devices and device.type not in spec.devices:
        why.append(f"runs on {'/'.join(spec.devices)}, not {device.type}")
    elif "any" not in spec.devices and device.type == "cuda":
        lo, hi = spec.min_capability, spec.max_capability
        if cap is None:
            why.append("no CUDA GPU visible")
        elif lo is not None and (cap < lo or (hi is not None and cap > hi)):
            want = _fmt_cap(lo) + ("+" if hi is None else "" if hi == lo else f"-{_fmt_cap(hi)}")
            why.append(f"needs {want} (this GPU is {_fmt_cap(cap)})")
    if not impl.available():
        why.append("this torch build has no CUDA/cuDNN" if spec.package == "torch"
                   else f"not installed (pip install {spec.package})")
    if dtype not in spec.dtypes:
        why.append(f"dtype {dtype} not in {[str(d).replace('torch.', '') for d in spec.dtypes]}")
    allowed_cache = spec.cache_dtypes or spec.dtypes
    if spec.op == "decode" and cache_dtype not in allowed_cache:
        why.append(f"cache dtype {cache_dtype} not supported")
    if spec.block_sizes is not None and block_size is not None and block_size not in spec.block_sizes:
        why.append(f"block size {block_size} not in {list(spec.block_sizes)}")
    if spec.num_heads is not None and num_heads is not None and num_heads not in spec.num_heads:
        why.append(f"{num_heads} heads not in {list(spec.num_heads)}")
    if head_dims is not None:
        if spec.head_dims is not None and tuple(head_dims) not in spec.head_dims:
            why.append(f"head dims {tuple(head_dims)} not in {list(spec.head_dims)}")
        if spec.max_head_dim is not None and (max(head_dims) > spec.max_head_dim or
                                              (spec.op == "prefill" and head_dims[-1] > head_dims[0])):
            why.append(f"head dims {tuple(head_dims)} exceed {spec.max_head_dim} or have v > qk")
    if query_len > 1 and not spec.multi_query:
        why.append(f"query_len {query_len} > 1 not supported")
    if sparse and not spec.sparse:
        why.append("no sparse (index-list) path")
    if need_lse and not spec.lse:
        why.append("returns no LSE and the caller needs it")
    if spec.needs_plan and not planned:
        hint = ("; give MetadataBuilder(decode_planner=FlashInferDecodePlanner(...)) to plan every step"
                if spec.op == "decode" else "")
        why.append(f"needs a host-side plan (plan_flashinfer_{spec.op}) and the caller supplies none{hint}")
    if cuda_graph and (spec.cuda_graph == "none" or (spec.cuda_graph == "planned" and not planned)):
        why.append("cannot be captured in a CUDA graph" + (" without a plan" if spec.cuda_graph == "planned" else ""))
    return "; ".join(why) or None


_AUTO_CAP = object()


def select_backend(op: str, *, device: torch.device | str, dtype: torch.dtype, block_size: int | None = None,
                   num_heads: int | None = None, head_dims: tuple[int, ...] | None = None, query_len: int = 1,
                   requested: str | None = None, cache_dtype: torch.dtype | None = None, sparse: bool = False,
                   need_lse: bool = True, planned: bool = False, cuda_graph: bool = False,
                   capability=_AUTO_CAP) -> Choice:
    """Pick the backend of ``op`` ("decode", "prefill" or "merge") for one static configuration.

    ``requested``: a backend name, a per-op spec, "auto", or None (``MLA_COMPILE_BACKEND``).
    ``head_dims``: decode ``(kv_lora_rank, rope_dim)``, prefill ``(qk, v)``, merge ``(D,)``.
    ``need_lse``: the caller uses the LSE; ``planned``: it supplies FlashInfer host plans;
    ``cuda_graph``: the call will be captured. ``capability``: ``(major, minor)`` to assume for a
    CUDA device (tests), default: the device's own (None without a GPU).
    """
    if op not in SPECS:
        raise ValueError(f"select_backend: op must be one of {list(SPECS)}, got {op!r}")
    device = torch.device(device)
    cap = _device_capability(device) if capability is _AUTO_CAP else capability
    source = "argument" if requested is not None else "MLA_COMPILE_BACKEND"
    name = requested_for(op, requested)
    facts = dict(device=device, dtype=dtype, cache_dtype=cache_dtype or dtype, block_size=block_size,
                 num_heads=num_heads, head_dims=None if head_dims is None else tuple(head_dims), query_len=query_len,
                 sparse=sparse, need_lse=need_lse, planned=planned, cuda_graph=cuda_graph, cap=cap)
    reasons = {n: _why_not(s, **facts) for n, s in SPECS[op].items()}
    usable = [n for n in PRIORITY[op] if reasons[n] is None]
    rejected = {n: r for n, r in reasons.items() if r is not None}
    where = f"{device.type} ({_fmt_cap(cap)})" if cap and device.type == "cuda" else device.type
    config = (f"[{where}, {str(dtype).replace('torch.', '')}, block size {block_size}, {num_heads} heads, "
              f"head dims {facts['head_dims']}, s_q {query_len}]")
    if name == "auto":
        # "auto" only picks paths that have passed their CUDA tests on a GPU; the others serve when
        # asked for by name (and join "auto" once their gpu_tested flag is set after a GPU run).
        for n in usable:
            if n == "autotune":  # a compile-time choice among the others, asked for by name only
                rejected[n] = "chosen by Inductor's timing at compile time: 'auto' skips it, ask for it by name"
            elif not SPECS[op][n].gpu_tested:
                rejected[n] = "not yet tested on a GPU: 'auto' skips it, ask for it by name"
        verified = [n for n in usable if SPECS[op][n].gpu_tested and n != "autotune"]
        if not verified:
            raise ValueError(f"{op}: no GPU-tested backend serves {config}: {rejected}")
        return Choice(verified[0], f"auto: first GPU-tested backend of the {op} priority {list(PRIORITY[op])} "
                      f"that serves {config}", rejected)
    if name not in SPECS[op]:
        raise ValueError(f"{op}: unknown backend {name!r} (from the {source}); {op} backends: {list(PRIORITY[op])}")
    if reasons[name] is not None:
        raise ValueError(f"{op}: backend {name!r} (from the {source}) cannot serve {config}: {reasons[name]}. "
                         f"Backends that can: {usable}; or ask for 'auto'")
    return Choice(name, f"requested by the {source}", rejected)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


class ChoiceCache(dict):
    """The selections of one owner (an :class:`~mla_compile.attention.MLAAttention`), keyed by the static
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
            cuda_graph: bool) -> str:
    """:func:`select_backend` once per (owner, configuration). Under Dynamo it runs at trace time with
    constant arguments and its result is a constant of the graph; the cache is invisible to Dynamo, so
    filling it adds no guards and no recompiles."""
    key = (op, requested, device, dtype, cache_dtype, block_size, num_heads, dim_a, dim_b, query_len, need_lse,
           planned, cuda_graph)
    cache = _CACHES.get(token)
    if cache is not None and key in cache:
        return cache[key]
    dims = (dim_a,) if dim_b < 0 else (dim_a, dim_b)
    name = select_backend(op, device=device, dtype=_dtype(dtype), cache_dtype=_dtype(cache_dtype),
                          block_size=block_size if block_size > 0 else None, num_heads=num_heads, head_dims=dims,
                          query_len=query_len, requested=requested, need_lse=need_lse, planned=planned,
                          cuda_graph=cuda_graph).name
    if cache is not None:
        cache[key] = name
    return name


def cached_backend(token: int, op: str, requested: str, *, device: torch.device, dtype: torch.dtype,
                   cache_dtype: torch.dtype | None = None, block_size: int | None, num_heads: int,
                   head_dims: tuple[int, ...], query_len: int = 1, need_lse: bool = True, planned: bool = False,
                   cuda_graph: bool = False) -> str:
    """The backend name for one static configuration, selected once per owner (``token`` from
    :func:`new_choice_cache`) and reused. Dynamo-friendly: the selection runs at trace time and is a
    constant of the graph; eager calls after the first are a dict lookup."""
    multi = 2 if query_len > 1 else 1  # only "s_q > 1" matters; keeps a symbolic query_len out of the key
    dims = tuple(int(d) for d in head_dims)
    return _choose(int(token), op, requested, str(device), str(dtype), str(cache_dtype or dtype),
                   int(block_size or 0), int(num_heads), dims[0], dims[1] if len(dims) > 1 else -1, multi,
                   bool(need_lse), bool(planned), bool(cuda_graph))


def takes_plan(op: str, name: str) -> bool:
    """Whether backend ``name`` of ``op`` needs a host-side plan passed as ``plan=``."""
    spec = SPECS.get(op, {}).get(name)
    return spec is not None and spec.needs_plan


def describe(device: torch.device | str | None = None, capability=_AUTO_CAP) -> list[dict]:
    """Every backend of every op with ``available`` (installed, right device and GPU) and ``why`` not.

    Shape-independent: dtype, block size and heads are left to :func:`select_backend`.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    probe = torch.device("cuda") if dev.type == "cpu" else dev  # peer backends are judged as on a CUDA device
    cap = _device_capability(probe) if capability is _AUTO_CAP else capability
    rows = []
    for op, specs in SPECS.items():
        for name in PRIORITY[op]:
            spec = specs[name]
            dtype = spec.dtypes[0]
            why = _why_not(spec, device=probe if "any" not in spec.devices else dev, dtype=dtype, cache_dtype=dtype,
                           block_size=None, num_heads=None, head_dims=None, query_len=1, sparse=False, need_lse=False,
                           planned=True, cuda_graph=False, cap=cap)
            rows.append(dict(op=op, backend=name, available=why is None, why=why or "", cuda_graph=spec.cuda_graph,
                             lse=spec.lse, gpu_tested=spec.gpu_tested, note=spec.note))
    return rows
