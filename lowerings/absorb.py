"""The absorbed-projection passes: ``q_nope @ W_UK`` + ``cat`` and ``out_lat @ W_UV`` + ``reshape`` around
the decode become ``mla::absorb_q`` / ``mla::absorb_out`` (:mod:`mla_compile.ops.absorb`).

After AOT tracing, ``torch.einsum("thn,hnc->thc", q_nope, w_uk)`` is an ``aten.bmm`` of head-major views
``[H, T, *]`` followed by views back to token-major ``[T, H, Dc]``; Inductor runs the bmm into an
``[H, T, Dc]`` buffer and copies it into the ``cat`` with q_pe. On the output side the bmm result is
copied by the ``clone`` of ``reshape(T, H*v)`` before ``o_proj``. The passes find these sites by FX
node inspection, independent of the dtype and of which attention op sits between them:

- ``fuse_absorb_q``: ``cat([V(bmm(a, b)), q_pe], -1)`` where ``V`` is a chain of view ops whose result is
  exactly ``bmm(a, b).permute(1, 0, 2)`` (checked on the fake values: same storage, sizes, strides and
  offset) -> ``absorb_q(a.permute(1, 0, 2), b, q_pe)``.
- ``fuse_absorb_out``: ``clone(V(bmm(a, b)))`` (the copy of a reshape) with the same ``V`` ->
  ``absorb_out(a.permute(1, 0, 2), b.permute(0, 2, 1)).view(T, H, v)``.

Each fires only when the bmm and every view in ``V`` feed nothing else, and counts in
``counters["mla_passes"]["fuse_absorb_q" | "fuse_absorb_out"]``. The ``permute`` nodes it adds are views.
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten
_VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
             aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
             aten.transpose.int, aten.t.default}


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same(xs, ys) -> bool:
    """Sizes/strides equal without adding guards (symbolic entries must be provably equal)."""
    return len(xs) == len(ys) and all(statically_known_true(x == y) for x, y in zip(xs, ys))


def _head_major_bmm(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``aten.bmm`` whose ``[H, T, X]`` result ``node`` views as ``[T, H, X]`` through single-user views."""
    target = _val(node)
    if target is None or target.dim() != 3:
        return None
    cur = node
    while cur.target in _VIEW_OPS:
        src = cur.args[0]
        if not isinstance(src, torch.fx.Node) or len(src.users) != 1:
            return None
        cur = src
    bmm = _val(cur)
    if cur.target is not aten.bmm.default or bmm is None or len(cur.users) != 1:
        return None
    if StorageWeakRef(bmm.untyped_storage()) != StorageWeakRef(target.untyped_storage()):
        return None  # a reshape in the chain copied: not a view of the bmm
    want = bmm.permute(1, 0, 2)
    if not (_same(target.shape, want.shape) and _same(target.stride(), want.stride())
            and statically_known_true(target.storage_offset() == want.storage_offset())):
        return None
    return cur


def _call(graph: torch.fx.Graph, target, args: tuple) -> torch.fx.Node:
    """A new node with its fake value (later passes and Inductor read ``meta["val"]``)."""
    node = graph.call_function(target, args)
    fake_args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    node.meta["val"] = target(*fake_args)
    return node


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, new: torch.fx.Node, op_node: torch.fx.Node) -> None:
    """``node``'s uses become ``new`` and ``node`` goes; the new op node keeps ``node``'s source info."""
    for key in ("stack_trace", "nn_module_stack"):
        if key in node.meta:
            op_node.meta[key] = node.meta[key]
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _finish(graph: torch.fx.Graph, name: str, fused: int) -> int:
    """Drop what the rewrites left unused and count them under ``name``."""
    if fused:
        graph.eliminate_dead_code()
        counters["mla_passes"][name] += fused
    return fused


def fuse_absorb_q(graph: torch.fx.Graph) -> int:
    """Rewrite every ``cat([q_nope @ W_UK, q_pe], -1)`` site of ``graph``; returns the number of rewrites."""
    fused = 0
    for node in list(graph.nodes):
        if node.target is not aten.cat.default or len(node.args) < 2:
            continue
        parts, dim = node.args[0], node.args[1]
        out = _val(node)
        if out is None or out.dim() != 3 or dim not in (-1, 2) or len(parts) != 2:
            continue
        q_lat, q_pe = parts
        lat, pe = _val(q_lat), _val(q_pe)
        if lat is None or pe is None or pe.dim() != 3 or out.dtype != lat.dtype or len(q_lat.users) != 1:
            continue
        bmm = _head_major_bmm(q_lat)
        if bmm is None:
            continue
        a, b = bmm.args
        with graph.inserting_before(node):
            q_nope = _call(graph, aten.permute.default, (a, [1, 0, 2]))
            new = _call(graph, torch.ops.mla.absorb_q.default, (q_nope, b, q_pe))
        _replace(graph, node, new, new)
        fused += 1
    return _finish(graph, "fuse_absorb_q", fused)


def _is_contiguous_clone(node: torch.fx.Node) -> bool:
    fmt = node.kwargs.get("memory_format", node.args[1] if len(node.args) > 1 else None)
    return node.target is aten.clone.default and fmt in (None, torch.contiguous_format)


def fuse_absorb_out(graph: torch.fx.Graph) -> int:
    """Rewrite every ``reshape(out_lat @ W_UV, (T, H*v))`` copy of ``graph``; returns the number of rewrites."""
    fused = 0
    for node in list(graph.nodes):
        if not _is_contiguous_clone(node) or not isinstance(node.args[0], torch.fx.Node):
            continue
        src = node.args[0]
        if len(src.users) != 1:
            continue
        bmm = _head_major_bmm(src)
        if bmm is None:
            continue
        a, b = bmm.args
        T, H, V = _val(src).shape
        if not (isinstance(H, int) and isinstance(V, int)):
            continue  # heads and v_head_dim are static in every model; a symbolic one is not our site
        with graph.inserting_before(node):
            out_lat = _call(graph, aten.permute.default, (a, [1, 0, 2]))
            w_uv = _call(graph, aten.permute.default, (b, [0, 2, 1]))
            rows = _call(graph, torch.ops.mla.absorb_out.default, (out_lat, w_uv))
            new = _call(graph, aten.view.default, (rows, [T if isinstance(T, int) else -1, H, V]))
        _replace(graph, node, new, rows)
        fused += 1
    return _finish(graph, "fuse_absorb_out", fused)
