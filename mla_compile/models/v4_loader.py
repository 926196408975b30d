"""``from_pretrained`` for DeepSeek-V4: a local HF-format checkpoint directory streamed into a
:class:`~mla_compile.models.v4_model.V4ForCausalLM`.

The HF ``DeepseekV4ForCausalLM`` is built on the meta device; the shards are read tensor by tensor with
``safe_open`` and each tensor is assigned where it belongs on the target device, so host memory peaks at about
one shard plus the loaded weights. Tensor names are accepted in every spelling a V4 checkpoint has:

- DeepSeek's own (the hub release): ``embed.weight``, ``layers.{i}.attn.wq_a.weight``,
  ``layers.{i}.attn.compressor.ape``, ``layers.{i}.attn.indexer.compressor.wkv.weight``,
  ``layers.{i}.ffn.experts.{j}.w1.weight``, ``layers.{i}.hc_attn_fn``, ``hc_head_fn``, ``head.weight``, ``.scale``
  for a block scale (transformers' ``conversion_mapping.py`` "deepseek_v4" and its fp8 quantizer read them so);
- what transformers' ``save_pretrained`` writes (some of those under a ``model.`` prefix);
- transformers' module names (``model.layers.{i}.self_attn.q_a_proj.weight``, per-expert
  ``mlp.experts.{j}.gate_proj.weight`` or stacked ``mlp.experts.gate_up_proj``, ``.weight_scale_inv``).

Formats: float / bf16 tensors (stored in ``dtype``; transformers' ``_keep_in_fp32_modules_strict`` in float32);
fp8 e4m3 weights with 128 x 128 block scales (float32, or ue8m0 as float8_e8m0fnu / uint8 bytes) stay fp8 in
:class:`~mla_compile.models.fp8_linear.FP8BlockLinear` (``o_a_proj``:
:class:`~mla_compile.models.fp8_linear.FP8GroupedLinear` when each group's rows are whole blocks), routed experts
in :class:`~mla_compile.models.fp8_linear.FP8Experts`; fp4 experts (packed e2m1 + ue8m0: ``expert_dtype: "fp4"``,
or int8 / uint8 expert weights when config.json names no ``expert_dtype``, as V4-Flash's first release) stay
packed in :class:`~mla_compile.models.fp4_linear.FP4Experts`. fp8 weights of modules that have no fp8 form
(embedding, ``lm_head``, router, a grouped projection whose groups split blocks) are dequantized once at load.
MTP tensors (``mtp.*``, layers >= ``num_hidden_layers``) are skipped. A broken checkpoint raises
:class:`~mla_compile.models.checkpoint.CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from mla_compile.models.checkpoint import (CONFIG_FILE, SCALE_SUFFIX, CheckpointError, ShardIndex, config_dtype,
                                           layer_index, read_fp8_format, read_index)
from mla_compile.models.fp4_checkpoint import expert_dtype, parse_expert_key, place_fp4_expert
from mla_compile.models.fp4_linear import FP4Experts
from mla_compile.models.fp8_linear import FP8Experts, fp8_form
from mla_compile.models.model import patch
from mla_compile.models.v4_model import V4ForCausalLM, is_v4_model
from mla_compile.ops.fp4_block_linear import scale_values
from mla_compile.ops.fp8_block_linear import BLOCK, dequantize

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
V4_MODEL_TYPE = "deepseek_v4"

# DeepSeek's V4 names -> transformers' module names, applied in order to "." + name + "." (facts of
# transformers' conversion_mapping.py "deepseek_v4"); names already in transformers' spelling pass unchanged.
_RENAMES = [(re.compile(p), r) for p, r in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.self_attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)\.", r".\1_hc.\2."), (r"\.attn_sink\.", ".sinks."),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."), (r"\.ape\.", ".position_bias."),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias\.", ".gate.e_score_correction_bias."),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"^\.embed\.", ".embed_tokens."), (r"^\.head\.", ".lm_head."),
    (r"^\.hc_head_(fn|base|scale)\.", r".hc_head.hc_\1."),
)]
_MTP = re.compile(r"^(model\.)?mtp\.")
_STACKED = re.compile(r"^.+\.experts\.(gate_up_proj|down_proj)$")  # transformers' stacked float experts [E, ...]
_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\."
                     r"(?P<name>weight|weight_scale_inv)$")


def is_v4_checkpoint(root: str | Path) -> bool:
    """True when ``root/config.json`` names the DeepSeek-V4 model type (read as JSON, transformers not needed)."""
    path = Path(root) / CONFIG_FILE
    try:
        return json.loads(path.read_text()).get("model_type") == V4_MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False  # the general loader reports a missing or unreadable config.json


def v4_model_name(key: str) -> str | None:
    """The transformers parameter name of V4 checkpoint tensor ``key`` in any of its spellings (module
    docstring); None for an MTP tensor (``mtp.*``). ``<module>.scale`` is the block scale of ``<module>.weight``
    (``weight_scale_inv``), except the mixing scale of a hyper-connection (``attn_hc.scale`` / ``ffn_hc.scale``)."""
    if _MTP.match(key):
        return None
    body = key.removeprefix("model.")
    if body.endswith(".scale") and not body.endswith(("attn_hc.scale", "ffn_hc.scale")):
        body = body[: -len(".scale")] + ".weight" + SCALE_SUFFIX
    s = f".{body}."
    for pattern, repl in _RENAMES:
        s = pattern.sub(repl, s)
    body = s[1:-1]
    return body if body.startswith("lm_head.") else "model." + body


@dataclass
class _Entry:
    """One checkpoint tensor: its file and its transformers name."""

    key: str
    file: str
    name: str


def load_v4(root: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
            parallel: object | None = None, kv_cache_dtype: torch.dtype | str | None = None,
            backend: str | None = None, moe_impl: str = "auto", regional_compile: bool = False) -> V4ForCausalLM:
    """Load the DeepSeek-V4 checkpoint directory ``root`` as a :class:`V4ForCausalLM` on ``device`` (default cpu);
    what :func:`mla_compile.from_pretrained` does for a ``model_type: "deepseek_v4"`` config.

    ``dtype``: of the float weights (default: the config's dtype, else bfloat16; transformers'
    ``_keep_in_fp32_modules_strict`` parameters stay float32 for half dtypes); fp8 weights stay float8_e4m3fn with
    float32 block scales, fp4 experts packed uint8 with ue8m0 bytes. ``backend`` / ``moe_impl`` / ``regional_compile``:
    passed to :func:`~mla_compile.models.model.patch`. ``parallel`` (a :class:`~mla_compile.parallel.ParallelConfig`
    or the state :func:`mla_compile.parallel.init` returned): this rank reads only its routed experts' tensors (the
    replicated weights whole; a stacked float experts tensor by its slice) straight onto the state's device, and
    :func:`mla_compile.parallel.v4.shard_v4` splits the heads where the attention groups have several ranks and wraps
    the model for expert parallelism.
    ``kv_cache_dtype`` is not supported for V4
    (NotImplementedError: V4's caches are in the model's dtype).
    Raises :class:`~mla_compile.models.checkpoint.CheckpointError` naming the file and tensor for a broken checkpoint.
    """
    root = Path(root)
    if kv_cache_dtype is not None:
        raise NotImplementedError(f"{root}: kv_cache_dtype={kv_cache_dtype!r}: DeepSeek-V4's paged caches are in the "
                                  "model's dtype (V4ForCausalLM.allocate_cache(dtype=...)); pass kv_cache_dtype=None")
    state, keep = None, None
    config = _read_config(root)
    if parallel is not None:
        from mla_compile.parallel import ParallelState, init
        from mla_compile.parallel.v4 import local_experts
        state = parallel if isinstance(parallel, ParallelState) else init(parallel)
        keep = local_experts(state, config)  # refuses another layout before anything is read
        device = state.device  # this rank's part only, straight onto its device
    read_fp8_format(config, root)  # only DeepSeek's fp8 e4m3 128 x 128 blocks (or no quantization_config)
    declared = expert_dtype(config, root)
    index = read_index(root)
    dtype = dtype or config_dtype(config)
    device = torch.device(device or "cpu")
    entries, skipped = _entries(index, config.num_hidden_layers)
    packed = _packed_experts(index, entries)
    if declared == "fp8" and packed is not None:
        raise CheckpointError(f"{packed.file}: tensor {packed.key} is packed fp4 bytes, but config.json says "
                              "expert_dtype 'fp8': set it to 'fp4' (or remove it) for DeepSeek-V4's fp4 experts")
    fp4 = declared == "fp4" or (declared is None and packed is not None)
    if fp4 and declared is None:
        log.info("%s: expert weights stored packed with no expert_dtype in config.json: loading them as fp4 "
                 "(e2m1 + ue8m0), as DeepSeek-V4 ships them", packed.key)
    with torch.device("meta"):
        hf = _hf_class()(config)
    loader = _V4Loader(hf, config, index, entries, device, dtype, fp4, keep)
    loader.run()
    if keep is not None:
        log.info("rank %d: routed experts [%d, %d) of %d read, %d expert tensors of other ranks skipped unread",
                 state.rank, keep[0], keep[1], config.n_routed_experts, loader.skipped_experts)
    rebuild_nonpersistent(hf, config, device)
    loader.check_complete()
    if skipped:
        log.info("skipped %d MTP tensors (mtp.* / layers >= num_hidden_layers=%d): generation does not use them",
                 skipped, config.num_hidden_layers)
    return patch(hf.eval(), backend=backend, moe_impl=moe_impl, regional_compile=regional_compile, parallel=state)


def _read_config(root: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{root / CONFIG_FILE}: transformers cannot read it ({e}); DeepSeek-V4 needs "
                              "transformers with DeepseekV4ForCausalLM (5.17 or newer)") from e
    if not is_v4_model(config):
        raise CheckpointError(f"{root / CONFIG_FILE}: model_type {getattr(config, 'model_type', None)!r} is not "
                              f"{V4_MODEL_TYPE!r}")
    config._attn_implementation = "eager"  # V4ForCausalLM replaces attention; no kernel lookup
    return config


def _hf_class():
    import transformers

    cls = getattr(transformers, "DeepseekV4ForCausalLM", None)
    if cls is None:
        raise CheckpointError(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM: DeepSeek-V4 "
                              "checkpoints need transformers 5.17 or newer")
    return cls


def _entries(index: ShardIndex, num_layers: int) -> tuple[list[_Entry], int]:
    """Every non-MTP checkpoint tensor with its transformers name; and the number of MTP tensors skipped."""
    keys = index.weight_map
    entries, skipped, seen = [], 0, {}
    for key, file in keys.items():
        name = v4_model_name(key)
        if name is None or (layer_index(name) or 0) >= num_layers:
            skipped += 1
            continue
        if name in seen:
            raise CheckpointError(f"{file}: tensor {key} and tensor {seen[name]} ({keys[seen[name]]}) are both "
                                  f"{name}: the index names one tensor twice")
        seen[name] = key
        entries.append(_Entry(key, file, name))
    return entries, skipped


def _packed_experts(index: ShardIndex, entries: list[_Entry]) -> _Entry | None:
    """The first routed-expert weight when it is stored as packed fp4 bytes (int8 / uint8 / float4, read from its
    shard's header), else None. DeepSeek-V4-Flash's first config.json names no ``expert_dtype``; its experts are
    int8-packed e2m1 with ue8m0 scales."""
    from safetensors import safe_open

    first = next((e for e in entries if _EXPERT.match(e.name) and e.name.endswith(".weight")), None)
    if first is None:
        return None
    try:
        with safe_open(str(index.root / first.file), framework="pt", device="cpu") as f:
            stored = f.get_slice(first.key).get_dtype()
    except Exception:  # a missing tensor or unreadable shard is reported, naming it, by the load itself
        return None
    return first if stored in ("I8", "U8", "F4") else None


def rebuild_nonpersistent(hf: nn.Module, config, device: torch.device) -> None:
    """Modules whose non-persistent buffers (rotary frequencies, computed at init, not stored) are still on the
    meta device are built again for real on ``device``."""
    for name, module in list(hf.named_modules()):
        bufs = [module._buffers[b] for b in module._non_persistent_buffers_set if module._buffers.get(b) is not None]
        if name and bufs and any(b.is_meta for b in bufs):
            parent, _, attr = name.rpartition(".")
            with torch.device(device):
                setattr(hf.get_submodule(parent) if parent else hf, attr, type(module)(config))


class _V4Loader:
    """Swaps in the fp8 / fp4 modules the checkpoint asks for, then streams its tensors into the meta model,
    one tensor in host memory at a time (plus the halves of a weight waiting for its scale to be dequantized)."""

    def __init__(self, hf: nn.Module, config, index: ShardIndex, entries: list[_Entry], device: torch.device,
                 dtype: torch.dtype, fp4: bool, keep: tuple[int, int] | None = None) -> None:
        self.hf, self.config, self.index, self.entries = hf, config, index, entries
        self.device, self.dtype, self.fp4 = device, dtype, fp4
        self.total = config.n_routed_experts
        self.keep = keep or (0, self.total)  # the routed experts [e0, e1) this process holds (all but under EP)
        self.skipped_experts = 0  # expert tensors of other ranks, never read
        self.fp32 = tuple(getattr(hf, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (
            torch.float16, torch.bfloat16) else ()
        self.names = {e.name: e for e in entries}
        self.dequant: set[str] = set()  # module prefixes whose fp8 weight is dequantized at load
        self.pending: dict[str, dict[str, tuple[Tensor, _Entry]]] = {}
        self.filled: set[tuple[str, int, str, str]] = set()  # (experts module, expert, proj, weight|scale)
        self.unexpected: list[str] = []
        self._swap_modules()

    def _swap_modules(self) -> None:
        experts: dict[str, tuple[_Entry, bool]] = {}  # experts module -> (an entry of it, has block scales)
        for e in self.entries:
            m = _EXPERT.match(e.name)
            if m:
                first, scaled = experts.get(m["module"], (e, False))
                experts[m["module"]] = (first, scaled or m["name"] == "weight" + SCALE_SUFFIX)
                continue
            if not e.name.endswith(".weight" + SCALE_SUFFIX):
                continue
            prefix = e.name[: -len(".weight" + SCALE_SUFFIX)]
            module = self._module(prefix, e)
            fp8 = fp8_form(module, "meta") if prefix != "lm_head" else None
            if fp8 is not None:
                self._set(prefix, fp8)
                continue
            if not isinstance(getattr(module, "weight", None), nn.Parameter) or module.weight.dim() != 2:
                raise CheckpointError(f"{e.file}: tensor {e.key} ({e.name}) scales {prefix}, a "
                                      f"{type(module).__name__} without a 2-D weight; fp8 blocks need one")
            self.dequant.add(prefix)
        limit = getattr(self.config, "swiglu_limit", None)
        local = self.keep[1] - self.keep[0]
        for prefix, (first, scaled) in experts.items():
            old = self._module(prefix, first)
            _, hidden, inter = old.down_proj.shape  # transformers' stacked experts: [E, H, I]
            if self.fp4:
                try:
                    new = FP4Experts(local, hidden, inter, old.act_fn, swiglu_limit=limit, device="meta")
                except ValueError as err:
                    raise CheckpointError(f"{self.index.root / CONFIG_FILE}: expert_dtype 'fp4' for {prefix}: "
                                          f"{err}") from None
                self._set(prefix, new)
            elif scaled:
                self._set(prefix, FP8Experts(local, hidden, inter, old.act_fn, swiglu_limit=limit, device="meta"))
        if local != self.total:  # the float experts left: this rank's slice of the stacked tensors
            for name, m in self.hf.named_modules():
                if (name.endswith(".experts") and not isinstance(m, (FP8Experts, FP4Experts))
                        and isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)):
                    for attr in ("gate_up_proj", "down_proj"):
                        full = getattr(m, attr)
                        setattr(m, attr, nn.Parameter(torch.empty((local, *full.shape[1:]), dtype=full.dtype,
                                                                  device="meta"), requires_grad=False))
                    m.num_experts = local

    def _module(self, prefix: str, e: _Entry) -> nn.Module:
        try:
            return self.hf.get_submodule(prefix)
        except AttributeError:
            raise CheckpointError(f"{e.file}: tensor {e.key} ({e.name}) names no module of "
                                  f"{type(self.hf).__name__}; is config.json the checkpoint's own?") from None

    def _set(self, prefix: str, module: nn.Module) -> None:
        parent, _, name = prefix.rpartition(".")
        setattr(self.hf.get_submodule(parent) if parent else self.hf, name, module)

    def run(self) -> None:
        from safetensors import safe_open

        by_file: dict[str, list[_Entry]] = {}
        for e in self.entries:
            by_file.setdefault(e.file, []).append(e)
        for file in sorted(by_file):
            with safe_open(str(self.index.root / file), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for e in by_file[file]:
                    if e.key not in present:
                        raise CheckpointError(f"{self.index.root / file}: tensor {e.key} is listed in the index "
                                              "but not in this shard")
                    m = _EXPERT.match(e.name)
                    if m and not self.keep[0] <= int(m["index"]) < self.keep[1] and int(m["index"]) < self.total:
                        self.skipped_experts += 1  # another rank's expert
                        continue
                    if self.keep != (0, self.total) and _STACKED.match(e.name):
                        self._place(e, f.get_slice(e.key)[self.keep[0]:self.keep[1]])
                        continue
                    self._place(e, f.get_tensor(e.key))
        if self.unexpected:
            log.warning("ignored %d checkpoint tensors the model has no place for, e.g. %s", len(self.unexpected),
                        self.unexpected[:3])

    def _place(self, e: _Entry, t: Tensor) -> None:
        if t.dtype == FP8 and not e.name.endswith(SCALE_SUFFIX) and e.name + SCALE_SUFFIX not in self.names:
            raise CheckpointError(f"{e.file}: tensor {e.key} is float8_e4m3fn but its block scale ("
                                  f"{e.key.removesuffix('.weight')}.scale or {e.key}{SCALE_SUFFIX}) is missing from "
                                  "the index: fp8 weights need their block scales")
        m = _EXPERT.match(e.name)
        if m:
            return self._place_expert(m, e, t)
        prefix, _, attr = e.name.rpartition(".")
        if prefix in self.dequant and attr in ("weight", "weight" + SCALE_SUFFIX):
            return self._place_dequantized(prefix, attr, e, t)
        try:
            module = self.hf.get_submodule(prefix)
        except AttributeError:
            self.unexpected.append(e.key)
            return
        target = module._parameters.get(attr, module._buffers.get(attr))
        if target is None:
            self.unexpected.append(e.key)
            return
        if attr == "weight" + SCALE_SUFFIX:
            t = self._block_scale(e, t)
        _check_shape(e, t, target.shape)
        _check_fp8(e, t, target)
        if target.dtype == FP8 or attr.endswith(SCALE_SUFFIX):
            dtype = target.dtype  # fp8 codes, float32 block scales
        elif not target.dtype.is_floating_point:  # e.g. the hash router's tid2eid
            if t.dtype.is_floating_point:
                raise CheckpointError(f"{e.file}: tensor {e.key} is {t.dtype}; {e.name} holds {target.dtype} values")
            dtype = target.dtype
        else:
            dtype = torch.float32 if any(p in e.name for p in self.fp32) else self.dtype
        value = t.to(device=self.device, dtype=dtype)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[attr] = value
        if prefix.endswith(".experts") and attr in ("gate_up_proj", "down_proj"):  # transformers' stacked experts
            for j in range(self.keep[0], self.keep[0] + t.shape[0]):
                for proj in (("gate_proj", "up_proj") if attr == "gate_up_proj" else ("down_proj",)):
                    self.filled.add((prefix, j, proj, "weight"))

    def _block_scale(self, e: _Entry, t: Tensor) -> Tensor:
        """A 128 x 128 block scale as float32: float tensors as they are, ue8m0 (float8_e8m0fnu, or uint8 bytes
        under ``scale_fmt: "ue8m0"``) as the exact powers of two."""
        if t.dtype == _E8M0 or (t.dtype == torch.uint8 and _scale_fmt(self.config) == "ue8m0"):
            return scale_values(t, torch.float32)
        if not t.dtype.is_floating_point or t.dtype == FP8:
            raise CheckpointError(f"{e.file}: tensor {e.key} is {t.dtype}; a block scale is float32 / bfloat16, or "
                                  "ue8m0 (float8_e8m0fnu, or uint8 with quantization_config.scale_fmt 'ue8m0')")
        return t.float()

    def _place_dequantized(self, owner: str, attr: str, e: _Entry, t: Tensor) -> None:
        """fp8 weight of a module without an fp8 form: dequantized once both it and its scale arrived."""
        part = self.pending.setdefault(owner, {})
        part[attr] = (t, e)
        if len(part) < 2:
            return
        (w, we), (s, se) = part.pop("weight"), part.pop("weight" + SCALE_SUFFIX)
        del self.pending[owner]
        module = self.hf.get_submodule(owner)
        _check_shape(we, w, module.weight.shape)
        if w.dtype != FP8:
            raise CheckpointError(f"{we.file}: tensor {we.key} has a block scale ({se.key}) but is {w.dtype}, not "
                                  "float8_e4m3fn")
        s = self._block_scale(se, s)
        _check_shape(se, s, (-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)))
        dtype = torch.float32 if any(p in we.name for p in self.fp32) else self.dtype
        module.weight = nn.Parameter(dequantize(w, s, torch.float32).to(device=self.device, dtype=dtype),
                                     requires_grad=False)
        log.info("%s: fp8 weight dequantized to %s at load (%s has no fp8 form here)", we.key, dtype, owner)

    def _place_expert(self, m, e: _Entry, t: Tensor) -> None:
        """One expert's projection into the stacked tensors of its experts module."""
        experts = self.hf.get_submodule(m["module"])
        j, proj, name = int(m["index"]), m["proj"], m["name"]
        kind = "weight" if name == "weight" else "scale"
        if j >= self.total:
            raise CheckpointError(f"{e.file}: tensor {e.key}: expert {j} out of range (the model has "
                                  f"{self.total} routed experts)")
        local = j - self.keep[0]  # its row in this process's stacked tensors
        if isinstance(experts, FP4Experts):  # packed bytes copied as they are, never dequantized
            place_fp4_expert(experts, replace(parse_expert_key(e.name), index=local), e.key, t, e.file,
                             device=self.device)
            self.filled.add((m["module"], j, proj, kind))
            return
        if t.dtype in (torch.int8, torch.uint8) and kind == "weight":
            raise CheckpointError(f"{e.file}: tensor {e.key} is {t.dtype}, packed fp4 bytes, but config.json says "
                                  "expert_dtype 'fp8': set it to 'fp4' (or remove it) for DeepSeek-V4's fp4 experts")
        if isinstance(experts, FP8Experts):
            param, rows = proj + (SCALE_SUFFIX if kind == "scale" else ""), slice(None)
            if kind == "scale":
                t = self._block_scale(e, t)
        else:
            if kind == "scale":
                raise CheckpointError(f"{e.file}: tensor {e.key} scales an expert of an unquantized experts module")
            param = "down_proj" if proj == "down_proj" else "gate_up_proj"
            half = experts.gate_up_proj.shape[1] // 2
            rows = {"gate_proj": slice(0, half), "up_proj": slice(half, 2 * half)}.get(proj, slice(None))
        stacked = getattr(experts, param)
        if stacked.is_meta:
            dtype = stacked.dtype if stacked.dtype == FP8 or kind == "scale" else self.dtype
            stacked = nn.Parameter(torch.empty(stacked.shape, dtype=dtype, device=self.device), requires_grad=False)
            setattr(experts, param, stacked)
        _check_shape(e, t, stacked[local, rows].shape)
        _check_fp8(e, t, stacked)
        with torch.no_grad():
            stacked[local, rows].copy_(t.to(stacked.dtype))
        self.filled.add((m["module"], j, proj, kind))

    def check_complete(self) -> None:
        """Every parameter and buffer has real values; else a CheckpointError listing what is missing."""
        tensors = list(self.hf.named_parameters()) + list(self.hf.named_buffers())
        missing = [n for n, t in tensors if t.is_meta and not n.rpartition(".")[0].endswith(".experts")]
        missing += [f"{owner}.{k}" for owner, part in self.pending.items()
                    for k in ("weight", "weight" + SCALE_SUFFIX) if k not in part]
        for name, experts in self.hf.named_modules():
            if not name.endswith(".experts") or not hasattr(experts, "down_proj"):
                continue
            quantized = isinstance(experts, (FP8Experts, FP4Experts))
            kinds = ("weight", "scale") if quantized else ("weight",)
            first = self.keep[0]
            missing += [f"{name}.{j}.{p}.{'weight' if k == 'weight' else 'weight' + SCALE_SUFFIX}"
                        for j in range(first, first + experts.down_proj.shape[0])
                        for p in ("gate_proj", "up_proj", "down_proj") for k in kinds
                        if (name, j, p, k) not in self.filled]
        if missing:
            listed = "; ".join(missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise CheckpointError(f"{self.index.root}: {len(missing)} tensors missing from the checkpoint "
                                  f"(transformers' names; DeepSeek's spelling is accepted too, e.g. "
                                  f"layers.0.attn.wq_a.weight): {listed}{more}")


def _scale_fmt(config) -> str | None:
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return (qc or {}).get("scale_fmt")


def _check_shape(e: _Entry, t: Tensor, expected) -> None:
    if tuple(t.shape) != tuple(expected):
        raise CheckpointError(f"{e.file}: tensor {e.key} ({e.name}) has shape {list(t.shape)}, the model built "
                              f"from config.json expects {list(expected)}")


def _check_fp8(e: _Entry, t: Tensor, target: Tensor) -> None:
    """fp8 tensors go only where the model holds fp8 (and fp8 slots take only fp8: no silent cast)."""
    if (t.dtype == FP8) != (target.dtype == FP8):
        why = "has a block scale" if target.dtype == FP8 else "has no block scale in the checkpoint"
        raise CheckpointError(f"{e.file}: tensor {e.key} is {t.dtype}, but the model expects {target.dtype} "
                              f"({e.name}: the weight {why})")
