"""What ``torch.compile`` made of a function: graphs, graph breaks, recompiles, custom ops, compile time.

:func:`inspect_compile` compiles any function or module, lets a caller-supplied ``run_steps`` drive it,
and returns an :class:`InspectReport`; with ``out_dir`` it also writes ``report.txt``,
``report.json`` and (when depyf is installed) a depyf dump of the decompiled bytecode, FX graphs and
Inductor output code. :class:`CompileWatch` is the counting part alone, for code that compiles on
its own (the demo). This module depends only on torch (and optionally depyf); when ``mla_compile.ops`` is importable
it also reports the autotune decisions of ``mla_compile.lowerings`` and the fusion passes that fired
(``counters["mla_passes"]``), and names the backend of every ``mla::`` op in the output code.

Sources (torch 2.11-2.13, private but stable across them): ``torch._dynamo.utils.counters``
(graph breaks, unique graphs, cache hits), ``torch._dynamo.utils.graph_break_reasons`` (where each
break happened), ``torch._dynamo.utils.get_compilation_metrics()`` (one record per frame compile:
recompile reason, compile time) and ``GraphLowering.save_output_code`` (the Inductor output code;
also called on FX-graph-cache hits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import linecache
import os
import re
import shutil
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch._dynamo
from torch._dynamo.utils import counters


FP8_LINEAR_AUTOTUNE = "mla::fp8_block_linear_autotune"  # the op whose autotune picks get a summary line


@dataclass
class GraphBreak:
    """One distinct graph break: a short ``reason``, how often Dynamo hit it, where, and the full text."""

    reason: str
    count: int
    locations: list[str] = field(default_factory=list)
    detail: str = ""
    source_lines: list[str] = field(default_factory=list)


@dataclass
class Recompile:
    """One recompilation: the frame's compile id (``frame/attempt``), its function and the guard that failed."""

    compile_id: str
    function: str
    reason: str


@dataclass
class GraphInfo:
    """One graph handed to the backend: its compile id, function, op count and namespace ops it calls."""

    compile_id: str
    function: str
    num_ops: int
    custom_ops: list[str]


def short_reason(reason: str) -> str:
    """The first line of a Dynamo graph-break message plus its ``Explanation:`` line, if any."""
    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
    if not lines:
        return "unknown reason"
    head = lines[0]
    explanation = next((ln for ln in lines[1:] if ln.startswith("Explanation:")), None)
    return f"{head} ({explanation[len('Explanation:'):].strip()})" if explanation else head


class CompileWatch:
    """Context manager counting what Dynamo compiles while it is active (any ``torch.compile`` call).

    After exit: ``graph_count``, ``graph_breaks`` (list of :class:`GraphBreak`), ``recompiles`` (list of
    :class:`Recompile`), ``compile_time_s`` (Dynamo + backend time of every frame compiled) and
    ``cache_hits`` (AOTAutograd / FX graph cache hits, which make compiles fast and dumps partial).
    Works by differencing global counters, so nested or concurrent compiles of other code count too.
    """

    def __init__(self) -> None:
        self.graph_count = 0
        self.graph_breaks: list[GraphBreak] = []
        self.recompiles: list[Recompile] = []
        self.compile_time_s = 0.0
        self.frames_compiled = 0
        self.cache_hits: dict[str, int] = {}
        self.guard_count = 0
        self.compile_phases_s: dict[str, float] = {}
        self.cudagraph_skips: list[str] = []
        self.cudagraph_skip_count = 0
        self.passes_fired: dict[str, int] = {}
        self.passes_skipped: dict[str, int] = {}
        self.autotune: list[dict] = []

    def __enter__(self) -> "CompileWatch":
        self._t0 = time.time()
        self._breaks0 = Counter(counters["graph_break"])
        self._graphs0 = counters["stats"]["unique_graphs"]
        self._inductor0 = Counter(counters["inductor"])
        self._aot0 = Counter(counters["aot_autograd"])
        self._reasons0 = len(_graph_break_reasons())
        self._passes0 = Counter(counters["mla_passes"])
        self._skipped0 = Counter(counters["mla_passes_skipped"])
        self._log0 = _autotune_mark()
        self._skip_msgs: list[str] = []
        self._unhook = _hook_cudagraph_skips(self._skip_msgs)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._unhook()
        self.update()

    def update(self) -> None:
        """Recompute every field from the counters (called on exit; call it earlier for a live view)."""
        self.graph_count = counters["stats"]["unique_graphs"] - self._graphs0
        breaks = Counter(counters["graph_break"]) - self._breaks0
        reasons = _graph_break_reasons()
        new_reasons = reasons[self._reasons0:] if len(reasons) >= self._reasons0 else reasons
        where: dict[str, list[str]] = {}
        code: dict[str, list[str]] = {}
        for r in new_reasons:
            frames = getattr(r, "user_stack", None) or []
            if frames:
                f = frames[-1]
                loc = f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
                locs = where.setdefault(getattr(r, "reason", ""), [])
                if loc not in locs:
                    locs.append(loc)
                    text = (getattr(f, "line", None) or linecache.getline(f.filename, f.lineno or 0)).strip()
                    code.setdefault(getattr(r, "reason", ""), []).append(text)
        self.graph_breaks = [GraphBreak(short_reason(k), n, where.get(k, []), k, code.get(k, []))
                             for k, n in breaks.most_common()]
        self.recompiles, self.compile_time_s, self.frames_compiled = [], 0.0, 0
        self.guard_count, phases = 0, Counter()
        for m in _compilation_metrics():
            if (getattr(m, "start_time", None) or 0.0) < self._t0:
                continue
            self.frames_compiled += 1
            self.compile_time_s += getattr(m, "entire_frame_compile_time_s", None) or 0.0
            self.guard_count += getattr(m, "guard_count", None) or 0
            for phase, attr, unit in _PHASES:
                phases[phase] += (getattr(m, attr, None) or 0) * unit
            reason = getattr(m, "recompile_reason", None)
            if reason:
                self.recompiles.append(Recompile(str(m.compile_id), str(m.co_name), _first_line(reason)))
        hits = {
            "aot_autograd": (Counter(counters["aot_autograd"]) - self._aot0)["autograd_cache_hit"],
            "fx_graph": (Counter(counters["inductor"]) - self._inductor0)["fxgraph_cache_hit"],
        }
        self.cache_hits = {k: v for k, v in hits.items() if v}
        self.compile_phases_s = {k: round(v, 4) for k, v in phases.items() if v}
        self.cudagraph_skip_count = (Counter(counters["inductor"]) - self._inductor0)["cudagraph_skips"]
        self.cudagraph_skips = list(dict.fromkeys(self._skip_msgs))
        self.passes_fired = dict(Counter(counters["mla_passes"]) - self._passes0)
        self.passes_skipped = dict(Counter(counters["mla_passes_skipped"]) - self._skipped0)
        self.autotune = _autotune_since(self._log0)

    @property
    def graph_break_count(self) -> int:
        """Graph breaks hit (each distinct reason counted as often as Dynamo met it)."""
        return sum(b.count for b in self.graph_breaks)


@dataclass
class InspectReport:
    """What :func:`inspect_compile` found; ``to_text()`` for people, ``to_json()`` for tools."""

    graphs: list[GraphInfo]
    graph_breaks: list[GraphBreak]
    recompiles: list[Recompile]
    ops_in_graphs: list[str]
    ops_in_output_code: list[str]
    compile_time_s: float
    run_time_s: float
    backend: str
    fullgraph: bool
    namespace: str
    cache_hits: dict[str, int] = field(default_factory=dict)
    dump_dir: str | None = None
    dump_files: list[str] = field(default_factory=list)
    dump_skipped: str | None = None
    output_code_files: list[str] = field(default_factory=list)
    user_triton_kernels: list[str] = field(default_factory=list)
    error: str | None = None
    torch_version: str = torch.__version__
    guard_count: int = 0
    compile_phases_s: dict[str, float] = field(default_factory=dict)
    mla_ops: list[dict] = field(default_factory=list)
    autotune: list[dict] = field(default_factory=list)
    passes_fired: dict[str, int] = field(default_factory=dict)
    passes_skipped: dict[str, int] = field(default_factory=dict)
    cudagraph_skip_count: int = 0
    cudagraph_skips: list[str] = field(default_factory=list)

    @property
    def graph_count(self) -> int:
        """Graphs compiled (one per frame compile that produced a graph, recompiles included)."""
        return len(self.graphs)

    @property
    def graph_break_count(self) -> int:
        """Graph breaks hit in total."""
        return sum(b.count for b in self.graph_breaks)

    @property
    def recompile_count(self) -> int:
        """Frames compiled again because a guard failed."""
        return len(self.recompiles)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, counts included."""
        d = dataclasses.asdict(self)
        d.update(graph_count=self.graph_count, graph_break_count=self.graph_break_count,
                 recompile_count=self.recompile_count)
        return d

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON (the content of ``report.json``)."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def to_text(self) -> str:
        """A short human-readable summary (the content of ``report.txt``)."""
        ns = self.namespace
        lines = [f"compile inspection: backend={self.backend} fullgraph={self.fullgraph} torch {self.torch_version}",
                 f"  graphs:        {self.graph_count}",
                 f"  graph breaks:  {self.graph_break_count}",
                 f"  recompiles:    {self.recompile_count}",
                 f"  guards:        {self.guard_count} (all frames compiled)",
                 f"  compile time:  {self.compile_time_s:.1f} s (whole run {self.run_time_s:.1f} s)"
                 + (f"; by phase: {', '.join(f'{k} {v:.2f} s' for k, v in self.compile_phases_s.items())}"
                    if self.compile_phases_s else ""),
                 f"  {ns}:: ops in Dynamo graphs:       {', '.join(self.ops_in_graphs) or 'none'}",
                 f"  {ns}:: ops in Inductor output code: {', '.join(self.ops_in_output_code) or 'none'}"]
        for op in self.mla_ops:
            lines.append(f"  final graph: {op['op']} -> backend {op['backend']}")
        for a in self.autotune:
            times = ", ".join(f"{k} {v:.3f} ms" if v is not None else f"{k} -" for k, v in a["timings_ms"].items())
            lines.append(f"  autotune {a['op']} {a['shapes']} {a['dtype']}: {a['winner']} ({a['winner_backend']})"
                         + (f" [{times}]" if times else ""))
        picks = Counter(a["winner_backend"] for a in self.autotune if a["op"] == FP8_LINEAR_AUTOTUNE)
        if picks:  # the fp8 linears of a model: one line of which backend the lowering picked, and how often
            lines.append("  fp8 linear backend (autotuned): " + ", ".join(f"{b} x{n}" for b, n in picks.items()))
        lines.append(f"  fusion passes fired: {', '.join(f'{k} x{v}' for k, v in self.passes_fired.items()) or 'none'}")
        if self.passes_skipped:
            lines.append(f"  fusion sites left alone: {'; '.join(f'{k} x{v}' for k, v in self.passes_skipped.items())}")
        if self.cudagraph_skip_count or self.cudagraph_skips:
            lines.append(f"  CUDA-graph skips: {self.cudagraph_skip_count}")
            lines.extend(f"    {r}" for r in self.cudagraph_skips)
        if self.user_triton_kernels:  # triton_op kernels pasted into the output code (CUDA)
            lines.append(f"  user Triton kernels in output code: {', '.join(self.user_triton_kernels)}")
        if self.cache_hits:
            lines.append(f"  compile cache hits: {self.cache_hits} (AOT/post-grad graphs are not re-dumped; "
                         "fresh=True / --fresh recompiles without caches)")
        for g in self.graphs:
            ops = f"; {', '.join(g.custom_ops)}" if g.custom_ops else ""
            lines.append(f"  graph {g.compile_id} ({g.function}): {g.num_ops} ops{ops}")
        for b in self.graph_breaks:
            at = f" at {', '.join(b.locations)}" if b.locations else ""
            lines.append(f"  break x{b.count}: {b.reason}{at}")
            lines.extend(f"    > {src}" for src in b.source_lines if src)
        for r in self.recompiles:
            lines.append(f"  recompile {r.compile_id} ({r.function}): {r.reason}")
        if self.dump_dir:
            lines.append(f"  depyf dump: {self.dump_dir} ({len(self.dump_files)} files)")
        elif self.dump_skipped:
            lines.append(f"  depyf dump skipped: {self.dump_skipped}")
        if self.output_code_files:
            lines.append(f"  output code: {', '.join(self.output_code_files)}")
        if self.error:
            shown = [ln for ln in self.error.splitlines() if ln.strip()][:4]
            lines.append("  ERROR while running: " + "\n    ".join(shown))
        return "\n".join(lines)

    def write(self, out_dir: str) -> None:
        """Write ``report.txt`` and ``report.json`` into ``out_dir``."""
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "report.txt"), "w") as f:
            f.write(self.to_text() + "\n")
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            f.write(self.to_json() + "\n")


def inspect_compile(fn: Callable, run_steps: Callable[[Callable], Any], out_dir: str | None = None, *,
                    backend: str | Callable = "inductor", fullgraph: bool = False, dynamic: bool | None = None,
                    namespace: str = "mla", reset: bool = True, dump: bool = True,
                    fresh: bool = False, options: dict | None = None) -> InspectReport:
    """Compile ``fn`` with ``torch.compile``, call ``run_steps(compiled_fn)``, and report what happened.

    Parameters
    ----------
    fn : callable or nn.Module to compile.
    run_steps : called once with the compiled ``fn``; it should call it with every input shape of
        interest (e.g. prefill then decode, two batch sizes) so graphs and recompiles show up.
    out_dir : where ``report.txt``, ``report.json`` and the depyf dump go; None writes nothing. The dump
        folder ``out_dir/depyf`` is emptied first; without depyf the Inductor output code goes to
        ``out_dir/output_code_N.py``.
    backend : a ``torch.compile`` backend name or callable; every graph passes through a recorder
        before it (to list ``namespace`` ops per graph).
    fullgraph : False (default) lets breaks happen so they are reported with reasons; True makes the
        first break an error, recorded in ``report.error``.
    namespace : custom-op namespace to look for (``"mla"`` finds ``torch.ops.mla.*``).
    reset : call ``torch._dynamo.reset()`` first so earlier compiles of ``fn`` do not hide graphs.
    dump : write a depyf dump (skipped, with the reason in ``report.dump_skipped``, if depyf is missing).
    fresh : compile with Inductor's caches disabled (slower; complete AOT/post-grad graph dumps).
    options : Inductor config patched in while ``run_steps`` runs (e.g. ``mla_compile.lowerings.compile_options()``
        for the MLA fusion passes).

    An exception raised by ``run_steps`` is recorded in ``report.error``, not raised.
    """
    from torch._inductor.graph import GraphLowering

    if reset:
        torch._dynamo.reset()
    backend_fn = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    backend_name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
    graphs: list[GraphInfo] = []
    output_code: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compile_id = torch._guards.CompileContext.current_compile_id()
        calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        graphs.append(GraphInfo(str(compile_id), "?", len(calls), _graph_custom_ops(gm, namespace)))
        return backend_fn(gm, example_inputs)

    dump_ctx: Any = contextlib.nullcontext()
    dump_dir = dump_skipped = None
    if not dump or out_dir is None:
        dump_skipped = "not requested" if not dump else "no out_dir given"
    else:
        try:
            import depyf
        except ImportError as e:
            dump_skipped = f"depyf is not installed ({e}); pip install 'mla-compile[inspect]'"
        else:
            dump_dir = os.path.join(out_dir, "depyf")
            shutil.rmtree(dump_dir, ignore_errors=True)  # ours alone: files of an earlier run would mislead
            os.makedirs(dump_dir)
            dump_ctx = depyf.prepare_debug(dump_dir)

    compiled = torch.compile(fn, backend=recording_backend, fullgraph=fullgraph, dynamic=dynamic)
    error = None
    patches = dict(options or {}, **({"force_disable_caches": True} if fresh else {}))
    cache_ctx = torch._inductor.config.patch(patches) if patches else contextlib.nullcontext()
    prev_hook = GraphLowering.save_output_code
    GraphLowering.save_output_code = staticmethod(output_code.append)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*You are trying to debug `torch.compile`.*")
            with CompileWatch() as watch, cache_ctx, dump_ctx:
                try:
                    run_steps(compiled)
                except Exception as e:  # reported, not raised: the report is the product
                    error = f"{type(e).__name__}: {str(e).strip()[:4000]}"
    finally:
        GraphLowering.save_output_code = prev_hook
    run_time = time.perf_counter() - t0

    names = {str(m.compile_id): str(m.co_name) for m in _compilation_metrics()}
    for g in graphs:
        g.function = names.get(g.compile_id, g.function)
    dump_files: list[str] = sorted(os.listdir(dump_dir)) if dump_dir is not None else []
    sources = list(output_code)
    for name in dump_files:  # output code that came another way (e.g. a subprocess compile)
        if ".kernel_" in name:
            with open(os.path.join(dump_dir, name), errors="replace") as f:
                sources.append(f.read())
    ops_in_code: set[str] = set()
    user_kernels: set[str] = set()
    pattern = re.compile(rf"torch\.ops\.{re.escape(namespace)}\.([A-Za-z_]\w*)")
    for code in sources:
        ops_in_code.update(f"{namespace}::{m}" for m in pattern.findall(code))
        # Inductor names its own kernels triton_{poi,red,per,tem,...}_*; other names are user kernels
        user_kernels.update(k for k in _TRITON_KERNEL.findall(code) if not k.startswith("triton_"))
    code_files: list[str] = []
    if out_dir is not None and dump_dir is None:  # without depyf, still keep the output code
        os.makedirs(out_dir, exist_ok=True)
        for stale in os.listdir(out_dir):
            if re.fullmatch(r"output_code_\d+\.py", stale):
                os.remove(os.path.join(out_dir, stale))
        for i, code in enumerate(output_code):
            code_files.append(f"output_code_{i}.py")
            with open(os.path.join(out_dir, code_files[-1]), "w") as f:
                f.write(code)

    report = InspectReport(
        graphs=graphs, graph_breaks=watch.graph_breaks, recompiles=watch.recompiles,
        ops_in_graphs=sorted({op for g in graphs for op in g.custom_ops}), ops_in_output_code=sorted(ops_in_code),
        compile_time_s=watch.compile_time_s, run_time_s=run_time, backend=str(backend_name), fullgraph=fullgraph,
        namespace=namespace, cache_hits=watch.cache_hits, dump_dir=dump_dir, dump_files=dump_files,
        dump_skipped=dump_skipped, output_code_files=code_files, user_triton_kernels=sorted(user_kernels),
        error=error, guard_count=watch.guard_count, compile_phases_s=watch.compile_phases_s,
        mla_ops=[{"op": op, "backend": op_backend(op)} for op in sorted(ops_in_code)] + [
            {"op": k, "backend": op_backend(k)} for k in sorted(user_kernels) if op_backend(k) != "?"],
        autotune=watch.autotune, passes_fired=watch.passes_fired, passes_skipped=watch.passes_skipped,
        cudagraph_skip_count=watch.cudagraph_skip_count, cudagraph_skips=watch.cudagraph_skips)
    if out_dir is not None:
        report.write(out_dir)
    return report


# (phase, CompilationMetrics attribute, factor to seconds); absent attributes count 0. Per frame; the
# phases nest (inductor inside aot_autograd inside dynamo), so they do not add up to the total.
_PHASES = (("dynamo", "dynamo_cumulative_compile_time_us", 1e-6),
           ("aot_autograd", "aot_autograd_cumulative_compile_time_us", 1e-6),
           ("inductor", "inductor_cumulative_compile_time_us", 1e-6),
           ("inductor_codegen", "inductor_code_gen_cumulative_compile_time_us", 1e-6),
           ("kernel_compile", "triton_compile_time_us", 1e-6))

def op_backend(name: str) -> str:
    """The backend an ``mla::`` op name (``mla::decode_flashmla`` -> ``flashmla``) or a user Triton kernel serves,
    as declared in the backend registry (:func:`mla_compile.ops.registry.kernel_backend`); "?" if unknown."""
    from mla_compile.ops.registry import kernel_backend

    return kernel_backend(name)


def _autotune_mark() -> int:
    try:
        from mla_compile.ops import _compile_log
    except ImportError:
        return 0
    return _compile_log.mark()


def _autotune_since(position: int) -> list[dict]:
    """Autotune decisions recorded by ``mla_compile.lowerings`` since ``position`` (plain dicts)."""
    try:
        from mla_compile.ops import _compile_log
    except ImportError:
        return []
    return [dataclasses.asdict(r) for r in _compile_log.records_since(position)]


def _hook_cudagraph_skips(sink: list[str]) -> Callable[[], None]:
    """Collect Inductor's "skipping cudagraphs due to ..." messages into ``sink``; returns the unhook."""
    try:
        from torch._inductor import cudagraph_utils
    except ImportError:
        return lambda: None
    logger = getattr(cudagraph_utils, "cudagraphs_log", None) or getattr(cudagraph_utils, "perf_hint_log", None)
    if logger is None:
        return lambda: None
    original = logger.warning

    def warning(msg, *args, **kwargs):
        text = str(msg) % args if args else str(msg)
        if "cudagraph" in text.lower():
            sink.append(_first_line(text))
        return original(msg, *args, **kwargs)

    logger.warning = warning
    return lambda: setattr(logger, "warning", original) if logger.warning is warning else None


_TRITON_KERNEL = re.compile(r"async_compile\.triton\(\s*['\"](\w+)['\"]")


def _graph_custom_ops(gm: torch.fx.GraphModule, namespace: str) -> list[str]:
    """``ns::name`` of every op of ``namespace`` called in ``gm`` (OpOverload or OpOverloadPacket targets)."""
    found = []
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            qualified = target._schema.name
        elif isinstance(target, torch._ops.OpOverloadPacket):
            qualified = target._qualified_op_name
        else:
            continue
        if qualified.split("::")[0] == namespace and qualified not in found:
            found.append(qualified)
    return sorted(found)


def _graph_break_reasons() -> list:
    return list(getattr(torch._dynamo.utils, "graph_break_reasons", []))


def _compilation_metrics() -> list:
    get = getattr(torch._dynamo.utils, "get_compilation_metrics", None)
    return list(get()) if get is not None else []


def _first_line(text: str) -> str:
    """First line of ``text`` with runs of spaces collapsed (guard reasons are column-aligned)."""
    return re.sub(r"\s+", " ", text.strip().splitlines()[0]) if text.strip() else text
