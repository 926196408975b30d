"""Per-request sampling parameters and a batched, counter-based sampler.

Random-stream contract: the draw of a row depends only on its logits, its parameters and its
``(seed, step)`` pair, never on the other rows or their order. For vocabulary index ``v`` the row's
uniform is ``u(seed, step, v) = (top 24 bits of mix(mix(mix(mix(seed) + step) + v)) + 0.5) / 2**24``, with
``mix`` the splitmix64 finalizer (64-bit wrapping arithmetic on int64), and
the token is the Gumbel-max ``argmax_v(logit_v / temperature - log(-log(u)))`` over the kept vocabulary:
an exact draw from the softmax of the kept, scaled logits. The engine uses ``step`` = the index of the token
being generated (0 for the first) and, for a request without a seed, a seed it draws at admission from its
own seeded generator, so a run is reproducible given the engine's seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from mla_compile.serving.host_upload import HostUpload

SEED_LIMIT = 2**63


def _wrap(value: int) -> int:
    """A 64-bit constant as the signed int64 with the same bits."""
    return value - 2**64 if value >= 2**63 else value


_MIX1 = _wrap(0xBF58476D1CE4E5B9)
_MIX2 = _wrap(0x94D049BB133111EB)
_UNIFORM_BITS = 24


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    ``temperature``: 0 is greedy (exact argmax), else logits are divided by it (finite, >= 0);
    ``top_k``: keep the ``top_k`` largest logits (0: off); ``top_p``: keep the smallest set of the most likely
    tokens whose probability reaches ``top_p`` (in ``(0, 1]``; 1: off; the top token is always kept);
    ``seed``: the request's random stream (an int in ``[0, 2**63)``; None: the engine draws one at admission);
    ``stop_token_ids``: generating one of these finishes the request (``finish_reason "stop"``; the stop token
    is kept in the output); ``max_new_tokens``: at most this many tokens (>= 1; ``finish_reason "length"``).
    Raises ``TypeError``/``ValueError`` naming the field and the value.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a float, got {value!r} ({type(value).__name__})")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            message = f"SamplingParams.temperature must be finite and >= 0 (0: greedy), got {self.temperature!r}"
            raise ValueError(message)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        self._check_int("top_k", 0)
        self._check_int("max_new_tokens", 1)
        if self.seed is not None:
            self._check_int("seed", 0, SEED_LIMIT - 1)
        stops = self.stop_token_ids
        if not isinstance(stops, tuple) or not all(_is_int(t) and t >= 0 for t in stops):
            raise TypeError(f"SamplingParams.stop_token_ids must be a tuple of int token ids >= 0, got {stops!r}")

    def _check_int(self, name: str, low: int, high: int | None = None) -> None:
        value = getattr(self, name)
        if not _is_int(value):
            raise TypeError(f"SamplingParams.{name} must be an int, got {value!r} ({type(value).__name__})")
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ValueError(f"SamplingParams.{name} must be {bound}, got {value!r}")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (temperature 0)."""
        return self.temperature == 0


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic: clear the sign-extended bits)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: Tensor) -> Tensor:
    """The splitmix64 finalizer on int64 tensors (wrapping multiplication)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniforms(seeds: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """float32 ``[B, vocab]`` uniforms in ``(0, 1)`` of the ``(seed, step)`` streams (module docstring).

    ``seeds``, ``steps``: int64 ``[B]``.
    """
    row = _mix(_mix(seeds) + steps)
    # no large constant times the index: Inductor folds arange arithmetic into (unbounded) index expressions
    index = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _shr(_mix(_mix(row[:, None] + index)), 64 - _UNIFORM_BITS)
    return (bits.to(torch.float32) + 0.5) * (1.0 / 2**_UNIFORM_BITS)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
           steps: Tensor) -> Tensor:
    """One token per row, made of tensor ops only (no host sync, no loop over rows; compiles with
    ``fullgraph=True`` and captures in CUDA graphs).

    ``logits``: ``[B, V]`` (any float dtype); ``temperature``, ``top_p``: float ``[B]``; ``top_k``: int ``[B]``
    (0: off); ``seeds``, ``steps``: int64 ``[B]``, all on the logits' device. Returns int64 ``[B]``: for a row
    with temperature 0 exactly ``logits.argmax(-1)``; otherwise a draw from the softmax of ``logits /
    temperature`` restricted to the ``top_k`` largest and to the ``top_p`` nucleus (the smallest prefix of
    the sorted probabilities whose mass reaches ``top_p``, ties broken by vocabulary index), with the
    randomness of the row's ``(seed, step)`` stream only (module docstring).
    """
    greedy = logits.argmax(-1)
    vocab = logits.shape[-1]
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float32)
    scaled = logits.to(torch.float32) / safe_t[:, None]
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    keep = rank[None, :] < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = keep & (mass_before < top_p.to(torch.float32)[:, None])
    keep = keep | (rank == 0)[None, :]
    gumbel = -torch.log(-torch.log(uniforms(seeds, steps, vocab)))
    scores = (ordered + gumbel.gather(-1, order)).masked_fill(~keep, float("-inf"))
    drawn = order.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
    return torch.where(temperature > 0, drawn, greedy)


def sample_columns(logits: Tensor, columns: Mapping[str, np.ndarray]) -> Tensor:
    """:func:`sample` of ``logits`` ``[B, V]`` with its per-row parameters from numpy ``columns`` ``[B]`` (by
    :func:`sample`'s argument names; what ``DecodeRows.sampling`` gives). Returns int64 ``[B]``."""
    dtypes = {"temperature": torch.float32, "top_p": torch.float32}
    # non_blocking, as sample_rows: a pageable source is staged at once, with no wait for the device's stream
    tensors = {name: torch.from_numpy(np.ascontiguousarray(v)).to(logits.device, dtypes.get(name, torch.int64),
                                                                 non_blocking=True)
               for name, v in columns.items()}
    return sample(logits, **tensors)


def sample_rows(logits: Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> Tensor:
    """:func:`sample` of ``logits`` ``[B, V]`` with row ``i`` drawn under ``params[i]`` at step ``steps[i]``
    (host-side: builds the ``[B]`` parameter tensors on the logits' device). Every ``params[i].seed`` must be
    set (the engine fills it at admission). Returns int64 ``[B]``."""
    assert len(params) == len(steps) == logits.shape[0] and all(p.seed is not None for p in params)
    columns = {"temperature": (torch.float32, [p.temperature for p in params]),
               "top_k": (torch.int64, [p.top_k for p in params]),
               "top_p": (torch.float32, [p.top_p for p in params]),
               "seeds": (torch.int64, [p.seed for p in params]),
               "steps": (torch.int64, list(steps))}
    tensors = {name: torch.tensor(values, dtype=dtype).to(logits.device, non_blocking=True)
               for name, (dtype, values) in columns.items()}
    return sample(logits, **tensors)


_ROW_FIELDS = ("temperature", "top_k", "top_p", "seeds", "steps")  # the order of SamplingRows' packed rows
# a greedy padding row as SamplingRows packs it: temperature 0, top_k 0, top_p 1.0 (float64 bits), seed 0, step 0
_PADDING_ROW = np.array([[0], [0], [np.float64(1.0).view(np.int64)], [0], [0]], dtype=np.int64)


class SamplingRows:
    """Persistent device tensors of :func:`sample`'s per-row parameters for up to ``max_batch`` rows, filled
    per step by one non-blocking copy from pinned host memory (two host buffers used in turn, each reused only
    after its copy finished), so a captured CUDA graph reads them at fixed addresses and the step makes no
    device allocation. The five fields are one int64 ``[5, max_batch]`` tensor (floats stored as float64
    bits); :meth:`fill` returns ``[n]`` views in the order of :func:`sample`'s arguments."""

    def __init__(self, max_batch: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.packed = torch.zeros(len(_ROW_FIELDS), max_batch, dtype=torch.int64, device=self.device)
        self._upload = HostUpload(self.packed)
        self._views: dict[int, dict[str, Tensor]] = {}

    def views(self, n: int) -> dict[str, Tensor]:
        """The ``[n]`` device views :func:`sample` takes (the same addresses every step; made once per ``n``, the
        same dict every call: read it, do not change it)."""
        views = self._views.get(n)
        if views is None:
            p = self.packed
            views = self._views[n] = dict(temperature=p[0, :n].view(torch.float64), top_k=p[1, :n],
                                          top_p=p[2, :n].view(torch.float64), seeds=p[3, :n], steps=p[4, :n])
        return views

    def fill(self, params: Sequence[SamplingParams], steps: Sequence[int], n: int) -> dict[str, Tensor]:
        """Write row ``i < len(params)`` from ``params[i]`` at generation step ``steps[i]`` (every seed set),
        rows up to ``n`` as greedy padding; returns :meth:`views` of ``n``."""
        if not len(params) == len(steps) <= n <= self.max_batch:
            raise ValueError(f"SamplingRows.fill: {len(params)} params and {len(steps)} steps for {n} rows "
                             f"(at most max_batch={self.max_batch})")
        if any(p.seed is None for p in params):
            raise ValueError("SamplingRows.fill: every params.seed must be set (the engine sets it at admission)")
        host = self._upload.begin()
        host[:, :n] = 0
        k = len(params)
        host[0, :k].view("float64")[:] = [p.temperature for p in params]
        host[1, :k] = [p.top_k for p in params]
        host[2, :n].view("float64")[:] = 1.0
        host[2, :k].view("float64")[:] = [p.top_p for p in params]
        host[3, :k] = [p.seed for p in params]
        host[4, :k] = list(steps)
        self._upload.upload()
        return self.views(n)

    def fill_packed(self, packed: np.ndarray, n: int) -> dict[str, Tensor]:
        """:meth:`fill` from rows already packed as this holds them (int64 ``[5, k]``: temperature, top_k, top_p,
        seeds, steps, floats as float64 bits, every seed set; what
        :meth:`~mla_compile.serving.decode_rows.DecodeRows.sampling_packed` gives): one copy, no per-row Python.
        Rows ``k..n`` are greedy padding; returns :meth:`views` of ``n``."""
        k = packed.shape[1]
        if packed.shape[0] != len(_ROW_FIELDS) or not k <= n <= self.max_batch:
            raise ValueError(f"SamplingRows.fill_packed: {packed.shape} packed rows for {n} (expected "
                             f"[{len(_ROW_FIELDS)}, k], k <= n <= max_batch={self.max_batch})")
        host = self._upload.begin()
        host[:, :k] = packed
        if k < n:
            host[:, k:n] = _PADDING_ROW
        self._upload.upload()
        return self.views(n)
