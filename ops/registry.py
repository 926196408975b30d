"""The backend registry: every implementation of every ``mla`` op, declared once, as data, beside its code.

Each op file declares its op (:func:`declare_op`) and each kernel file or adapter declares its backends
(:func:`declare`): the callable that runs it together with what it can serve (dtypes, cache formats, page
sizes, heads, head dims, ``s_q > 1``, LSE, host plan, host syncs, CUDA-graph level, GPU architectures,
autotune eligibility). Everything that asks "which backends exist and what can they do" reads this table:
the selector (:mod:`mla_compile.ops.select`, the one "auto"), the autotune lowerings, ``mla-compile
inspect`` (:func:`kernel_backend`) and ``mla-compile doctor``. Nothing here imports ``mla_compile``'s core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# Every ``mla::`` custom op declares its layout constraint instead of relying on the global default
# (``torch._functorch.config.custom_op_default_layout_constraint``, which a user may change): Inductor
# passes each input with the strides eager would have, so no kernel or peer library ever sees strides
# it was not written for (the kernels make the last dim contiguous themselves, the peers copy when they
# must). ``triton_op`` kernels take no tags: Inductor traces into them and hands them strides directly.
LAYOUT_TAGS = (torch.Tag.needs_exact_strides,)

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SM80, SM89, SM90, SM100, SM103 = (8, 0), (8, 9), (9, 0), (10, 0), (10, 3)
DEEPSEEK_DECODE = ((512, 64),)  # (kv_lora_rank, rope_dim)
DEEPSEEK_PREFILL = ((192, 128),)  # (qk_head_dim, v_head_dim)

# CUDA-graph support: "full" = captured once, replays with any lengths (nothing read on the host);
# "planned" = capturable when its host-side plan (use_cuda_graph=True) is redone before each replay;
# "none" = reads lengths on the host, never captured.
GRAPH_LEVELS = ("full", "planned", "none")
COSTS = ("lengths", "capacity")  # what a backend's time follows (Backend.cost)


def _always() -> bool:
    return True


@dataclass(frozen=True)
class OpInfo:
    """One op: ``name`` (the selector's key, e.g. "decode"), ``key`` (the op's name in errors, "mla.decode"),
    ``cache`` (whether the op reads a paged cache whose dtype the backends constrain), ``env``: how a single
    ``MLA_COMPILE_BACKEND`` name applies ("all": every backend must exist, the attention ops; "if_present":
    used when the op has that backend; "named": only a per-op entry ``op=name`` applies)."""

    name: str
    key: str
    cache: bool = False
    env: str = "named"


@dataclass(frozen=True)
class Backend:
    """One backend of one op. ``None`` for a constraint means "any".

    ``fn`` runs it with the op's arguments (and ``plan=`` when ``needs_plan``); ``rank`` orders the backends
    of an op when no timings apply (lower first). ``head_dims``: decode ``(kv_lora_rank, rope_dim)``,
    prefill ``(qk_head_dim, v_head_dim)``, merge and v4_attention ``(D,)``. ``block_multiple``: page sizes must be a
    multiple of it; ``stride_align``: the cache's page and row strides are multiples of it (bytes of a
    uint8 cache); ``packed_rows``: rows are dense (row stride = row width). ``host_sync``: reads lengths on
    the host every call ("auto" skips it). ``gpu_tested``: passed its CUDA tests on a GPU ("auto" skips the
    others). ``autotune``: a candidate of the Inductor autotune lowering.
    The block linears' forms: ``act_quant_only`` (runs only with the activation quantized), ``grouped`` (serves
    3-D weights and sorted groups), ``k_multiple`` (K must be a multiple of it). ``auto_skip``: why "auto" never
    picks it although it serves (empty: "auto" may). ``cost``: what the backend's time follows, "lengths" (the
    sequences' lengths, as its timing rows were measured) or "capacity" (a paged decode's block-table width whatever
    the lengths: "auto" ranks it at its time for the call's capacity, and passes over it where the call names
    none). ``tiers``: a composite that runs ``backend`` for steps
    of at most ``rows`` query rows, ``((rows, backend), ..., (None, backend))``; its timing is its parts'.
    ``kernels``: names of ops and Triton kernels that belong to this backend (``mla-compile inspect``),
    ``"name"`` or ``"name=label"``. ``plan_id_fn``: for a backend that needs a plan, the op that runs it
    given the plan's static id as a last argument (what a split calls). ``derived``: a split made by the
    selector (:func:`declare_split`), not declared by a kernel file: left out of :func:`priority`.
    ``schedule_fn``: for a backend that can take a step schedule made once for every layer of a step (FlashMLA's
    split schedule), the op that runs it given the op's arguments and then the schedule's tensors (a split, or a
    declared composite with ``tiers``, whose one scheduling part takes it, has one too). ``make_schedule``: the
    function making that schedule, ``(seq_lens, num_heads, query_len, min_rows, max_rows) -> tuple of tensors``
    (a step of query rows outside ``(min_rows, max_rows]``, -1 unbounded, may get it unmade): see
    :func:`step_schedule`.
    """

    name: str
    op: str
    fn: Callable
    rank: int
    devices: tuple[str, ...] = ("cuda",)
    available: Callable[[], bool] = _always
    dtypes: tuple[torch.dtype, ...] = HALF
    cache_dtypes: tuple[torch.dtype, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    block_multiple: int | None = None
    stride_align: int | None = None
    packed_rows: bool = False
    num_heads: tuple[int, ...] | None = None
    head_dims: tuple[tuple[int, ...], ...] | None = None
    max_head_dim: int | None = None
    multi_query: bool = True
    sparse: bool = False
    lse: bool = True
    needs_plan: bool = False
    host_sync: bool = False
    cuda_graph: str = "full"
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    package: str | None = None
    gpu_tested: bool = False
    autotune: bool = False
    act_quant_only: bool = False
    grouped: bool = True
    k_multiple: int | None = None
    auto_skip: str = ""
    cost: str = "lengths"
    tiers: tuple[tuple[int | None, str], ...] = ()
    kernels: tuple[str, ...] = ()
    note: str = ""
    plan_id_fn: Callable | None = None
    derived: bool = False
    schedule_fn: Callable | None = None
    make_schedule: Callable | None = None

    @property
    def backend(self) -> str:
        return self.name

    @property
    def takes_plan(self) -> bool:
        return self.needs_plan

    def __post_init__(self) -> None:
        if self.cuda_graph not in GRAPH_LEVELS:
            raise ValueError(f"backend {self.name!r} of {self.op!r}: cuda_graph must be one of {GRAPH_LEVELS}, "
                             f"got {self.cuda_graph!r}")
        if self.cost not in COSTS:
            raise ValueError(f"backend {self.name!r} of {self.op!r}: cost must be one of {COSTS}, got {self.cost!r}")


BackendSpec = Backend  # the name mla_compile.backends has always exported

OPS: dict[str, OpInfo] = {}
_BY_KEY: dict[str, str] = {}
_TABLE: dict[str, dict[str, Backend]] = {}  # op name -> backend name -> Backend (the live table)
_KERNELS: dict[str, str] = {}  # op / Triton kernel name -> the label ``inspect`` prints


def declare_op(name: str, key: str, *, cache: bool = False, env: str = "named") -> str:
    """Declare op ``name`` (``key`` is its name in errors, e.g. "mla.decode"); returns ``key``."""
    OPS[name] = OpInfo(name, key, cache, env)
    _BY_KEY[key] = name
    _TABLE.setdefault(name, {})
    return key


def op_name(op: str) -> str:
    """The registry's name of ``op``, given as either its name ("decode") or its key ("mla.decode")."""
    if op in OPS:
        return op
    if op in _BY_KEY:
        return _BY_KEY[op]
    raise ValueError(f"unknown mla op {op!r}; declared: {sorted(OPS)}")


def _kernel_base(name: str) -> str:
    return name.split("::")[-1].split(".")[0]


def declare_kernels(label: str, *names: str) -> None:
    """Name ``label`` as the backend of ops/kernels that serve no op's selection (fusion passes, autotune)."""
    for n in names:
        _KERNELS[_kernel_base(n)] = label


def declare(op: str, name: str, fn: Callable, **caps) -> Backend:
    """Declare backend ``name`` of ``op`` (its name or key), run by ``fn``, with capabilities ``caps``
    (the fields of :class:`Backend`). A custom op's own name counts among its kernels."""
    opn = op_name(op)
    spec = Backend(name, opn, fn, **caps)
    _TABLE[opn][name] = spec
    own = getattr(fn, "_qualified_op_name", None) or getattr(getattr(fn, "_opoverload", None), "name", None)
    for entry in ((own,) if isinstance(own, str) else ()) + spec.kernels:
        kernel, _, label = entry.partition("=")
        _KERNELS[_kernel_base(kernel)] = label or name
    return spec


def backends_for(op: str) -> dict[str, Backend]:
    """The live table of ``op``'s backends by name (its name or key); an empty dict for an unknown op."""
    try:
        return _TABLE[op_name(op)]
    except ValueError:
        return {}


def priority(op: str) -> tuple[str, ...]:
    """``op``'s declared backends in their static order (the order "auto" follows without timings); the
    selector's derived splits are left out."""
    table = backends_for(op)
    return tuple(sorted((n for n in table if not table[n].derived), key=lambda n: (table[n].rank, n)))


# Splits: "auto" may find that different backends win at different batch sizes of one shape class. A split
# runs, inside one op of the graph, the part whose bound covers the call's query rows (B * s_q, a static
# shape at run time, so nothing is read on the host and each CUDA-graph size records its own part).
SPLIT_PREFIX = "split:"
_SPLIT_OPS: dict[str, tuple[Callable, str, str]] = {}
_SPLIT_SCHEDULES: dict[str, int] = {}  # ops whose split op takes a step schedule: its tensor count
SPLIT_ROWS = ("batch", "tokens")  # what a split's row bound counts: query rows B * s_q, or tokens T


def declare_split_op(op: str, split_op: Callable, rows: str, schedule_tensors: int = 0) -> None:
    """Let ``op`` be split: ``split_op`` is the custom op taking the op's arguments, then the split's text
    (:func:`split_name` without the prefix) and a plan id (-1: none), that runs :func:`run_split_part`.
    ``rows``: "batch" (a timing row's batch bound is the split bound; the op counts ``B * s_q`` query rows) or
    "tokens" (batch bound times context bound; the op counts its tokens). ``schedule_tensors``: when > 0, the
    split op also takes a step schedule of that many tensors after the plan id (optional, None: none), handed to
    a part that takes one."""
    if rows not in SPLIT_ROWS:
        raise ValueError(f"declare_split_op: rows must be one of {SPLIT_ROWS}, got {rows!r}")
    kernel = split_op._qualified_op_name if hasattr(split_op, "_qualified_op_name") else split_op._opoverload.name()
    _SPLIT_OPS[op_name(op)] = (split_op, _kernel_base(kernel), rows)
    if schedule_tensors:
        _SPLIT_SCHEDULES[op_name(op)] = schedule_tensors
    declare_kernels("split", kernel)


def split_rows(op: str) -> str | None:
    """What ``op``'s split bounds count ("batch" / "tokens"); None when ``op`` cannot be split."""
    entry = _SPLIT_OPS.get(op_name(op))
    return entry[2] if entry else None


def run_split_part(op: str, tiers: str, rows: int, args: tuple, plan_id: int, schedule: tuple | None = None):
    """Run the part of split ``tiers`` that serves ``rows`` on the op's ``args`` (the body of a split op);
    a part that needs a plan gets ``plan_id`` (ValueError when it is -1); a part that takes a step schedule gets
    ``schedule`` when given (tensors, or None each where the call gave none)."""
    name = split_part(parse_split(tiers), rows)
    spec = backends_for(op).get(name)
    if spec is None:
        raise ValueError(f"{OPS[op_name(op)].key}: split {tiers!r} runs {name!r} for {rows} rows, which is not a "
                         f"declared backend; declared: {priority(op)}")
    if schedule is not None and all(t is not None for t in schedule) and spec.schedule_fn is not None:
        return spec.schedule_fn(*args, *schedule)
    if not spec.needs_plan:
        return spec.fn(*args)
    if plan_id < 0 or spec.plan_id_fn is None:
        raise ValueError(f"{OPS[op_name(op)].key}: split {tiers!r} runs {name!r} for {rows} rows, which needs a "
                         f"host plan, and none was given")
    return spec.plan_id_fn(*args, plan_id)


def _split_fn(op: str, split_op: Callable, tiers: str, needs_plan: bool, schedule_tensors: int = 0) -> Callable:
    """The backend function of a split: the op's arguments (and ``plan=`` when a part needs one); with
    ``schedule_tensors``, the same taking a step schedule of that many tensors after the op's arguments (the
    split's ``schedule_fn``)."""
    key = OPS[op_name(op)].key

    def run(*args, plan: object | None = None):
        plan_id = getattr(plan, "plan_id", None)
        if needs_plan and not isinstance(plan_id, int):
            raise ValueError(f"{key}: split {tiers!r} needs plan= (a host plan with a plan_id, made before the "
                             f"step), got {type(plan).__name__}")
        if schedule_tensors:
            return split_op(*args[:-schedule_tensors], tiers, plan_id if needs_plan else -1,
                            *args[-schedule_tensors:])
        return split_op(*args, tiers, plan_id if needs_plan else -1)
    return run


def _schedule_part(tiers: tuple[tuple[int | None, str], ...], table: dict[str, Backend]
                   ) -> tuple[Backend, int, int] | None:
    """The one part of ``tiers`` that makes a step schedule, with the rows it serves ``(min_rows, max_rows]``
    (-1: unbounded); None when no part or more than one does."""
    found, low = [], 0
    for bound, name in tiers:
        part = table.get(name)
        if part is not None and part.make_schedule is not None and part.schedule_fn is not None:
            found.append((part, low, -1 if bound is None else bound))
        low = bound if bound is not None else low
    return found[0] if len(found) == 1 else None


def step_schedule(op: str, name: str, seq_lens: Tensor, num_heads: int, query_len: int = 1) -> tuple | None:
    """The step schedule backend ``name`` of ``op`` takes (``schedule=`` of every layer's call of the step), made
    from the step's ``seq_lens`` for calls of ``num_heads`` heads and ``query_len`` queries a sequence; None when
    it takes none. A split's is made for the rows its scheduling part serves (other steps get no scheduler
    launch). On the step's device, capturable: made inside a compiled or captured step, before its layers."""
    table = backends_for(op)
    spec = table.get(name)
    if spec is None or spec.schedule_fn is None:
        return None
    if spec.make_schedule is not None and not spec.tiers:
        return tuple(spec.make_schedule(seq_lens, num_heads, query_len, 0, -1))
    found = _schedule_part(spec.tiers, table)
    if found is None:
        return None
    part, low, high = found
    return tuple(part.make_schedule(seq_lens, num_heads, query_len, low, high))


def takes_schedule(op: str, name: str) -> bool:
    """Whether backend ``name`` of ``op`` takes a step schedule (``schedule=``; see :func:`step_schedule`)."""
    spec = backends_for(op).get(name)
    return spec is not None and spec.schedule_fn is not None


def split_name(tiers: tuple[tuple[int | None, str], ...]) -> str:
    """``((2, "triton"), (None, "flashinfer"))`` -> ``"split:triton:2/flashinfer"``."""
    return SPLIT_PREFIX + "/".join(n if b is None else f"{n}:{b}" for b, n in tiers)


def parse_split(text: str) -> tuple[tuple[int | None, str], ...]:
    """The inverse of :func:`split_name` (with or without its prefix); ValueError naming a malformed text."""
    body = text[len(SPLIT_PREFIX):] if text.startswith(SPLIT_PREFIX) else text
    tiers = []
    for part in body.split("/"):
        name, _, bound = part.partition(":")
        if not name or (bound and not bound.isdigit()):
            raise ValueError(f"split {text!r}: expected 'name:rows/.../name' (rows a positive int), got {part!r}")
        tiers.append((int(bound) if bound else None, name))
    if any(b is None for b, _ in tiers[:-1]) or tiers[-1][0] is not None:
        raise ValueError(f"split {text!r}: every part but the last needs a row bound, and the last none")
    bounds = [b for b, _ in tiers[:-1]]
    if bounds != sorted(set(bounds)):
        raise ValueError(f"split {text!r}: row bounds must increase, got {bounds}")
    return tuple(tiers)


def split_part(tiers: tuple[tuple[int | None, str], ...], rows: int) -> str:
    """The part of ``tiers`` that serves a call of ``rows`` query rows."""
    return next(name for bound, name in tiers if bound is None or rows <= bound)


def declare_split(op: str, tiers: tuple[tuple[int | None, str], ...]) -> Backend:
    """The split backend of ``op`` over ``tiers`` (declared on first use, derived: it keeps the weakest
    capability of its parts); the parts must be declared backends of ``op``."""
    opn = op_name(op)
    name = split_name(tuple(tiers))
    tiers = parse_split(name)
    table = _TABLE[opn]
    if name in table:
        return table[name]
    if opn not in _SPLIT_OPS:
        raise ValueError(f"{OPS[opn].key} has no split op (declare_split_op)")
    unknown = [n for _, n in tiers if n not in table]
    if unknown:
        raise ValueError(f"{OPS[opn].key}: split {name!r} names unknown backends {unknown}")
    parts = [table[n] for _, n in tiers]
    needs_plan = any(p.needs_plan for p in parts)
    level = GRAPH_LEVELS[max(GRAPH_LEVELS.index(p.cuda_graph) for p in parts)]
    devices = tuple(d for d in parts[0].devices if all(d in p.devices or "any" in p.devices for p in parts))
    split_op, kernel, _ = _SPLIT_OPS[opn]
    arity = _SPLIT_SCHEDULES.get(opn, 0)
    scheduled = arity and _schedule_part(tiers, table) is not None
    spec = Backend(name, opn, _split_fn(opn, split_op, name[len(SPLIT_PREFIX):], needs_plan), rank=0,
                   schedule_fn=_split_fn(opn, split_op, name[len(SPLIT_PREFIX):], needs_plan, arity) if scheduled
                   else None,
                   kernels=(f"{kernel}=split",),
                   devices=devices or parts[0].devices, available=lambda: all(p.available() for p in parts),
                   lse=all(p.lse for p in parts), needs_plan=needs_plan, host_sync=any(p.host_sync for p in parts),
                   cuda_graph=level, gpu_tested=all(p.gpu_tested for p in parts), tiers=tiers, derived=True,
                   note="split by query rows: " + ", ".join(
                       f"{n} up to {b}" if b is not None else f"{n} above" for b, n in tiers))
    table[name] = spec
    return spec


def kernel_backend(name: str) -> str:
    """The backend an op name (``mla::decode_flashmla`` -> ``flashmla``) or a Triton kernel belongs to; "?" if none."""
    return _KERNELS.get(_kernel_base(name), "?")


_CAPABILITIES: dict[int, tuple[int, int]] = {}  # CUDA device index -> (major, minor): it never changes in a process


def device_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """``(major, minor)`` compute capability of a CUDA device, or None without one. Asked of the driver once a
    device (eager adapter calls check it on every call)."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    cap = _CAPABILITIES.get(index)
    if cap is None:
        cap = _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))  # type: ignore[assignment]
    return cap


def call_impl(op: str, impl: Backend, args: tuple, plan: object | None, schedule: tuple | None = None):
    """Run ``impl.fn(*args)``, passing ``plan=`` when given; with a step ``schedule`` (a tuple of tensors),
    ``impl.schedule_fn(*args, *schedule)``. A plan or a schedule for a backend that takes none is an error."""
    if schedule is not None:
        if impl.schedule_fn is None or (plan is not None and not impl.needs_plan):
            takers = [b for b in priority(op) if backends_for(op)[b].schedule_fn is not None]
            raise ValueError(f"{OPS[op_name(op)].key}: schedule= is a step schedule of the backends that take one "
                             f"({takers}, and the splits that run them), plan= only beside it for those that also "
                             f"plan; backend {impl.name!r}"
                             f"{' got plan= too' if impl.schedule_fn is not None else ' takes none'}: drop schedule= "
                             "or pick one of those")
        if impl.needs_plan:
            return impl.schedule_fn(*args, *schedule, plan=plan)
        return impl.schedule_fn(*args, *schedule)
    if plan is None:
        return impl.fn(*args)
    if not impl.needs_plan:
        takers = sorted(b for b, i in backends_for(op).items() if i.needs_plan)
        raise ValueError(f"{OPS[op_name(op)].key}: plan= is only used by backends that plan on the host ({takers}); "
                         f"backend {impl.name!r} takes none: drop plan= or pick one of those")
    return impl.fn(*args, plan=plan)
