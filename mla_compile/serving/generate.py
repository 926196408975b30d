"""Minimal greedy generation over the paged cache: prefill all prompts in one step, then batched decode.

A reference loop for the demo, tests and ``inspect``; the serving engine (admission, scheduling,
CUDA graphs) builds on the same metadata. Host-side planning runs before each step; the step itself
(``step_fn``, e.g. a compiled model) sees only tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from mla_compile.serving.block_manager import BlockManager
from mla_compile.models.metadata import MLAMetadata, SeqChunk, StepInputs, mark_dynamic, plan_step


@dataclass
class GenerationResult:
    """Tokens generated per prompt, the logits of every step, and timings (seconds)."""

    tokens: list[list[int]]
    step_logits: list[Tensor] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0


def _check_max_new_tokens(max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__} {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0 (the number of tokens to generate per prompt), got "
                         f"{max_new_tokens}; pass 0 for no new tokens")


def greedy_generate(step_fn: Callable[[Tensor, Tensor, MLAMetadata], Tensor], prompts: Sequence[Sequence[int]],
                    max_new_tokens: int, *, block_size: int, num_blocks: int, device: torch.device | str = "cpu",
                    dynamic: bool = True, keep_logits: bool = False,
                    on_step: Callable[[list[int]], bool | None] | None = None) -> GenerationResult:
    """Greedy-decode ``max_new_tokens`` tokens for each prompt with ``step_fn(input_ids, positions, meta)``.

    ``step_fn`` is a patched model or its compiled form, with caches of ``num_blocks`` blocks of
    ``block_size`` already allocated. ``dynamic`` marks per-step sizes dynamic (one graph for all).
    ``max_new_tokens=0`` returns an empty token list per prompt without calling ``step_fn``.
    ``on_step(new_tokens)`` is called after every step with one new token per prompt (for streaming);
    when it returns True, generation stops there.
    Raises ``ValueError`` for empty prompts or a negative ``max_new_tokens``.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    _check_max_new_tokens(max_new_tokens)
    result = GenerationResult(tokens=[[] for _ in prompts])
    if max_new_tokens == 0:
        return result
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    lens = [len(p) for p in prompts]
    blocks = [manager.allocate(p, len(p) + max_new_tokens).blocks for p in prompts]
    max_blocks = max([len(b) for b in blocks] + [2])

    def run(step: StepInputs) -> list[int]:
        step = step.to(device)
        if dynamic:
            mark_dynamic(step.input_ids, step.positions, step.meta)
        with torch.no_grad():
            logits = step_fn(step.input_ids, step.positions, step.meta)[:step.num_rows]
        if keep_logits:
            result.step_logits.append(logits.float().cpu())
        return logits.argmax(-1).tolist()

    t0 = time.perf_counter()
    nxt = run(plan_step([], [SeqChunk(b, list(p)) for b, p in zip(blocks, prompts)], block_size,
                        max_blocks=max_blocks, num_blocks=num_blocks))
    sync()
    result.prefill_s = time.perf_counter() - t0
    for i, t in enumerate(nxt):
        result.tokens[i].append(t)
    stop = bool(on_step and on_step(nxt))
    t0 = time.perf_counter()
    for step in range(1, 1 if stop else max_new_tokens):
        chunks = [SeqChunk(b, [toks[-1]], n + step - 1) for b, toks, n in zip(blocks, result.tokens, lens)]
        nxt = run(plan_step(chunks, [], block_size, max_blocks=max_blocks, num_blocks=num_blocks))
        for i, t in enumerate(nxt):
            result.tokens[i].append(t)
        result.decode_steps += 1
        if on_step and on_step(nxt):
            break
    sync()
    result.decode_s = time.perf_counter() - t0
    return result


def hf_greedy_reference(hf_model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        device: torch.device | str = "cpu") -> tuple[list[list[int]], list[Tensor]]:
    """Greedy tokens and per-step last-token logits from an unpatched HF model, one prompt at a time
    (no padding, full recompute each step: the simplest correct reference). ``max_new_tokens=0`` gives
    empty token lists and ``[0, vocab]`` logits without calling the model; a negative one raises ``ValueError``."""
    _check_max_new_tokens(max_new_tokens)
    tokens, logits = [], []
    for prompt in prompts:
        seq = list(prompt)
        out, steps = [], []
        for _ in range(max_new_tokens):
            with torch.no_grad():
                last = hf_model(torch.tensor([seq], device=device)).logits[0, -1].float().cpu()
            steps.append(last)
            seq.append(int(last.argmax()))
            out.append(seq[-1])
        tokens.append(out)
        logits.append(torch.stack(steps) if steps else torch.empty(0, hf_model.config.vocab_size))
    return tokens, logits
