"""Compile diagnostics: what ``torch.compile`` made of a function (graphs, breaks, recompiles, ops).

Depends only on torch (depyf optional); see :mod:`mla_compile.graphs.inspect`.
"""

from mla_compile.graphs.inspect import (CompileWatch, GraphBreak, GraphInfo, InspectReport, Recompile,
                                        inspect_compile, short_reason)

__all__ = ["CompileWatch", "GraphBreak", "GraphInfo", "InspectReport", "Recompile", "inspect_compile", "short_reason"]
