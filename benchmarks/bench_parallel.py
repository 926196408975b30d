"""Decode-step scaling of a DeepSeek-V3-dims model over GPUs: TP, DP-attention + EP, TP + DCP, in one table.

    torchrun --nproc-per-node 8 benchmarks/bench_parallel.py --out OUT --modes tp,dp_ep,tp_dcp --batches 1,64,256
    python benchmarks/bench_parallel.py --out OUT --tp 1,2,4,8 --batches 1,64,256 --budget-s 560
    python benchmarks/bench_parallel.py --out OUT                       # world size 1 (tp=1) on one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --out OUT --device cpu --tiny --batches 1,3   # CPU

Under ``torchrun`` the world size ``W`` is the number of processes and every mode of ``--modes`` runs over all of
them: ``tp`` (``ParallelConfig(tp=W)``: heads, MLPs, experts and vocabulary split ``W`` ways, latent cache
duplicated), ``dp_ep`` (``tp=W, dp_attention=W, ep=W``: each rank decodes its own ``1/W`` of the sequences with all
heads and its own cache; tokens gathered around the MoE, experts whole and split over the ranks, all-to-all
dispatch) and ``tp_dcp`` (``tp=W, dcp=W``: heads split as in ``tp``, each sequence's latent cache split by token,
:func:`mla_compile.parallel.dcp.localize` on each step). Modes the world size cannot serve are skipped with the
reason (``dp_ep`` and ``tp_dcp`` need ``W > 1``). Without ``torchrun`` and with ``--tp`` listing several degrees,
the script is a launcher: it runs ``torchrun --nproc-per-node N`` of itself for each ``N`` (only ``--modes``' ``tp``
below the largest ``N`` unless ``--all-modes-at all``) in turn, each with what is left of ``--budget-s`` less
``MODE_FLOOR_S`` for each mode still to run after it (it is killed, with its workers, 60 s past that), and merges
the results.
Plain ``python`` with ``--tp 1`` (the default) runs world size 1 in-process.

The model: ``bench_decode_step``'s ``--kind v3`` (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, 256 experts
top-8 in 8 groups, 1 shared expert, moe_intermediate 2048, vocab 129280; ``--layers`` layers, the first dense),
random weights (bf16 on CUDA, float32 on CPU). It is built on the meta device and every rank materialises only its
shards (``patch(hf, parallel=..., weights=...)``): each full tensor is drawn from a per-name seed on the rank's
device, sliced and dropped, so the peak is one full tensor (the 15 GB ``gate_up_proj`` of a MoE layer at V3 dims)
above the rank's shards. The model flags of ``bench_decode_step.py`` (``--layers``, ``--hidden``, ``--tiny``, ...,
``--batches``, ``--ctx``, ``--block-size``, ``--warmup``, ``--iters``, ``--dtype``, ``--backend``, ``--fit-ctx``,
``--fit-frac``, ``--seed``) are taken here too (``--kind`` defaults to v3, ``--fit-ctx`` to 32768).

Per mode and batch (the global batch: every sequence of the step, over all ranks): each sequence decodes one token
over ``--ctx`` tokens of random context (``bench_decode_step.Workload``'s latents; under DCP each rank's cache holds
its tokens of them). ``--step graph`` (CUDA default): the sharded model compiled (``torch.compile(fullgraph=True)``;
with ``--regional-compile`` each layer as nested compile regions) and its decode steps captured in CUDA graphs by
``DecodeGraphRunner``; ``compiled`` (compiled, no graphs) and ``eager`` (CPU default) otherwise. Reported: the step
latency (``bench_decode_step.measure``: the median of CUDA events around one whole step, host planning included;
the slowest rank), tokens/s (batch / latency), the GPU time of a graph replay, the share of the replay's GPU time in
collective kernels (``torch.profiler`` over 5 replays; kernels named nccl / AllReduce / AllGather / ReduceScatter /
AllToAll; this time includes waiting for the other ranks), the relative error of the first step's logits of the
first 4 sequences against a world-size-1 unsharded model built from the same seeds (``--check``: rank 0 builds it
before the modes), and the largest global batch at ``--fit-ctx`` tokens of context that ``--fit-frac`` of each
rank's free memory after its weights holds (its cache share, plus the step's working memory per sequence as
``bench_decode_step`` scales it; for the ``--layers`` built, not the whole model). Rows past ``--budget-s`` (seconds
since start; rank 0 decides for all) are skipped. Writes ``bench_parallel_w{W}.json`` per world size and
``bench_parallel.{json,txt}`` (every world size found under ``--out``) with versions, GPU, world size and the
NVLink-multicast environment (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``: set when unset,
refused when set otherwise).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import bench_decode_step as bds  # noqa: E402  (model, workload, timing helpers)

MODES = ("tp", "dp_ep", "tp_dcp")
REQUIRED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # NVLink multicast stays off
COMM_KERNELS = ("nccl", "allreduce", "allgather", "reducescatter", "alltoall")
MODE_FLOOR_S = 75.0  # launcher: seconds kept for each mode of a later world size (start, build, compile, rows)
CHECK_ROWS = 4  # first-step logits rows compared with the world-1 reference
ROWS: list[dict] = []
INFO: dict = {}


def require_env() -> dict:
    """Set the multicast-off variables where unset; raise where set to anything else. Returns them."""
    for name, value in REQUIRED_ENV.items():
        have = os.environ.setdefault(name, value)
        if have != value:
            raise SystemExit(f"{name}={have!r}: this benchmark keeps NVLink multicast off ({name}={value}); unset it "
                             "or set it to that value")
    return {k: os.environ[k] for k in REQUIRED_ENV}


def parse_args(argv=None):
    """This script's flags, then ``bench_decode_step.parse_args`` for the model and run flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_parallel.{json,txt}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--tp", default="1", help="world sizes (TP degrees); without torchrun and with more than one, "
                                              "the script launches torchrun for each")
    ap.add_argument("--all-modes-at", choices=("max", "all"), default="max",
                    help="launcher: run dp_ep / tp_dcp at the largest world size only (max) or at every one")
    ap.add_argument("--step", choices=("graph", "compiled", "eager"), default=None,
                    help="graph: compiled + CUDA graphs (CUDA default); compiled; eager (CPU default)")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="compare first-step logits with a world-1 unsharded model (rank 0 builds it)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="CUDA graphs: profile 5 replays per row for the collectives' share")
    ap.add_argument("--ep-dispatch", default="all_to_all", choices=("all_to_all", "all_reduce"))
    ap.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout (rendezvous, collectives)")
    mine, rest = ap.parse_known_args(argv)
    if "--kind" not in rest:
        rest += ["--kind", "v3"]
    if "--fit-ctx" not in rest:
        rest += ["--fit-ctx", "32768"]
    args = bds.parse_args(rest + ["--out", mine.out])
    for k, v in vars(mine).items():
        setattr(args, k, v)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; pick from {', '.join(MODES)}")
    args.tp_list = [int(x) for x in str(args.tp).split(",")]
    if min(args.tp_list) < 1:
        ap.error(f"--tp must list positive world sizes, got {args.tp!r}")
    args.step = args.step or ("graph" if args.device.startswith("cuda") else "eager")
    if args.step == "graph" and not args.device.startswith("cuda"):
        ap.error("--step graph needs CUDA; use --step eager or compiled on CPU")
    return args


class RandomWeights:
    """HF parameter name -> the full tensor, drawn on ``device`` from a per-name seed (the same on every rank and
    in the reference): norms 1, the routing bias uniform in [-0.05, 0.05], the rest normal(0, ``std``)."""

    def __init__(self, meta_model, seed: int, device: torch.device, std: float):
        self.specs = {n: (tuple(t.shape), t.dtype) for n, t in list(meta_model.named_parameters())
                      + list(meta_model.named_buffers())}
        self.seed, self.device, self.std = seed, device, std

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(name)
        shape, dtype = self.specs[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=self.device)
        gen = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if name.endswith("e_score_correction_bias"):
            return t.uniform_(-0.05, 0.05, generator=gen)
        return t.normal_(0.0, self.std, generator=gen)


def meta_model(args, dtype):
    """The HF model of ``--kind`` on the meta device (``bench_decode_step.build_hf``'s config)."""
    return bds.build_hf(args, torch.device("meta"), dtype)


def build_reference(args, dev, dtype, weights: RandomWeights):
    """The unsharded patched model, every weight materialised from ``weights`` (as ``shard_model`` materialises
    the replicated ones)."""
    from mla_compile.models.model import patch
    from mla_compile.parallel.shard import _materialise_rest, _Source

    hf = meta_model(args, dtype)
    _materialise_rest(hf, _Source(hf, weights, dev), dev)
    return patch(hf, backend=args.backend)


def reference_logits(args, dev, dtype, wl, weights) -> dict:
    """First-step logits (first ``CHECK_ROWS`` sequences, float32 CPU) of the unsharded model per batch."""
    from mla_compile.serving.builder import MetadataBuilder

    model = build_reference(args, dev, dtype, weights)
    caches = model.allocate_cache(wl.num_blocks, wl.bs)
    for i, cache in enumerate(caches):
        cache.copy_(wl.latents(i))
    builder = MetadataBuilder(max_batch=wl.max_batch, max_blocks_per_seq=wl.nb, max_tokens=wl.max_batch,
                              block_size=wl.bs, device=dev)
    ctx, out = max(args.ctx_list), {}
    with torch.no_grad():
        for b in args.batch_list:
            s = builder.build(wl.chunks(b, ctx, 0))
            out[b] = model(s.input_ids, s.positions, s.meta)[:min(b, CHECK_ROWS)].float().cpu()
    del model, caches
    bds.free_memory()
    return out


def reference_path(args, dev) -> str:
    """Where the reference logits of this model, workload and device type are kept under ``--out`` (the
    launcher's world sizes share them)."""
    keys = ("kind", "tiny", "layers", "hidden", "heads", "experts", "topk", "moe_inter", "inter", "vocab",
            "q_lora_rank", "n_group", "topk_group", "shared_experts", "batches", "ctx", "block_size", "seed", "dtype",
            "backend")
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    text = repr([(k, getattr(args, k)) for k in keys] + [device])
    return os.path.join(args.out, f"reference_{zlib.crc32(text.encode()):08x}.pt")


def load_reference(args, dev) -> dict | None:
    """The reference logits :func:`reference_path` holds for this configuration, or None where none was saved."""
    path = reference_path(args, dev)
    return torch.load(path) if os.path.exists(path) else None


def mode_config(mode: str, world: int):
    """The :class:`~mla_compile.parallel.ParallelConfig` of ``mode`` (one of :data:`MODES`) over ``world`` ranks."""
    from mla_compile.parallel import ParallelConfig

    if mode == "tp":
        return ParallelConfig(tp=world)
    if mode == "dp_ep":
        return ParallelConfig(tp=world, dp_attention=world, ep=world)
    return ParallelConfig(tp=world, dcp=world)


def dcp_part(latents: torch.Tensor, tables: torch.Tensor, dcp: int, rank: int) -> torch.Tensor:
    """This DCP rank's paged cache under ``localize``'s layout (interleave = block size, a sequence's part in the
    first of its own blocks): local position ``p`` of sequence ``i`` holds global position
    ``global_position(p)`` of the unsplit cache ``latents [num_blocks, bs, D]`` (every block in ``tables``)."""
    from mla_compile.parallel.dcp import global_position

    nblocks, bs, d = latents.shape
    n_seq, nb = tables.shape
    tables = tables.to(latents.device)
    seq = latents[tables].view(n_seq, nb * bs, d)
    lp = torch.arange(nb * bs, device=latents.device)
    gp = global_position(lp, dcp, rank, bs)
    ok = gp < nb * bs
    local = torch.zeros_like(seq)
    local[:, lp[ok]] = seq[:, gp[ok]]
    out = torch.zeros_like(latents)
    out[tables] = local.view(n_seq, nb, bs, d)
    return out


class Dist:
    """Collective helpers over the world group (no-ops at world size 1 without a process group)."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank

    def _on(self) -> bool:
        import torch.distributed as dist
        return self.world > 1 and dist.is_initialized()

    def agree(self, value):
        """Rank 0's ``value`` on every rank."""
        if not self._on():
            return value
        import torch.distributed as dist
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value) -> list:
        """Every rank's ``value``, in rank order."""
        if not self._on():
            return [value]
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        """Wait for every rank."""
        if self._on():
            import torch.distributed as dist
            dist.barrier()


def profile_comm(graph, out_path: str | None) -> dict:
    """GPU time of a captured step's kernels over 5 replays of ``graph`` (its metadata staged; per replay) and the
    part in collective kernels."""
    averages = bds.replay_profile(graph)
    avgs = [a for a in averages if a.device_type == torch.autograd.DeviceType.CUDA]

    def collective(a) -> bool:
        return any(k in a.key.lower() for k in COMM_KERNELS)

    comm = [a for a in avgs if collective(a)]
    if out_path is not None:
        bds.write_kernel_csv(out_path, averages, ("collective", collective))
    return {"kernel_us": sum(a.device_time_total for a in avgs) / bds.REPLAYS,
            "comm_us": sum(a.device_time_total for a in comm) / bds.REPLAYS,
            "comm_kernels": sorted({a.key[:60] for a in comm})}


def run_mode(args, mode: str, world: int, rank: int, dev, dtype, wl, weights, ref: dict, dd: Dist) -> None:
    """Build, shard, compile and capture ``mode`` over the world; one row per batch."""
    from mla_compile.app.demo import _dcp_step
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from mla_compile.models.model import patch
    from mla_compile.parallel import init
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.serving.dp_sync import StepShape
    from torch._dynamo.utils import counters

    ctx = max(args.ctx_list)
    base = dict(mode=mode, world=world, ctx=ctx)

    def skip_all(reason: str) -> None:
        for b in args.batch_list:
            ROWS.append(dict(base, batch=b, skipped=reason))
        log(rank, f"{mode} W={world}: skipped ({reason})")

    if world == 1 and mode != "tp":
        return skip_all("needs world size > 1 (at 1 it is tp=1)")
    try:
        pconf = mode_config(mode, world)
    except ValueError as exc:
        return skip_all(str(exc))
    if dd.agree(bds.elapsed() > args.budget_s - (bds.COMPILE_S if args.step != "eager" else 0.0)):
        return skip_all("time budget")
    base["parallel"] = " ".join(f"{k}={getattr(pconf, k)}" for k in ("tp", "dp_attention", "ep", "dcp")
                                if getattr(pconf, k) > 1 or k == "tp")
    state = init(pconf, timeout=args.timeout_s, device=dev)
    t0 = time.perf_counter()
    hf = meta_model(args, dtype)
    try:
        model = patch(hf, parallel=state, backend=args.backend, ep_dispatch=args.ep_dispatch, weights=weights,
                      regional_compile=args.regional_compile)
    except ValueError as exc:  # the model does not split this way (every rank raises alike)
        return skip_all(f"{type(exc).__name__}: {exc}"[:300])
    info = {"parallel": str(pconf), "build_s": time.perf_counter() - t0,
            "weight_bytes_per_rank": sum(p.numel() * p.element_size() for p in model.parameters())}
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        info["free_bytes_after_weights"] = min(dd.gather(torch.cuda.mem_get_info()[0]))
    dp = pconf.dp_attention
    group = rank // pconf.attn_tp
    caches = model.allocate_cache(wl.num_blocks, wl.bs)
    for i, cache in enumerate(caches):
        lat = wl.latents(i)
        cache.copy_(dcp_part(lat, wl.tables, pconf.dcp, state.dcp.rank) if pconf.dcp > 1 else lat)
    info["cache_bytes_per_token_per_rank"] = sum(c[0, 0].numel() * c.element_size() for c in caches) / pconf.dcp
    rows_of = {b: (-(-b // dp) if dp > 1 else b) for b in args.batch_list}  # sequences a rank's step holds
    sizes = sorted({max(n, 2) for n in rows_of.values()})
    builder = MetadataBuilder(max_batch=max(sizes), max_blocks_per_seq=wl.nb, max_tokens=max(sizes),
                              block_size=wl.bs, device=dev)
    graphs0 = counters["stats"]["unique_graphs"]
    fn = torch.compile(model, fullgraph=True) if args.step != "eager" else model
    if pconf.dcp > 1:
        fn = _dcp_step(fn, wl.bs, state)
    runner = DecodeGraphRunner(fn, builder, capture_sizes=sizes, enabled=args.step == "graph")
    if args.step == "graph":
        t0 = time.perf_counter()
        try:
            runner.capture()  # compiles (each size) and captures
        except Exception as exc:
            traceback.print_exc(limit=4)
            info["capture_error"] = f"{type(exc).__name__}: {exc}"[:500]
            INFO.setdefault("modes", {})[mode] = info
            return skip_all("capture failed")
        info["compile_capture_s"] = time.perf_counter() - t0
    INFO.setdefault("modes", {})[mode] = info
    info.update(paper_plan(args, pconf, dev))
    log(rank, f"{mode} W={world} ({base['parallel']}): built in {info['build_s']:.1f} s"
        + (f", compiled + captured in {info['compile_capture_s']:.1f} s" if "compile_capture_s" in info else ""))

    for b in args.batch_list:
        row = dict(base, batch=b, rows_per_rank=rows_of[b])
        if dd.agree(bds.elapsed() > args.budget_s):
            row["skipped"] = "time budget"
            ROWS.append(row)
            continue
        mine = list(range(group, b, dp)) if dp > 1 else list(range(b))  # global indices of this rank's sequences
        shape = StepShape(True, decode_rows=rows_of[b]) if dp > 1 else None

        def chunks(k, b=b, mine=mine):
            every = wl.chunks(b, ctx, k)
            return [every[i] for i in mine]

        res: dict = {}
        try:
            res = bds.measure(lambda k: runner.decode(chunks(k), shape), dev, args.warmup, args.iters)
            first = res.pop("first_logits")
            res["check"] = [(i, first[j]) for j, i in enumerate(mine[:first.shape[0]]) if i < CHECK_ROWS]
            if args.step == "graph":
                runner.decode(chunks(0), shape)  # stage this size's metadata
                graph = runner.graphs[runner.graph_size(max(len(mine), rows_of[b]))][0]
                res["replay_ms"] = statistics.median(bds.replay_ms(graph) for _ in range(args.iters))
                if args.profile:
                    path = os.path.join(args.out, f"profile_{mode}_w{world}_b{b}.csv") if rank == 0 else None
                    res.update(profile_comm(graph, path))
        except Exception as exc:  # the reason goes into the table
            traceback.print_exc(limit=4)
            res = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        everyone = dd.gather(res)
        errors = [f"rank {r}: {x['error']}" for r, x in enumerate(everyone) if "error" in x]
        if errors:
            row["error"] = "; ".join(errors)[:800]
        else:
            ms = [x["ms"] for x in everyone]
            row.update(ms=max(ms), ms_rank0=ms[0], tok_s=b / (max(ms) / 1e3), first_call_s=everyone[0]["first_call_s"],
                       times_ms_rank0=everyone[0]["times_ms"])
            for key in ("step_extra_bytes", "replay_ms", "comm_us", "kernel_us"):
                if key in everyone[0]:
                    row[key] = max(x[key] for x in everyone)
            if "comm_us" in row:
                row["comm_share"] = max(x["comm_us"] / (x["replay_ms"] * 1e3) for x in everyone)
                row["comm_kernels"] = everyone[0]["comm_kernels"]
            got = {i: t for x in everyone for i, t in x["check"]}
            want = ref.get(b)
            if want is not None and sorted(got) == list(range(want.shape[0])):
                row["rel_err_vs_world1"] = bds.rel_err(torch.stack([got[i] for i in range(want.shape[0])]), want)
            elif want is not None:
                row["check_error"] = f"first-step rows of sequences {sorted(got)} came back, {want.shape[0]} expected"
        ROWS.append(row)
        log(rank, f"{mode:7s} W={world} B={b:<4d} ctx={ctx}: {cell(row, 200)}")
        if rank == 0:
            save(args, world)
    info["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs0
    info["graph_breaks"] = dict(counters["graph_break"])
    del runner, fn, model, caches, builder
    bds.free_memory()
    dd.barrier()


def paper_plan(args, pconf, dev) -> dict:
    """The whole DeepSeek-V3 (61 layers) in this layout on this GPU's memory, on paper
    (``mla_compile.serving.memory_plan``, its default 10% reserve): sequences of ``--fit-ctx`` tokens that fit,
    with fp8 and with bf16 weights. Only for ``--kind v3`` at its real dims on CUDA."""
    if args.kind != "v3" or args.tiny or dev.type != "cuda":
        return {}
    from mla_compile.models.config import preset
    from mla_compile.serving.memory_plan import plan_memory

    gib = torch.cuda.get_device_properties(dev).total_memory / 2**30
    out = {}
    for wdt in ("fp8", "bf16"):
        try:
            plan = plan_memory(preset("deepseek-v3"), pconf, gpu_mem_gib=gib, weight_dtype=wdt)
            out[f"paper_v3_{wdt}"] = dict(batch=plan.batch_at(args.fit_ctx), weight_gib=plan.weight_bytes / 2**30,
                                          cache_gib=plan.cache_bytes / 2**30)
        except ValueError as exc:
            out[f"paper_v3_{wdt}"] = dict(error=str(exc)[:200])
    return out


def log(rank: int, text: str) -> None:
    """Print ``text`` with the elapsed time, on rank 0 only."""
    if rank == 0:
        print(f"[{bds.elapsed():6.1f}s] {text}", flush=True)


def cell(r: dict | None, width: int = 30) -> str:
    """A table cell: ``bench_decode_step``'s, with the share of the step in collectives where profiled."""
    if r is None or "skipped" in r or "error" in r or "comm_share" not in r:
        return bds._cell(r, width)
    text = f"{r['ms']:.3f} ms ({r['tok_s']:.0f} tok/s, {100 * r['comm_share']:.0f}% comm)"
    return text if len(text) <= width else text[:width - 3] + "..."


def save(args, world: int) -> None:
    """Write this world size's rows and info so far to ``bench_parallel_w{world}.json`` under ``--out``."""
    with open(os.path.join(args.out, f"bench_parallel_w{world}.json"), "w") as f:
        json.dump({"info": INFO, "rows": ROWS}, f, indent=1, default=str)


def memory_fit(info: dict, rows: list[dict], fit_ctx: int, fit_frac: float) -> list[str]:
    """Largest global batch at ``fit_ctx`` per mode and world size (see the module docstring)."""
    lines = []
    world = info.get("world_size", 1)
    for mode, m in sorted(info.get("modes", {}).items()):
        free, per_tok = m.get("free_bytes_after_weights"), m.get("cache_bytes_per_token_per_rank")
        if free is None or per_tok is None:
            lines.append(f"  {mode} W={world}: n/a (needs CUDA memory figures)")
            continue
        budget = fit_frac * free
        cache_seq = per_tok * fit_ctx
        scale = world if mode == "dp_ep" else 1  # each rank holds its own sequences
        text = (f"  {mode} W={world}: {scale * int(budget // cache_seq)} (cache only, "
                f"{cache_seq / 2**20:.1f} MiB/seq/rank)")
        measured = [r for r in rows if r["mode"] == mode and "step_extra_bytes" in r]
        if measured:
            r = max(measured, key=lambda r: r["batch"])
            extra = r["step_extra_bytes"] / max(r["rows_per_rank"], 1) * fit_ctx / r["ctx"]
            text += (f"; {scale * int(budget // (cache_seq + extra))} with the step's working memory "
                     f"({extra / 2**20:.1f} MiB/seq, from B={r['batch']})")
        m["max_batch_at_fit_ctx"] = text.strip()
        lines.append(text + f"; {free / 2**30:.1f} GiB free per rank after "
                     f"{m['weight_bytes_per_rank'] / 2**30:.1f} GiB of weights")
        paper = [f"{w} weights {m[f'paper_v3_{w}'].get('batch', 'n/a')} ({m[f'paper_v3_{w}'].get('weight_gib', 0):.1f} "
                 "GiB/rank)" for w in ("fp8", "bf16") if f"paper_v3_{w}" in m]
        if paper:
            lines.append("    whole DeepSeek-V3 (61 layers) on paper (serving.memory_plan, 10% reserve): "
                         + ", ".join(paper))
    return lines


def merge(out: str) -> str:
    """``bench_parallel.{json,txt}`` from every ``bench_parallel_w*.json`` under ``out``; returns the text."""
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "bench_parallel_w*.json")),
                       key=lambda p: int(p.rsplit("_w", 1)[1].split(".")[0])):
        with open(path) as f:
            runs.append(json.load(f))
    if not runs:
        with open(os.path.join(out, "bench_parallel.json"), "w") as f:
            json.dump({"runs": runs}, f)
        return "no runs"
    a = runs[-1]["info"]
    batches = sorted({r["batch"] for run in runs for r in run["rows"]})
    ctx = max((r["ctx"] for run in runs for r in run["rows"]), default=0)
    lines = [f"{a.get('device')} x{a.get('gpus_visible')}, torch {a.get('torch')}, "
             f"transformers {a.get('transformers')}, env {a.get('env')}; model: {a.get('model')}; {a.get('dtype')}; "
             f"step: {a.get('step')}; ctx {ctx}",
             "decode step latency (slowest rank; median of CUDA events around one whole step, host planning "
             "included), ms (tokens/s = global batch / latency, % of the graph replay's GPU time in collective "
             "kernels)", f"{'mode':34s}" + "".join(f"{f'B={b}':>38s}" for b in batches)]
    for run in runs:
        for mode in MODES:
            got = {r["batch"]: r for r in run["rows"] if r["mode"] == mode}
            if not got:
                continue
            par = next((r.get("parallel") for r in got.values() if r.get("parallel")), "")
            label = f"{mode} ({par})" if par else f"{mode} W={run['info'].get('world_size')}"
            lines.append(f"{label[:34]:34s}" + "".join(f"{cell(got.get(b), 37):>38s}" for b in batches))
    lines.append("build / compile + capture per mode: " + "; ".join(
        f"{mode} W={run['info'].get('world_size')} {m.get('build_s', 0):.1f} s / "
        f"{m.get('compile_capture_s', float('nan')):.1f} s, {m.get('compiled_graphs', '?')} graphs, "
        f"breaks {m.get('graph_breaks') or 'none'}" for run in runs for mode, m in run["info"].get("modes", {}).items()))
    lines.append("graph replay GPU time, ms / collective kernels us per replay:")
    for run in runs:
        for r in run["rows"]:
            if "replay_ms" in r:
                lines.append(f"  {r['mode']} W={r['world']} B={r['batch']}: replay {r['replay_ms']:.3f} ms"
                             + (f", collectives {r['comm_us']:.0f} us of {r['kernel_us']:.0f} us kernel time"
                                if "comm_us" in r else ""))
    checks = [f"{r['mode']} W={r['world']} B={r['batch']} "
              + (f"{r['rel_err_vs_world1']:.1e}" if "rel_err_vs_world1" in r else r["check_error"])
              for run in runs for r in run["rows"] if "rel_err_vs_world1" in r or "check_error" in r]
    lines.append("first-step logits vs the world-1 unsharded model (first 4 sequences), rel. error: "
                 + ("; ".join(checks) or "n/a"))
    for run in runs:
        i = run["info"]
        if not i.get("modes"):
            continue
        lines.append(f"largest global batch at {i.get('fit_ctx')} tokens of context in {i.get('fit_frac', 0):.0%} of "
                     f"free memory per rank ({i.get('layers')} layers built):")
        lines += memory_fit(i, run["rows"], i.get("fit_ctx", 32768), i.get("fit_frac", 0.8))
    errors = [f"  {r['mode']} W={r['world']} B={r['batch']}: {r['error']}" for run in runs for r in run["rows"]
              if "error" in r]
    errors += [f"  W={run['info'].get('world_size')} {k}: {v}" for run in runs for k, v in run["info"].items()
               if k.endswith("_error")]
    if errors:
        lines += ["errors:"] + errors
    text = "\n".join(lines)
    with open(os.path.join(out, "bench_parallel.json"), "w") as f:  # memory_fit fills in each mode's line
        json.dump({"runs": runs}, f, indent=1, default=str)
    with open(os.path.join(out, "bench_parallel.txt"), "w") as f:
        f.write(text + "\n")
    return text


def worker(args, world: int, rank: int) -> None:
    """One rank of a world of ``world`` processes: every mode of ``--modes`` over all of them."""
    import transformers

    import mla_compile  # noqa: F401  (registers the ops)
    from mla_compile.parallel import ParallelConfig, destroy, init

    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local) if args.device.startswith("cuda") else torch.device(args.device)
    dtype = args.torch_dtype
    torch.manual_seed(args.seed)
    INFO.update(args={k: v for k, v in vars(args).items() if k != "torch_dtype"}, torch=torch.__version__,
                transformers=transformers.__version__, world_size=world, env=require_env(), step=args.step,
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                gpus_visible=torch.cuda.device_count() if dev.type == "cuda" else 0, dtype=args.dtype,
                model=bds.model_text(args), layers=args.layers, fit_ctx=args.fit_ctx, fit_frac=args.fit_frac)
    # the world group first (rank 0 then builds the reference while the others wait in a collective)
    init(ParallelConfig(tp=world), rank=rank, world_size=world, timeout=args.timeout_s, device=dev)
    dd = Dist(world, rank)
    from mla_compile.models.config import preset

    lat = preset("deepseek-v2-lite")
    wl = bds.Workload(args, dev, dtype, lat.kv_lora_rank, lat.qk_rope_head_dim)
    meta = meta_model(args, dtype)
    weights = RandomWeights(meta, args.seed, dev, getattr(meta.config, "initializer_range", 0.02))
    del meta
    ref: dict = {}
    if args.check and rank == 0:
        try:
            t0 = time.perf_counter()
            ref = load_reference(args, dev)
            if ref is None:
                ref = reference_logits(args, dev, dtype, wl, weights)
                torch.save(ref, reference_path(args, dev))
            INFO["reference_s"] = time.perf_counter() - t0
        except Exception as exc:  # no check then; the modes still run
            INFO["reference_error"] = f"{type(exc).__name__}: {exc}"[:500]
            traceback.print_exc(limit=4)
            bds.free_memory()
    dd.barrier()
    for mode in args.mode_list:
        try:
            run_mode(args, mode, world, rank, dev, dtype, wl, weights, ref, dd)
        except Exception as exc:  # a mode that fails to start (build, OOM) loses only its rows
            INFO[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:500]
            traceback.print_exc()
        bds.free_memory()  # whatever the mode left (a skipped or failed mode returns early)
    if rank == 0:
        save(args, world)
        text = merge(args.out)
        print("\n" + text, flush=True)
    dd.barrier()
    destroy()


def strip_flags(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the flags ``names`` and their values (``--x v`` and ``--x=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if a.split("=", 1)[0] in names and "=" in a:
            continue
        out.append(a)
    return out


def launch(args, argv: list[str]) -> None:
    """Run ``torchrun --nproc-per-node N`` of this script for each world size of ``--tp``, then merge."""
    for old in glob.glob(os.path.join(args.out, "bench_parallel_w*.json")):
        os.remove(old)
    base = strip_flags(argv, ("--tp", "--budget-s", "--modes"))
    have = torch.cuda.device_count() if args.device.startswith("cuda") else max(args.tp_list)
    worlds = sorted(set(args.tp_list))
    modes_of = {n: [m for m in args.mode_list if m == "tp" or args.all_modes_at == "all" or n == max(worlds)]
                for n in worlds}
    skipped = {}
    for i, n in enumerate(worlds):
        if n > have:
            skipped[n] = f"needs {n} GPUs, {have} visible"
            print(f"world size {n}: skipped ({skipped[n]})", flush=True)
            continue
        later = sum(len(modes_of[m]) for m in worlds[i + 1:] if m <= have)
        budget = args.budget_s - bds.elapsed() - MODE_FLOOR_S * later  # what the later world sizes' modes keep
        if budget < 30:
            skipped[n] = "time budget"
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               os.path.abspath(__file__), *base, "--tp", str(n), "--modes", ",".join(modes_of[n]),
               "--budget-s", f"{budget:.0f}"]
        print(f"[{bds.elapsed():6.1f}s] world size {n}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.Popen(cmd, start_new_session=True)  # its own process group: torchrun and its workers
        try:
            if proc.wait(timeout=budget + 60):
                skipped[n] = f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # this launch's group only
            proc.wait()
            skipped[n] = f"ran past {budget + 60:.0f} s"
    text = merge(args.out)
    if skipped:
        text += "\nworld sizes without results: " + "; ".join(f"{n}: {why}" for n, why in skipped.items())
        with open(os.path.join(args.out, "bench_parallel.txt"), "a") as f:
            f.write("world sizes without results: " + "; ".join(f"{n}: {why}" for n, why in skipped.items()) + "\n")
    print("\n" + text, flush=True)


def main(argv=None) -> None:
    """The command line (the module docstring): a worker under ``torchrun`` or at world size 1, else the launcher."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    require_env()
    os.makedirs(args.out, exist_ok=True)
    if "WORLD_SIZE" in os.environ:  # under torchrun
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world not in args.tp_list and args.tp != "1":
            print(f"note: --tp {args.tp} lists no {world}; running world size {world}", flush=True)
        worker(args, world, rank)
    elif args.tp_list == [1]:
        worker(args, 1, 0)
    else:
        launch(args, argv)


if __name__ == "__main__":
    main()
