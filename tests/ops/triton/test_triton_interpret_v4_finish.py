"""The FlashMLA V4 adapter's boundary kernels (``ops/triton/v4_finish.py``) under Triton's CPU interpreter: the
index lists against the torch path; the LSE merge of two partial results, the sink applied once, rows live in
neither part, NaN / inf where a part is not live, strided inputs and output views, the rope back-rotation; against
the adapter's torch path and, end to end through a fake ``flash_mla``, against the float64 reference of the paper's
equations.

Run with ``TRITON_INTERPRET=1`` (tests/conftest.py sets it without a GPU); skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile.ops.adapters import flashmla_v4 as fv4

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs TRITON_INTERPRET=1 and an importable triton")

NAN, INF = float("nan"), float("inf")


def _parts(seed, T, h, D, n_parts, width=None):
    """Partial results as FlashMLA leaves them: bf16 slices ``[:, :h]`` of a wider output, LSE slices of a
    ``[T, width]`` tensor, NaN / inf in rows where the part is not live."""
    g = torch.Generator().manual_seed(seed)
    width = width or h + 3
    parts = []
    lives = [torch.tensor(x[:T], dtype=torch.bool) for x in ([1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 1, 0])]
    for i in range(n_parts):
        o = torch.randn(T, width, D, generator=g).to(torch.bfloat16)
        lse = torch.randn(T, width, generator=g) * 3
        live = lives[i]
        o[~live] = NAN
        lse[~live] = INF if i == 0 else NAN
        parts.append((o[:, :h], lse[:, :h], live))
    return parts


@pytest.mark.parametrize("n_parts,sink_applied", [(2, False), (1, False), (1, True)])
@pytest.mark.parametrize("D,rope", [(512, 64), (48, 16)])
def test_finish_kernel_matches_the_torch_path(n_parts, sink_applied, D, rope):
    from mla_compile.ops.triton.v4_finish import v4_finish_triton

    T, h = 6, 5
    parts = _parts(D + n_parts, T, h, D, n_parts)
    g = torch.Generator().manual_seed(1)
    sinks = torch.randn(h, generator=g)
    sinks[0] = 30.0
    sinks[1] = -INF
    pos = torch.tensor([0, 7, 100, 3, 65535, 12], dtype=torch.int32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    big_out = torch.full((T, h + 4, D), NAN, dtype=torch.bfloat16)
    big_lse = torch.full((T, h + 4), NAN)
    v4_finish_triton(parts, sinks, sink_applied, pos, inv_freq, big_out[:, 2:2 + h], big_lse[:, 2:2 + h])
    want_out = torch.empty(T, h, D, dtype=torch.bfloat16)
    want_lse = torch.empty(T, h)
    fv4.finish(parts, sinks, sink_applied, pos, inv_freq, want_out, want_lse)  # CPU: the torch path
    got_out, got_lse = big_out[:, 2:2 + h], big_lse[:, 2:2 + h]
    torch.testing.assert_close(got_out.float(), want_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    assert big_out[:, :2].isnan().all() and big_out[:, 2 + h:].isnan().all(), "only the view is written"
    dead = ~torch.stack([p[2] for p in parts]).any(0)
    assert dead.any() and (got_out[dead] == 0).all() and torch.isneginf(got_lse[dead]).all()
    assert not got_out.isnan().any() and not got_lse.isnan().any()


@pytest.mark.parametrize("T,la,lb,dtypes", [(5, 8, 0, (torch.int32, None)), (3, 130, 0, (torch.int64, None)),
                                             (4, 0, 0, (torch.int32, None)), (6, 128, 512, (torch.int32, torch.int64)),
                                             (2, 7, 20, (torch.int64, torch.int32)), (0, 4, 4, (torch.int32,) * 2)])
def test_index_kernel_matches_the_torch_path(T, la, lb, dtypes):
    """``sparse_indices_triton`` against the adapter's torch ``sparse_indices`` (lists side by side concatenated):
    slots out of range either way, rows without a valid slot, lists of 0 / 130 / 640 slots, NaN-free -1 padding,
    whatever the outputs held before."""
    from mla_compile.ops.triton.v4_finish import sparse_indices_triton
    from tests.poison import poisoned_empty

    g = torch.Generator().manual_seed(T * 1000 + la + lb)
    n_rows = 50
    a = torch.randint(-3, n_rows + 4, (T, la), generator=g).to(dtypes[0])
    b = None if dtypes[1] is None else torch.randint(-3, n_rows + 4, (T, lb), generator=g).to(dtypes[1])
    if T > 1:
        a[1] = -1  # a row with no valid slot (when b has none there either)
        if b is not None:
            b[1] = n_rows
    want = fv4.sparse_indices(a, n_rows, b)
    with poisoned_empty():
        got = sparse_indices_triton(a, n_rows, b, fv4.index_width(la + (0 if b is None else lb)))
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if T > 1:
        assert not got[2][1] and got[1][1] == 0


def test_adapter_with_the_kernel_matches_the_reference(monkeypatch):
    """The whole adapter with its CUDA boundaries (both kernels) against the float64 reference, through a fake
    ``flash_mla`` (``tests/ops/adapters/conftest.py``): 130 heads (two groups, one padded), two caches, one cache
    with both lists side by side, a sliding layer's one list."""
    import sys

    from mla_compile.ops.triton.v4_finish import sparse_indices_triton, v4_finish_triton
    from tests.ops.adapters.conftest import Calls, make_flash_mla
    from tests.ops.adapters.test_flashmla_v4_contract import SCALE, _case, _check

    monkeypatch.setitem(sys.modules, "flash_mla", make_flash_mla(Calls()))
    monkeypatch.setattr(fv4, "finish", v4_finish_triton)
    monkeypatch.setattr(fv4, "sparse_indices", lambda slots, n_rows, more=None: sparse_indices_triton(
        slots, n_rows, more, fv4.index_width(slots.shape[1] + (0 if more is None else more.shape[1]))))
    for args in (_case(21, 130), _case(22, 4, same_cache=True)):
        out, lse = fv4.flashmla_v4_attention_core(*args, SCALE)
        _check(out, lse, args)
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(21, 130)
    out, lse = fv4.flashmla_v4_attention_core(q, kv, ws, kv, cs[:, :0], sinks, pos, inv_freq, SCALE)
    _check(out, lse, (q, kv, ws, kv, cs[:, :0], sinks, pos, inv_freq))
