"""``from_pretrained``: a local HF-format DeepSeek checkpoint (bf16 or fp8 blocks) streamed into the patched model.

The HF model is built on the meta device; the shards are read tensor by tensor with ``safe_open`` and each
tensor is assigned on the target device, so host memory peaks at about one shard plus the loaded weights.
Linears with a ``weight_scale_inv`` in the checkpoint become :class:`~mla_compile.models.fp8_linear.FP8BlockLinear`
(fp8 kept in memory); fp8 experts become :class:`~mla_compile.models.fp8_linear.FP8Experts`, and with
``expert_dtype: "fp4"`` (DeepSeek-V4's packed e2m1 + ue8m0) :class:`~mla_compile.models.fp4_linear.FP4Experts`, kept
packed; ``kv_b_proj`` is dequantized once (the absorbed decode reads its weight as ``W_UK`` / ``W_UV``).
With ``parallel=`` the same modules are sharded (:mod:`mla_compile.parallel.shard`) from lazily sliced tensors.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from mla_compile.models.checkpoint import (EXPERT, SCALE_SUFFIX, CheckpointError, ShardIndex, config_dtype, layer_index,
                                           read_config, read_fp8_format, read_index)
from mla_compile.models.fp4_checkpoint import expert_dtype, parse_expert_key, place_fp4_expert
from mla_compile.models.fp4_linear import FP4Experts
from mla_compile.models.fp8_linear import FP8BlockLinear, FP8Experts
from mla_compile.models.model import MLAForCausalLM, patch
from mla_compile.models.v4_loader import is_v4_checkpoint, load_v4
from mla_compile.ops.fp8_block_linear import BLOCK as FP8_BLOCK, dequantize

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def from_pretrained(path: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                    parallel: object | None = None, kv_cache_dtype: torch.dtype | str | None = None,
                    backend: str | None = None, moe_impl: str = "auto", regional_compile: bool = False) -> MLAForCausalLM:
    """Load the DeepSeek checkpoint directory ``path`` (config.json, model.safetensors.index.json + shards) as an
    :class:`MLAForCausalLM` on ``device`` (default cpu).

    ``dtype``: of the non-fp8 weights (default: the config's dtype, else bfloat16); fp8 weights stay
    float8_e4m3fn with float32 block scales, fp4 experts (``expert_dtype: "fp4"``) packed uint8 with ue8m0 bytes. ``kv_cache_dtype``: default of ``allocate_cache`` (e.g. "fp8").
    ``parallel``: a :class:`~mla_compile.parallel.ParallelConfig` (or the state :func:`mla_compile.parallel.init`
    returned; a config is initialised here): this rank's shard only, each tensor read as the slice the rank keeps
    (``device`` is then the parallel state's). fp8 and fp4 weights stay quantized: a rank reads its rows /
    columns of the codes with the matching rows / columns of the block scales and only its experts' codes and
    scales, and its heads of ``kv_b_proj`` dequantized; a split through a quantization block raises ValueError
    (see :func:`mla_compile.parallel.shard.block_split`). ``backend`` / ``moe_impl`` / ``regional_compile``: as for
    :func:`patch` (``regional_compile``: ``torch.compile`` compiles one layer of each kind, not the whole depth).
    MTP layers (``num_nextn_predict_layers``) are skipped. A DeepSeek-V4 checkpoint (``model_type: "deepseek_v4"``)
    loads as a :class:`~mla_compile.models.v4_model.V4ForCausalLM` (:func:`mla_compile.models.v4_loader.load_v4`).
    Raises :class:`~mla_compile.models.checkpoint.CheckpointError` naming the file and tensor for a broken checkpoint.
    """
    root = Path(path)
    if is_v4_checkpoint(root):  # DeepSeek-V4: its own loader
        return load_v4(root, device=device, dtype=dtype, parallel=parallel, kv_cache_dtype=kv_cache_dtype,
                       backend=backend, moe_impl=moe_impl, regional_compile=regional_compile)
    config = read_config(root)
    fp8 = read_fp8_format(config, root)
    fp4_experts = expert_dtype(config, root) == "fp4"
    index = read_index(root)
    dtype = dtype or config_dtype(config)
    if parallel is not None:
        return _sharded(root, config, index, parallel, dtype, kv_cache_dtype, backend, moe_impl, fp4_experts,
                        regional_compile)
    device = torch.device(device or "cpu")
    hf = _meta_model(config)
    kv_b = _swap_fp8_modules(hf, config, index, fp4_experts)
    if kv_b and fp8 is None:
        log.info("%s: weight_scale_inv tensors without a quantization_config; loading them as fp8 blocks", root)
    loader = _Loader(hf, index, device, dtype, kv_b)
    loader.run(config.num_hidden_layers)
    with torch.device(device):  # rotary buffers are computed at init, not stored: make them for real
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config)
    loader.check_complete()
    model = patch(hf.eval(), backend=backend, moe_impl=moe_impl, regional_compile=regional_compile)
    model.kv_cache_dtype = kv_cache_dtype
    return model


def _sharded(root: Path, config, index: ShardIndex, parallel, dtype: torch.dtype, kv_cache_dtype, backend,
             moe_impl: str, fp4_experts: bool, regional_compile: bool) -> MLAForCausalLM:
    """``from_pretrained(parallel=...)``: a meta model (fp8 / fp4 modules swapped in as for one process)
    sharded by :func:`patch` from lazily sliced shard tensors."""
    from mla_compile.parallel import ParallelState, init

    hf = _meta_model(config)  # MTP layers (index >= num_hidden_layers) are not built, so never read
    kv_b = _swap_fp8_modules(hf, config, index, fp4_experts)  # before init: a broken checkpoint fails alone
    state = parallel if isinstance(parallel, ParallelState) else init(parallel)
    fp32 = tuple(getattr(hf, "_keep_in_fp32_modules", None) or ()) + tuple(
        getattr(hf, "_keep_in_fp32_modules_strict", None) or ())
    source = _SliceSource(index, dtype, fp32, kv_b)
    model = patch(hf.eval(), backend=backend, moe_impl=moe_impl, parallel=state, weights=source,
                  regional_compile=regional_compile)
    model.kv_cache_dtype = kv_cache_dtype
    return model


class _SliceSource:
    """HF parameter name -> a lazily sliced checkpoint tensor (:class:`_Lazy`): only the rows / columns a rank
    keeps are read from the shard (safetensors ``get_slice``). The stacked experts of an HF MoE
    (``...experts.gate_up_proj [E, 2I, H]``, ``...experts.down_proj [E, H, I]``; of an FP8Experts / FP4Experts
    ``...experts.gate_proj`` and ``...experts.gate_proj_scale_inv`` etc.) are assembled from the per-expert
    checkpoint tensors of the experts and rows asked for. Float tensors are cast to ``dtype`` (float32 for
    the ``fp32`` modules); fp8 / fp4 codes and their scales keep their stored dtype. The ``kv_b`` linears'
    fp8 weights are read dequantized (:class:`_DequantizedRows`)."""

    def __init__(self, index: ShardIndex, dtype: torch.dtype, fp32: tuple[str, ...],
                 kv_b: set[str] | frozenset[str] = frozenset()) -> None:
        self.index, self.dtype, self.fp32, self.kv_b = index, dtype, fp32, kv_b
        self._shapes: dict[str, tuple[int, ...]] = {}

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of checkpoint tensor ``key`` (read from its shard's header once)."""
        if key not in self._shapes:
            with self.open(key) as f:
                self._shapes[key] = tuple(f.get_slice(key).get_shape())
        return self._shapes[key]

    def open(self, key: str):
        """The safetensors reader of the shard holding ``key`` (KeyError when the index lists no such tensor)."""
        from safetensors import safe_open

        if key not in self.index.weight_map:
            raise KeyError(key)
        return safe_open(str(self.index.root / self.index.file_of(key)), framework="pt", device="cpu")

    def __call__(self, name: str) -> "_Lazy | _DequantizedRows":
        dtype = torch.float32 if any(p in name for p in self.fp32) else self.dtype
        prefix, _, param = name.rpartition(".")
        if prefix.endswith(".experts") and param in ("gate_up_proj", "down_proj", "gate_proj", "up_proj",
                                                     "gate_proj" + SCALE_SUFFIX, "up_proj" + SCALE_SUFFIX,
                                                     "down_proj" + SCALE_SUFFIX):
            if param == "gate_up_proj":
                parts = ("gate_proj.weight", "up_proj.weight")
            elif param.endswith(SCALE_SUFFIX):  # FP8Experts / FP4Experts: one projection's scales
                parts = (param[: -len(SCALE_SUFFIX)] + ".weight" + SCALE_SUFFIX,)
            else:
                parts = (param + ".weight",)
            keys = []
            while f"{prefix}.{len(keys)}.{parts[0]}" in self.index.weight_map:
                keys.append([f"{prefix}.{len(keys)}.{p}" for p in parts])
            if not keys:
                raise KeyError(name)
            return _Lazy(self, keys, dtype, stacked=True)
        if prefix in self.kv_b and param == "weight":
            return _DequantizedRows(self, name, dtype)
        return _Lazy(self, [[name]], dtype, stacked=False)


class _Lazy:
    """A checkpoint tensor, or experts stacked from per-expert tensors (row ``j`` = expert ``j``'s parts
    concatenated, e.g. ``[gate; up]``), read only where it is indexed: ``shape`` and ``t[slices]``, as
    :func:`~mla_compile.parallel.shard.shard_model` takes its weights."""

    def __init__(self, source: _SliceSource, keys: list[list[str]], dtype: torch.dtype, stacked: bool) -> None:
        self.source, self.keys, self.dtype, self.stacked = source, keys, dtype, stacked
        first = [source.shape(k) for k in keys[0]]
        if stacked:
            self.shape = torch.Size((len(keys), sum(sh[0] for sh in first)) + first[0][1:])
        else:
            self.shape = torch.Size(first[0])

    def _read(self, key: str, index: tuple) -> Tensor:
        with self.source.open(key) as f:
            t = f.get_slice(key)[index]
        if t.dtype == FP8 and not key.endswith(SCALE_SUFFIX) and key + SCALE_SUFFIX not in self.source.index.weight_map:
            raise CheckpointError(f"{self.source.index.file_of(key)}: tensor {key} is float8_e4m3fn but "
                                  f"{key}{SCALE_SUFFIX} is missing from the index: fp8 weights need their block scales")
        # fp8 / fp4 codes and block scales stay as stored; float weights take the model's dtype
        return t if key.endswith(SCALE_SUFFIX) or t.dtype not in _FLOATS else t.to(self.dtype)

    def __getitem__(self, index) -> Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if not self.stacked:
            return self._read(self.keys[0][0], index)
        if not all(isinstance(i, slice) for i in index):
            raise TypeError(f"stacked experts of {self.keys[0][0]} take slices only, got {index}")
        experts, rows, rest = index[0], (index[1:2] or (slice(None),))[0], index[2:]
        r0, r1, step = rows.indices(self.shape[1])
        if step != 1:
            raise TypeError(f"stacked experts of {self.keys[0][0]} take unit-step row slices, got {rows}")
        out = []
        for parts in self.keys[experts]:
            pieces, start = [], 0
            for key in parts:  # the rows asked for, read from each part that holds some of them
                n = self.source.shape(key)[0]
                lo, hi = max(r0, start), min(r1, start + n)
                if lo < hi:
                    pieces.append(self._read(key, (slice(lo - start, hi - start),) + rest))
                start += n
            out.append(torch.cat(pieces))
        return torch.stack(out)


class _DequantizedRows:
    """An fp8 ``kv_b_proj.weight`` (``weight_scale_inv`` beside it) read dequantized, rows only where indexed:
    ``t[r0:r1]`` reads the 128-row blocks covering ``[r0, r1)`` and their scales, dequantizes them in float32
    and keeps exactly rows ``r0 .. r1 - 1`` (any row boundary: the result is float), cast to ``dtype``."""

    def __init__(self, source: _SliceSource, key: str, dtype: torch.dtype) -> None:
        self.source, self.key, self.dtype = source, key, dtype
        self.shape = torch.Size(source.shape(key))

    def __getitem__(self, index) -> Tensor:
        index = index if isinstance(index, tuple) else (index,)
        rows, rest = index[0], index[1:]
        if not isinstance(rows, slice):
            raise TypeError(f"{self.key} (read dequantized) takes a row slice, got {rows}")
        r0, r1, step = rows.indices(self.shape[0])
        if step != 1:
            raise TypeError(f"{self.key} (read dequantized) takes unit-step row slices, got {rows}")
        b0, b1 = r0 // FP8_BLOCK, -(-r1 // FP8_BLOCK)
        with self.source.open(self.key) as f:
            codes = f.get_slice(self.key)[b0 * FP8_BLOCK: min(b1 * FP8_BLOCK, self.shape[0])]
        scale_key = self.key + SCALE_SUFFIX
        with self.source.open(scale_key) as f:
            scale = f.get_slice(scale_key)[b0:b1]
        if codes.dtype != FP8:
            raise CheckpointError(f"{self.source.index.file_of(self.key)}: tensor {self.key} has a weight_scale_inv "
                                  f"but is {codes.dtype}, not float8_e4m3fn")
        w = dequantize(codes, scale.float(), torch.float32)[r0 - b0 * FP8_BLOCK: r1 - b0 * FP8_BLOCK]
        return w[(slice(None),) + rest].to(self.dtype)


def _meta_model(config) -> nn.Module:
    """The HF causal LM of ``config``, every parameter on the meta device (no memory, no init time)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping[type(config)]
    config._attn_implementation = "eager"  # MLAAttention replaces attention; no kernel lookup
    with torch.device("meta"):
        return cls(config)


def _swap_fp8_modules(hf: nn.Module, config, index: ShardIndex, fp4_experts: bool = False) -> set[str]:
    """Replace modules whose checkpoint weights are fp8 (a ``weight_scale_inv`` exists; experts: fp4 when
    ``fp4_experts``); returns the ``kv_b_proj`` prefixes, which stay ``nn.Linear`` and are dequantized at load."""
    kv_b, experts = set(), set()
    for key in index.weight_map:
        if not key.endswith(SCALE_SUFFIX) or (layer_index(key) or 0) >= config.num_hidden_layers:
            continue
        prefix = key[: -len(".weight" + SCALE_SUFFIX)]
        m = EXPERT.match(key)
        if m:
            experts.add(m["module"])
        elif prefix.endswith("kv_b_proj"):
            kv_b.add(prefix)
        else:
            linear = _submodule(hf, prefix, key, index)
            if not isinstance(linear, nn.Linear) or linear.bias is not None:
                raise CheckpointError(f"{index.file_of(key)}: {key} scales {prefix}, a {type(linear).__name__}; "
                                      "only bias-free nn.Linear layers can be fp8")
            _set_submodule(hf, prefix, FP8BlockLinear(linear.in_features, linear.out_features, device="meta"))
    for prefix in experts:
        old = _submodule(hf, prefix, prefix, index)
        cls = FP4Experts if fp4_experts else FP8Experts
        extra = dict(swiglu_limit=getattr(config, "swiglu_limit", None)) if fp4_experts else {}
        _set_submodule(hf, prefix, cls(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                                       old.act_fn, device="meta", **extra))
    return kv_b


def _submodule(hf: nn.Module, prefix: str, key: str, index: ShardIndex) -> nn.Module:
    try:
        return hf.get_submodule(prefix)
    except AttributeError:
        raise CheckpointError(f"{index.file_of(key)}: tensor {key} names no module of "
                              f"{type(hf).__name__}; is config.json the checkpoint's own?") from None


def _set_submodule(root: nn.Module, prefix: str, module: nn.Module) -> None:
    parent, _, name = prefix.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


class _Loader:
    """Streams shard tensors into the meta model: one tensor in host memory at a time (plus kv_b pairs)."""

    def __init__(self, hf: nn.Module, index: ShardIndex, device: torch.device, dtype: torch.dtype,
                 kv_b: set[str]) -> None:
        self.hf, self.index, self.device, self.dtype, self.kv_b = hf, index, device, dtype, kv_b
        self.fp32 = tuple(getattr(hf, "_keep_in_fp32_modules", None) or ()) + tuple(
            getattr(hf, "_keep_in_fp32_modules_strict", None) or ())
        self.pending: dict[str, dict[str, Tensor]] = {}
        self.filled: set[tuple[str, str, int]] = set()
        self.unexpected: list[str] = []

    def run(self, num_layers: int) -> None:
        from safetensors import safe_open

        skipped = 0
        for file in sorted(self.index.files):
            with safe_open(str(self.index.root / file), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for key in self.index.files[file]:
                    if (layer_index(key) or 0) >= num_layers:
                        skipped += 1  # MTP (num_nextn_predict_layers): not used by generation
                        continue
                    if key not in present:
                        raise CheckpointError(f"{self.index.root / file}: tensor {key} is listed in the index "
                                              "but not in this shard")
                    self._place(key, f.get_tensor(key), file)
        if skipped:
            log.info("skipped %d tensors of MTP layers (index >= num_hidden_layers=%d): generation does not "
                     "use them", skipped, num_layers)
        if self.unexpected:
            log.warning("ignored %d checkpoint tensors the model has no place for, e.g. %s", len(self.unexpected),
                        self.unexpected[:3])

    def _place(self, key: str, t: Tensor, file: str) -> None:
        if t.dtype == FP8 and SCALE_SUFFIX not in key and key + SCALE_SUFFIX not in self.index.weight_map:
            raise CheckpointError(f"{file}: tensor {key} is float8_e4m3fn but {key}{SCALE_SUFFIX} is missing from "
                                  "the index: fp8 weights need their block scales")
        m = EXPERT.match(key)
        if m:
            return self._place_expert(m, key, t, file)
        prefix, _, name = key.rpartition(".")
        if prefix in self.kv_b or prefix[: -len(".weight")] in self.kv_b:
            return self._place_kv_b(key, t, file)
        try:
            module = self.hf.get_submodule(prefix)
        except AttributeError:
            self.unexpected.append(key)
            return
        target = module._parameters.get(name, module._buffers.get(name))
        if target is None:
            self.unexpected.append(key)
            return
        _check_shape(file, key, t, target.shape)
        module_dtype = self._dtype(key, target)
        _check_fp8(file, key, t, target)
        value = t.to(device=self.device, dtype=module_dtype)
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[name] = value

    def _dtype(self, key: str, target: Tensor) -> torch.dtype:
        if target.dtype == FP8 or key.endswith(SCALE_SUFFIX):
            return target.dtype
        return torch.float32 if any(p in key for p in self.fp32) else self.dtype

    def _place_kv_b(self, key: str, t: Tensor, file: str) -> None:
        """Dequantize ``kv_b_proj`` (fp8 weight and scale) once both halves arrived."""
        prefix = key[: key.rindex(".weight")]
        part = self.pending.setdefault(prefix, {})
        part[key.rpartition(".")[2]] = t
        if len(part) < 2:
            return
        linear = self.hf.get_submodule(prefix)
        _check_shape(file, f"{prefix}.weight", part["weight"], linear.weight.shape)
        if part["weight"].dtype != FP8:
            raise CheckpointError(f"{file}: tensor {prefix}.weight has a weight_scale_inv but is "
                                  f"{part['weight'].dtype}, not float8_e4m3fn")
        w = dequantize(part["weight"], part["weight" + SCALE_SUFFIX], torch.float32)
        linear.weight = nn.Parameter(w.to(device=self.device, dtype=self.dtype), requires_grad=False)
        del self.pending[prefix]

    def _place_expert(self, m, key: str, t: Tensor, file: str) -> None:
        """One expert's projection into the stacked tensor of its experts module."""
        experts = self.hf.get_submodule(m["module"])
        j, proj, name = int(m["index"]), m["proj"], m["name"]
        if isinstance(experts, FP4Experts):  # packed bytes copied as they are, never dequantized
            place_fp4_expert(experts, parse_expert_key(key), key, t, file, device=self.device)
            self.filled.add((m["module"], f"{proj}.{name}", j))
            return
        if t.dtype in (torch.int8, torch.uint8):
            raise CheckpointError(f"{file}: tensor {key} is {t.dtype}: packed fp4 expert weights need "
                                  "quantization_config.expert_dtype 'fp4' in config.json")
        if isinstance(experts, FP8Experts):
            param = proj + (SCALE_SUFFIX if name != "weight" else "")
            rows = slice(None)
        else:
            param = "down_proj" if proj == "down_proj" else "gate_up_proj"
            half = experts.gate_up_proj.shape[1] // 2
            rows = {"gate_proj": slice(0, half), "up_proj": slice(half, 2 * half)}.get(proj, slice(None))
        stacked = getattr(experts, param)
        if stacked.is_meta:
            real = torch.empty(stacked.shape, dtype=self._dtype(key, stacked), device=self.device)
            stacked = nn.Parameter(real, requires_grad=False)
            setattr(experts, param, stacked)
        _check_shape(file, key, t, stacked[j, rows].shape)
        _check_fp8(file, key, t, stacked)
        with torch.no_grad():
            stacked[j, rows].copy_(t.to(stacked.dtype))
        self.filled.add((m["module"], f"{proj}.{name}", j))

    def check_complete(self) -> None:
        """Every parameter and buffer has real values; else a CheckpointError listing what is missing."""
        tensors = list(self.hf.named_parameters()) + list(self.hf.named_buffers())
        # stacked experts are listed per expert below, by their checkpoint names
        missing = [name for name, t in tensors if t.is_meta and not name.rpartition(".")[0].endswith(".experts")]
        missing += [f"{prefix}.{k}" for prefix in self.pending for k in ("weight", "weight" + SCALE_SUFFIX)
                    if k not in self.pending[prefix]]
        for module_name, experts in self.hf.named_modules():
            if not module_name.endswith(".experts") or not hasattr(experts, "down_proj"):
                continue
            names = [f"{p}.{n}" for p in ("gate_proj", "up_proj", "down_proj") for n in ("weight", "weight_scale_inv")
                     if n == "weight" or isinstance(experts, (FP8Experts, FP4Experts))]
            num = experts.down_proj.shape[0]
            missing += [f"{module_name}.{j}.{n}" for j in range(num) for n in names
                        if (module_name, n, j) not in self.filled]
        if missing:
            listed = "; ".join(f"{k} (expected in {self.index.file_of(k)})" for k in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise CheckpointError(f"{self.index.root}: {len(missing)} tensors missing from the checkpoint: "
                                  f"{listed}{more}")


def _check_shape(file: str, key: str, t: Tensor, expected: torch.Size) -> None:
    if tuple(t.shape) != tuple(expected):
        raise CheckpointError(f"{file}: tensor {key} has shape {list(t.shape)}, the model built from config.json "
                              f"expects {list(expected)}")


def _check_fp8(file: str, key: str, t: Tensor, target: Tensor) -> None:
    """fp8 tensors go only where the model holds fp8 (and fp8 slots take only fp8: no silent cast)."""
    if (t.dtype == FP8) != (target.dtype == FP8):
        why = "has a weight_scale_inv" if target.dtype == FP8 else "has no fp8 slot there"
        raise CheckpointError(f"{file}: tensor {key} is {t.dtype}, but the model expects {target.dtype} "
                              f"(the linear {why})")
