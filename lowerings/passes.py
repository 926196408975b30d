"""Post-grad fusion passes for MLA graphs (a ``CustomGraphPass`` with a stable ``uuid()``, so Inductor's
FX-graph cache keeps working: the uuid is the hash of this file).

``fuse_kv_write``: the latent RMSNorm (``kv_a_layernorm``), the RoPE of k_pe and the paged cache write
become one ``mla::write_latent_cache_fused`` call (one launch instead of a norm kernel, a rope kernel
and the write). The norm and the rope are found with Inductor's pattern matcher (patterns traced from
the model's own math for float32/bfloat16/float16 and both RoPE layouts, ``eps`` free); the write is
the functionalized ``mla::write_latent_cache_ref`` (``auto_functionalized``/``_v2``) or our Triton cache
write kernel (``triton_kernel_wrapper_functional``). The quantizing write into the 656-byte fp8 latent
cache (``mla::write_latent_cache_fp8_ref``, or the Triton fp8 write kernel that
``mla::write_latent_cache_fp8_triton`` decomposes into) is fused the same way: the fused op quantizes
when its cache is uint8. It fires only when the normed latent and the roped k_pe feed nothing but the
write (a decode-only step); otherwise the graph is left alone.

Switch on per compile: ``torch.compile(m, options=mla_compile.lowerings.compile_options())``, or
``with mla_compile.lowerings.mla_passes(): ...`` around the first call. ``MLA_COMPILE_PASSES=0`` (read
in :mod:`mla_compile.envs`) makes both a no-op, for a before/after comparison; a comma-separated list of
pass names (``MLA_COMPILE_PASSES=fuse_kv_write``) runs only those, to measure one pass at a time. Each
rewrite counts in ``torch._dynamo.utils.counters["mla_passes"]`` under ``COUNTER_KEYS``: ``fuse_kv_write``
for a float cache, ``fuse_kv_write_fp8`` for an fp8 one, and the two below (the inspect report lists them).

``fuse_absorb_q`` / ``fuse_absorb_out`` (:mod:`mla_compile.lowerings.absorb`): the absorbed decode's
``q_nope @ W_UK`` + ``cat`` with q_pe, and ``out_lat @ W_UV`` + the reshape for ``o_proj``, become
``mla::absorb_q`` / ``mla::absorb_out``, which write the matmul straight into the final layout (the
copy Inductor makes after each bmm is gone). Counted under their names in the same counters.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import operator
from collections import Counter
from typing import Iterator

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from mla_compile import envs
from mla_compile.lowerings import absorb
from mla_compile.lowerings.absorb import fuse_absorb_out, fuse_absorb_q
from mla_compile.ops.fused_kv_write import rms_norm, rope

COUNTER_KEYS = ("fuse_kv_write", "fuse_kv_write_fp8", "fuse_absorb_q", "fuse_absorb_out")  # counters["mla_passes"]
_EPS_PLACEHOLDER = 1.2345e-6  # a value no model uses: traced patterns leave eps as a free scalar


def _norm_search(latent, weight):
    return rms_norm(latent, weight, _EPS_PLACEHOLDER)


def _rope_search_interleave(k_pe, cos, sin):
    return rope(k_pe, cos, sin, True)


def _rope_search_half(k_pe, cos, sin):
    return rope(k_pe, cos, sin, False)


@functools.lru_cache(maxsize=None)
def _patterns(dtype: torch.dtype):
    """(norm pattern, {interleave: rope pattern}) traced for activations of ``dtype`` (traced once)."""
    from torch._inductor.pattern_matcher import fwd_only, gen_pattern

    T, Dc, Dr = 4, 16, 8
    lat, w = torch.empty(T, Dc, dtype=dtype), torch.empty(Dc, dtype=dtype)
    kpe = torch.empty(T, Dr, dtype=dtype)
    cos, sin = torch.empty(T, Dr // 2), torch.empty(T, Dr // 2)  # distinct objects: one placeholder each
    norm = gen_pattern(_norm_search, [lat, w], fwd_only, scalar_workaround={"eps": _EPS_PLACEHOLDER})
    ropes = {True: gen_pattern(_rope_search_interleave, [kpe, cos, sin], fwd_only),
             False: gen_pattern(_rope_search_half, [kpe, cos, sin], fwd_only)}
    return norm, ropes


def _match_norm(node: torch.fx.Node):
    """``(latent, weight, eps)`` when ``node`` computes DeepSeek's RMSNorm, else None."""
    val = node.meta.get("val")
    if val is None or val.dim() != 2:
        return None
    for dtype in dict.fromkeys((val.dtype, torch.float32, torch.bfloat16, torch.float16)):
        m = _patterns(dtype)[0].match(node)
        if m:
            kw = m.kwargs
            eps = kw.get("eps", None)
            if "latent" in kw and "weight" in kw and isinstance(eps, (int, float)):
                return kw["latent"], kw["weight"], float(eps), m
    return None


def _match_rope(node: torch.fx.Node):
    """``(k_pe, cos, sin, interleave)`` when ``node`` is the RoPE of a 2-D k_pe, else None."""
    val = node.meta.get("val")
    if val is None or val.dim() != 2:
        return None
    for dtype in dict.fromkeys((val.dtype, torch.float32, torch.bfloat16, torch.float16)):
        for interleave, pat in _patterns(dtype)[1].items():
            m = pat.match(node)
            if m and {"k_pe", "cos", "sin"} <= set(m.kwargs):
                return m.kwargs["k_pe"], m.kwargs["cos"], m.kwargs["sin"], interleave, m
    return None


def _write_ops() -> dict:
    """The cache-write custom ops a functionalized write site may call -> their counter key: the
    references, and our Triton ``triton_op``s when they stay opaque (not traced into their kernels)."""
    ops = {torch.ops.mla.write_latent_cache_ref.default: "fuse_kv_write",
           torch.ops.mla.write_latent_cache_fp8_ref.default: "fuse_kv_write_fp8"}
    for name, key in (("write_latent_cache_triton", "fuse_kv_write"), ("write_latent_cache_fp8_triton", "fuse_kv_write_fp8")):
        op = getattr(torch.ops.mla, name, None)  # registered once its Triton module loads
        if op is not None:
            ops[op.default] = key
    return ops


# our Triton cache-write kernels (module suffix, function name) -> counter key; their functional wrappers
# are matched (both take ``lat_ptr``, ``kpe_ptr``, ``slot_ptr``, ``cache_ptr``)
_TRITON_WRITES = {("ops.triton.cache_write", "_cache_write_kernel"): "fuse_kv_write",
                  ("ops.triton.fp8_cache_write", "_fp8_write_kernel"): "fuse_kv_write_fp8"}


def _triton_write_key(kernel) -> str | None:
    """The counter key when ``kernel`` (from Inductor's kernel side table) is one of our Triton cache writes,
    recognised by its function's module and name (not identity: torch 2.11 hands back another object)."""
    fn = getattr(kernel, "fn", kernel)
    name, module = getattr(fn, "__name__", None), getattr(fn, "__module__", "") or ""
    return next((key for (mod, fname), key in _TRITON_WRITES.items() if name == fname and module.endswith(mod)), None)


def _write_site(node: torch.fx.Node):
    """``(latent, k_pe, slot_mapping, kind, cache, counter key)`` for a functionalized cache write, else None."""
    hop = torch.ops.higher_order
    if node.target in (getattr(hop, "auto_functionalized_v2", None), getattr(hop, "auto_functionalized", None)):
        key = _write_ops().get(node.args[0]) if node.args else None
        if key is None:
            return None
        kw = node.kwargs
        return kw["latent"], kw["k_pe"], kw["slot_mapping"], "auto", None, key
    if node.target is getattr(hop, "triton_kernel_wrapper_functional", None):
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

        key = _triton_write_key(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]))
        if key is None:
            return None
        kw = node.kwargs["kwargs"]
        return kw["lat_ptr"], kw["kpe_ptr"], kw["slot_ptr"], "triton", kw["cache_ptr"], key
    return None


def _only_feeds(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return set(node.users) == {user}


def _drop_self_copies(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Remove ``aten.copy_(node, node)`` (a write-back of an input onto itself), its uses becoming ``node``."""
    for user in list(node.users):
        if user.target is torch.ops.aten.copy_.default and user.args[:2] == (node, node):
            user.replace_all_uses_with(node)
            graph.erase_node(user)


def _skipped(reason: str) -> None:
    """Count a cache-write site left unfused, by reason (``counters["mla_passes_skipped"]``; inspect lists them)."""
    counters["mla_passes_skipped"][f"fuse_kv_write: {reason}"] += 1


def fuse_kv_write(graph: torch.fx.Graph) -> int:
    """Rewrite every norm + rope + cache write site (float or fp8 cache) of ``graph``; returns the number
    of rewrites (counted per cache format in ``counters["mla_passes"]``)."""
    hop = torch.ops.higher_order
    fused: Counter = Counter()
    for node in list(graph.nodes):
        site = _write_site(node)
        if site is None:
            continue
        latent_n, kpe_n, slots, kind, cache, key = site
        if not (isinstance(latent_n, torch.fx.Node) and isinstance(kpe_n, torch.fx.Node)):
            _skipped("latent or k_pe is not computed in the graph")
            continue
        if not (_only_feeds(latent_n, node) and _only_feeds(kpe_n, node)):
            _skipped("the normed latent or roped k_pe has other users (prefill)")
            continue  # keep the graph
        norm = _match_norm(latent_n)
        rot = _match_rope(kpe_n)
        if norm is None or rot is None:
            _skipped("no RMSNorm feeds the latent" if norm is None else "no RoPE feeds k_pe")
            continue
        latent, weight, eps, _ = norm
        k_pe, cos, sin, interleave, _ = rot
        args = dict(latent=latent, k_pe=k_pe, norm_weight=weight, cos=cos, sin=sin, slot_mapping=slots,
                    eps=eps, interleave=interleave)
        op = torch.ops.mla.write_latent_cache_fused.default
        if kind == "auto":
            base = {k: v for k, v in node.kwargs.items() if k.startswith("_") or k == "kv_cache"}
            with graph.inserting_before(node):
                new = graph.call_function(node.target, (op,), {**args, **base})
            new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
            node.replace_all_uses_with(new)
        else:
            if not (isinstance(cache, torch.fx.Node) and cache.op == "placeholder"):
                _skipped("the Triton write's cache is a view, not a graph input")
                continue  # a view of the cache would need the view's size/stride kwargs: leave it
            getters = [u for u in node.users if u.target is operator.getitem]
            cache_getters = [g for g in getters if g.args[1] == "cache_ptr"]
            # torch's kernel analysis also counts the slot mapping as written (the store address is derived
            # from its values), so the functional wrapper hands back a "new" slot tensor, written back into
            # the graph input: that one is the unchanged original
            spurious = [g for g in getters if g.args[1] == "slot_ptr" and isinstance(slots, torch.fx.Node)]
            if len(getters) != len(node.users) or len(cache_getters) + len(spurious) != len(getters) \
                    or not cache_getters:
                _skipped("the Triton write's outputs are used other than as the cache")
                continue
            v2 = getattr(hop, "auto_functionalized_v2", None)
            if v2 is None:
                _skipped("this torch has no auto_functionalized_v2")
                continue
            with graph.inserting_before(node):
                new = graph.call_function(v2, (op,), {**args, "_kv_cache_base_index": 0, "_all_bases": [cache]})
                out = graph.call_function(operator.getitem, (new, 1))
            cache_val = cache_getters[0].meta.get("val")
            new.meta["val"] = (None, cache_val)
            out.meta["val"] = cache_val
            for g in cache_getters:
                g.replace_all_uses_with(out)
                graph.erase_node(g)
            for g in spurious:
                g.replace_all_uses_with(slots)
                graph.erase_node(g)
            _drop_self_copies(graph, slots)
        graph.erase_node(node)
        fused[key] += 1
    if fused:
        graph.eliminate_dead_code()
        counters["mla_passes"].update(fused)
    return sum(fused.values())


_PASSES = {"fuse_kv_write": fuse_kv_write, "fuse_absorb_q": fuse_absorb_q, "fuse_absorb_out": fuse_absorb_out}
PASS_NAMES = tuple(_PASSES)  # selectable by MLA_COMPILE_PASSES, run in this order


def _source_hash() -> str:
    """Hash of the passes' sources (this file and :mod:`mla_compile.lowerings.absorb`)."""
    h = hashlib.sha256()
    for path in (__file__, absorb.__file__):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def selected_passes() -> tuple[str, ...]:
    """The passes ``MLA_COMPILE_PASSES`` leaves on, in ``PASS_NAMES`` order: all ("1", the default), none
    ("0"), or the comma-separated names it lists (an unknown name is a ValueError)."""
    spec = envs.passes()
    if not envs.passes_enabled():
        return ()
    if spec in ("1", "true", "yes", "on", ""):
        return PASS_NAMES
    names = {n.strip() for n in spec.split(",") if n.strip()}
    unknown = sorted(names - set(PASS_NAMES))
    if unknown:
        raise ValueError(f"MLA_COMPILE_PASSES={spec!r}: unknown pass name(s) {unknown}; expected 0, 1 or a "
                         f"comma-separated subset of {list(PASS_NAMES)}")
    return tuple(n for n in PASS_NAMES if n in names)


class MLAFusionPass(CustomGraphPass):
    """The MLA post-grad fusions that ``MLA_COMPILE_PASSES`` selects (default every one of ``PASS_NAMES``,
    in that order); a no-op when ``MLA_COMPILE_PASSES=0``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for name in selected_passes():
            _PASSES[name](graph)

    def uuid(self) -> str:
        return f"mla_compile.lowerings.passes:{_source_hash()}:{','.join(selected_passes()) or 'off'}"


def compile_options(passes: bool | None = None, pdl: bool = True) -> dict:
    """Inductor options for ``torch.compile(options=...)``: the MLA passes as ``post_grad_custom_post_pass`` and
    Inductor's programmatic dependent launch (``triton.enable_pdl``).

    ``passes``: None follows ``MLA_COMPILE_PASSES`` (default on); False leaves them out. ``pdl``: Inductor's
    kernels launched with PDL where the device has it (sm_90 and later; no effect elsewhere), so our custom ops'
    PDL kernels (``mla_compile.ops.triton._pdl``) overlap the kernels around them too.
    """
    on = envs.passes_enabled() if passes is None else passes
    return ({"post_grad_custom_post_pass": MLAFusionPass()} if on else {}) | ({"triton.enable_pdl": True} if pdl else {})


@contextlib.contextmanager
def mla_passes(enabled: bool | None = None) -> Iterator[None]:
    """Within the block, compiles run the MLA passes (``torch._inductor.config.patch`` of the post-grad hook)."""
    with torch._inductor.config.patch(compile_options(enabled, pdl=False) or {"post_grad_custom_post_pass": None}):
        yield
