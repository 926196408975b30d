"""``mla::decode_absorb_out``'s contract on CPU: the reference against float64 attention and up-projection loops,
opcheck and the fake, errors naming the argument, "auto" before the kernels are GPU-tested, and the attention's
static choice of it. The kernels: tests/ops/triton/test_decode_absorb.py."""

from __future__ import annotations

import types

import pytest
import torch

from mla_compile import ops

H, DC, DR, V, BS = 4, 32, 16, 24, 8


def _case(lens, s_q=1, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B = len(lens)
    per = max(1, -(-max(lens) // BS))
    cache = torch.randn(B * per + 2, BS, DC + DR, generator=gen).to(dtype)
    table = torch.randperm(B * per + 2, generator=gen)[:B * per].view(B, per).to(torch.int32)
    q = torch.randn(B, s_q, H, DC + DR, generator=gen).to(dtype)
    kvb = (torch.randn(H, 2 * V, DC, generator=gen) / DC ** 0.5).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32), kvb[:, V:]  # W_UV: a strided view


def _want64(q, cache, table, seq_lens, w_uv, scale):
    """Row by row in float64: query i of a sequence of length L sees its first L - (s_q - 1 - i) positions."""
    B, s_q = q.shape[:2]
    out = torch.zeros(B * s_q, H * V, dtype=torch.float64)
    for b in range(B):
        L = int(seq_lens[b])
        pos = torch.arange(L)
        rows = cache[table[b, pos // BS].long(), pos % BS].double()
        for i in range(s_q):
            n = L - (s_q - 1 - i)
            if n <= 0:
                continue  # no key: 0
            for h in range(H):
                s = rows[:n] @ q[b, i, h].double() * scale
                lat = torch.softmax(s, 0) @ rows[:n, :DC]
                out[b * s_q + i, h * V:(h + 1) * V] = w_uv[h].double() @ lat
    return out


@pytest.mark.parametrize("lens,s_q", [([13, 0, 5], 1), ([9], 2), ([1, 30], 2)])
def test_reference_matches_float64(lens, s_q):
    q, cache, table, seq_lens, w_uv = _case(lens, s_q, seed=len(lens) + s_q)
    got = ops.decode_absorb_out(q, cache, table, seq_lens, 0.2, kv_lora_rank=DC, w_uv=w_uv, backend="reference")
    assert got.shape == (len(lens) * s_q, H * V) and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), _want64(q, cache, table, seq_lens, w_uv, 0.2), atol=1e-5, rtol=1e-5)


def test_opcheck_and_fake():
    import mla_compile.ops.triton.decode_absorb  # noqa: F401

    q, cache, table, seq_lens, w_uv = _case([7, 3], seed=2)
    args = (q, cache, table, seq_lens, 0.3, DC, w_uv)
    for op in (torch.ops.mla.decode_absorb_out_ref, torch.ops.mla.decode_absorb_out_triton,
               torch.ops.mla.decode_absorb_out_gluon):
        torch.library.opcheck(op.default, args)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        out = torch.ops.mla.decode_absorb_out_ref(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                    for a in args))
    assert out.shape == (2, H * V) and out.dtype == q.dtype


@pytest.mark.parametrize("change,match", [
    (dict(w_uv=torch.zeros(H + 1, V, DC)), "w_uv"),
    (dict(w_uv=torch.zeros(H, V, DC - 1)), "w_uv"),
    (dict(w_uv=torch.zeros(H, V, DC, dtype=torch.float64)), "w_uv"),
    (dict(kv_lora_rank=DC + DR + 1), "kv_lora_rank"),
    (dict(q=torch.zeros(2, H, DC + DR)), "q"),
])
def test_errors_name_the_argument(change, match):
    q, cache, table, seq_lens, w_uv = _case([4, 4])
    args = dict(q=q, kv_lora_rank=DC, w_uv=w_uv)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.decode_absorb_out(args.pop("q"), cache, table, seq_lens, 0.1, backend="reference", **args)


def test_auto_takes_the_reference_the_kernels_being_slower():
    """The kernels passed their GPU tests but lost to the two ops apart: "auto" passes over them, saying why."""
    from mla_compile.ops.decode_absorb_out import SLOWER
    from mla_compile.ops.registry import backends_for
    from mla_compile.ops.select import auto_skip

    for dtype in (torch.bfloat16, torch.float16):
        assert ops.resolve("decode_absorb_out", torch.device("cuda"), None, dtype=dtype).name == "reference"
    for name in ("triton", "gluon"):
        spec = backends_for("decode_absorb_out")[name]
        assert spec.gpu_tested and auto_skip(spec) == SLOWER


def test_the_attention_asks_for_it_only_by_name():
    """``MLAAttention._decode_absorb_backend``: None off CUDA and under "auto"; the named backend (a static choice)
    where asked on CUDA half precision (the tensors' device and dtype faked with meta tensors)."""
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.model import patch

    hf = toy.toy_hf_model("v2-lite", seed=1, num_hidden_layers=1)
    asked = patch(hf, backend="decode_absorb_out=gluon").model.layers[0].self_attn
    plain = patch(toy.toy_hf_model("v2-lite", seed=1, num_hidden_layers=1)).model.layers[0].self_attn
    q = torch.empty(2, 1, 4, 8, dtype=torch.bfloat16)
    assert asked._decode_absorb_backend(q, q, None) is None  # CPU
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # CUDA tensors without a GPU: only their device and dtype are read
        qc = torch.empty(2, 1, 4, 8, dtype=torch.bfloat16, device="cuda")
        assert asked._decode_absorb_backend(qc, qc, None) == "gluon"
        planned = types.SimpleNamespace(plan=object())
        assert asked._decode_absorb_backend(qc, qc, planned) is None  # a FlashInfer plan: the decode op takes it
        assert asked._decode_absorb_backend(qc, qc.float(), None) is None  # W_UV of another dtype
        assert plain._decode_absorb_backend(qc, qc, None) is None  # "auto": the reference (the kernels skipped)


def test_auto_folds_only_where_the_layers_decode_is_the_same_kernel(monkeypatch):
    """Once "auto" resolves the op to a kernel (faked here: ``ops.resolve`` answering "gluon"), the attention takes
    it only where its own decode choice for the step is that kernel (the op runs that kernel's decode at every size):
    not beside another decode backend (e.g. FlashMLA at 128 heads), not without the decode's metadata; by name it
    is taken whatever the decode's choice."""
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models import attention
    from mla_compile.models.model import patch

    hf = toy.toy_hf_model("v2-lite", seed=1, num_hidden_layers=1)
    plain = patch(hf).model.layers[0].self_attn
    asked = patch(toy.toy_hf_model("v2-lite", seed=1, num_hidden_layers=1),
                  backend="decode_absorb_out=triton").model.layers[0].self_attn
    monkeypatch.setattr(attention.ops, "resolve", lambda op, device, requested, dtype=None: types.SimpleNamespace(
        name="gluon" if requested in (None, "auto") else requested))
    d = types.SimpleNamespace(plan=None)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qc = torch.empty(2, 1, 4, 8, dtype=torch.bfloat16, device="cuda")
        for layer_decode, want in (("gluon", "gluon"), ("flashmla", None), ("triton", None)):
            monkeypatch.setattr(plain, "_decode_name", lambda dtype, step, n=layer_decode: n)
            assert plain._decode_absorb_backend(qc, qc, d) == want, layer_decode
            monkeypatch.setattr(asked, "_decode_name", lambda dtype, step, n=layer_decode: n)
            assert asked._decode_absorb_backend(qc, qc, d) == "triton", layer_decode  # by name: taken
        assert plain._decode_absorb_backend(qc, qc, None) is None  # no decode metadata to compare with


def test_no_step_schedule_where_the_fused_op_replaces_the_decode(monkeypatch):
    """``MLAAttention.decode_step_schedule``: a layer whose decode would take FlashMLA's step schedule makes none
    when ``mla::decode_absorb_out`` runs in its place (asked by name; the op reads no schedule), and still makes it
    under "auto" (the reference: the fused op not taken). CUDA tensors faked: only device and dtype are read."""
    pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mla_compile.app import toy
    from mla_compile.models import attention
    from mla_compile.models.model import patch

    made = []
    monkeypatch.setattr(attention.ops, "decode_step_schedule",
                        lambda seq_lens, heads, name, query_len=1: made.append(name) or ("schedule",))
    meta = types.SimpleNamespace(decode=types.SimpleNamespace(plan=None, seq_lens=None, query_len=1))
    layers = {requested: patch(toy.toy_hf_model("v2-lite", seed=1, num_hidden_layers=1),
                               backend=requested).model.layers[0].self_attn
              for requested in (None, "decode_absorb_out=gluon")}
    with FakeTensorMode():
        cache = torch.empty(4, 64, 576, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(4, 8, 512, dtype=torch.bfloat16, device="cuda")
        for attn in layers.values():
            monkeypatch.setattr(attn, "kv_cache", cache)
            monkeypatch.setattr(attn, "_w_uk_uv", lambda w=w: (w, w))
            monkeypatch.setattr(attn, "_decode_name", lambda dtype, step: "flashmla")
        assert layers[None].decode_step_schedule(meta) == ("schedule",) and made == ["flashmla"]
        assert layers["decode_absorb_out=gluon"].decode_step_schedule(meta) is None and made == ["flashmla"]
