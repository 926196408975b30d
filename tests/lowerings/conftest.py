"""The lowering tests never measure time: Inductor's benchmarker is replaced by one that returns the costs
the candidates charge (:mod:`tests.lowerings._timings`). The CUDA tests, which check real timings of real
backends on a GPU, keep the real benchmarker."""

from __future__ import annotations

import pytest

from tests.lowerings._timings import timed


@pytest.fixture(autouse=True)
def injected_timings(request, monkeypatch):
    if request.node.get_closest_marker("cuda") is not None:
        yield
        return
    from torch._inductor.runtime.benchmarking import benchmarker

    def benchmark(fn, fn_args=None, fn_kwargs=None, **kwargs):
        return timed(lambda: fn(*(fn_args or ()), **(fn_kwargs or {})))

    def benchmark_cpu(fn, *args, **kwargs):
        return timed(fn)

    def no_gpu_timing(*args, **kwargs):
        raise AssertionError("a CPU lowering test reached GPU timing")

    monkeypatch.setattr(benchmarker, "benchmark", benchmark)
    monkeypatch.setattr(benchmarker, "benchmark_cpu", benchmark_cpu)
    monkeypatch.setattr(benchmarker, "benchmark_gpu", no_gpu_timing)
    yield
