"""Running and inspecting compiled steps: CUDA-graph replay of decode steps, compile diagnostics.

What it holds:

- :mod:`~mla_compile.graphs.cuda_graph`: :class:`~mla_compile.graphs.cuda_graph.DecodeGraphRunner`
  captures one CUDA graph per capture size from a :class:`~mla_compile.serving.builder.MetadataBuilder`'s
  padding steps (one shared memory pool), replays the smallest graph that fits a decode batch after
  the builder fills its persistent buffers, and calls the step function directly for prefill, mixed
  and larger steps (and everywhere without CUDA).
- :mod:`~mla_compile.graphs.inspect`: what ``torch.compile`` made of a function (graphs, graph breaks,
  recompiles, ``mla::`` ops and their backends, autotune decisions, fusion passes), as an
  :class:`InspectReport` or the counting :class:`CompileWatch`; depends only on torch (depyf optional).
- :mod:`~mla_compile.graphs.warm_start`: a fresh process over the compile caches of an earlier one, ready
  without re-tracing (torch's Dynamo cache where it works), saving / loading the compile artifacts, and where
  a process's compile time went; depends only on torch.

How it plugs in: the package sits above core and depends on it (the builder, the step metadata).
``import mla_compile`` does not import it: :class:`~mla_compile.serving.engine.Engine` takes a runner as an
argument, and ``mla_compile.DecodeGraphRunner`` is a lazy re-export (the demo and the CLI import the
package). Importing it registers nothing.
"""

from mla_compile.graphs.inspect import (CompileWatch, GraphBreak, GraphInfo, InspectReport, Recompile,
                                        inspect_compile, short_reason)

__all__ = ["CompileWatch", "GraphBreak", "GraphInfo", "InspectReport", "Recompile", "inspect_compile", "short_reason"]
