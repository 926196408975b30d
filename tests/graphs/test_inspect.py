"""inspect_compile: planted graph breaks and recompiles are found with their reasons; the demo model
compiles to two graphs (prefill, decode) with no breaks and no shape recompiles; the report files and
the depyf dump are written, and without depyf the report still works."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from mla_compile.graphs import CompileWatch, inspect_compile, short_reason

LINE_OF_BREAK = None  # set below: the line of the planted graph break


def with_break(x: torch.Tensor) -> torch.Tensor:
    y = x.sin() * 2
    torch._dynamo.graph_break()  # planted
    return y.cos() + 1


LINE_OF_BREAK = with_break.__code__.co_firstlineno + 2


def with_print(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    print("planted print")
    return y * 3


def scaled(x: torch.Tensor, n: int) -> torch.Tensor:
    return x * n + 1


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_planted_graph_break_is_found_with_reason_and_location(tmp_path):
    report = inspect_compile(with_break, lambda f: f(torch.randn(4)), str(tmp_path), backend="aot_eager", dump=False)
    assert report.error is None
    assert report.graph_break_count == 1
    assert report.graph_count == 2  # the part before the break and the resumed part
    (brk,) = report.graph_breaks
    assert "graph_break()" in brk.reason
    assert brk.locations == [f"test_inspect.py:{LINE_OF_BREAK} in with_break"]
    assert report.recompile_count == 0


def test_planted_print_break_is_found():
    report = inspect_compile(with_print, lambda f: f(torch.randn(4)), backend="aot_eager")
    assert report.graph_break_count == 1
    assert "print" in report.graph_breaks[0].detail
    assert report.graph_breaks[0].locations[0].endswith("in with_print")


def test_no_break_no_recompile_for_a_clean_function():
    def run(f):
        for _ in range(3):
            f(torch.randn(4), 2)

    report = inspect_compile(scaled, run, backend="aot_eager", dynamic=False)
    assert (report.graph_count, report.graph_break_count, report.recompile_count) == (1, 0, 0)


def test_planted_recompile_is_counted_with_its_guard():
    def run(f):
        f(torch.randn(4), 2)
        f(torch.randn(4), 3)  # a new int value: the `n == 2` guard fails
        f(torch.randn(4), 2)  # served by the first graph: no recompile

    report = inspect_compile(scaled, run, backend="aot_eager", dynamic=False)
    assert report.recompile_count == 1
    assert report.graph_count == 2
    (rec,) = report.recompiles
    assert rec.function == "scaled" and "n == 2" in rec.reason


def test_fullgraph_turns_a_break_into_a_reported_error():
    report = inspect_compile(with_break, lambda f: f(torch.randn(4)), backend="aot_eager", fullgraph=True)
    assert report.error is not None and "graph_break" in report.error
    assert "ERROR" in report.to_text()


@torch.library.custom_op("mla_inspect_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_custom_ops_found_in_graphs_and_inductor_output_code(tmp_path):
    def f(x):
        return torch.ops.mla_inspect_test.twice(x.sin()) + 1

    report = inspect_compile(f, lambda g: g(torch.randn(8)), str(tmp_path), namespace="mla_inspect_test")
    assert report.ops_in_graphs == ["mla_inspect_test::twice"]
    assert report.ops_in_output_code == ["mla_inspect_test::twice"]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["graph_count"] == 1 and data["graph_break_count"] == 0 and data["recompile_count"] == 0
    assert "mla_inspect_test::twice" in (tmp_path / "report.txt").read_text()
    if report.dump_dir is not None:  # depyf installed: dumped graphs and output code
        assert any(n.startswith("__compiled_fn_") for n in report.dump_files)
        assert any(".kernel_" in n for n in report.dump_files)


def test_report_without_depyf(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "depyf", None)  # `import depyf` now raises ImportError
    report = inspect_compile(with_break, lambda f: f(torch.randn(4)), str(tmp_path))
    assert report.dump_dir is None and "depyf is not installed" in report.dump_skipped
    assert report.graph_break_count == 1
    assert report.output_code_files and all((tmp_path / n).exists() for n in report.output_code_files)
    assert "depyf dump skipped" in report.to_text()


def test_compile_watch_counts_plain_torch_compile():
    f = torch.compile(with_break, backend="aot_eager")
    with CompileWatch() as watch:
        f(torch.randn(4))
        f(torch.randn(4))
    assert watch.graph_count == 2 and watch.graph_break_count == 1 and watch.recompiles == []
    assert watch.compile_time_s > 0


def test_short_reason_keeps_head_and_explanation():
    text = "Failed to trace builtin operator\n  Explanation: Dynamo does not know print\n  Hint: avoid it\n"
    assert short_reason(text) == "Failed to trace builtin operator (Dynamo does not know print)"
    assert short_reason("") == "unknown reason"


@pytest.mark.slow
def test_demo_model_two_graphs_no_breaks_no_shape_recompiles(tmp_path):
    from mla_compile.app.demo import build_demo
    from mla_compile.serving.generate import greedy_generate

    setup = build_demo("v2-lite", layers=1, num_prompts=3, max_new_tokens=3)

    def run(compiled):
        for batch in (2, 3):
            greedy_generate(compiled, setup.prompts[:batch], 3, block_size=setup.block_size,
                            num_blocks=setup.num_blocks)

    report = inspect_compile(setup.model, run, str(tmp_path))
    assert report.error is None, report.error
    assert report.graph_count == 2, report.to_text()  # prefill and decode
    assert report.graph_break_count == 0, report.to_text()
    # The one recompile is the step-kind split (decode steps take their own graph), never a shape.
    assert [r.reason.split(": ", 1)[1].split(" #")[0] for r in report.recompiles] == ["meta.decode is None"]
    for op in ("mla::write_latent_cache", "mla::decode", "mla::prefill"):
        assert any(o.startswith(op) for o in report.ops_in_graphs), report.ops_in_graphs
        assert any(o.startswith(op) for o in report.ops_in_output_code), report.ops_in_output_code
    per_graph = sorted(tuple(g.custom_ops) for g in report.graphs)
    assert all(any(o.startswith("mla::write_latent_cache") for o in ops) for ops in per_graph)
    assert os.path.exists(tmp_path / "report.json") and os.path.exists(tmp_path / "report.txt")
