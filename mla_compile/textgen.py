"""Text in, text out for a checkpoint directory: the checkpoint's own tokenizer, :func:`from_pretrained`, greedy
generation with the text streamed as it is produced (``mla-compile generate``)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

import torch


@dataclass
class TextResult:
    """The prompt's and the generated token ids, the generated text, and the timings (seconds)."""

    prompt_ids: list[int]
    tokens: list[int]
    text: str
    load_s: float
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of generation (prefill included: the first token costs a prefill)."""
        total = self.prefill_s + self.decode_s
        return len(self.tokens) / total if total > 0 else float("inf")


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer: transformers ``AutoTokenizer`` (tokenizer.json + tokenizer_config.json)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{Path(path) / 'tokenizer.json'}: cannot load the checkpoint's tokenizer ({e})") from e


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt``; with ``chat`` through the tokenizer's chat template (one user message)."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat needs a chat_template in the checkpoint's tokenizer_config.json; "
                             "drop --chat to feed the prompt as plain text")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
    return list(ids)


def generate_text(path: str | Path, prompt: str, *, max_new_tokens: int = 64, device: str = "cpu",
                  dtype: torch.dtype | None = None, kv_cache: str = "bf16", compile: bool = True, chat: bool = False,
                  block_size: int = 16, stream: TextIO | None = sys.stdout,
                  log: Callable[[str], None] = lambda s: None) -> TextResult:
    """Greedy-generate up to ``max_new_tokens`` after ``prompt`` with the checkpoint at ``path``; stops at the
    tokenizer's eos token. The new text is written to ``stream`` as each token arrives.

    ``kv_cache``: "bf16" (the cache in the weights' dtype) or "fp8" (DeepSeek's 656-byte rows).
    ``compile``: ``torch.compile(model, fullgraph=True)`` (one prefill and one decode graph).
    """
    from mla_compile.checkpoint import read_config
    from mla_compile.generate import greedy_generate
    from mla_compile.loader import from_pretrained

    if kv_cache not in ("bf16", "fp8"):
        raise ValueError(f"kv_cache must be 'bf16' or 'fp8', got {kv_cache!r}")
    read_config(Path(path))  # a broken checkpoint is reported by its config, before the tokenizer is read
    tokenizer = load_tokenizer(path)
    prompt_ids = encode_prompt(tokenizer, prompt, chat)
    t0 = time.perf_counter()
    model = from_pretrained(path, device=device, dtype=dtype, kv_cache_dtype="fp8" if kv_cache == "fp8" else None)
    load_s = time.perf_counter() - t0
    log(f"loaded {path} in {load_s:.1f} s ({model.config.num_layers} layers, {device})")
    num_blocks = -(-(len(prompt_ids) + max_new_tokens) // block_size) + 1
    model.allocate_cache(num_blocks, block_size)
    step_fn = torch.compile(model, fullgraph=True) if compile else model
    eos = getattr(tokenizer, "eos_token_id", None)
    out: list[int] = []
    shown = ""

    def on_step(new: list[int]) -> bool:
        nonlocal shown
        if new[0] == eos:
            return True
        out.append(new[0])
        text = tokenizer.decode(out, skip_special_tokens=True)
        if stream is not None and text.startswith(shown):  # a multi-byte character may complete later
            stream.write(text[len(shown):])
            stream.flush()
            shown = text
        return False

    res = greedy_generate(step_fn, [prompt_ids], max_new_tokens, block_size=block_size, num_blocks=num_blocks,
                          device=device, dynamic=True, on_step=on_step)
    text = tokenizer.decode(out, skip_special_tokens=True)
    if stream is not None:
        stream.write(text[len(shown):] + "\n")
        stream.flush()
    return TextResult(prompt_ids, out, text, load_s, res.prefill_s, res.decode_s)
