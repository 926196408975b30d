"""CPU checks of ``benchmarks/bench_backends.py``: the (op, backend, shape) grid covers every declared
backend of the ranked ops, every shape falls in a timing class, and ``--check`` validates timing files."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mla_compile.ops import timings
from mla_compile.ops.registry import priority

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_backends", ROOT / "benchmarks" / "bench_backends.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_backends"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_backends", None)


def test_the_grid_covers_every_backend_of_every_ranked_op(bench, capsys):
    pairs = bench.grid()
    for op in ("decode", "decode_fp8", "sparse_decode", "prefill", "merge", "v4_attention"):
        assert {n for s, n in pairs if s.op == op} == set(priority(op)) - {"autotune"}, op
    for s in bench.GRID:
        key = s.key()
        assert all(key[k] in timings.bounds(k, s.op) for k in ("heads", "batch", "context"))
    assert bench.main(["--dry-run"]) == 0
    assert f"{len(pairs)} (shape, backend) pairs over {len(bench.GRID)} shapes" in capsys.readouterr().out


def test_check_accepts_the_shipped_file_and_rejects_a_broken_one(bench, tmp_path, capsys):
    [shipped] = sorted(timings.FOLDER.glob("*.json"))
    assert bench.main(["--check", str(shipped)]) == 0
    bad = json.loads(shipped.read_text())
    bad["rows"][0]["heads"] = 17
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert bench.main(["--check", str(path)]) == 1
    assert "row 0: heads 17 is not a bucket bound" in capsys.readouterr().out


def test_the_selector_accepts_the_facts_of_every_grid_shape(bench):
    """Every (shape, backend) pair of the grid reaches the selector: it either serves the shape or says why not
    (a ValueError), on an assumed H200, so a GPU run never skips the whole grid on a broken call."""
    from mla_compile.ops.select import select

    served = 0
    for s, name in bench.grid():
        try:
            select(s.op, bench.facts(s, planned=True, cap=(9, 0)), requested=name)
            served += 1
        except ValueError:
            pass
    assert served > 0


def test_v4_attention_shapes_are_one_class_each_and_only_keeps_the_other_ops_rows(bench, capsys):
    v4 = bench.shapes(("v4_attention",))
    assert {s.heads for s in v4} == {16, 32, 64, 128} and {s.batch for s in v4} == {1, 8, 64, 256}
    assert {s.context for s in v4} == {128, 640, 192}  # sliding, CSA, HCA: the slots a query row lists
    assert len({tuple(s.key().items()) for s in v4}) == len(v4), "two shapes would share (and overwrite) a row"
    assert all(bench.facts(s, planned=True, cap=(9, 0)).context == s.context for s in v4)
    assert bench.main(["--dry-run", "--only", "v4_attention"]) == 0
    out = capsys.readouterr().out
    assert f"{len(bench.grid(('v4_attention',)))} (shape, backend) pairs over {len(v4)} shapes" in out
    assert "decode " not in out and "v4_attention   flashmla" in out
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--only", "v4_attn"])
    [shipped] = sorted(timings.FOLDER.glob("*.json"))
    old = json.loads(shipped.read_text())
    v4_row = next(r for r in old["rows"] if r["op"] == "v4_attention")
    new = dict(old, source="new run", rows=[dict(v4_row, us={"triton": 1.0})])
    merged = bench.keep_other_ops(old, new, ("v4_attention",))
    assert [r for r in merged["rows"] if r["op"] == "v4_attention"] == new["rows"]
    assert [r for r in merged["rows"] if r["op"] != "v4_attention"] == [r for r in old["rows"]
                                                                        if r["op"] != "v4_attention"]
    assert timings.check(merged) == [] and "new run (--only)" in merged["source"]
    with pytest.raises(SystemExit, match="write another file"):
        bench.keep_other_ops(old, dict(new, capability=[10, 0]), ("v4_attention",))
