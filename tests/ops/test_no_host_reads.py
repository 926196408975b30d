"""The reference ops that may run inside a captured CUDA graph (the V3.2 indexer ops have no other
backend; cache writes and decode are the fallback) never read a device value on the host: checked on
CPU with a dispatch mode that fails on ``.item()``-style reads (``aten._local_scalar_dense``) and on
data-dependent shapes (``nonzero``), with the CPU-only data validation switched off. The ops' Python
bodies are called directly (``CustomOpDef._init_fn``): a dispatch mode does not see inside a custom op."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mla_compile.ops  # noqa: F401  (registers the ops)

HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
              torch.ops.aten.item.default}


class NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError(f"host read of device data: {func}")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_data_checks(monkeypatch):
    """CPU tensors always get data validation (it reads values on purpose); turn it off everywhere."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("mla_compile.ops") and hasattr(mod, "data_checks_enabled"):
            monkeypatch.setattr(mod, "data_checks_enabled", lambda t: False)


def body(module: str, name: str):
    """The Python body of the custom op ``name`` defined in ``mla_compile.ops.<module>``."""
    return getattr(importlib.import_module(f"mla_compile.ops.{module}"), name)._init_fn


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    nb, bs, B = 6, 4, 3
    table = torch.randperm(nb, generator=gen)[:B * 2].view(B, 2).int()
    lens = torch.tensor([5, 0, 8], dtype=torch.int32)
    return gen, nb, bs, B, table, lens


def test_planted_host_read_is_caught():
    with pytest.raises(AssertionError, match="host read"):
        with NoHostReads():
            torch.tensor([1, 2])[torch.tensor(0)].tolist()


def test_cache_writes_and_decode_references_read_nothing_on_the_host(no_data_checks):
    gen, nb, bs, B, table, lens = _case()
    cache = torch.randn(nb, bs, 576, generator=gen)
    slots = torch.tensor([-1, 9, 3, -1], dtype=torch.int64)
    q = torch.randn(B, 1, 2, 576, generator=gen)
    with NoHostReads():
        write = body("cache_write", "write_latent_cache_ref")
        write(torch.randn(4, 512, generator=gen), torch.randn(4, 64, generator=gen), slots, cache)
        write(torch.randn(2, 512, generator=gen), torch.randn(2, 64, generator=gen), torch.tensor([-1, -1]),
              cache)  # all padding
        body("decode", "decode_ref")(q, cache, table, lens, 0.1, 512)


def test_v32_indexer_references_read_nothing_on_the_host(no_data_checks):
    gen, nb, bs, B, table, lens = _case(1)
    k_cache = torch.randn(nb, bs, 16, generator=gen)
    T = 4
    with NoHostReads():
        body("sparse_index", "write_index_cache_ref")(torch.randn(T, 16, generator=gen), torch.tensor([2, -1, 7, 0]),
                                                      k_cache)
        idx = body("sparse_index", "lightning_index_ref")(
            torch.randn(T, 2, 16, generator=gen), torch.randn(T, 2, generator=gen), k_cache, table, lens,
            torch.tensor([0, 2, -1, 2]), torch.tensor([4, 7, 0, 3]), 3)
        body("sparse_decode", "sparse_decode_ref")(torch.randn(T, 1, 2, 576, generator=gen),
                                                   torch.randn(nb, bs, 576, generator=gen), idx.view(T, 1, 3), 0.1, 512)


def test_fp8_index_cache_write_and_read_read_nothing_on_the_host(no_data_checks):
    """The fp8 index-key path (quantize in the write, dequantize in lightning_index) stays sync-free."""
    gen, nb, bs, B, table, lens = _case(2)
    k_cache = torch.full((nb, bs, 16 + 4), 0xFF, dtype=torch.uint8)
    T = 4
    with NoHostReads():
        write = body("sparse_index", "write_index_cache_ref")
        write(torch.randn(T, 16, generator=gen), torch.tensor([2, -1, 7, 0]), k_cache)
        write(torch.randn(2, 16, generator=gen), torch.tensor([-1, -1]), k_cache)  # all padding
        body("sparse_index", "lightning_index_ref")(
            torch.randn(T, 2, 16, generator=gen), torch.randn(T, 2, generator=gen), k_cache, table, lens,
            torch.tensor([0, 2, -1, 2]), torch.tensor([4, 7, 0, 3]), 3)
