"""Time DeepSeek-V3's fp8 block weights: ``mla::fp8_block_linear`` per projection, and a decode step of a real-dims
V3 slice loaded from an fp8 checkpoint against the same weights loaded as bf16, in one run.

    python benchmarks/bench_fp8_weights.py --out OUT_DIR [--budget-s 150] [--experts 64]
    python benchmarks/bench_fp8_weights.py --tiny --device cpu --out /tmp/bf8     # CPU smoke test (toy dims)

Section "linear": ``mla::fp8_block_linear`` at DeepSeek-V3 shapes (q_a_proj 7168 -> 1536, q_b_proj 1536 -> 128 x 192,
kv_a_proj_with_mqa 7168 -> 576, o_proj 128 x 128 -> 7168, one routed expert's gate_up 7168 -> 2 x 2048 and down
2048 -> 7168) at M = 1, 16, 128, 1024, 4096 tokens, bf16 activations: backends "triton" (weight-only and with the
activation quantized), "scaled-mm" (activation quantized: its only mode) and "reference", against a bf16
``torch.mm`` of the dequantized weight; and ``backend="autotune"`` compiled (``torch.compile``, static shapes) with
``mla_compile.lowerings`` installed (rows "fp8 autotune [act_quant]"): Inductor times the candidates the
registry says serve the shape (our Triton launch configs; scaled-mm for act_quant) and emits the winner, named in
the row's note and ``autotune_winner`` (each shape compiles afresh: a few seconds per row). Weights are random bf16 quantized to 128 x 128 blocks (amax / 448, as
DeepSeek's checkpoints); where one weight would sit in L2, several weight sets rotate inside the timed call. Time:
CUDA-graph replay per call (``bench_kernels.attempt``; "eager" = ``do_bench`` on the Python call). TB/s counts the
weight bytes (fp8 codes + float32 scales, or bf16); TFLOP/s counts 2 M N K. ``err``: norm-relative error against a
float64 product of the same inputs under the row's own contract (weight-only, or activation rounded per 1 x 128
group); ``err_real``: against the float64 product with the unrounded activation (what the act-quant rows give up).

Section "decode": a V3 slice with the real per-layer dims (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64,
dense intermediate 18432, moe intermediate 2048, top-8 + 1 shared expert; the first layer dense, the rest MoE) and
``--experts`` routed experts (default 64, not 256: with 256, the bf16 model's 71 GB would fit an H200, but 36 GB fp8
+ 71 GB bf16 of checkpoint to write and read take more than the budget and the device's disk; ``--experts 256
--formats fp8`` writes the fp8 one only), vocab cut to ``--vocab``. Random fp8
codes with power-of-two block scales are written with safetensors as an fp8 checkpoint (DeepSeek's layout: e4m3
``weight`` + float32 ``weight_scale_inv``) and, from the same tensors, a bf16 one (exact: a code times a power of two
is a bf16 number); ``mla_compile.from_pretrained`` loads each in turn (fp8 kept, or bf16). For each: weight memory
(bytes of parameters + buffers, also projected to 256 experts), then the decode-step latency over ``--ctx`` tokens of
random cached context at each batch, eager and compiled + CUDA graph (``torch.compile(fullgraph=True)`` captured by
``DecodeGraphRunner``, as ``bench_decode_step.py``; the time is CUDA events around one whole step, host planning
included; "replay" is the graph alone). The first step's logits of the two models are compared.

``--budget-s`` (wall clock from the start): the decode section runs first (its rows come whole or not at all) within
the budget less 25 s, skipping what would not fit (a compile + capture needs about 25 s left); the linear section
then runs its shapes (by M, smallest first) until the budget is spent. Every skip is listed. Writes
``bench_fp8_weights.json`` and ``bench_fp8_weights.txt`` under ``--out``; the short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench_kernels (timing helpers), bench_decode_step (decode workload, step timing)

START = time.time()
FULL = dict(hidden=7168, heads=128, q_lora=1536, inter=18432, moe_inter=2048, experts=64, topk=8, layers=4,
            vocab=32768, ms="1,16,128,1024,4096", batches="1,16,128", ctx=4096, block_size=64, warmup=2, iters=10)
TINY = dict(hidden=256, heads=4, q_lora=128, inter=384, moe_inter=128, experts=16, topk=4, layers=2,
            vocab=1024, ms="1,16", batches="1,4", ctx=64, block_size=16, warmup=1, iters=3)
KV_LORA, ROPE, NOPE, V_DIM = 512, 64, 128, 128
LINEAR_RESERVE_S = 25.0  # the decode section (run first) leaves this much of --budget-s to the linear one
DECODE_MIN_S = 45.0  # the decode section does not start with less of its budget left (write + load + eager)
COMPILE_S = 25.0  # expected compile + capture of one model: its graph rows are skipped with less left
ROTATE_BYTES = 256e6  # weights smaller than this rotate over several sets (L2 is 60 MB on an H200)
INFO: dict = {}
DECODE_ROWS: list[dict] = []
MODELS: dict = {}
SKIPPED: list[str] = []
LOGITS: dict = {}
bk = None  # bench_kernels, imported in main() once TRITON_INTERPRET is settled


def elapsed() -> float:
    return time.time() - START


def skip(what: str, why: str = "time budget") -> None:
    SKIPPED.append(f"{what}: {why} (at {elapsed():.0f} s)")
    print(f"[{elapsed():6.1f}s] skipped {what}: {why}", flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def save(args) -> None:
    data = {"info": INFO, "ceilings": bk.CEIL if bk else {}, "linear": bk.ROWS if bk else [],
            "decode": {"models": MODELS, "rows": DECODE_ROWS}, "skipped": SKIPPED}
    with open(os.path.join(args.out, "bench_fp8_weights.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)


def checkpoint_format():
    """``tests/checkpoints.py`` (the project's model of the fp8 checkpoint format: which tensors are fp8, block
    quantization, the float64 dequantization), loaded from its file so no other ``tests`` package can shadow it."""
    mod = sys.modules.get("_bench_checkpoints")
    if mod is None:
        import importlib.util

        path = os.path.join(os.path.dirname(HERE), "tests", "checkpoints.py")
        spec = importlib.util.spec_from_file_location("_bench_checkpoints", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_bench_checkpoints"] = mod
        spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------- section: linear


def linear_shapes(a) -> list[tuple[str, int, int]]:
    """``(name, N, K)`` of the projections timed, from the model dims."""
    h = a.hidden
    return [("q_a_proj", a.q_lora, h), ("q_b_proj", a.heads * (NOPE + ROPE), a.q_lora),
            ("kv_a_proj_with_mqa", KV_LORA + ROPE, h), ("o_proj", h, a.heads * V_DIM),
            ("expert gate_up", 2 * a.moe_inter, h), ("expert down", h, a.moe_inter)]


def act_round64(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` in float64, rounded as ``act_quant=True`` specifies: per token and 128-wide group of K,
    ``s = max(amax / 448, 2^-64)``, ``x -> e4m3(x / s) * s``."""
    M, K = x.shape
    kb = -(-K // 128)
    xg = F.pad(x.double(), (0, kb * 128 - K)).view(M, kb, 128)
    s = (xg.abs().amax(-1) / 448.0).clamp_min(2.0 ** -64)[..., None]
    return ((xg / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double() * s).flatten(1)[:, :K]


def cpu_ceilings() -> None:
    """What ``bench_kernels.ceilings`` measures, at CPU sizes (so every fraction in the rows is a number)."""
    src = torch.empty(1 << 26, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    copy_ms, mm_ms = cpu_ms(lambda: dst.copy_(src)), cpu_ms(lambda: a @ b)
    bk.CEIL.update(copy_gbs=2 * src.numel() / copy_ms / 1e6, mm_tflops=2 * 512 ** 3 / mm_ms / 1e9, device="cpu",
                   sms=0, torch=torch.__version__, triton="interpreter" if os.environ.get("TRITON_INTERPRET") else "")


def cpu_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timed(dev, group, impl, fn, flops, nbytes, sets=1, note="", **fields) -> None:
    """One row: ``bench_kernels.attempt`` on CUDA (graph replay + do_bench), a perf_counter median on CPU;
    ``fields`` (the errors) join the row."""
    n = len(bk.ROWS)
    if dev.type == "cuda":
        bk.attempt(group, impl, fn, flops, nbytes, note=note, rep_ms=20, sets=sets)
    else:
        try:
            ms = cpu_ms(fn, reps=3) / sets
            bk.record(group, impl, ms, ms, flops, nbytes, f"{note} [cpu: perf_counter]".strip())
        except Exception as exc:
            bk.ROWS.append({"group": group, "impl": impl, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"  {impl:30s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    if len(bk.ROWS) > n:
        bk.ROWS[-1].update(fields)


def linear_case(a, dev, M: int, name: str, N: int, K: int) -> None:
    from mla_compile.ops import fp8_block_linear
    from mla_compile.ops.fp8_block_linear import dequantize

    fmt = checkpoint_format()
    group = f"{name} M={M} N={N} K={K}"
    if elapsed() > a.linear_until_s:
        skip(f"linear {group}")
        return
    print(group, flush=True)
    gen = torch.Generator(dev).manual_seed(M * 7919 + N * 31 + K)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
    fp8_bytes = N * K + 4 * (-(-N // 128)) * (-(-K // 128))
    sets8 = max(1, min(16, math.ceil(ROTATE_BYTES / fp8_bytes))) if dev.type == "cuda" else 1
    sets16 = max(1, min(16, math.ceil(ROTATE_BYTES / (2 * N * K)))) if dev.type == "cuda" else 1
    quant = [fmt.quantize_blocks(torch.randn(N, K, device=dev, generator=gen) * 0.02) for _ in range(sets8)]
    w16 = [dequantize(*quant[i % sets8], torch.bfloat16) for i in range(sets16)]
    w64 = fmt.dequantize64(*quant[0])
    want = x.double() @ w64.T
    want_aq = act_round64(x) @ w64.T
    del w64
    flops = 2 * M * N * K

    def row(impl, call, bytes_per_set, sets, ref, note=""):
        try:
            y = call(0)
            errs = dict(err=rel_err(y, ref), err_real=rel_err(y, want))
        except Exception as exc:  # the timing below records the failure
            errs = dict(err_error=f"{type(exc).__name__}: {exc}"[:200])
        timed(dev, group, impl, lambda: [call(i) for i in range(sets)], flops, bytes_per_set, sets=sets, note=note,
              M=M, proj=name, N=N, K=K, **errs)

    row("bf16 torch.mm", lambda i: torch.mm(x, w16[i].t()), 2 * N * K, sets16, want,
        note="bf16 copy of the dequantized weight")
    cpu = dev.type != "cuda"  # off CUDA every fp8 row runs the reference backend (a smoke test of the code path)
    for impl, backend, aq, note in (("fp8 triton", "triton", False, "weight-only"),
                                    ("fp8 triton act_quant", "triton", True, "activation rounded per 1x128"),
                                    ("fp8 scaled-mm act_quant", "scaled-mm", True, "torch._scaled_mm blockwise"),
                                    ("fp8 reference", "reference", False, "dequantize + float32 matmul")):
        backend, note = ("reference", f"{note} [cpu: backend reference]") if cpu else (backend, note)
        row(impl, lambda i, b=backend, aq=aq: fp8_block_linear(x, *quant[i], act_quant=aq, backend=b), fp8_bytes,
            sets8, want_aq if aq else want, note=note)
    for impl, aq in (("fp8 autotune", False), ("fp8 autotune act_quant", True)):
        try:
            call, winner = autotuned_linear(x, quant, aq)
        except Exception as exc:
            bk.ROWS.append({"group": group, "impl": impl, "error": f"{type(exc).__name__}: {exc}"[:300], "M": M,
                            "proj": name, "N": N, "K": K})
            print(f"  {impl:30s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        note = f"torch.compile + the autotune lowering: {winner}" + (" [cpu: nothing timed, static default]" if cpu
                                                                     else "")
        row(impl, call, fp8_bytes, sets8, want_aq if aq else want, note=note)
        bk.ROWS[-1]["autotune_winner"] = winner


def autotuned_linear(x, quant, act_quant: bool):
    """``(call(i), winner)``: ``fp8_block_linear(backend="autotune")`` compiled (fullgraph, static shapes, Dynamo
    reset first: every shape compiles afresh) and lowered by ``mla_compile.lowerings``, which times the candidates
    the registry says serve this call on ``x``'s shapes and emits the winner; ``call(i)`` runs it on weight set
    ``i``; ``winner``: the emitted candidate and its backend (or what ran without a lowering decision)."""
    import mla_compile.lowerings  # noqa: F401  (installs the lowering)
    from mla_compile.ops import _compile_log, fp8_block_linear

    torch._dynamo.reset()
    fn = torch.compile(lambda a, w, s: fp8_block_linear(a, w, s, act_quant=act_quant, backend="autotune"),
                       fullgraph=True, dynamic=False)
    before = _compile_log.mark()
    fn(x, *quant[0])
    recs = [r for r in _compile_log.records_since(before) if r.op == "mla::fp8_block_linear_autotune"]
    winner = f"{recs[-1].winner} ({recs[-1].winner_backend})" if recs else "no autotune record"
    return (lambda i: fn(x, *quant[i])), winner


# ---------------------------------------------------------------------------------------------- section: decode


def v3_config(a):
    """The HF ``DeepseekV3Config`` of the slice (real per-layer dims of DeepSeek-V3, ``a``'s experts/layers/vocab)."""
    from mla_compile.app import toy

    groups = 8 if a.experts % 8 == 0 and a.experts // 8 * 4 >= a.topk else 1
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)
    return toy.toy_hf_config(
        "v3", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter, moe_intermediate_size=a.moe_inter,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads, q_lora_rank=a.q_lora,
        kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
        n_routed_experts=a.experts, num_experts_per_tok=a.topk, n_group=groups, topk_group=min(4, groups),
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=max(163840, a.ctx + 1024), rope_parameters=rope)


def checkpoint_keys(config) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of the checkpoint, in the hub's per-expert layout (the HF model's stacked
    ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` split into ``experts.{j}.*.weight``)."""
    from mla_compile.models.loader import _meta_model

    keys = []
    for name, t in _meta_model(config).state_dict().items():
        prefix, _, last = name.rpartition(".")
        if prefix.endswith(".experts") and last == "gate_up_proj":
            E, two_i, H = t.shape
            keys += [(f"{prefix}.{j}.{p}.weight", (two_i // 2, H)) for j in range(E) for p in ("gate_proj", "up_proj")]
        elif prefix.endswith(".experts") and last == "down_proj":
            keys += [(f"{prefix}.{j}.down_proj.weight", tuple(t.shape[1:])) for j in range(t.shape[0])]
        else:
            keys.append((name, tuple(t.shape)))
    return keys


def checkpoint_bytes(keys) -> tuple[int, int]:
    """Bytes of the fp8 and of the bf16 checkpoint (tensor data)."""
    fp8 = bf16 = 0
    for name, shape in keys:
        n = math.prod(shape)
        if checkpoint_format().FP8_LINEAR.search(name):
            fp8 += n + 4 * (-(-shape[0] // 128)) * (-(-shape[1] // 128))
            bf16 += 2 * n
        else:
            width = 4 if name.endswith("e_score_correction_bias") else 2
            fp8, bf16 = fp8 + width * n, bf16 + width * n
    return fp8, bf16


def random_tensor(name: str, shape, dev, gen):
    """``{suffix: tensor}`` of one checkpoint tensor: fp8 linears get e4m3 codes (|code| <= 448, std 48) and
    power-of-two block scales near ``1 / (48 sqrt(K))`` plus their exact bf16 weight; others a bf16/float32 value."""
    from mla_compile.ops.fp8_block_linear import dequantize

    if checkpoint_format().FP8_LINEAR.search(name):
        N, K = shape
        codes = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=gen).mul_(48).clamp_(-448, 448)
        codes = codes.to(torch.float8_e4m3fn)
        exp = round(-math.log2(48 * math.sqrt(K)))
        jitter = torch.randint(-1, 2, (-(-N // 128), -(-K // 128)), device=dev, generator=gen)
        scale = torch.exp2((exp + jitter).float())
        return {"fp8": codes, "scale": scale, "bf16": dequantize(codes, scale, torch.bfloat16)}
    if name.endswith("norm.weight"):
        value = torch.ones(shape, device=dev, dtype=torch.bfloat16)
    elif name.endswith("e_score_correction_bias"):
        value = torch.rand(shape, device=dev, generator=gen).mul_(0.1).sub_(0.05)
    else:  # embeddings (std 1), router and lm_head (std 1 / sqrt(in))
        std = 1.0 if "embed_tokens" in name else 1 / math.sqrt(shape[-1])
        value = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen).mul_(std)
    return {"same": value}


def write_checkpoints(config, keys, roots: dict[str, Path], dev, seed: int, shard_bytes: float = 2e9) -> None:
    """The fp8 checkpoint and its exact bf16 twin (same tensors, dequantized) into ``roots["fp8"]`` /
    ``roots["bf16"]`` (either may be left out), shard by shard: tensors are made on ``dev``, then copied to the host
    and written by two writer threads while the next shard is made."""
    from safetensors.torch import save_file

    from mla_compile.models.checkpoint import INDEX_FILE, SCALE_SUFFIX

    def write(tensors: dict, path: Path) -> None:  # in a writer thread: the device-to-host copies too
        save_file({k: v.cpu() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})

    gen = torch.Generator(dev).manual_seed(seed)
    maps: dict[str, dict[str, str]] = {"fp8": {}, "bf16": {}}
    shards, cur, size = [], [], 0
    for name, shape in keys:
        if cur and size + 2 * math.prod(shape) > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += 2 * math.prod(shape)
    shards.append(cur)
    pending = []
    with ThreadPoolExecutor(2) as pool:
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            out8, out16 = {}, {}
            for name, shape in shard:
                parts = random_tensor(name, shape, dev, gen)
                if "same" in parts:
                    out8[name] = out16[name] = parts["same"]
                else:
                    out8[name], out8[name + SCALE_SUFFIX], out16[name] = parts["fp8"], parts["scale"], parts["bf16"]
            for fmt, out in (("fp8", out8), ("bf16", out16)):
                if fmt in roots:
                    maps[fmt].update({k: file for k in out})
                    pending.append(pool.submit(write, out, roots[fmt] / file))
            del out8, out16
            while len(pending) > 4:  # bound the memory held by shards in flight
                pending.pop(0).result()
        for p in pending:
            p.result()
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    for fmt, root in roots.items():
        config.save_pretrained(str(root))
        path = root / "config.json"
        cfg = json.loads(path.read_text())
        cfg["dtype"] = "bfloat16"
        cfg.pop("torch_dtype", None)
        if fmt == "fp8":
            cfg["quantization_config"] = qc
        path.write_text(json.dumps(cfg, indent=2))
        (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": maps[fmt]}, indent=1))


def weight_bytes(model, experts: int) -> dict:
    """Bytes of parameters and buffers (routed experts separately, and projected to 256 routed experts)."""
    seen, params, bufs, routed = set(), 0, 0, 0
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            if id(t) in seen:
                continue
            seen.add(id(t))
            n = t.numel() * t.element_size()
            params, bufs = (params + n, bufs) if kind == "p" else (params, bufs + n)
            routed += n if ".mlp.experts." in name else 0
    total = params + bufs
    return dict(param_bytes=params, buffer_bytes=bufs, total_bytes=total, routed_expert_bytes=routed,
                projected_256_experts_bytes=total - routed + routed * 256 // experts)


def run_row(args, fmt: str, impl: str, batch: int, fn) -> dict:
    """One decode cell: ``fn()`` -> ``bench_decode_step.measure``'s dict, or the reason it has no time."""
    import bench_decode_step as bds

    row = dict(weights=fmt, impl=impl, batch=batch, ctx=args.ctx)
    if elapsed() > args.decode_until_s:
        row["skipped"] = "time budget"
    else:
        try:
            res = fn()
            LOGITS[(fmt, impl, batch)] = res.pop("first_logits")
            res.pop("times_ms", None)
            row.update(res, tok_s=batch / (res["ms"] / 1e3))
            fp8, bf16 = LOGITS.get(("fp8", impl, batch)), LOGITS.get(("bf16", impl, batch))
            if fp8 is not None and bf16 is not None:
                row["logits_rel_err_fp8_vs_bf16"] = rel_err(fp8, bf16)
        except Exception as exc:  # keep measuring the rest; the reason goes into the table
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc(limit=4)
            bds.free_memory()
    DECODE_ROWS.append(row)
    text = row.get("skipped") or row.get("error") or f"{row['ms']:.3f} ms"
    print(f"[{elapsed():6.1f}s] {fmt:4s} {impl:6s} B={batch:<4d} {text}", flush=True)
    save(args)
    return row


def run_model(args, fmt: str, root: Path, dev, dtype) -> None:
    """Load ``root`` with ``from_pretrained``; its weight memory, eager rows, then compiled + CUDA-graph rows."""
    import bench_decode_step as bds

    import mla_compile
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from mla_compile.serving.builder import MetadataBuilder

    info = MODELS.setdefault(fmt, {})
    bds.sync(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    t0 = time.perf_counter()
    model = mla_compile.from_pretrained(root, device=dev, dtype=dtype, backend=args.backend)
    model.regional_compile = args.regional_compile  # as patch(regional_compile=) sets it
    bds.sync(dev)
    info["load_s"] = time.perf_counter() - t0
    info.update(weight_bytes(model, args.experts))
    if dev.type == "cuda":
        info["cuda_allocated_by_load"] = torch.cuda.memory_allocated(dev) - base
    kinds = {type(m).__name__ for m in model.modules()}
    info["fp8_modules"] = sorted(k for k in kinds if k.startswith("FP8"))
    if info["fp8_modules"]:  # what the fp8 linears run ("auto")
        from mla_compile.ops.fp8_block_linear import OP
        from mla_compile.ops.select import resolve

        info["fp8_linear_backend"] = resolve(OP, dev, None, dtype=dtype).name
    print(f"[{elapsed():6.1f}s] {fmt} model loaded in {info['load_s']:.1f} s: weights "
          f"{info['total_bytes'] / 1e9:.2f} GB ({info['fp8_modules'] or 'no fp8 modules'})", flush=True)
    wl = bds.Workload(SimpleNamespace(kind="v3", seed=args.seed, block_size=args.block_size,
                                      batch_list=args.batch_list, ctx_list=[args.ctx], vocab=args.vocab),
                      dev, dtype, KV_LORA, ROPE)
    caches = model.allocate_cache(wl.num_blocks, wl.bs)
    for i, cache in enumerate(caches):
        bds.fill_cache(cache, wl.latents(i), KV_LORA, False)
    builder = MetadataBuilder(max_batch=wl.max_batch, max_blocks_per_seq=wl.nb, max_tokens=wl.max_batch,
                              block_size=wl.bs, device=dev)

    def eager(b):
        def step(k):
            s = builder.build(wl.chunks(b, args.ctx, k))
            with torch.no_grad():
                return model(s.input_ids, s.positions, s.meta)[:s.num_rows]
        return bds.measure(step, dev, 1, min(args.iters, 3))

    for b in args.batch_list:
        run_row(args, fmt, "eager", b, lambda b=b: eager(b))
    runner, compiled, why = None, None, None
    if dev.type != "cuda":
        why = "needs CUDA"
    elif elapsed() > args.decode_until_s - COMPILE_S:
        why = "time budget"
    else:
        try:
            compiled = torch.compile(model, fullgraph=True)
            runner = DecodeGraphRunner(compiled, builder, capture_sizes=sorted({max(b, 2) for b in args.batch_list}))
            t0 = time.perf_counter()
            runner.capture()  # compiles on its first call
            info["compile_and_capture_s"] = time.perf_counter() - t0
        except Exception as exc:
            why = "compile/capture failed"
            info["capture_error"] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc(limit=4)
    for b in args.batch_list:
        if why is not None:
            DECODE_ROWS.append(dict(weights=fmt, impl="graph", batch=b, ctx=args.ctx, skipped=why))
            continue

        def graph(b=b):
            res = bds.measure(lambda k: runner.decode(wl.chunks(b, args.ctx, k)), dev, args.warmup, args.iters)
            g = runner.graphs[runner.graph_size(b)][0]
            res.update(replay_ms=statistics.median(bds.replay_ms(g) for _ in range(args.iters)),
                       fallbacks=runner.fallbacks)
            return res
        run_row(args, fmt, "graph", b, graph)
    if why is not None:
        skip(f"decode {fmt} compiled + CUDA graph rows", why)
    runner = compiled = model = caches = builder = None  # drop the references before freeing
    bds.free_memory()


def decode_section(args, dev, dtype) -> None:
    """Write the two checkpoints (temporary), then load and time each model in turn."""
    import bench_decode_step as bds

    if elapsed() > args.decode_until_s - DECODE_MIN_S:
        skip("decode section (checkpoint write, load, every row)")
        return
    config = v3_config(args)
    keys = checkpoint_keys(config)
    fp8_b, bf16_b = checkpoint_bytes(keys)
    need = 1.05 * (fp8_b * ("fp8" in args.format_list) + bf16_b * ("bf16" in args.format_list))
    # /dev/shm (memory) first where it has room: the write then runs at memory speed, not the disk's
    places = [Path(args.ckpt_dir)] if args.ckpt_dir else [Path("/dev/shm"), Path(tempfile.gettempdir())]
    free = {}
    for place in places:
        if args.ckpt_dir:
            place.mkdir(parents=True, exist_ok=True)
        if place.is_dir() and os.access(place, os.W_OK):
            free[place] = shutil.disk_usage(place).free
    parent = next((p for p in free if free[p] > need), None)
    INFO["checkpoint"] = dict(dir=str(parent), fp8_bytes_est=fp8_b, bf16_bytes_est=bf16_b,
                              free_bytes={str(p): f for p, f in free.items()}, experts=args.experts,
                              layers=args.layers, vocab=args.vocab)
    if parent is None:
        skip("decode section", f"the two checkpoints need {need / 1e9:.1f} GB; free: "
                                + ", ".join(f"{p} {f / 1e9:.1f} GB" for p, f in free.items())
                                + " (lower --experts or set --ckpt-dir)")
        return
    root = Path(tempfile.mkdtemp(prefix="bench_fp8_ckpt_", dir=parent))
    try:
        roots = {fmt: root / fmt for fmt in args.format_list}
        for path in roots.values():
            path.mkdir()
        t0 = time.perf_counter()
        write_checkpoints(config, keys, roots, dev, args.seed)
        INFO["checkpoint"].update(write_s=time.perf_counter() - t0, **{
            f"{fmt}_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors")) for fmt, path in roots.items()})
        print(f"[{elapsed():6.1f}s] checkpoints written in {INFO['checkpoint']['write_s']:.1f} s: " + ", ".join(
            f"{fmt} {INFO['checkpoint'][fmt + '_bytes'] / 1e9:.2f} GB" for fmt in roots), flush=True)
        save(args)
        for fmt, path in roots.items():
            if elapsed() > args.decode_until_s - 15:
                skip(f"decode {fmt} model (load and rows)")
                continue
            try:
                run_model(args, fmt, path, dev, dtype)
            except Exception as exc:  # a model that fails to load loses only its rows
                MODELS.setdefault(fmt, {})["error"] = f"{type(exc).__name__}: {exc}"[:400]
                traceback.print_exc()
            if "error" in MODELS.get(fmt, {}):  # out of the except block: its frames (the model) are gone
                bds.free_memory()
            save(args)
    finally:
        if not args.keep_ckpt:
            shutil.rmtree(root, ignore_errors=True)
        else:
            INFO["checkpoint"]["kept_at"] = str(root)


# ---------------------------------------------------------------------------------------------- report


def _num(v, fmt="{:.1f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def linear_lines() -> list[str]:
    c = bk.CEIL
    out = [f"== mla::fp8_block_linear at DeepSeek-V3 shapes ({c.get('device')}, torch {c.get('torch')}, triton "
           f"{c.get('triton')}; ceilings: copy {_num(c.get('copy_gbs'), '{:.0f}')} GB/s, bf16 mm "
           f"{_num(c.get('mm_tflops'), '{:.0f}')} TFLOP/s)",
           ("time = CUDA-graph replay per call (eager = do_bench on the Python call)" if c.get("device") != "cpu"
            else "time = perf_counter median on the CPU (smoke test: every fp8 row runs backend reference)")
           + "; TB/s = weight bytes / time; err vs float64 of the row's contract, err_real vs float64 with the "
           "unrounded activation"]
    group = None
    for r in bk.ROWS:
        if r["group"] != group:
            group = r["group"]
            out.append(f"{group}\n  {'impl':26s} {'time us':>9s} {'eager us':>9s} {'TB/s':>6s} {'TFLOP/s':>7s} "
                       f"{'err':>8s} {'err_real':>8s}  note")
        if "us" not in r:
            out.append(f"  {r['impl']:26s} {r.get('skipped') and 'skipped: ' + r['skipped'] or 'FAILED ' + r.get('error', '')[:150]}")
            continue
        out.append(f"  {r['impl']:26s} {r['us']:9.1f} {r['eager_us']:9.1f} {r['gbs'] / 1e3:6.2f} {r['tflops']:7.1f} "
                   f"{_num(r.get('err'), '{:.1e}'):>8s} {_num(r.get('err_real'), '{:.1e}'):>8s}  {r['note']}")
    return out


def decode_lines(args) -> list[str]:
    ck = INFO.get("checkpoint", {})
    out = [f"== decode step, DeepSeek-V3 slice: {args.layers} layers (1 dense + {args.layers - 1} MoE), hidden "
           f"{args.hidden}, {args.heads} heads, q_lora {args.q_lora}, kv_lora {KV_LORA}, rope {ROPE}, {args.experts} "
           f"routed experts top-{args.topk} + 1 shared (moe {args.moe_inter}, dense {args.inter}), vocab {args.vocab} "
           f"(cut), random weights, {INFO.get('dtype')}; ctx {args.ctx}, block {args.block_size}; attention backend "
           f"{args.backend or 'auto'}" + ("; regional compile" if args.regional_compile else ""),
           f"checkpoints (safetensors): fp8 {_num(ck.get('fp8_bytes', float('nan')) / 1e9, '{:.2f}')} GB, bf16 "
           f"{_num(ck.get('bf16_bytes', float('nan')) / 1e9, '{:.2f}')} GB, written in {_num(ck.get('write_s'))} s"]
    for fmt, m in MODELS.items():
        if "error" in m:
            out.append(f"  {fmt}: FAILED {m['error'][:200]}")
            continue
        out.append(f"  {fmt} weights: {m['total_bytes'] / 1e9:.2f} GB (params + buffers; routed experts "
                   f"{m['routed_expert_bytes'] / 1e9:.2f} GB; projected at 256 experts "
                   f"{m['projected_256_experts_bytes'] / 1e9:.2f} GB), loaded in {m['load_s']:.1f} s, compile + capture "
                   f"{_num(m.get('compile_and_capture_s'))} s"
                   + (f"; fp8 linears: backend {m['fp8_linear_backend']}" if "fp8_linear_backend" in m else "")
                   + (f"; capture FAILED {m['capture_error']}" if "capture_error" in m else ""))
    errs = [f"{r['impl']} B={r['batch']} {r['logits_rel_err_fp8_vs_bf16']:.1e}" for r in DECODE_ROWS
            if "logits_rel_err_fp8_vs_bf16" in r]
    out.append("first-step logits, fp8 model vs bf16 model (same weights), rel. error: " + ("; ".join(errs) or "n/a"))
    for r in DECODE_ROWS:
        head = f"  {r['weights']:4s} {r['impl']:5s} B={r['batch']:<4d}"
        if "ms" in r:
            out.append(f"{head} {r['ms']:9.3f} ms/step ({r['tok_s']:8.0f} tok/s), first call {r['first_call_s']:.1f} s"
                       + (f", replay {r['replay_ms']:.3f} ms" if "replay_ms" in r else ""))
        else:
            out.append(f"{head} " + (f"skipped ({r['skipped']})" if "skipped" in r else f"FAILED {r['error'][:200]}"))
    return out


def short_table(args) -> list[str]:
    out = ["== short table", "linear, us per call (graph replay); last column: bf16 mm time / fp8 triton time"]
    impls = ["bf16 torch.mm", "fp8 triton", "fp8 triton act_quant", "fp8 scaled-mm act_quant", "fp8 reference",
             "fp8 autotune", "fp8 autotune act_quant"]
    heads = ["bf16 mm", "triton", "triton aq", "scaled-mm aq", "reference", "autotuned", "autotuned aq"]
    out.append(f"  {'proj':20s} {'M':>5s} " + " ".join(f"{h:>12s}" for h in heads) + f" {'bf16/triton':>11s}")
    cell = {(r.get("proj"), r.get("M"), r["impl"]): r for r in bk.ROWS}
    for proj, M in dict.fromkeys((r.get("proj"), r.get("M")) for r in bk.ROWS):
        vals = [cell.get((proj, M, i), {}).get("us") for i in impls]
        ratio = vals[0] / vals[1] if vals[0] and vals[1] else None
        out.append(f"  {proj:20s} {M:5d} " + " ".join(f"{_num(v):>12s}" for v in vals) + f" {_num(ratio, '{:.2f}x'):>11s}")
    out.append(f"decode step ms (ctx {args.ctx}; graph: whole step, replay: graph alone), weights GB")
    out.append(f"  {'weights':8s} {'GB':>6s} " + " ".join(f"{f'B={b} {k}':>16s}" for b in args.batch_list
                                                         for k in ("eager", "graph", "replay")))
    cell = {(r["weights"], r["impl"], r["batch"]): r for r in DECODE_ROWS}
    for fmt in ("fp8", "bf16"):
        gb = MODELS.get(fmt, {}).get("total_bytes")
        vals = []
        for b in args.batch_list:
            e, g = cell.get((fmt, "eager", b), {}), cell.get((fmt, "graph", b), {})
            vals += [e.get("ms"), g.get("ms"), g.get("replay_ms")]
        out.append(f"  {fmt:8s} {_num(gb / 1e9 if gb else None, '{:.2f}'):>6s} "
                   + " ".join(f"{_num(v, '{:.3f}'):>16s}" for v in vals))
    if SKIPPED:
        out += ["skipped:"] + [f"  {s}" for s in SKIPPED]
    out.append(f"total {elapsed():.0f} s (budget {args.budget_s:.0f} s)")
    return out


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_fp8_weights.{json,txt}")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--tiny", action="store_true", help="toy dims (CPU smoke test)")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="wall-clock seconds: the decode section (first) gets all but 25 s of it, the linear section "
                         "the rest; what would start past its share is skipped and listed")
    ap.add_argument("--only", default="linear,decode", help="sections to run: linear, decode or both")
    for name, value in FULL.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None,
                        help=f"default {value} ({TINY[name]} with --tiny)")
    ap.add_argument("--regional-compile", action="store_true",
                    help="compile each decoder layer once as nested regions (MLAForCausalLM.regional_compile)")
    ap.add_argument("--formats", default="fp8,bf16", help="decode section's checkpoints: fp8, bf16 or both")
    ap.add_argument("--backend", default=None, help="attention ops' backend of both models (default: auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default=None,
                    help="where the temporary checkpoints go (default: /dev/shm if it has room, else the temp dir)")
    ap.add_argument("--keep-ckpt", action="store_true", help="keep the written checkpoints")
    args = ap.parse_args(argv)
    for name, value in (TINY if args.tiny else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.m_list = [int(v) for v in args.ms.split(",")]
    args.batch_list = [int(v) for v in args.batches.split(",")]
    args.format_list = [f for f in ("fp8", "bf16") if f in args.formats.split(",")]
    if not args.format_list:
        ap.error(f"--formats takes fp8, bf16 or fp8,bf16; got {args.formats!r}")
    if min(args.m_list + args.batch_list) < 1 or args.ctx < 1 or args.experts < args.topk:
        ap.error(f"--ms, --batches and --ctx must be positive and --experts >= --topk; got {args.ms!r}, "
                 f"{args.batches!r}, {args.ctx}, {args.experts} < {args.topk}")
    return args


def main(argv=None) -> None:
    global bk
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)
    if dev.type != "cuda":  # Triton (imported by bench_kernels) runs kernels in its interpreter off CUDA
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import bench_kernels

    import mla_compile  # noqa: F401  (registers the ops)

    bk = bench_kernels
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    INFO.update(args={k: v for k, v in vars(args).items()}, dtype=str(dtype).replace("torch.", ""),
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    sections = [p.strip() for p in args.only.split(",")]
    args.linear_until_s = args.budget_s
    args.decode_until_s = args.budget_s - (LINEAR_RESERVE_S if "linear" in sections else 0.0)
    if dev.type == "cuda":
        bk.ceilings()
    else:
        cpu_ceilings()
    json_path = os.path.join(args.out, "bench_fp8_weights.json")
    if "decode" in sections:  # first: its rows come whole or not at all; the linear rows degrade shape by shape
        try:
            decode_section(args, dev, dtype)
        except Exception as exc:
            INFO["decode_error"] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()
        save(args)
    if "linear" in sections:
        linear = [lambda m=m, s=s: linear_case(args, dev, m, *s) for m in args.m_list for s in linear_shapes(args)]
        bk.run_sections(linear + [lambda: save(args)], json_path + ".partial")
        os.remove(json_path + ".partial")
    save(args)
    detail = linear_lines() + [""] + decode_lines(args) + [""]
    short = short_table(args)
    with open(os.path.join(args.out, "bench_fp8_weights.txt"), "w") as f:
        f.write("\n".join(detail + short) + "\n")
    print("\n" + "\n".join(detail + short))


if __name__ == "__main__":
    main()
