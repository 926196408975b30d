"""The ``sm90_compile`` tests in a child process without Triton's interpreter: where this process runs the
Triton tests interpreted (CI: no GPU, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), its kernels are
interpreter objects that Triton's compiler cannot take, so those tests skip here and run there. Every
selected test must pass (none skipped)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(not INTERPRETED, reason="this process runs the sm90_compile tests itself (no interpreter)")
def test_sm90_compile_tests_pass_without_the_interpreter():
    """Two children, one per CPU core (``-k gluon`` and ``-k "not gluon"``: together every test exactly once);
    each must pass with nothing skipped."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "sm90_compile", "-rs",
           "tests/ops/triton", "-k"]
    procs = [subprocess.Popen(cmd + [k], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for k in ("gluon", "not gluon")]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    total = 0
    for proc, out in zip(procs, outs):
        summary = out.strip().splitlines()[-1]
        assert proc.returncode == 0, out[-6000:]
        passed = re.search(r"(\d+) passed", summary)
        assert passed, summary
        total += int(passed.group(1))
        assert not re.search(r"skipped|failed|error", summary), out[-6000:]
    assert total >= 15, outs  # 15 at the time of writing: the fp8/sparse, decode and Gluon checks
