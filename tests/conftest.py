"""Shared pytest setup: the ``cuda`` marker skips without a GPU; hypothesis runs the "ci" profile;
without a GPU, Triton kernels run in Triton's interpreter; in CI a skipped test that no GPU run selects fails;
CPU ops use one thread (``OMP_NUM_THREADS=1`` unless the caller set it); Inductor trusts the CPU's vector ISAs
without probe builds (``TORCHINDUCTOR_VEC_ISA_OK=1`` unless set); the ``sm_90`` compile checks' children start when
collection ends (under pytest-xdist, in the controller).

``HYPOTHESIS_PROFILE=dev`` runs many more examples (for a local bug hunt). ``TRITON_INTERPRET`` set
by the caller is kept (``0`` runs the ``sm90_compile`` tests, which need Triton's compiler).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

# One intra-op thread on CPU, here and in the processes tests spawn (set before torch is imported: the gloo
# workers inherit the environment). The tests' tensors are tiny: a second thread only adds synchronization, and
# on a loaded machine (CI neighbours, parallel jobs) it makes small ops orders of magnitude slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's CPU backend takes the vector ISAs that /proc/cpuinfo lists without first compiling and loading a probe
# library for each (read when torch._inductor.config is imported, so set here for the workers and the processes
# tests spawn). Every process with an empty Inductor cache (the warm-start, split-plan and benchmark children) paid
# ~13 s of g++ for those probes, every other one ~2 s of dlopen child processes; the ISA picked is the same here.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.torch_state import pin_device_constructors  # noqa: E402

pin_device_constructors()  # before any test can monkeypatch torch.empty (see its docstring)

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
    # the sm_90 children's test waits for them: last, so the suite runs beside them instead of a worker idling
    items.sort(key=lambda item: item.name == SM90_CHILDREN)  # stable: every other test keeps its place
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


SM90_CHILDREN = "test_sm90_compile_tests_pass_without_the_interpreter"  # its children start when collection ends
_SM90_MODULE: list = []  # under pytest-xdist, the controller's copy of that test's module once it started them


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under pytest-xdist the controller starts them (below), once for the run
    for item in session.items:
        if item.name == SM90_CHILDREN:
            item.module.start_children()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """pytest-xdist's controller: the first worker that collected the sm_90 children's test has it start them,
    into the run's folder (``run_folder``: every worker finds it by the run's id)."""
    if _SM90_MODULE or not any(i.endswith("::" + SM90_CHILDREN) for i in ids):
        return
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "ops", "triton", "test_sm90_compile_subprocess.py")
    spec = importlib.util.spec_from_file_location("_sm90_children", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _SM90_MODULE.append(module)
    module.start_children(module.run_folder(node.workerinput["testrunuid"]))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for module in _SM90_MODULE:
        module.stop_children()
    for item in session.items:
        if item.name == SM90_CHILDREN:
            item.module.stop_children()


# The GPU runs select -m cuda and -m sm90_compile; CI (no GPU) runs the rest. A skip of any other test in
# CI means that test runs nowhere, so CI (CI=true) reports it as a failure.
RUN_ELSEWHERE = ("cuda", "sm90_compile")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    rep = outcome.get_result()
    if not (rep.skipped and os.environ.get("CI") == "true" and not torch.cuda.is_available()):
        return
    if hasattr(rep, "wasxfail") or any(item.get_closest_marker(m) for m in RUN_ELSEWHERE):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    rep.outcome = "failed"
    rep.longrepr = (f"skipped in CI but not marked {' or '.join(RUN_ELSEWHERE)}, so no run selects it: {reason}. "
                    f"Make it run here (install what it needs in the test extra) or mark it for a GPU run.")


@pytest.fixture
def fresh_dynamo():
    """A clean Dynamo state and counters around a test (compile tests count graphs, breaks, recompiles)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
