"""``from_pretrained(dir, parallel=...)`` of fp8 (128 x 128 block e4m3) and fp4-expert (packed e2m1, ue8m0 per 32)
checkpoints on 2 gloo processes: each rank reads only its rows / columns / experts of the codes and of their
scales, keeps them quantized, and its logits equal the single-process load of the same checkpoint (float32,
<= 1e-5) with the same greedy tokens. A split that cuts a quantization block is refused on every rank."""

from types import SimpleNamespace

import pytest
import torch

from tests import parallel_workers as w
from tests.checkpoints import dequantize64, write_checkpoint
from tests.dist_helpers import run_ranks

pytest.importorskip("transformers")
TOL = 1e-5
FP8, F32 = "float8_e4m3fn", "float32"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny checkpoints written once for the module, on demand: ``checkpoints(kind, fmt)`` -> directory."""
    made = {}

    def get(kind, fmt):
        if (kind, fmt) not in made:
            made[kind, fmt] = tmp_path_factory.mktemp(f"{kind}-{fmt}")
            write_checkpoint(made[kind, fmt], kind, fmt, seed=4)
        return made[kind, fmt]
    return get


def _load(root, pconf, dp=False):
    results = run_ranks(w.from_pretrained_sharded, 2, str(root), pconf, dp, timeout=240)
    for r in results:
        assert r["meta_left"] == [] and r["finite"], r["meta_left"]
        assert r["err"] <= TOL, r["err"]
        assert r["same_tokens"]
    return results


def _has(shapes, want):
    for name, shape_dtype in want.items():
        assert shapes[name] == shape_dtype, (name, shapes[name], shape_dtype)


def test_fp8_tp2_splits_heads_mlps_and_experts_with_their_block_scales(checkpoints):
    # toy v3: 4 heads (qk 192, v 128), dense MLP 512 wide, 16 experts and a shared expert 64 wide
    results = _load(checkpoints("v3", "fp8"), dict(tp=2))
    a, m, e = "model.layers.0.self_attn.", "model.layers.0.mlp.", "model.layers.1.mlp."
    for r in results:
        _has(r["shapes"], {
            a + "q_b_proj.weight": ([384, 128], FP8), a + "q_b_proj.weight_scale_inv": ([3, 1], F32),
            a + "o_proj.weight": ([256, 256], FP8), a + "o_proj.weight_scale_inv": ([2, 2], F32),
            a + "kv_b_proj.weight": ([512, 512], F32),  # this rank's 2 heads, dequantized at load
            a + "q_a_proj.weight": ([128, 256], FP8),  # replicated, still fp8
            m + "gate_proj.weight": ([256, 256], FP8), m + "gate_proj.weight_scale_inv": ([2, 2], F32),
            m + "down_proj.weight": ([256, 256], FP8), m + "down_proj.weight_scale_inv": ([2, 2], F32),
            # moe_tp = 2: 32 of each expert's 64 rows, inside one 128-block, whose scale row both ranks keep
            e + "experts.local.gate_proj": ([16, 32, 256], FP8),
            e + "experts.local.gate_proj_scale_inv": ([16, 1, 2], F32),
            e + "experts.local.down_proj": ([16, 256, 32], FP8),
            e + "experts.local.down_proj_scale_inv": ([16, 2, 1], F32),
            e + "shared_experts.up_proj.weight": ([32, 256], FP8),
            e + "shared_experts.up_proj.weight_scale_inv": ([1, 2], F32)})
        assert r["params"] < 0.6 * r["full_params"]
        assert r["expert_params"] < 0.51 * r["full_expert_params"]


def test_fp8_ep2_each_rank_reads_only_its_experts(checkpoints):
    results = _load(checkpoints("v2-lite", "fp8"), dict(tp=2, ep=2))  # v2-lite: q_proj (no q LoRA), 8 experts
    a, e = "model.layers.0.self_attn.", "model.layers.1.mlp.experts.local."
    for r in results:
        _has(r["shapes"], {a + "q_proj.weight": ([384, 256], FP8), a + "q_proj.weight_scale_inv": ([3, 2], F32),
                           e + "gate_proj": ([4, 64, 256], FP8), e + "gate_proj_scale_inv": ([4, 1, 2], F32),
                           e + "down_proj": ([4, 256, 64], FP8), e + "down_proj_scale_inv": ([4, 2, 1], F32)})
        assert r["params"] < 0.6 * r["full_params"]
    # whole experts split: the ranks' expert tensors partition the full ones
    assert sum(r["expert_params"] for r in results) == results[0]["full_expert_params"]


@pytest.mark.parametrize("pconf", [dict(tp=2), dict(tp=2, ep=2)])
def test_fp4_experts_split_by_width_or_by_expert(checkpoints, pconf):
    results = _load(checkpoints("v3", "fp4"), pconf)
    e = "model.layers.1.mlp.experts.local."
    if pconf.get("ep", 1) == 2:  # 8 whole experts: [rows, K/2] codes, [rows, K/32] scales
        want = {e + "gate_proj": ([8, 64, 128], "uint8"), e + "gate_proj_scale_inv": ([8, 64, 8], "uint8"),
                e + "down_proj": ([8, 256, 32], "uint8"), e + "down_proj_scale_inv": ([8, 256, 2], "uint8")}
    else:  # all 16 experts, 32 of the 64 intermediate rows (gate / up) and columns (down) each
        want = {e + "gate_proj": ([16, 32, 128], "uint8"), e + "gate_proj_scale_inv": ([16, 32, 8], "uint8"),
                e + "down_proj": ([16, 256, 16], "uint8"), e + "down_proj_scale_inv": ([16, 256, 1], "uint8")}
    for r in results:
        _has(r["shapes"], want)
    assert sum(r["expert_params"] for r in results) == results[0]["full_expert_params"]


def test_fp8_dp_attention_with_ep_each_group_equals_single_process(checkpoints):
    results = _load(checkpoints("v3", "fp8"), dict(tp=2, dp_attention=2, ep=2), dp=True)
    a = "model.layers.0.self_attn."
    for r in results:  # attention whole on each rank (its own requests), experts split
        _has(r["shapes"], {a + "q_b_proj.weight": ([768, 128], FP8), a + "o_proj.weight": ([256, 512], FP8),
                           a + "o_proj.weight_scale_inv": ([2, 4], F32)})
    assert sum(r["expert_params"] for r in results) == results[0]["full_expert_params"]


def test_a_split_through_a_quantization_block_is_refused_on_every_rank(tmp_path):
    # fp8 dense MLP 320 wide over TP 2: rank 1 would start at row 160, inside block [128, 256), and run past it;
    # fp4 experts 96 wide over MoE TP 2: 48 columns per rank, not whole 32-weight scale groups
    write_checkpoint(tmp_path / "fp8", "v3", "fp8", seed=1, intermediate_size=320)
    write_checkpoint(tmp_path / "fp4", "v3", "fp4", seed=1, moe_intermediate_size=96)
    results = run_ranks(w.from_pretrained_error, 2, [str(tmp_path / "fp8"), str(tmp_path / "fp4")], dict(tp=2),
                        timeout=240)
    for fp8_error, fp4_error in results:  # the same error on both ranks: neither goes on into a collective
        assert fp8_error.startswith("ValueError: model.layers.0.mlp.gate_proj.weight: dim 0 of size 320 split over "
                                    "TP degree 2 gives rank 1 [160, 320)"), fp8_error
        assert "128-wide quantization block" in fp8_error
        assert fp4_error.startswith("ValueError: model.layers.1.mlp.experts.<j>.down_proj.weight: dim 1 of size 96 "
                                    "split over MoE TP degree 2 gives rank 1 [48, 96)"), fp4_error
    assert results[0] == results[1]


def test_block_split_keeps_whole_block_scales_and_checks_every_rank():
    from mla_compile.parallel.shard import block_split

    def group(size, rank):
        return SimpleNamespace(size=size, rank=rank)

    assert block_split("w", 0, 512, group(4, 3), 128) == (slice(384, 512), slice(3, 4))
    assert block_split("w", 0, 64, group(2, 1), 128) == (slice(32, 64), slice(0, 1))  # inside block 0
    assert block_split("w", 1, 300, group(1, 0), 128) == (slice(0, 300), slice(0, 3))  # ends inside a block
    for rank in (0, 1):  # rank 0's shard is aligned, but rank 1's is not: both raise
        with pytest.raises(ValueError, match=r"w: dim 1 of size 300 split over TP degree 2 gives rank 1 \[150, 300\)"):
            block_split("w", 1, 300, group(2, rank), 128)
    with pytest.raises(ValueError, match="does not split"):
        block_split("w", 0, 301, group(2, 0), 128)


def test_kv_b_is_read_dequantized_exactly_for_any_rows(checkpoints):
    from safetensors import safe_open

    from mla_compile.models.checkpoint import read_index
    from mla_compile.models.loader import _SliceSource

    root = checkpoints("v3", "fp8")
    index = read_index(root)
    key = "model.layers.1.self_attn.kv_b_proj.weight"
    source = _SliceSource(index, torch.float64, (), {key.removesuffix(".weight")})
    with safe_open(str(root / index.file_of(key)), framework="pt") as f:
        want = dequantize64(f.get_tensor(key), f.get_tensor(key + "_scale_inv"))
    lazy = source(key)
    assert tuple(lazy.shape) == (1024, 512)
    for rows in (slice(0, 1024), slice(256, 512), slice(100, 300), slice(1000, 1024)):
        got = lazy[rows]
        assert got.dtype == torch.float64  # dequantized in float32 as the single-process load does: 1 rounding
        torch.testing.assert_close(got, want[rows], rtol=2 ** -23, atol=0)
