"""Parallel execution of MLA models on ``torch.distributed``.

:class:`ParallelConfig` (the degrees and their validation), :func:`init` (process groups from the ``torchrun``
environment or an explicit rank / world size), :func:`shard_model` (what ``mla_compile.patch(hf_model,
parallel=...)`` runs: tensor-parallel attention, MLPs, vocabulary; expert-parallel MoE), DeepSeek-V4's data-parallel
attention with expert parallelism (:mod:`mla_compile.parallel.v4`) and decode context parallelism at the op level
(:mod:`mla_compile.parallel.dcp`). Collectives are functional collectives, so a
sharded model compiles with ``torch.compile(fullgraph=True)`` with the collectives as graph nodes.
"""

from mla_compile.parallel.config import ParallelConfig
from mla_compile.parallel.groups import Group, ParallelState, current, destroy, init

__all__ = ["Group", "ParallelConfig", "ParallelState", "current", "destroy", "init", "shard_model"]


def __getattr__(name: str):
    """``shard_model`` on first access (it imports the attention and MoE modules)."""
    if name == "shard_model":
        from mla_compile.parallel.shard import shard_model
        return shard_model
    raise AttributeError(f"module 'mla_compile.parallel' has no attribute {name!r}")
