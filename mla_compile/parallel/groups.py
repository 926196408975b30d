"""Process groups for a :class:`ParallelConfig`: :func:`init` sets up ``torch.distributed`` and the subgroups.

Rank layout (``world_size == tp``; see :mod:`mla_compile.parallel.config`):

- attention groups: ``dp_attention`` blocks of ``attn_tp`` consecutive ranks (rank ``r`` is attention rank
  ``r % attn_tp`` of group ``r // attn_tp``); the heads are split over one group.
- DP groups: the ``dp_attention`` ranks with the same attention rank, one per attention group; tokens are
  gathered over it before the MLPs / MoE and ``lm_head`` (which see every group's tokens) and split back after.
- DCP groups: blocks of ``dcp`` consecutive ranks inside an attention group; each holds ``1 / dcp`` of the
  tokens of a sequence's latent cache.
- MoE: rank ``r`` is expert-parallel rank ``r // moe_tp`` and expert-TP rank ``r % moe_tp``; an EP group is the
  ``ep`` ranks with the same expert-TP rank, a MoE-TP group the ``moe_tp`` ranks with the same EP rank.

Every rank creates every group in the same order (``new_group`` is collective). A group of one rank has no
process group (``Group.group is None``): layers skip its collectives at trace time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mla_compile.parallel.config import ParallelConfig

DEFAULT_TIMEOUT = timedelta(seconds=120)

_STATES: list["ParallelState"] = []  # what init() set up in this process (patch(parallel=config) finds it)
# the process groups init() created: its subgroups, and the default group when it made that one
_OWNED: list[dist.ProcessGroup] = []


@dataclass(frozen=True)
class Group:
    """One process group as seen from this rank: the torch ``group`` (``None`` for a single rank, unless
    ``init(single_rank_collectives=True)``: no collectives then), the global ``ranks`` it holds in order, and
    this rank's index in it."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return len(self.ranks)


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in a :class:`ParallelConfig` and its process groups (made by :func:`init`)."""

    config: ParallelConfig
    rank: int
    world_size: int
    device: torch.device
    tp: Group  # all ranks: dense MLPs, shared experts, lm_head
    attn: Group  # this rank's attention group (heads split over it)
    dp: Group  # the ranks of the other attention groups with this rank's attention rank
    dcp: Group  # this rank's decode-context-parallel group (tokens of the latent cache split over it)
    ep: Group  # ranks holding the other experts (same expert-TP rank)
    moe_tp: Group  # ranks splitting the same experts (same EP rank)
    timeout: timedelta = DEFAULT_TIMEOUT  # what init() bounds the rendezvous and every collective of its groups by


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an int") from None


def init(config: ParallelConfig, rank: int | None = None, world_size: int | None = None,
         backend: str | None = None, *, init_method: str | None = None,
         timeout: timedelta | float = DEFAULT_TIMEOUT, device: torch.device | str | None = None,
         single_rank_collectives: bool = False) -> ParallelState:
    """Set up ``torch.distributed`` and the groups of ``config``; returns this rank's :class:`ParallelState`.

    ``rank`` / ``world_size`` default to the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``; rendezvous at
    ``MASTER_ADDR:MASTER_PORT`` unless ``init_method`` is given). ``backend``: "nccl" when ``device`` is CUDA
    (default: CUDA when available, device ``cuda:LOCAL_RANK``), else "gloo". ``timeout`` (a timedelta or
    seconds) bounds the rendezvous and every collective, so a missing or dead peer raises instead of hanging.
    Reuses an already initialised default group (:func:`destroy` then leaves it). A group of one rank runs no
    collectives unless ``single_rank_collectives`` (then every group is a real process group: one GPU exercises
    the collective path, e.g. NCCL inside a CUDA graph). Raises ``ValueError`` when the world size is not
    ``config.world_size`` (before any rendezvous when the numbers are known) or rank/world size are missing.
    """
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a ParallelConfig, got {type(config).__name__}")
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank = _env_int("RANK") if rank is None else rank
        world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
        if rank is None or world_size is None:
            raise ValueError("init() needs rank and world_size: run under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, "
                             "MASTER_PORT set) or pass them")
    if world_size != config.world_size:
        raise ValueError(f"world size {world_size} does not match the ParallelConfig: tp={config.tp} ranks "
                         f"(world_size == tp); launch {config.tp} processes or use tp={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
    if device is None:
        local = _env_int("LOCAL_RANK")
        device = torch.device("cuda", rank % torch.cuda.device_count() if local is None else local) \
            if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if init_method is None and missing:
            raise ValueError(f"init() rendezvous needs {' and '.join(missing)} in the environment (torchrun sets "
                             "them) or an init_method such as 'tcp://127.0.0.1:29500'")
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        kw = dict(device_id=device) if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                                timeout=timeout, **kw)
        _OWNED.append(dist.group.WORLD)
    state = _make_groups(config, rank, world_size, device, timeout, single_rank_collectives)
    if dist.get_backend() == "nccl":  # create the communicators now: lazy NCCL init must not run inside a capture
        for group in {id(g.group): g.group for g in (state.tp, state.attn, state.dp, state.dcp, state.ep,
                                                     state.moe_tp) if g.group is not None}.values():
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        torch.cuda.synchronize(device)
    _STATES.append(state)
    return state


def _make_groups(config: ParallelConfig, rank: int, world: int, device: torch.device,
                 timeout: timedelta, single: bool) -> ParallelState:
    """Create every subgroup on every rank (same order everywhere) and keep this rank's."""
    a, d, m = config.attn_tp, config.dcp, config.moe_tp
    layouts = {
        "tp": [list(range(world))],
        "attn": [list(range(g * a, (g + 1) * a)) for g in range(world // a)],
        "dp": [list(range(t, world, a)) for t in range(a)],
        "dcp": [list(range(g * d, (g + 1) * d)) for g in range(world // d)],
        "ep": [list(range(t, world, m)) for t in range(m)],
        "moe_tp": [list(range(e * m, (e + 1) * m)) for e in range(config.ep)],
    }
    mine: dict[str, Group] = {}
    for name, groups in layouts.items():
        for ranks in groups:
            if len(ranks) == 1 and not single:
                pg = None
            elif len(ranks) == world:
                pg = dist.group.WORLD
            else:
                pg = dist.new_group(ranks, timeout=timeout)
                _OWNED.append(pg)
            if rank in ranks:
                mine[name] = Group(pg, tuple(ranks), ranks.index(rank))
    return ParallelState(config, rank, world, device, **mine, timeout=timeout)


def current(config: ParallelConfig | None = None) -> ParallelState:
    """The state :func:`init` made last in this process (for ``config`` when given); raises when there is none."""
    for state in reversed(_STATES):
        if config is None or state.config == config:
            return state
    wanted = "" if config is None else f" for {config}"
    raise RuntimeError(f"no parallel state{wanted}: call mla_compile.parallel.init(config) on every rank first")


def destroy() -> None:
    """Forget the states :func:`init` made and destroy the process groups it created: every group when it
    initialised ``torch.distributed`` itself, else only its subgroups (a default group made by the caller before
    :func:`init` stays, for the caller to destroy)."""
    _STATES.clear()
    owned, _OWNED[:] = list(_OWNED), []
    if not dist.is_initialized():
        return
    if any(pg is dist.group.WORLD for pg in owned):
        dist.destroy_process_group()
        return
    for pg in owned:
        dist.destroy_process_group(pg)
