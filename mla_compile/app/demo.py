"""The end-to-end demo: a toy DeepSeek model, patched and compiled whole, served over the paged cache.

:func:`run_demo` builds a seeded toy HF model, keeps an unpatched copy as the reference, patches the
other, compiles it with ``torch.compile(fullgraph=True)``, greedily generates for prompts of different
lengths (one prefill step, then batched decode), and compares the tokens with HF eager. The CLI
(``mla-compile demo``) prints :meth:`DemoResult.to_text`. Sits above the core and ops; the only
diagnostics it needs (:class:`~mla_compile.graphs.inspect.CompileWatch`) depend on torch alone.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mla_compile import envs, ops
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.engine import Engine
from mla_compile.serving.generate import GenerationResult, greedy_generate, hf_greedy_reference
from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.graphs.inspect import CompileWatch, short_reason
from mla_compile.models.model import MLAForCausalLM, patch
from mla_compile.app.toy import ALL_KINDS, random_prompts, toy_hf_model

# Prompt lengths cycle through these: short and long, some crossing 16-token block boundaries.
PROMPT_LENGTHS = (7, 19, 3, 12, 26, 5, 16, 9)
_MODEL_OPS = ("cache_write", "decode", "prefill")  # what MLAAttention calls (registry op names)
# The guard that splits prefill-only and decode steps into two graphs (expected, not a shape recompile).
_STEP_KIND_GUARD = re.compile(r"meta\.(decode|prefill) is (not )?None")


@dataclass
class DemoSetup:
    """A patched model with its caches allocated, the unpatched HF reference and the prompts."""

    model: MLAForCausalLM
    reference: torch.nn.Module
    prompts: list[list[int]]
    block_size: int
    num_blocks: int
    device: torch.device


def demo_prompts(num_prompts: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` seeded random token lists with lengths cycling through ``PROMPT_LENGTHS``."""
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(num_prompts)]
    return random_prompts(seed, lengths, vocab_size)


def build_demo(kind: str = "v2-lite", *, layers: int = 2, num_prompts: int = 4, max_new_tokens: int = 8,
               block_size: int = 16, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0, backend: str | None = None, parallel=None) -> DemoSetup:
    """Build the toy model of ``kind`` with ``layers`` layers, its HF reference copy and the prompts.

    Layer 0 is dense, later layers are MoE (``first_k_dense_replace=1``), so ``layers >= 2`` covers both.
    ``backend`` picks the attention ops' backend (None: ``MLA_COMPILE_BACKEND`` or "auto"). ``parallel``: a
    :class:`~mla_compile.parallel.ParallelState` from ``mla_compile.parallel.init``; the model is sharded for
    this rank (on ``parallel.device``) and every rank serves the same prompts.
    """
    if kind not in ALL_KINDS:
        raise ValueError(f"model must be one of {ALL_KINDS}, got {kind!r}")
    for name, value in (("layers", layers), ("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens),
                        ("block_size", block_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    device = torch.device(device if parallel is None else parallel.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch.cuda.is_available() is False; use device 'cpu'")
    chosen = backend or envs.backend()
    from mla_compile.backends import requested_for

    for op in _MODEL_OPS:  # an unusable backend fails here, not as a confusing error inside tracing
        ops.resolve(op, device, requested_for(op, chosen), dtype=dtype)  # per-op specs ("decode=autotune") too
    hf = toy_hf_model(kind, seed=seed, dtype=dtype, device=device, num_hidden_layers=layers)
    reference = copy.deepcopy(hf)  # patch() rewrites hf in place
    model = patch(hf, backend=backend, parallel=parallel)
    prompts = demo_prompts(num_prompts, hf.config.vocab_size, seed)
    num_blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts) + 1
    model.allocate_cache(num_blocks, block_size)
    return DemoSetup(model, reference, prompts, block_size, num_blocks, device)


@dataclass
class DemoResult:
    """Tokens (ours and HF eager), throughput, compile figures and whether everything held."""

    description: str
    tokens: list[list[int]]
    reference_tokens: list[list[int]]
    prompt_lengths: list[int]
    max_new_tokens: int
    compiled: bool
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    compile_time_s: float = 0.0
    warmup_s: float = 0.0
    steady_s: float = 0.0
    graphs: int = 0
    graph_breaks: list[str] = field(default_factory=list)
    recompiles: list[str] = field(default_factory=list)
    steady_tokens: list[list[int]] | None = None

    @property
    def tokens_match(self) -> bool:
        """Whether every generated token, of the first and of the steady-state run, equals HF eager's."""
        return self.tokens == self.reference_tokens and self.steady_tokens in (None, self.reference_tokens)

    @property
    def ok(self) -> bool:
        """Tokens match and nothing broke the graph (the CLI's exit status)."""
        return self.tokens_match and not self.graph_breaks

    def first_mismatch(self) -> str | None:
        """Where the tokens first differ from HF eager's, as text (None when they match)."""
        for run, tokens in (("first run", self.tokens), ("steady run", self.steady_tokens)):
            if tokens is None or tokens == self.reference_tokens:
                continue
            if not tokens:
                return f"{run}: no tokens, the run stopped"
            for i, (ours, ref) in enumerate(zip(tokens, self.reference_tokens)):
                for j, (a, b) in enumerate(zip(ours, ref)):
                    if a != b:
                        return f"{run}, prompt {i}, new token {j}: ours {a}, HF {b}"
            return f"{run}: token counts differ"
        return None

    def to_text(self) -> str:
        """The summary the CLI prints."""
        n = len(self.tokens)
        lines = [self.description,
                 f"prompts: {n} (lengths {', '.join(map(str, self.prompt_lengths))}), "
                 f"{self.max_new_tokens} new tokens each",
                 f"tokens match HF eager: {'yes' if self.tokens_match else 'NO (' + str(self.first_mismatch()) + ')'}",
                 f"throughput (steady state): prefill {self.prefill_tok_s:.0f} tok/s, decode {self.decode_tok_s:.1f} tok/s"]
        if self.compiled:
            lines.append(f"compile time: {self.compile_time_s:.1f} s (Dynamo+Inductor; first run {self.warmup_s:.1f} s, "
                         f"steady run {self.steady_s:.2f} s)")
            by_design = [r for r in self.recompiles if _STEP_KIND_GUARD.search(r)]
            note = (f" ({len(by_design)} by design: decode and prefill steps take separate graphs, "
                    f"{len(self.recompiles) - len(by_design)} from shapes)" if by_design else "")
            lines.append(f"graphs: {self.graphs}, graph breaks: {len(self.graph_breaks)}, "
                         f"recompiles: {len(self.recompiles)}{note}")
            lines += [f"  graph break: {b}" for b in self.graph_breaks]
            lines += [f"  recompile: {r}" for r in self.recompiles]
        else:
            lines.append("compile: off (--no-compile), eager run")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def _dcp_step(step_fn, block_size: int, state):
    """``step_fn`` on this DCP rank's metadata (:func:`mla_compile.parallel.dcp.localize` of each planned step)."""
    from mla_compile.models.metadata import mark_dynamic
    from mla_compile.parallel.dcp import localize

    def run(input_ids, positions, meta):
        meta = localize(meta, positions, block_size, state.config.dcp, state.dcp.rank)
        mark_dynamic(input_ids, positions, meta)
        return step_fn(input_ids, positions, meta)

    run._orig_mod = getattr(step_fn, "_orig_mod", step_fn)  # DecodeGraphRunner finds the model there
    return run


def _layout(p) -> str:
    return " ".join(f"{k}={getattr(p, k)}" for k in ("tp", "dp_attention", "ep", "dcp") if getattr(p, k) > 1 or k == "tp")


def engine_generate(runner: DecodeGraphRunner, prompts: list[list[int]], max_new_tokens: int, *,
                    num_blocks: int) -> GenerationResult:
    """Greedy generation through the serving engine: one prefill step for all prompts, then decode
    steps (CUDA-graph replays when the runner captures)."""
    sync = torch.cuda.synchronize if runner.builder.device.type == "cuda" else (lambda: None)
    engine = Engine(runner, num_blocks=num_blocks)
    for p in prompts:
        engine.add_request(p, max_new_tokens)
    t0 = time.perf_counter()
    engine.step()
    sync()
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps = 0
    while engine.running or engine.waiting:
        engine.step()
        steps += 1
    sync()
    tokens = [r.output for r in sorted(engine.finished, key=lambda r: r.id)]
    return GenerationResult(tokens=tokens, prefill_s=prefill_s, decode_s=time.perf_counter() - t0, decode_steps=steps)


def run_demo(kind: str = "v2-lite", *, layers: int = 2, num_prompts: int = 4, max_new_tokens: int = 8,
             block_size: int = 16, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             seed: int = 0, backend: str | None = None, compile: bool = True, cuda_graphs: bool = False,
             log: Callable[[str], None] = lambda s: None, parallel=None) -> DemoResult:
    """Run the demo end to end and return its :class:`DemoResult` (see the module docstring).

    The generation runs twice: the first run compiles (prefill graph, then decode graph), the second
    is timed for steady-state throughput. ``cuda_graphs`` serves through the engine with decode steps
    captured as CUDA graphs (on CPU the engine runs the same padded steps uncaptured). ``log``
    receives progress lines. ``parallel``: run this rank of a sharded model (see :func:`build_demo`).
    """
    setup = build_demo(kind, layers=layers, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                       block_size=block_size, device=device, dtype=dtype, seed=seed, backend=backend,
                       parallel=parallel)
    c = setup.model.config
    dtype_name = str(dtype).removeprefix("torch.")
    description = (f"mla-compile demo: toy {kind} model ({c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} heads, "
                   f"kv_lora_rank {c.kv_lora_rank}, rope {c.qk_rope_head_dim}) on {setup.device.type} {dtype_name}, "
                   f"paged latent cache of {setup.num_blocks} x {block_size}-token blocks, "
                   + ("torch.compile(fullgraph=True)" if compile else "eager")
                   + (", engine with CUDA-graph decode" if cuda_graphs else "")
                   + ("" if parallel is None else f", rank {parallel.rank} of {parallel.world_size} "
                      f"({_layout(parallel.config)}, {parallel.config.world_size} processes)"))
    log(description)
    log("HF eager reference ...")
    ref_tokens, _ = hf_greedy_reference(setup.reference, setup.prompts, max_new_tokens, device=setup.device)
    step = torch.compile(setup.model, fullgraph=True) if compile else setup.model
    if parallel is not None and parallel.config.dcp > 1:
        step = _dcp_step(step, block_size, parallel)
    if cuda_graphs:
        n = len(setup.prompts)
        builder = MetadataBuilder(max_batch=max(n, 2), max_blocks_per_seq=setup.num_blocks,
                                  max_tokens=sum(len(p) for p in setup.prompts) + 2 * n, block_size=block_size,
                                  device=setup.device)
        runner = DecodeGraphRunner(step, builder, enabled=setup.device.type == "cuda")
        gen = lambda: engine_generate(runner, setup.prompts, max_new_tokens, num_blocks=setup.num_blocks)  # noqa: E731
    else:
        gen = lambda: greedy_generate(step, setup.prompts, max_new_tokens, block_size=block_size,  # noqa: E731
                                      num_blocks=setup.num_blocks, device=setup.device)
    breaks: list[str] = []
    log("first run (compiles prefill and decode graphs) ..." if compile else "first run ...")
    with CompileWatch() as watch:
        t0 = time.perf_counter()
        try:
            first = gen()
        except torch._dynamo.exc.Unsupported as e:  # fullgraph=True turns a graph break into this error
            breaks.append(short_reason(str(e)))
            first = None
        warmup = time.perf_counter() - t0
        steady = None
        if first is not None:
            log("steady-state run ...")
            t0 = time.perf_counter()
            steady = gen()
            steady_s = time.perf_counter() - t0
    breaks += [f"{b.reason} (x{b.count}{', at ' + ', '.join(b.locations) if b.locations else ''})"
               for b in watch.graph_breaks]
    result = DemoResult(
        description=description, tokens=first.tokens if first else [], reference_tokens=ref_tokens,
        prompt_lengths=[len(p) for p in setup.prompts], max_new_tokens=max_new_tokens, compiled=compile,
        compile_time_s=watch.compile_time_s, warmup_s=warmup, graphs=watch.graph_count, graph_breaks=breaks,
        recompiles=[f"{r.compile_id} {r.function}: {r.reason}" for r in watch.recompiles])
    if steady is not None:
        prompt_tokens = sum(result.prompt_lengths)
        result.prefill_tok_s = prompt_tokens / max(steady.prefill_s, 1e-9)
        result.decode_tok_s = len(setup.prompts) * steady.decode_steps / max(steady.decode_s, 1e-9)
        result.steady_s = steady_s
        result.steady_tokens = steady.tokens
    return result
