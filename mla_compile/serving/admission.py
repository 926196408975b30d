"""Admission checks of the serving engine: a request is validated on the host before it is queued, so
no bad token id, length or parameter ever reaches a kernel (on a GPU an out-of-range id in the embedding
is a device-side assert that ends the process, and every other request with it).

Accepted token ids are Python ``int`` and numpy integer scalars, or a 1-D integer ``torch.Tensor`` /
``numpy.ndarray`` as the whole prompt; ``bool`` (an ``int`` subclass), floats (even ``1.0``), strings
and anything else are rejected. Each parameter has one ``check_*`` helper, so new sampling parameters
slot in as one more call in :func:`validate_request`.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch

from mla_compile.serving.sampling import SamplingParams


class RequestRejected(ValueError):
    """A request failed admission. ``request_id``: the id it was given; ``field``: the argument at fault
    (``"prompt"``, ``"max_new_tokens"``, ...); ``position``: the first bad prompt index, or None."""

    def __init__(self, request_id: int, field: str, message: str, position: int | None = None) -> None:
        super().__init__(f"request {request_id}: {message}")
        self.request_id = request_id
        self.field = field
        self.position = position


@dataclass(frozen=True)
class RequestLimits:
    """What an admitted request must fit: ``vocab_size`` token ids; at most ``max_positions`` (the
    model's position embeddings, None: no limit), ``max_seq_tokens`` (the block table of one sequence)
    and ``cache_tokens`` (the whole paged cache) prompt + new tokens. ``peak_tokens(prompt_len, total)``, when
    given (a windowed block manager's :meth:`~mla_compile.serving.block_manager.BlockManager.peak_tokens`), is
    what a request holds of the cache at once, compared to ``cache_tokens`` instead of the total.
    ``never_fits(prompt_len, total)``, when given, says why a request could not be admitted even into an empty
    cache for reasons beyond the token rows (DeepSeek-V4's compressed-entry caches), or returns None."""

    vocab_size: int
    max_seq_tokens: int
    cache_tokens: int
    max_positions: int | None = None
    peak_tokens: Callable[[int, int], int] | None = None
    never_fits: Callable[[int, int], str | None] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_tokens", "cache_tokens", "max_positions"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"RequestLimits.{name} must be a positive int, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _integer_dtype(array: torch.Tensor | np.ndarray) -> bool:
    if isinstance(array, torch.Tensor):
        return array.dtype != torch.bool and not (array.dtype.is_floating_point or array.dtype.is_complex)
    return bool(np.issubdtype(array.dtype, np.integer))


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:40] + "..."
    return f"{text} ({type(value).__name__})"


def check_int(request_id: int, name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high]`` (``high`` None: no bound); else
    :class:`RequestRejected`."""
    if not _is_int(value):
        raise RequestRejected(request_id, name, f"{name} = {_describe(value)} must be an int")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestRejected(request_id, name, f"{name} = {value} must be {bound}")
    return value


def check_prompt(request_id: int, prompt: Any, vocab_size: int) -> list[int]:
    """The prompt as a list of Python ints, each a token id in ``[0, vocab_size)``; else
    :class:`RequestRejected` naming the first bad position."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        if prompt.ndim != 1 or not _integer_dtype(prompt):
            got = f"{prompt.ndim}-D of dtype {prompt.dtype}"
            message = f"prompt must be a 1-D integer tensor or array, got {got}"
            raise RequestRejected(request_id, "prompt", message)
        prompt = prompt.tolist()
    elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        got = type(prompt).__name__
        raise RequestRejected(request_id, "prompt", f"prompt must be a sequence of int token ids, got {got} "
                              "(tokenize text first)")
    if len(prompt) == 0:
        message = "prompt is empty; it must be non-empty (one token id or more)"
        raise RequestRejected(request_id, "prompt", message)
    tokens = []
    for i, t in enumerate(prompt):
        if not _is_int(t):
            message = f"prompt[{i}] = {_describe(t)} is not an int token id"
            raise RequestRejected(request_id, "prompt", message, position=i)
        if not 0 <= t < vocab_size:
            message = f"prompt[{i}] = {int(t)} is not a token id in [0, {vocab_size})"
            raise RequestRejected(request_id, "prompt", message, position=i)
        tokens.append(int(t))
    return tokens


def check_length(request_id: int, prompt_len: int, max_new_tokens: int, limits: RequestLimits) -> None:
    """Prompt plus new tokens must fit the model's positions, one sequence's block table and the cache."""
    total = prompt_len + max_new_tokens
    bounds = [(limits.max_positions, "the model's max_position_embeddings"),
              (limits.max_seq_tokens, "max_blocks_per_seq * block_size of the runner's builder"),
              (limits.cache_tokens if limits.peak_tokens is None else None,  # windowed: the peak, below
               "the paged cache (num_blocks * block_size)")]
    for bound, what in bounds:
        if bound is not None and total > bound:
            message = (f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} tokens "
                       f"exceed {what} = {bound}; shorten the prompt or lower max_new_tokens")
            raise RequestRejected(request_id, "prompt + max_new_tokens", message)
    if limits.peak_tokens is not None and (peak := limits.peak_tokens(prompt_len, total)) > limits.cache_tokens:
        message = (f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) hold up to {peak} cache tokens "
                   f"at once (the prompt, or the sink + window blocks), more than the paged cache's "
                   f"{limits.cache_tokens}; shorten the prompt or give the engine more blocks")
        raise RequestRejected(request_id, "prompt + max_new_tokens", message)
    if limits.never_fits is not None and (why := limits.never_fits(prompt_len, total)):
        message = (f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) cannot fit: {why}; shorten the "
                   "prompt or lower max_new_tokens")
        raise RequestRejected(request_id, "prompt + max_new_tokens", message)


def check_params(request_id: int, params: Any, vocab_size: int) -> SamplingParams:
    """The request's :class:`~mla_compile.serving.sampling.SamplingParams` (an int is ``max_new_tokens`` of greedy
    decoding) with every stop token id in ``[0, vocab_size)``; else :class:`RequestRejected`. The fields
    themselves were validated when the ``SamplingParams`` was made."""
    if not isinstance(params, SamplingParams):  # anything else must be an int max_new_tokens
        return SamplingParams(max_new_tokens=check_int(request_id, "max_new_tokens", params, 1))
    for i, t in enumerate(params.stop_token_ids):
        if t >= vocab_size:
            message = f"stop_token_ids[{i}] = {t} is not a token id in [0, {vocab_size})"
            raise RequestRejected(request_id, "stop_token_ids", message, position=i)
    return params


def validate_request(request_id: int, prompt: Any, params: Any,
                     limits: RequestLimits) -> tuple[list[int], SamplingParams]:
    """Every admission check of one request; returns ``(prompt as Python ints, SamplingParams)``
    (``params``: a ``SamplingParams``, or an int ``max_new_tokens`` for greedy decoding), or raises
    :class:`RequestRejected` (a ``ValueError``) naming the request, the argument and the first bad position."""
    tokens = check_prompt(request_id, prompt, limits.vocab_size)
    params = check_params(request_id, params, limits.vocab_size)
    check_length(request_id, len(tokens), params.max_new_tokens, limits)
    return tokens, params


def model_limits(runner: Any) -> tuple[int | None, int | None]:
    """``(vocab_size, max_position_embeddings)`` of the model a runner steps, read duck-typed from
    ``runner.step_fn`` (a ``torch.compile`` wrapper is looked through); None where it has none."""
    fn = getattr(runner, "step_fn", None)
    model = getattr(fn, "_orig_mod", fn)
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    positions = getattr(config, "max_position_embeddings", None)
    vocab = vocab if _is_int(vocab) and vocab > 0 else None
    positions = positions if _is_int(positions) and positions > 0 else None
    return vocab, positions
