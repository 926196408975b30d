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
    for op in ("decode", "decode_fp8", "sparse_decode", "prefill", "merge"):
        assert {n for s, n in pairs if s.op == op} == set(priority(op)) - {"autotune"}, op
    for s in bench.GRID:
        key = s.key()
        assert all(key[k] in timings.BUCKETS[k] for k in ("heads", "batch", "context"))
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
