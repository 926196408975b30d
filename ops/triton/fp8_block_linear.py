"""Triton ``mla::fp8_block_linear``: a tiled GEMM over fp8 block-quantized weights (DeepSeek's format).

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y = x @ W.T`` for one group (expert). ``BLOCK_N``
divides 128, so a tile's rows share one weight-scale row; the K loop walks 128-wide steps, one scale
column each. The e4m3 codes are exact in bf16/fp32: the dot runs on the codes and the partial sum is
scaled afterwards (``acc += dot(x, codes.T) * s_w``), as DeepSeek's own kernel does. With ``act_quant`` the
activation step is rounded per row to e4m3 codes first (scale ``amax / 448``, round to nearest even, in
integer arithmetic so the interpreter matches torch) and its per-row scale joins ``s_w``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops._workspace import workspace
from mla_compile.ops.fp8_block_linear import fake, validate
from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.triton._common import last_dim_contiguous, tiles_started
from mla_compile.ops.triton._fp8 import FP8_MAX, SCALE_FLOOR, e4m3_codes
from mla_compile.ops.triton._pdl import OFF as PDL_OFF
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, y_ptr, out_ptr, count_ptr,
    M, N, N2, K, KB, KB_PER, s_yk,
    s_xe, s_xm, s_we, s_wn, s_se, s_sn, s_ye, s_ym, s_oe, s_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT_QUANT: tl.constexpr, IEEE: tl.constexpr,
    SPLIT_K: tl.constexpr, SERIAL: tl.constexpr, PDL: tl.constexpr, PAIR: tl.constexpr,
):
    """Program (m tile x split, n tile, group). With ``SPLIT_K > 1`` split ``k`` sums 128-wide steps
    ``[k * KB_PER, (k + 1) * KB_PER)`` into its own float32 slice of ``y`` (stride ``s_yk``). Without ``SERIAL``
    the caller adds the slices; with it the tile's last program to arrive (an acquire-release count on
    ``count_ptr``, one int32 a tile, 0 on entry and left 0) adds them in slice order and stores ``out``: one
    launch, and the sum does not depend on which program came last. ``PDL``: launched with programmatic dependent
    launch (``_pdl.py``; launches of at most ``PDL_MAX_BYTES`` of codes); every program waits before it reads
    anything, so it only overlaps the kernel before. ``PAIR`` (one group): the column tiles past ``cdiv(N, BLOCK_N)``
    are a second weight's (``w2_ptr``/``s2_ptr``, ``[N2, K]`` with the first's strides), written to ``y``'s columns
    ``N .. N + N2``."""
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    pid_n = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    pid_m = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kb0 = split * KB_PER
    w_base, s_base, local, n_lim, col0 = w_ptr + e * s_we, s_ptr + e * s_se, pid_n, N, 0
    if PAIR:  # one group (e == 0): the tiles past the first weight's read the second
        second = (pid_n >= tl.cdiv(N, BLOCK_N)).to(tl.int32)
        local = pid_n - second * tl.cdiv(N, BLOCK_N)
        n_lim = N + second * (N2 - N)
        col0 = second * N
        if second == 1:
            w_base = w2_ptr
            s_base = s2_ptr
    acc = _tile(x_ptr + e * s_xe, w_base, s_base, offs_m, offs_m < M, local, n_lim, K,
                kb0, tl.minimum(kb0 + KB_PER, KB), s_xm, s_wn, s_sn, BLOCK_M, BLOCK_N, ACT_QUANT, IEEE)
    offs_n = local * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_m < M)[:, None] & (offs_n < n_lim)[None, :]
    tile = e * s_ye + offs_m.to(tl.int64)[:, None] * s_ym + (col0 + offs_n)[None, :]
    tl.store(y_ptr + split.to(tl.int64) * s_yk + tile, acc.to(y_ptr.dtype.element_ty), mask=ok)
    if SERIAL:
        tl.debug_barrier()  # every thread's slice stored before the program counts itself in (release, GPU scope)
        count = count_ptr + (e * tl.num_programs(1) + pid_n) * (tl.num_programs(0) // SPLIT_K) + pid_m
        arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the tile's last program: every slice is visible
            tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")  # zero again for the next call (stream order)
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in tl.static_range(SPLIT_K):
                total += tl.load(y_ptr + k * s_yk + tile, mask=ok, other=0.0, volatile=True)
            out = out_ptr + e * s_oe + offs_m.to(tl.int64)[:, None] * s_om + (col0 + offs_n)[None, :]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fp8_sorted_kernel(
    x_ptr, w_ptr, s_ptr, cu_ptr, y_ptr,
    R, N, K, KB, E,
    s_xm, s_we, s_wn, s_se, s_sn, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT_QUANT: tl.constexpr, IEEE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Rows sorted by group; ``cu [E + 1]`` = ``[0, offs...]``. Program slot -> (group, row tile) by
    ``tiles_started``, as the varlen prefill finds its sequence; slots past ``cu[E]`` write zeros."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = -1
    for c in range(0, E + 1, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        e += tiles_started(tl.load(cu_ptr + idx, mask=idx <= E, other=0), idx, E, slot, BLOCK_M)
    start = tl.load(cu_ptr + e).to(tl.int32)
    m0 = (slot - (start // BLOCK_M + e)) * BLOCK_M
    offs_m = start + m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * s_ym + offs_n[None, :]
    n_ok = (offs_n < N)[None, :]
    if e == E:  # rows past cu[E]
        tl.store(y, tl.zeros([BLOCK_M, BLOCK_N], dtype=y_ptr.dtype.element_ty), mask=(offs_m < R)[:, None] & n_ok)
        return
    end = tl.load(cu_ptr + e + 1).to(tl.int32)
    if start + m0 >= end:  # an unused slot between two groups' tiles
        return
    m_ok = offs_m < end
    e64 = e.to(tl.int64)
    acc = _tile(x_ptr, w_ptr + e64 * s_we, s_ptr + e64 * s_se, offs_m, m_ok, pid_n, N, K, 0, KB,
                s_xm, s_wn, s_sn, BLOCK_M, BLOCK_N, ACT_QUANT, IEEE)
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok)


@triton.jit
def _tile(x_base, w_base, s_base, offs_m, m_ok, pid_n, N, K, kb_start, kb_end, s_xm, s_wn, s_sn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT_QUANT: tl.constexpr, IEEE: tl.constexpr):
    """float32 ``[BLOCK_M, BLOCK_N]`` tile of ``x @ W.T`` for rows ``offs_m`` and column tile ``pid_n``, summed
    over the 128-wide K steps ``[kb_start, kb_end)``."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    n_ok = offs_n < N
    x_rows = x_base + offs_m.to(tl.int64) * s_xm
    w_rows = w_base + offs_n.to(tl.int64) * s_wn
    s_row = s_base + (pid_n * BLOCK_N // 128) * s_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        k = kb * 128 + offs_k
        k_ok = k < K
        x = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        codes = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        w = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load(s_row + kb)
        if ACT_QUANT:
            amax = tl.max(tl.abs(x), axis=1)
            sx = tl.maximum(tl.math.div_rn(amax, tl.full([BLOCK_M], FP8_MAX, tl.float32)), SCALE_FLOOR)
            quot = tl.math.div_rn(x, tl.broadcast_to(sx[:, None], (BLOCK_M, 128)))
            quot = tl.minimum(tl.maximum(quot, -FP8_MAX), FP8_MAX)
            x = e4m3_codes(quot).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if IEEE:
            part = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:  # codes are exact in bf16; x was bf16 (or its fp8 codes)
            part = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        if ACT_QUANT:
            acc += part * (sx[:, None] * scale)
        else:
            acc += part * scale
    return acc


def _wrap(kernel):
    """``wrap_triton(kernel)``; under Triton's interpreter (CPU tests) the kernel itself: torch 2.11's ``wrap_triton``
    refuses an interpreted function (2.13 accepts it), and an interpreted launch is never traced."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    return wrap_triton(kernel) if isinstance(kernel, (JITFunction, Autotuner)) else kernel


# Few-row dense launches over at most this many output columns (E * N) take 32-column tiles: twice the programs
# over the weight (q_a, kv, the shared expert, V4's grouped o_a), where wide launches (q_b) keep 64.
NARROW_COLS = 8192


def _config(M: int, ieee: bool, cols: int | None = None) -> dict:
    """Tiles and launch options; ``cols``: the output columns ``E * N`` of a dense launch (None: the sorted
    kernel's). fp32 operands take twice the registers of bf16 ones: smaller tiles, more warps and one stage keep
    them from spilling (sm_90 compile at 2 stages: 144 B of stack)."""
    block_m = 16 if M <= 16 else (32 if ieee else 64)
    narrow = ieee or (M <= 16 and cols is not None and cols <= NARROW_COLS)
    block_n = 32 if narrow else 64  # divides 128: a tile's rows share one weight-scale row
    num_warps, num_stages = (8, 1) if ieee else (4, 3)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, IEEE=ieee, num_warps=num_warps, num_stages=num_stages)


def _config_with(M: int, ieee: bool, config: dict | None, cols: int | None = None) -> dict:
    """:func:`_config` with the entries of ``config`` (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``) in
    its place; ``BLOCK_N`` must divide 128 (a tile's rows share one weight-scale row) and ``BLOCK_M`` be at least 16."""
    cfg = _config(M, ieee, cols)
    cfg.update(config or {})
    if 128 % cfg["BLOCK_N"] or cfg["BLOCK_M"] < 16 or cfg["BLOCK_M"] & (cfg["BLOCK_M"] - 1):
        raise ValueError(f"mla.fp8_block_linear: Triton config needs BLOCK_N dividing 128 and BLOCK_M a power of two "
                         f">= 16; got BLOCK_M={cfg['BLOCK_M']}, BLOCK_N={cfg['BLOCK_N']}")
    return cfg


def _launch_sorted(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool, offs: Tensor,
                   config: dict | None = None) -> Tensor:
    """Sorted-groups kernel path: ``x [R, K]`` with ``offs [E]`` cumulative row ends -> ``[R, N]``; ``config``
    overrides the launch parameters (:func:`_config_with`)."""
    E, N, K = weight.shape
    R = x.shape[0]
    y = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R * N == 0:
        return y
    x = last_dim_contiguous(x)
    w = last_dim_contiguous(weight).view(torch.uint8)
    s = last_dim_contiguous(weight_scale_inv)
    cu = torch.cat([offs.new_zeros(1), offs])
    cfg = _config_with(R, x.dtype == torch.float32, config)
    grid = (triton.cdiv(R, cfg["BLOCK_M"]) + E, triton.cdiv(N, cfg["BLOCK_N"]))
    _wrap(_fp8_sorted_kernel)[grid](
        x, w, s, cu, y, R, N, K, triton.cdiv(K, 128), E,
        x.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), y.stride(0),
        ACT_QUANT=act_quant, CHUNK=128, **cfg,
    )
    return y


# Programs a launch should reach before K is split: a few per SM of an H100 / H200 (132 SMs), so a skinny
# decode GEMM (M <= 16, N / 32 or N / 64 column tiles) streams its weight from every SM instead of a few.
_SPLIT_TARGET = 528
# K is split only where a tile has at least _SPLIT_MIN_KB 128-wide steps, into slices of at least _SPLIT_STEPS: a
# slice's store, count and sum cost more than a short K loop wins back (BENCHMARKS.md, fifty-first session).
_SPLIT_MIN_KB, _SPLIT_STEPS = 16, 4
# Launches of row tiles over 16 rows (a slice four times a 16-row tile's) split only up to this many programs before
# the split: above it splitting lost (V4's grouped o_a at 17-64 rows, o_b and the shared down at 128; BENCHMARKS.md,
# sixtieth session).
_SPLIT_MAX_WIDE = 64


def split_k(tiles: int, kb: int, target: int = _SPLIT_TARGET) -> int:
    """How many K slices a launch of ``tiles`` output tiles over ``kb`` 128-wide K steps takes: 1 when the tiles
    already fill the GPU or K is short, else enough slices to reach ``target`` programs, each slice at least
    ``_SPLIT_STEPS`` K steps."""
    if tiles >= target // 2 or kb < _SPLIT_MIN_KB:
        return 1
    return max(1, min(-(-target // tiles), kb // _SPLIT_STEPS))


def _split(M: int, m_tiles: int, tiles: int, K: int, split: int | None) -> tuple[int, int]:
    """``(split, kb_per)``: the K slices of a launch of ``m_tiles`` row tiles by ``tiles`` output column tiles and the
    128-wide K steps of each (no empty slice). ``split`` None: :func:`split_k`'s choice for all ``m_tiles * tiles``
    programs where M is a number (a run-time launch: an opaque op's body, or eager), above 16 rows only for at most
    ``_SPLIT_MAX_WIDE`` programs; traced with a symbolic M, the choice for M <= 16 (one row tile) and 1 above (a
    choice that followed M would guard on it and recompile per band of M; M <= 16 is a guard :func:`_config` already
    takes)."""
    kb = triton.cdiv(K, 128)
    if split is None:
        if isinstance(M, int):
            programs = m_tiles * tiles
            split = split_k(programs, kb) if M <= 16 or programs <= _SPLIT_MAX_WIDE else 1
        else:
            split = split_k(tiles, kb) if M <= 16 else 1
    kb_per = triton.cdiv(kb, split)
    return triton.cdiv(kb, kb_per), kb_per


# Launches whose weight codes are at most this many bytes take PDL where it runs: short launches gain the overlap with
# the kernel before, long ones lose more to the successor's programs, started early and waiting, holding SM slots
# the launch still needs (BENCHMARKS.md, fifty-first session).
PDL_MAX_BYTES = 12 << 20
# Output tiles a serial-split launch may count (one int32 arrival counter each; a fixed size, so the buffer is never
# replaced). :func:`split_k` splits only launches of fewer than ``_SPLIT_TARGET // 2`` tiles.
MAX_SERIAL_TILES = 4096


def serial_split(x: Tensor, weight: Tensor) -> int:
    """The K slices :func:`_launch` takes at run time for ``x`` and a 2-D / 3-D ``weight`` (more than 1 where its
    output tiles are too few to fill the GPU and K is long: :func:`split_k`), else 0; 0 for CPU or float64 ``x``."""
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return 0
    *groups, N, K = weight.shape
    E, M = (groups[0] if groups else 1), x.shape[-2]
    cfg = _config(M, x.dtype == torch.float32, E * N)
    split, _ = _split(M, triton.cdiv(M, cfg["BLOCK_M"]), E * triton.cdiv(N, cfg["BLOCK_N"]), K, None)
    return split if split > 1 else 0


def _launch(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool,
            split: int | None = None, config: dict | None = None, serial: bool = False,
            pair: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract. ``split``: K slices (None:
    :func:`_split`'s choice), summed in float32 in slice order: by the caller (a second kernel) or, with ``serial``
    where the launch has at most ``MAX_SERIAL_TILES`` output tiles, by each tile's last program (one launch; the
    kernel launched directly, so not from a traced triton_op); ``config`` overrides the launch parameters
    (:func:`_config_with`). ``pair``: a second 2-D weight and its scales ``([N2, K], [ceil(N2/128), ceil(K/128)])``
    beside a 2-D ``weight``, in the same launch: ``[M, N + N2]``, the first weight's columns first."""
    grouped = weight.dim() == 3
    w3 = weight if grouped else weight[None]
    s3 = last_dim_contiguous(weight_scale_inv if grouped else weight_scale_inv[None])
    E, N, K = w3.shape
    M = x.shape[-2]
    x3 = x if x.dim() == 3 else x[None]
    x3 = last_dim_contiguous(x3)
    w3 = last_dim_contiguous(w3).view(torch.uint8)  # raw codes: the interpreter has no float8 numpy dtype
    w2, s2, N2 = w3, s3, 0
    if pair is not None:  # the kernel reads the second weight with the first's strides
        assert not grouped, "a pair of 2-D weights"
        w3, s3 = w3.contiguous(), s3.contiguous()
        w2, s2 = pair[0].contiguous().view(torch.uint8), pair[1].contiguous()
        N2 = w2.shape[0]
    cols = N + N2
    if M * cols == 0:
        y = torch.empty(E, M, cols, dtype=x.dtype, device=x.device)
        return y if grouped else y[0]
    s_xe = x3.stride(0) if x3.shape[0] == E else 0  # a shared [M, K] activation for every group
    cfg = _config_with(M, x.dtype == torch.float32, config, E * cols)
    m_tiles = triton.cdiv(M, cfg["BLOCK_M"])
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"]) + triton.cdiv(N2, cfg["BLOCK_N"])
    split, kb_per = _split(M, m_tiles, E * n_tiles, K, split)
    serial = serial and split > 1 and E * m_tiles * n_tiles <= MAX_SERIAL_TILES
    if serial and cfg["BLOCK_M"] > 16 and "num_warps" not in (config or {}):
        cfg["num_warps"] = 8  # the slices' sum beside a 64-row tile spills at 4 warps (sm_90 compile)
    if split == 1:
        y = torch.empty(1, E, M, cols, dtype=x.dtype, device=x.device)
    else:  # float32 slices, added in a fixed order
        y = torch.empty(split, E, M, cols, dtype=torch.float32, device=x.device)
    out, count = y, y
    if serial:
        out = torch.empty(E, M, cols, dtype=x.dtype, device=x.device)
        count = workspace("fp8_block_linear-arrivals", x.device, 4 * MAX_SERIAL_TILES, zero=True).view(torch.int32)
    grid = (m_tiles * split, n_tiles, E)
    kernel = _fp8_linear_kernel if serial else _wrap(_fp8_linear_kernel)
    kernel[grid](
        x3, w3, s3, w2, s2, y, out, count, M, N, N2, K, triton.cdiv(K, 128), kb_per, y.stride(0),
        s_xe, x3.stride(1), w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1), y.stride(1), y.stride(2),
        out.stride(0) if serial else 0, out.stride(1) if serial else 0,
        ACT_QUANT=act_quant, SPLIT_K=split, SERIAL=serial, PAIR=pair is not None, **cfg,
        **(launch_kwargs(x.device, eager_only=not serial) if E * cols * K <= PDL_MAX_BYTES else PDL_OFF),
    )
    y = out if serial else (y[0] if split == 1 else y.sum(0).to(x.dtype))
    return y if grouped else y[0]


@triton_op("mla::fp8_block_linear_triton", mutates_args=())
def fp8_block_linear_triton(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool,
                            offs: Tensor | None = None) -> Tensor:
    """Triton ``mla::fp8_block_linear`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return torch.ops.mla.fp8_block_linear_ref(x, weight, weight_scale_inv, act_quant, offs)
    validate(x, weight, weight_scale_inv, offs)
    if offs is not None:
        return _launch_sorted(x, weight, weight_scale_inv, act_quant, offs)
    return _launch(x, weight, weight_scale_inv, act_quant)


@torch.library.custom_op("mla::fp8_block_linear_serial_triton", mutates_args=(), tags=LAYOUT_TAGS)
def fp8_block_linear_serial_triton(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool,
                                   split: int) -> Tensor:
    """``mla::fp8_block_linear`` for a 2-D / 3-D weight (contract of the ``_ref`` op), its K split in ``split``
    slices (0: :func:`_split`'s choice for the call's rows, made here at run time, so a compiled graph takes no guard
    on them) that each output tile's last program sums (:func:`_launch` with ``serial``): one launch where the
    triton_op takes two. The arrival counters are a persistent zeroed buffer per device
    (:func:`~mla_compile.ops._workspace.workspace`, allocated by the first call: a warm-up before any CUDA-graph
    capture), so calls on one device must not run concurrently on two streams."""
    validate(x, weight, weight_scale_inv)
    return _launch(x, weight, weight_scale_inv, act_quant, split=split or None, serial=True)


@fp8_block_linear_serial_triton.register_fake
def _serial_fake(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool, split: int) -> Tensor:
    return fake(x, weight, weight_scale_inv, act_quant)


@torch.library.custom_op("mla::fp8_block_linear_pair_triton", mutates_args=(), tags=LAYOUT_TAGS)
def fp8_block_linear_pair_triton(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, weight2: Tensor,
                                 weight2_scale_inv: Tensor, act_quant: bool) -> Tensor:
    """``mla::fp8_block_linear_pair``'s two products side by side, ``[M, N_1 + N_2]`` (CUDA ``x`` of 16 or 32 bits):
    one :func:`_launch` over both weights' column tiles, K split and summed in the kernel as the serial op does
    where few rows need it. The backend splits the result into the two outputs (views)."""
    from mla_compile.ops.fp8_block_linear_pair import validate as validate_pair

    validate_pair(x, weight, weight_scale_inv, weight2, weight2_scale_inv)
    return _launch(x, weight, weight_scale_inv, act_quant, serial=True, pair=(weight2, weight2_scale_inv))


@fp8_block_linear_pair_triton.register_fake
def _pair_fake(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, weight2: Tensor, weight2_scale_inv: Tensor,
               act_quant: bool) -> Tensor:
    from mla_compile.ops.fp8_block_linear_pair import validate as validate_pair

    validate_pair(x, weight, weight_scale_inv, weight2, weight2_scale_inv)
    return x.new_empty(x.shape[0], weight.shape[0] + weight2.shape[0])
