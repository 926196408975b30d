"""Warm start (:mod:`mla_compile.graphs.warm_start`): a second process over the compile caches of a first one
loads every compiled graph instead of compiling it (no FX-graph / AOTAutograd cache miss; with torch's Dynamo
cache, no tracing either) and its tokens still equal eager's; a process whose steps fail the loaded guards
compiles them as usual; the saved artifacts fill an empty cache in another process."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_compile.graphs import warm_start

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_regional_compile.py"
CHILD = ROOT / "tests" / "warm_start_child.py"


def _env(cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    return env


def _run(cmd: list[str], cache: Path) -> dict:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _toy(cache: Path, layers: int, start: str) -> dict:
    """The benchmark's child: a regional-compiled v2-lite toy of ``layers`` layers, compiled with Inductor, a
    3-prompt prefill and 3 decode steps, compared with eager."""
    return _run([sys.executable, str(BENCH), "--device", "cpu", "--one", f"v2-lite,{layers},1", "--start", start],
                cache)


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    cache = tmp_path_factory.mktemp("warm_start_cache")
    return cache, _toy(cache, 1, "cold:auto")


@pytest.mark.slow
def test_second_process_loads_every_graph_and_matches_eager(cold):
    cache, first = cold
    b = first["breakdown"]
    assert first["tokens_equal"] and first["dynamo_cache"] == warm_start.dynamo_cache_status()[0]
    assert b["fx_cache_miss"] >= 2 and b["fx_cache_hit"] == 0 and b["graphs_traced"] >= 2  # prefill and decode
    second = _toy(cache, 1, "warm:auto")
    w = second["breakdown"]
    assert second["tokens_equal"]
    assert second["dynamo_cache"] == warm_start.dynamo_cache_status()[0]
    assert w["fx_cache_miss"] == 0 and w["aot_cache_miss"] == 0
    if second["dynamo_cache"]:  # torch 2.11: the saved bytecode, guards and graphs; nothing traced
        assert w["dynamo_cache_hit"] == 1 and w["graphs_traced"] == 0 and w["dynamo"] == 0.0
    else:  # traced again, every graph from the FX-graph cache
        assert w["fx_cache_hit"] == b["fx_cache_miss"] and w["graphs_traced"] == b["graphs_traced"]


@pytest.mark.slow
def test_steps_that_fail_the_loaded_guards_compile_again(cold):
    """Another depth over the same cache: the loaded Dynamo entry's guards fail (where the Dynamo cache is on) and
    the process traces and compiles its own graphs, tokens equal to eager."""
    cache, first = cold
    other = _toy(cache, 2, "warm:auto")
    w = other["breakdown"]
    assert other["tokens_equal"]
    assert w["graphs_traced"] >= 2 and w["fx_cache_miss"] >= 2
    if first["dynamo_cache"]:
        assert w["dynamo_cache_hit"] == 1


@pytest.mark.slow
def test_saved_artifacts_fill_an_empty_cache_in_another_process(tmp_path):
    saved = tmp_path / "artifacts.bin"
    first = _run([sys.executable, str(CHILD), "--seed", "3", "--save", str(saved)], tmp_path / "a")
    assert first["breakdown"]["fx_cache_miss"] >= 1 and saved.stat().st_size > 0
    second = _run([sys.executable, str(CHILD), "--seed", "3", "--load", str(saved)], tmp_path / "b")  # empty cache
    w = second["breakdown"]
    assert second["loaded"] is True
    assert w["fx_cache_miss"] == 0 and w["aot_cache_miss"] == 0
    assert w["fx_cache_hit"] >= 1 or w["dynamo_cache_hit"] == 1
    x, wt = (torch.tensor(second[k], dtype=torch.float64) for k in ("x", "w"))
    want = torch.tanh(x @ wt) * 2.0 + x.sin()  # float64 reference of the child's function
    torch.testing.assert_close(torch.tensor(second["out"], dtype=torch.float64), want, atol=1e-5, rtol=1e-5)
    assert second["out"] == first["out"]


def test_enable_sets_torch_config_and_defaults_to_the_supported_versions():
    config = torch._dynamo.config
    before = config.caching_precompile
    try:
        usable, why = warm_start.dynamo_cache_status()
        assert isinstance(why, str) and why
        assert warm_start.enable_warm_start() is usable and config.caching_precompile is usable
        assert warm_start.enable_warm_start(False) is False and config.caching_precompile is False
        assert warm_start.enable_warm_start(True) is True and config.caching_precompile is True
        from torch._dynamo.source import DefaultsSource, LocalSource  # a guard source torch 2.11 did not unpickle
        src = DefaultsSource(LocalSource("fn"), 1)
        back = pickle.loads(pickle.dumps(src))
        assert back == src and back.field == src.field == "__defaults__"
        seen: list[str] = []  # the per-guard "dropped" warnings are filtered, other warnings pass
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: seen.append(record.getMessage())
        log = logging.getLogger("torch._dynamo.guards")
        log.addHandler(handler)
        try:
            log.warning("%s guard on %s is dropped with caching_precompile=True.", "ID_MATCH", "L['self']")
            log.warning("another guard warning")
        finally:
            log.removeHandler(handler)
        assert seen == ["another guard warning"]
    finally:
        config.caching_precompile = before


def test_load_of_a_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        warm_start.load_warm_start(tmp_path / "missing.bin")


def test_breakdown_counts_this_process():
    b = warm_start.compile_breakdown()
    assert set(b) >= {"compile", "dynamo", "guards", "aot_inductor", "load", "fx_cache_hit", "fx_cache_miss",
                      "aot_cache_hit", "aot_cache_miss", "dynamo_cache_hit", "dynamo_cache_miss", "graphs_traced"}
    assert all(isinstance(v, (int, float)) and v >= 0 for v in b.values())


def test_forced_dynamo_cache_fails_loudly_when_torch_internals_moved(monkeypatch):
    config = torch._dynamo.config
    before = config.caching_precompile

    def moved():
        raise ImportError("no _unique_id_counter")

    monkeypatch.setattr(warm_start, "_fix_global_names", moved)
    try:
        config.caching_precompile = False
        with pytest.raises(NotImplementedError, match="dynamo=True"):
            warm_start.enable_warm_start(True)
        assert config.caching_precompile is False
        if warm_start.dynamo_cache_status()[0]:  # the default choice warns and leaves it off instead
            with pytest.warns(UserWarning, match="left off"):
                assert warm_start.enable_warm_start() is False
            assert config.caching_precompile is False
    finally:
        config.caching_precompile = before


def test_plain_linear_check_installs_no_class_guard_on_a_module_type(monkeypatch):
    """``attention.plain_linears`` (the skinny-linear choice of the CUDA step) compiled: its answer for plain, biased,
    subclassed and other-dtype linears, and no class guard on ``type(<module>)``, which torch 2.11's Dynamo cache
    cannot save (``type(m) is nn.Linear`` made four a layer and failed the GPU step's warm start)."""
    from torch import nn
    from torch._dynamo.guards import GuardBuilder

    from mla_compile.models.attention import plain_linears

    names = []
    original = GuardBuilder.CLASS_MATCH

    def CLASS_MATCH(self, guard):  # the name the Dynamo cache's serializer checks
        names.append(guard.name)
        return original(self, guard)

    monkeypatch.setattr(GuardBuilder, "CLASS_MATCH", CLASS_MATCH)

    class Sub(nn.Linear):
        pass

    class Two(nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x):
            return x + 1 if plain_linears((self.a, self.b), torch.bfloat16) else x - 1

    x = torch.randn(3)
    cases = {(nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False)): True,
             (nn.Linear(4, 4, bias=False), nn.Linear(4, 2)): False,
             (nn.Linear(4, 4, bias=False), Sub(4, 2, bias=False)): False,
             (nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False).float()): False}
    for (a, b), want in cases.items():
        a.bfloat16()
        if want or b.bias is not None or isinstance(b, Sub):
            b.bfloat16()
        torch._dynamo.reset()
        got = torch.compile(Two(a, b), backend="eager", fullgraph=True)(x)
        assert torch.equal(got, x + 1 if want else x - 1), (type(b).__name__, b.bias is None, b.weight.dtype)
    assert names and not [n for n in names if n.startswith("type(")], names


class _Typed(torch.nn.Module):
    """A module whose forward tests its linear's exact type (module level: the Dynamo cache refuses local classes)."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.q(x) * 2 if type(self.q) is torch.nn.Linear else x


def test_a_step_with_an_unsaveable_guard_compiles_with_the_dynamo_cache_on():
    """A step whose guards the Dynamo cache cannot save (``type(module) is nn.Linear``: a class guard on a module's
    type) compiles and runs with the cache on, left out of the cache (torch 2.11-2.13 failed such a compile with an
    AssertionError on the entry's missing guards)."""
    config = torch._dynamo.config
    before = config.caching_precompile  # restored by assignment (monkeypatch's undo deletes config entries)
    model = _Typed()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    try:
        assert warm_start.enable_warm_start(True) is True
        got = torch.compile(model, fullgraph=True)(x)
    finally:
        config.caching_precompile = before
        torch._dynamo.reset()
    torch.testing.assert_close(got, model.q(x) * 2)
