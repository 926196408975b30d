"""Shared pytest setup: the ``cuda`` marker skips without a GPU; hypothesis runs the "ci" profile;
without a GPU, Triton kernels run in Triton's interpreter.

``HYPOTHESIS_PROFILE=dev`` runs many more examples (for a local bug hunt). ``TRITON_INTERPRET`` set
by the caller is kept (``0`` runs the ``sm90_compile`` tests, which need Triton's compiler).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

# Set before any test module imports a kernel: @triton.jit reads it when a kernel is defined. On CPU the
# interpreter runs the Triton tests on CPU tensors (tests/ops/triton/test_triton_interpret*.py, ...).
if ("TRITON_INTERPRET" not in os.environ and importlib.util.find_spec("triton") is not None
        and not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"
from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

# Hypothesis keeps constants and failure patches in a home dir; keep it out of the checkout.
if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "mla_compile-hypothesis"))

# database=None: no .hypothesis/ folder written into the checkout; deadline=None: the first call of
# an op pays for dispatch setup and would trip hypothesis' per-example timer.
settings.register_profile("ci", deadline=None, max_examples=25, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=500, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """A clean Dynamo state and counters around a test (compile tests count graphs, breaks, recompiles)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
