"""Text in, text out for a checkpoint directory: the checkpoint's own tokenizer, :func:`from_pretrained`, one
request through the :class:`~mla_compile.serving.engine.Engine` (greedy or sampled) with the text streamed as it is
produced (``mla-compile generate``)."""

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
                  block_size: int = 16, stream: TextIO | None = sys.stdout, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int | None = None, regional_compile: bool = True,
                  log: Callable[[str], None] = lambda s: None, parallel=None) -> TextResult:
    """Generate up to ``max_new_tokens`` after ``prompt`` with the checkpoint at ``path``; stops at the tokenizer's
    eos token. The new text is written to ``stream`` as each token arrives (``Engine.stream``).

    ``temperature`` / ``top_k`` / ``top_p`` / ``seed``: :class:`~mla_compile.serving.sampling.SamplingParams` (default:
    greedy). ``kv_cache``: "bf16" (the cache in the weights' dtype) or "fp8" (DeepSeek's 656-byte rows).
    ``compile``: ``torch.compile(model, fullgraph=True)`` (one prefill and one decode graph); on CUDA the decode
    steps are then replayed as CUDA graphs. ``regional_compile`` (with ``compile``): each layer as nested compile
    regions, so a deep checkpoint compiles one layer of each kind instead of every layer (``from_pretrained``).
    ``parallel``: a :class:`~mla_compile.parallel.ParallelState` (from ``mla_compile.parallel.init``): this rank's
    shard of the checkpoint on ``parallel.device``; every rank runs the same request (so every attention group's
    steps have the same shape; pass ``stream=None`` on all ranks but one).
    """
    from mla_compile.models.checkpoint import read_config
    from mla_compile.models.loader import from_pretrained
    from mla_compile.models.v4_loader import is_v4_checkpoint
    from mla_compile.serving.sampling import SamplingParams

    if kv_cache not in ("bf16", "fp8"):
        raise ValueError(f"kv_cache must be 'bf16' or 'fp8', got {kv_cache!r}")
    if not is_v4_checkpoint(path):  # DeepSeek-V4 has its own config; the loader reads it
        read_config(Path(path))  # a broken checkpoint is reported by its config, before the tokenizer is read
    tokenizer = load_tokenizer(path)
    prompt_ids = encode_prompt(tokenizer, prompt, chat)
    eos = getattr(tokenizer, "eos_token_id", None)
    t0 = time.perf_counter()
    if parallel is not None:
        device = str(parallel.device)
    model = from_pretrained(path, device=device, dtype=dtype, kv_cache_dtype="fp8" if kv_cache == "fp8" else None,
                            regional_compile=compile and regional_compile, parallel=parallel)
    load_s = time.perf_counter() - t0
    layers = getattr(model.config, "num_layers", None) or model.config.num_hidden_layers
    where = device if parallel is None else (f"{device}, rank {parallel.rank} of {parallel.world_size}: "
                                             f"{parallel.config}")
    log(f"loaded {path} in {load_s:.1f} s ({layers} layers, {where})")
    stop = (eos,) if isinstance(eos, int) and 0 <= eos < model.config.vocab_size else ()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_token_ids=stop,
                            max_new_tokens=max_new_tokens)
    engine = single_request_engine(model, len(prompt_ids), max_new_tokens, block_size=block_size, device=device,
                                   compile=compile)
    rid = engine.add_request(prompt_ids, params)
    out: list[int] = []
    shown = ""
    times = [time.perf_counter()]
    for step in engine.stream():
        times.append(time.perf_counter())
        for t in step.tokens.get(rid, []):
            if t == eos:
                continue  # the stop token ends the request; it is not text
            out.append(t)
            text = tokenizer.decode(out, skip_special_tokens=True)
            if stream is not None and text.startswith(shown):  # a multi-byte character may complete later
                stream.write(text[len(shown):])
                stream.flush()
                shown = text
    text = tokenizer.decode(out, skip_special_tokens=True)
    if stream is not None:
        stream.write(text[len(shown):] + "\n")
        stream.flush()
    return TextResult(prompt_ids, out, text, load_s, times[1] - times[0], times[-1] - times[1])


def single_request_engine(model: Any, prompt_len: int, max_new_tokens: int, *, block_size: int, device: str,
                          compile: bool) -> Any:
    """An :class:`~mla_compile.serving.engine.Engine` for one request of ``prompt_len`` + ``max_new_tokens`` tokens
    over ``model`` (an MLA model, or DeepSeek-V4's :class:`~mla_compile.models.v4_model.V4ForCausalLM`), its
    caches allocated to fit: the whole prompt in one step, then decode steps padded to 2 rows (as every graph
    runner's), replayed as CUDA graphs when compiled on CUDA."""
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from mla_compile.models.v4_model import V4ForCausalLM
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.serving.engine import Engine
    from mla_compile.serving.v4_builder import V4DecodeBuilder

    total = prompt_len + max_new_tokens
    num_blocks = -(-total // block_size) + 1  # V4: + the windowed manager's null block
    if isinstance(model, V4ForCausalLM):
        entries = {r: -(-max(total // r, 1) // block_size) for r in model.rates}
        model.allocate_cache(num_blocks, block_size, entries or 1, 1)
        builder = V4DecodeBuilder(max_batch=2, max_blocks_per_seq=num_blocks, max_entry_blocks=max(entries.values(),
                                  default=1), rates=model.rates, block_size=block_size, device=device,
                                  max_tokens=prompt_len + 2)
    else:
        model.allocate_cache(num_blocks, block_size)
        builder = MetadataBuilder(max_batch=2, max_blocks_per_seq=num_blocks, max_tokens=prompt_len + 2,
                                  block_size=block_size, device=device)
    step_fn = torch.compile(model, fullgraph=True) if compile else model
    runner = DecodeGraphRunner(step_fn, builder, capture_sizes=[2], enabled=compile and builder.device.type == "cuda")
    return Engine(runner, num_blocks=num_blocks, enable_prefix_caching=False)
