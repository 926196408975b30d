"""The ``mla-compile`` command line: ``generate`` (text from a local DeepSeek checkpoint), ``demo`` (serve a
toy model, check against HF), ``inspect``
(what torch.compile made of it: graphs, breaks, recompiles, mla:: ops, a depyf dump) and ``doctor``
(versions, the GPU, which attention backends can run here and which one is picked) and ``plan`` (weights and
latent-cache memory per rank of a DeepSeek preset laid out over GPUs, on paper).

``main(argv)`` returns the exit status, so tests call it in-process.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from mla_compile.app.toy import ALL_KINDS


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _device(text: str) -> str:
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected 'cpu' or 'cuda', got {text!r}")
    if text == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("'cuda' asked for, but torch.cuda.is_available() is False; "
                                             "use --device cpu or a CUDA build of torch")
    return text


def _add_model_args(p: argparse.ArgumentParser, layers: int) -> None:
    p.add_argument("--model", choices=ALL_KINDS, default="v2-lite",
                   help="toy model shape; v3.2 is sparse (top-k indexer) and needs a transformers with DeepSeek-V3.2 "
                   "(default: %(default)s)")
    p.add_argument("--layers", type=_positive, default=layers,
                   help="layers of the toy model; layer 0 is dense, later ones MoE (default: %(default)s)")
    p.add_argument("--device", type=_device, default="cpu", metavar="{cpu,cuda}", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights, activations and cache dtype, for ours and HF alike (default: %(default)s)")
    p.add_argument("--backend", default=None, metavar="NAME",
                   help="attention ops backend: auto, reference, triton, ... (default: $MLA_COMPILE_BACKEND or auto)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=_positive, default=8, help="tokens generated per prompt (default: %(default)s)")
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per cache block (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (subcommands ``generate``, ``demo``, ``inspect``, ``doctor`` and ``plan``)."""
    parser = argparse.ArgumentParser(
        prog="mla-compile", description="DeepSeek MLA under torch.compile: generate text from a checkpoint, "
        "run the demo, inspect the compiled graphs, "
        "check which attention backends run here, or plan memory over GPUs.")
    sub = parser.add_subparsers(dest="command", metavar="{generate,demo,inspect,doctor,plan}")
    _add_generate(sub)
    demo = sub.add_parser("demo", help="serve a toy DeepSeek model compiled whole; check tokens against HF eager",
                          description="Build a seeded toy DeepSeek model, patch it to paged MLA, compile it with "
                          "torch.compile(fullgraph=True), generate greedily for prompts of different lengths "
                          "(prefill + decode over the paged latent cache) and compare with HF eager. Exit status "
                          "1 if tokens differ or the graph breaks.")
    _add_model_args(demo, layers=2)
    demo.add_argument("--prompts", type=_positive, default=4, help="number of prompts (default: %(default)s)")
    demo.add_argument("--no-compile", action="store_true", help="run the patched model eagerly")
    demo.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                      help="serve through the engine, decode steps replayed as CUDA graphs (on CPU: same steps, "
                      "uncaptured); default: on for --device cuda when compiling, off otherwise")
    for flag in ("--tp", "--dp-attention", "--ep", "--dcp"):
        demo.add_argument(flag, type=_positive, default=1,
                          help="parallel degree; run under torchrun --nproc-per-node TP -m mla_compile.app.cli demo "
                          "(default: %(default)s)")
    insp = sub.add_parser("inspect", help="report graphs, graph breaks, recompiles and mla:: ops; write a depyf dump",
                          description="Compile the demo model, run prefill and decode at two batch sizes "
                          "(--batch and --batch + 1), and report what torch.compile produced. Writes "
                          "report.txt, report.json and a depyf dump (if depyf is installed) to --out.")
    _add_model_args(insp, layers=2)
    insp.add_argument("--batch", type=_positive, default=2, help="prompts in the first run (default: %(default)s)")
    insp.add_argument("--out", default="mla_inspect", help="output folder (default: %(default)s)")
    insp.add_argument("--json", action="store_true", help="print report.json instead of the text report")
    insp.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True (a break is an error)")
    insp.add_argument("--fresh", action="store_true",
                      help="disable Inductor's caches so every graph is compiled and dumped in full")
    insp.add_argument("--lowerings", action="store_true",
                      help="import mla_compile.lowerings, run the MLA fusion passes and autotune the decode and "
                      "any fp8 linears (backend decode=autotune,fp8_block_linear=autotune unless --backend is "
                      "given); the report lists passes and choices")
    sub.add_parser("doctor", help="versions, the GPU, every attention backend (available or why not) and the "
                   "selector's choice for DeepSeek-V2-Lite and V3 shapes",
                   description="Print torch/triton/CUDA versions, the GPU, every decode/prefill/merge backend with "
                   "whether it can run here and why not, and the backend 'auto' picks for DeepSeek-V2-Lite (16 "
                   "heads) and V3 (128 heads) in bf16 with block size 64. Imports no peer library.")
    _add_plan(sub)
    return parser


def _add_plan(sub) -> None:
    plan = sub.add_parser("plan", help="weights and latent-cache memory per rank of a DeepSeek model over GPUs",
                          description="On paper, from the preset's dims: weight bytes per rank (fp8 with block "
                          "scales, or bf16), latent-cache bytes per token per rank, the tokens that fit and the "
                          "batch at 32k context. Ranks = --tp; --dp-attention, --ep and --dcp partition them "
                          "(SGLang's convention; see mla_compile.parallel).")
    plan.add_argument("--model", choices=("v3", "v2", "v2-lite", "v3.2", "v4-flash"), default="v3",
                      help="DeepSeek preset (default: %(default)s); v4-flash prints V4's cache by layer type")
    plan.add_argument("--context", type=_positive, default=1 << 20,
                      help="tokens of context for the v4-flash cache table (default: %(default)s)")
    for flag in ("--tp", "--dp-attention", "--ep", "--dcp"):
        plan.add_argument(flag, type=_positive, default=1, help="parallel degree (default: %(default)s)")
    plan.add_argument("--gpu-mem", type=float, default=141.0, metavar="GIB", help="GiB per GPU (default: %(default)s)")
    plan.add_argument("--reserve", type=float, default=None, metavar="GIB",
                      help="GiB kept for activations, CUDA graphs, buffers (default: 10%% of --gpu-mem)")
    plan.add_argument("--weights", choices=("fp8", "bf16"), default="fp8", help="weight dtype (default: %(default)s)")
    plan.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16",
                      help="latent cache: bf16 rows or DeepSeek's 656-byte fp8 rows (default: %(default)s)")


def cmd_plan(args: argparse.Namespace) -> int:
    """``mla-compile plan``: print the per-rank memory table; exit 0 (2 for a layout that does not divide)."""
    from mla_compile.models.config import preset
    from mla_compile.serving.memory_plan import format_plan, plan_memory
    from mla_compile.parallel import ParallelConfig

    if args.model == "v4-flash":  # V4's caches: sliding window rows, compressed entries, indexer keys
        from mla_compile.models.v4_cache import V4_FLASH, V4CacheLayout

        kv = "bf16" if args.kv_cache == "bf16" else None
        if kv is None:
            raise ValueError("--kv-cache fp8 is not modelled for v4-flash yet; use bf16")
        print(f"deepseek-v4-flash cache per sequence ({kv}), {args.context:,} tokens of context")
        print(V4CacheLayout(V4_FLASH, kv).table(args.context))
        return 0
    parallel = ParallelConfig(tp=args.tp, dp_attention=args.dp_attention, dcp=args.dcp, ep=args.ep)
    plan = plan_memory(preset(f"deepseek-{args.model}"), parallel, gpu_mem_gib=args.gpu_mem,
                       weight_dtype=args.weights, kv_dtype=args.kv_cache, reserve_gib=args.reserve)
    print(f"deepseek-{args.model} on {parallel.world_size} x {args.gpu_mem:g} GiB")
    print(format_plan(plan))
    return 0


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a local DeepSeek checkpoint directory (bf16 or fp8)",
                         description="Load a local HF-format DeepSeek checkpoint (config.json, safetensors shards, "
                         "tokenizer.json) with mla_compile.from_pretrained, tokenize the prompt with the checkpoint's "
                         "tokenizer, and stream the tokens (greedy, or sampled with --temperature / --top-k / "
                         "--top-p / --seed) as text; prints tokens/s to stderr.")
    gen.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-new-tokens", type=_positive, default=64, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--device", type=_device, default="cpu", metavar="{cpu,cuda}", help="(default: %(default)s)")
    gen.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                     help="dtype of the unquantized weights (default: the checkpoint's)")
    gen.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16",
                     help="latent cache: the weights' dtype, or DeepSeek's fp8 rows (default: %(default)s)")
    gen.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                     help="torch.compile(model, fullgraph=True) (default: on)")
    gen.add_argument("--regional-compile", action=argparse.BooleanOptionalAction, default=True,
                     help="with --compile: each layer as nested compile regions, so the compile time hardly grows "
                          "with depth (default: on)")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    gen.add_argument("--block-size", type=_positive, default=16, help="tokens per cache block (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: off (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1: off (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="the sampling stream (default: drawn once, seed 0)")
    for flag in ("--tp", "--dp-attention", "--ep"):
        gen.add_argument(flag, type=_positive, default=1,
                         help="parallel degree; run under torchrun --nproc-per-node TP -m mla_compile.app.cli generate "
                         "(each rank reads its shard of the checkpoint; every attention group serves the prompt, rank "
                         "0 prints; default: %(default)s)")


def cmd_generate(args: argparse.Namespace) -> int:
    """``mla-compile generate``: stream the text, then report tokens/s on stderr."""
    from mla_compile.app.textgen import generate_text

    state = _init_parallel(args)
    quiet = state is not None and state.rank != 0  # rank 0 prints; every rank runs the same steps
    try:
        res = generate_text(args.model, args.prompt, max_new_tokens=args.max_new_tokens, device=args.device,
                            dtype=_dtype(args.dtype) if args.dtype else None, kv_cache=args.kv_cache,
                            compile=args.compile, chat=args.chat, block_size=args.block_size,
                            stream=None if quiet else sys.stdout, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, regional_compile=args.regional_compile,
                            log=(lambda s: None) if quiet else _log, parallel=state)
    finally:
        if state is not None:
            from mla_compile.parallel import destroy

            destroy()
    if quiet:
        return 0
    _log(f"{len(res.tokens)} tokens in {res.prefill_s + res.decode_s:.2f} s: {res.tokens_per_s:.1f} tokens/s "
         f"(prompt {len(res.prompt_ids)} tokens, prefill {res.prefill_s:.2f} s, load {res.load_s:.1f} s"
         f"{'; the first prefill and decode steps include compiling them' if args.compile else ''})")
    return 0


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _cuda_graphs(args: argparse.Namespace) -> bool:
    """``--cuda-graphs`` as given, else on for compiled CUDA runs (what a serving user wants)."""
    if args.cuda_graphs is not None:
        return args.cuda_graphs
    return str(args.device).startswith("cuda") and not args.no_compile


def cmd_demo(args: argparse.Namespace) -> int:
    """``mla-compile demo``: exit 0 when tokens match HF eager and the graph does not break."""
    from mla_compile.app.demo import run_demo

    state = _init_parallel(args)
    quiet = state is not None and state.rank != 0  # rank 0 reports; every rank checks its own tokens
    try:
        result = run_demo(args.model, layers=args.layers, num_prompts=args.prompts,
                          max_new_tokens=args.max_new_tokens, block_size=args.block_size, device=args.device,
                          dtype=_dtype(args.dtype), seed=args.seed, backend=args.backend, compile=not args.no_compile,
                          cuda_graphs=_cuda_graphs(args), log=(lambda s: None) if quiet else _log, parallel=state)
    finally:
        if state is not None:
            from mla_compile.parallel import destroy

            destroy()
    if not quiet:
        print(result.to_text())
    elif not result.ok:
        _log(f"rank {state.rank}: FAILED ({result.first_mismatch() or 'graph breaks'})")
    return 0 if result.ok else 1


def _init_parallel(args: argparse.Namespace):
    """The process groups of ``--tp/--dp-attention/--ep/--dcp`` (None for one process without torchrun)."""
    import os

    from mla_compile.parallel import ParallelConfig, init

    config = ParallelConfig(tp=args.tp, dp_attention=args.dp_attention, ep=args.ep, dcp=getattr(args, "dcp", 1))
    if config.world_size == 1 and "WORLD_SIZE" not in os.environ:
        return None
    device = None
    if args.device == "cpu":
        device = "cpu"
    return init(config, device=device)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``mla-compile inspect``: exit 0 when the compiled runs completed (breaks are reported, not fatal)."""
    from mla_compile.app.demo import build_demo
    from mla_compile.serving.generate import greedy_generate
    from mla_compile.graphs.inspect import inspect_compile

    options = None
    backend = args.backend
    if getattr(args, "lowerings", False):
        import mla_compile.lowerings as lowerings  # registers the autotuned decode lowering

        options = lowerings.compile_options(True)
        backend = backend or "decode=autotune,fp8_block_linear=autotune"
    setup = build_demo(args.model, layers=args.layers, num_prompts=args.batch + 1,
                       max_new_tokens=args.max_new_tokens, block_size=args.block_size, device=args.device,
                       dtype=_dtype(args.dtype), seed=args.seed, backend=backend)

    def run_steps(compiled) -> None:
        for batch in (args.batch, args.batch + 1):  # a second batch size: shows whether shapes recompile
            greedy_generate(compiled, setup.prompts[:batch], args.max_new_tokens, block_size=args.block_size,
                            num_blocks=setup.num_blocks, device=setup.device)

    _log(f"compiling the toy {args.model} model ({args.layers} layers) on {args.device}; "
         f"batches {args.batch} and {args.batch + 1} ...")
    report = inspect_compile(setup.model, run_steps, args.out, fullgraph=args.fullgraph, fresh=args.fresh,
                             options=options)
    print(report.to_json() if args.json else report.to_text())
    if not args.json:
        print(f"report: {args.out}/report.txt, {args.out}/report.json")
    return 1 if report.error else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mla-compile`` script; returns the exit status (2 for usage errors)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and on errors; hand the status back instead
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "plan":  # arithmetic only
        try:
            return cmd_plan(args)
        except ValueError as e:
            print(f"mla-compile plan: error: {e}", file=sys.stderr)
            return 2
    if args.command == "doctor":  # needs neither transformers nor a GPU
        from mla_compile.app.doctor import doctor_report

        print(doctor_report())
        return 0
    try:
        import transformers  # noqa: F401  (the toy model and the HF reference are transformers models)
    except ImportError:
        print(f"mla-compile {args.command}: error: needs transformers>=5.17 for the toy DeepSeek model; "
              "pip install 'transformers>=5.17' (or pip install -e '.[test]')", file=sys.stderr)
        return 2
    try:
        commands = {"generate": cmd_generate, "demo": cmd_demo, "inspect": cmd_inspect}
        return commands[args.command](args)
    except (ValueError, NotImplementedError) as e:  # bad inputs, or what is not built (e.g. a V4 layout): named
        print(f"mla-compile {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
