"""Warm start: a fresh process over the compile caches of an earlier one, ready to serve without re-tracing.

A process that compiles a model fills Inductor's FX-graph cache and AOTAutograd's cache (under
``TORCHINDUCTOR_CACHE_DIR``), so a later process skips AOTAutograd and Inductor; Dynamo still traces every
graph again, and on torch 2.11 it traces every nested compile region of ``patch(..., regional_compile=True)``
once per layer (2.12+ stamps a traced region out instead), which is most of a warm start. This module adds:

- :func:`enable_warm_start`: turn on torch's Dynamo cache (``torch._dynamo.config.caching_precompile``) for
  the ``torch.compile`` calls that follow, when asked for (``dynamo=True``; by default on no torch version now,
  :func:`dynamo_cache_status` says why): a process then installs the saved bytecode, guards and compiled graphs at
  ``torch.compile`` time and its first steps run them without tracing. A step whose guards fail (another model, a
  new shape) compiles as usual. On torch 2.11 it serves the CPU toy and the GPU model's step (BENCHMARKS.md run
  200); a step holding a guard the cache cannot save compiles and is left out of the cache; a model class defined
  in a local scope fails its compile (torch's TypeError), one reason it stays opt-in.
- :func:`save_warm_start`: after the warm-up steps, write the Dynamo cache entries into the local cache
  (what a later :func:`enable_warm_start` process loads) and return (or write to ``path``) torch's portable
  "mega-cache" of every compile artifact (``torch.compiler.save_cache_artifacts``).
- :func:`load_warm_start`: fill the local caches of this process from such a file (another machine, an
  empty ``TORCHINDUCTOR_CACHE_DIR``) before ``torch.compile``.
- :func:`compile_breakdown`: where this process's compile time went (Dynamo tracing, guards, AOTAutograd +
  Inductor, loading compiled graphs) and the cache hits and misses.

No op, lowering or kernel of ours re-times anything at a warm start: the autotune lowerings
(:mod:`mla_compile.lowerings`) run inside Inductor's compile, which an FX-graph cache hit skips, and our
Triton kernels have no ``@triton.autotune``.

The Dynamo cache is torch's (private, experimental) API. Three defects in it are worked around here, each only
where a probe finds it: on torch 2.11 a guard on a function's default argument does not unpickle
(``DefaultsSource``'s pickling passes its derived fields) and a step that fails the loaded guards crashes
Dynamo's next trace (the loaded package's globals take the names the new trace generates); on 2.11-2.13 a step
holding a guard the cache cannot save (a class guard on ``type(<object>)``) fails its compile instead of being
left out of the cache. On torch 2.13 the
loaded guards never pass for steps marked dynamic (``greedy_generate``, the engine): they test dim-marking
attributes that the saved guards lost, so :func:`enable_warm_start` leaves the Dynamo cache off there by
default (2.13's Dynamo stamps regions out, so its warm start is mostly cache loads anyway).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import pickle
import re
import warnings

import torch

# torch versions whose Dynamo cache serves our compiled models across processes, so that enable_warm_start turns it on
# by default: none (the reasons below)
_DYNAMO_CACHE_VERSIONS: tuple[tuple[int, int], ...] = ()
# why it stays off by default on a torch that has it (BENCHMARKS.md runs 186 and 200 for 2.11); other versions: _OFF_ELSE
_OFF_REASONS = {(2, 11): "torch's Dynamo cache is experimental (a model class defined in a local scope fails its "
                         "compile with it on), so it is off unless asked for (enable_warm_start(True), for models it "
                         "serves: this repo's, CPU and GPU)"}
_OFF_ELSE = ("the saved guards of dynamic steps never pass on load (dim-marking guards), so a warm start uses the "
             "FX-graph / AOTAutograd caches only")
_FIXED: set[str] = set()


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def dynamo_cache_status() -> tuple[bool, str]:
    """``(usable, why)``: whether :func:`enable_warm_start` turns torch's Dynamo cache on by default here."""
    config = torch._dynamo.config
    if not hasattr(config, "caching_precompile"):
        return False, f"torch {torch.__version__} has no torch._dynamo.config.caching_precompile"
    try:
        from torch._dynamo.package import CompilePackage, DynamoCache  # noqa: F401
    except ImportError as e:
        return False, f"torch {torch.__version__}: no Dynamo cache ({e})"
    if _version() not in _DYNAMO_CACHE_VERSIONS:
        return False, f"torch {torch.__version__}: {_OFF_REASONS.get(_version(), _OFF_ELSE)}"
    return True, "torch's Dynamo cache (caching_precompile)"


def _fix_source_pickling() -> None:
    """torch 2.11: a guard source whose dataclass has ``init=False`` fields (``DefaultsSource``) pickles them too
    and cannot be unpickled; pickle the ``__init__`` fields only (what 2.13 does). Only where a probe fails."""
    if "sources" in _FIXED:
        return
    from torch._dynamo import source

    def reduce(self):
        return self.__class__, tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.init)

    probe = source.DefaultsSource(source.LocalSource("fn"), 0)
    try:
        pickle.loads(pickle.dumps(probe))
    except TypeError:
        for cls in vars(source).values():
            if (isinstance(cls, type) and issubclass(cls, source.Source) and dataclasses.is_dataclass(cls)
                    and any(not f.init for f in dataclasses.fields(cls))):
                cls.__reduce__ = reduce
    _FIXED.add("sources")


def _fix_global_names() -> None:
    """A loaded Dynamo package installs globals named like those a trace generates (``__builtins_dict___0``)
    into the traced function's module; a step that fails the loaded guards then traces and asserts on the taken
    name. Advance Dynamo's name counter past the installed names after each install."""
    if "names" in _FIXED:
        return
    from torch._dynamo import bytecode_transformation as bt
    from torch._dynamo.package import CompilePackage

    if not hasattr(bt, "_unique_id_counter"):
        raise AttributeError("torch._dynamo.bytecode_transformation has no _unique_id_counter")
    install = CompilePackage.install
    if getattr(install, "_mla_warm_start", False):
        _FIXED.add("names")
        return

    def install_and_skip_names(self, backends):
        install(self, backends)
        top = -1
        for module in list(getattr(self, "_installed_globals", {})):
            for name in list(vars(module)):
                found = re.fullmatch(r"__.*_(\d+)", name)
                if found:
                    top = max(top, int(found.group(1)))
        while top >= 0 and next(bt._unique_id_counter) < top:
            pass

    install_and_skip_names._mla_warm_start = True
    CompilePackage.install = install_and_skip_names
    _FIXED.add("names")


def _fix_unsaveable_guards() -> None:
    """torch 2.11-2.13: a step holding a guard the Dynamo cache cannot save (a class guard on ``type(<object>)``, a
    closure guard) bypasses its cache entry, and then ``convert_frame`` fails the compile on the entry's missing
    serialized guards. Give a bypassed entry empty bytes instead (a bypassed entry's guarded code is never saved),
    so such a step compiles as usual and is only left out of the cache. Only where ``convert_frame`` checks them."""
    if "bypass" in _FIXED:
        return
    from torch._dynamo import convert_frame, guards

    manager = guards.CheckFunctionManager
    init = manager.__init__
    if "check_fn.guards_state" not in inspect.getsource(convert_frame) or getattr(init, "_mla_warm_start", False):
        _FIXED.add("bypass")
        return
    params = inspect.signature(init)
    if "save_guards" not in params.parameters:
        raise AttributeError("torch._dynamo.guards.CheckFunctionManager takes no save_guards")

    @functools.wraps(init)
    def init_keeping_bypassed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.guards_state is None and params.bind(self, *args, **kwargs).arguments.get("save_guards"):
            self.guards_state = b""  # serialization failed and bypassed the entry (a strict save raises instead)

    init_keeping_bypassed._mla_warm_start = True
    manager.__init__ = init_keeping_bypassed
    _FIXED.add("bypass")


class _DroppedGuardNotes(logging.Filter):
    """Drops torch's per-guard "... guard on ... is dropped with caching_precompile=True." warnings (hundreds a
    compile of a deep model): the Dynamo cache drops identity guards (ID_MATCH, CLOSURE_MATCH, DICT_VERSION,
    WEAKREF_ALIVE) by design, since object identities differ between processes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "dropped with caching_precompile" not in str(record.msg)


_NOTES = _DroppedGuardNotes()


def enable_warm_start(dynamo: bool | None = None) -> bool:
    """Make the ``torch.compile`` calls that follow load (and, after :func:`save_warm_start`, save) torch's Dynamo
    cache in ``TORCHINDUCTOR_CACHE_DIR``, so a fresh process skips Dynamo's tracing of graphs whose guards pass.

    ``dynamo``: None turns it on where :func:`dynamo_cache_status` says it is usable; True wherever the torch has
    it (``NotImplementedError`` where it has none; a step whose loaded guards fail traces as usual); False turns
    it off. Returns whether it is on. Call it before ``torch.compile``, with the same choice in the process that
    saves and the one that loads (the choice is part of AOTAutograd's cache key); Inductor's and AOTAutograd's
    caches (on by default) are left as they are. The Dynamo cache is keyed by the compiled function's code: a
    process that compiles another model (other sizes, other layer count) over the same cache directory fails
    the loaded guards and compiles as usual. The cache drops identity guards (object ids differ between
    processes); with it on, torch's warning for each dropped guard is filtered out of ``torch._dynamo.guards``'s
    log.
    """
    config = torch._dynamo.config
    usable, why = dynamo_cache_status()
    if dynamo and not hasattr(config, "caching_precompile"):
        raise NotImplementedError(f"enable_warm_start(dynamo=True): {why}; pass dynamo=None or False")
    on = usable if dynamo is None else bool(dynamo)
    if on:
        try:
            _fix_source_pickling()
            _fix_global_names()
            _fix_unsaveable_guards()
        except (ImportError, AttributeError) as e:  # torch internals moved
            if dynamo:
                raise NotImplementedError(f"enable_warm_start(dynamo=True): torch {torch.__version__}'s Dynamo "
                                          f"cache internals moved ({type(e).__name__}: {e}); pass dynamo=None") from e
            warnings.warn(f"enable_warm_start: Dynamo cache left off on torch {torch.__version__} "
                          f"({type(e).__name__}: {e}); a warm start traces again", stacklevel=2)
            on = False
    if hasattr(config, "caching_precompile"):
        config.caching_precompile = on
    guards_log = logging.getLogger("torch._dynamo.guards")
    if on and _NOTES not in guards_log.filters:
        guards_log.addFilter(_NOTES)
    return on


def save_warm_start(path: str | os.PathLike | None = None) -> bytes | None:
    """After the warm-up steps: write this process's Dynamo cache entries (when :func:`enable_warm_start` turned
    it on) into ``TORCHINDUCTOR_CACHE_DIR`` and return torch's serialized compile artifacts (FX graphs,
    AOTAutograd entries, Triton kernels, autotune results, Dynamo entries), also written to ``path`` if given
    (for :func:`load_warm_start` on a machine with an empty cache). None when there is nothing to save."""
    saved = torch.compiler.save_cache_artifacts()
    data = None if saved is None else saved[0]
    if path is not None and data is not None:
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return data


def load_warm_start(path_or_bytes: str | os.PathLike | bytes) -> bool:
    """Fill this process's compile caches from :func:`save_warm_start`'s artifacts (a path or the bytes); call it
    before ``torch.compile`` (and after :func:`enable_warm_start`). Returns whether anything was loaded;
    a missing file raises ``FileNotFoundError``."""
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data = bytes(path_or_bytes)
    else:
        with open(path_or_bytes, "rb") as f:
            data = f.read()
    return torch.compiler.load_cache_artifacts(data) is not None


_PHASES = {  # our name -> torch's dynamo_timed names (torch 2.11-2.13), summed
    "compile": ("_compile.compile_inner",),
    "dynamo": ("bytecode_tracing",),
    "guards": ("build_guards", "precompile_build_guards", "precompile_load_guards"),
    "aot_inductor": ("OutputGraph.call_user_compiler",),
    "load": ("AOTAutogradCache.inductor_load",),
}
_COUNTS = {
    "dynamo_cache_hit": ("dynamo_cache", "dynamo_cache_hit"),
    "dynamo_cache_miss": ("dynamo_cache", "dynamo_cache_miss"),
    "aot_cache_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_cache_miss": ("aot_autograd", "autograd_cache_miss"),
    "fx_cache_hit": ("inductor", "fxgraph_cache_hit"),
    "fx_cache_miss": ("inductor", "fxgraph_cache_miss"),
    "graphs_traced": ("stats", "unique_graphs"),
}


def compile_breakdown() -> dict[str, float | int]:
    """This process's compile seconds by phase and cache counts so far (torch's ``dynamo_timed`` metrics and
    ``counters``): ``compile`` (all of Dynamo's frame compiles, loads included), ``dynamo`` (bytecode tracing),
    ``guards`` (building / loading guards), ``aot_inductor`` (the backend: AOTAutograd + Inductor, or their cache
    loads; on a Dynamo-cache hit the loads happen at ``torch.compile`` time instead, in ``load``), ``load``
    (loading compiled graphs), and ``dynamo_cache_hit``/``_miss``, ``aot_cache_hit``/``_miss``,
    ``fx_cache_hit``/``_miss``, ``graphs_traced``."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    out: dict[str, float | int] = {}
    for name, keys in _PHASES.items():
        out[name] = round(sum(sum(compilation_time_metrics.get(k, ())) for k in keys), 3)
    for name, (group, key) in _COUNTS.items():
        out[name] = int(counters[group][key])
    return out
