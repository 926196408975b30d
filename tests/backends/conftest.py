"""Fixtures of the selector tests: peer libraries faked as installed, GPU-tested flags, no timings."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

import mla_compile.ops.triton as ops_triton
from mla_compile.backends import SPECS
from mla_compile.ops import timings


@pytest.fixture
def installed_untested(monkeypatch):
    """Every peer library "installed" (empty fake modules) and a CUDA/cuDNN torch build; every peer
    adapter marked gpu_tested=False (as they were before their first H200 run)."""
    for name in ("flash_mla", "flashinfer", "flash_attn"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for specs in SPECS.values():
        for name, spec in specs.items():
            if name not in ("triton", "reference"):
                monkeypatch.setitem(specs, name, dataclasses.replace(spec, gpu_tested=False))
    monkeypatch.setattr(ops_triton, "_AVAILABLE", True)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.delenv("MLA_COMPILE_BACKEND", raising=False)


@pytest.fixture
def everything_installed(installed_untested, monkeypatch):
    """As ``installed_untested``, with every backend marked GPU-tested: the priority as it will act
    once the peer adapters have passed their CUDA tests."""
    for op, specs in SPECS.items():
        for name, spec in specs.items():
            monkeypatch.setitem(specs, name, dataclasses.replace(spec, gpu_tested=True))


@pytest.fixture
def static_order():
    """No timing table: "auto" follows the declared static order everywhere."""
    with timings.using():
        yield
