"""The ``sm90_compile`` tests in a child process without Triton's interpreter: where this process runs the
Triton tests interpreted (CI: no GPU, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), its kernels are
interpreter objects that Triton's compiler cannot take, so those tests skip here and run there. Every
selected test must pass (none skipped). The children start when collection ends (``tests/conftest.py``), so they
run beside the rest of the suite."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
NEEDED = HAS_TRITON and INTERPRETED  # the test runs (its two skip conditions below)
_CHILDREN: list[tuple[subprocess.Popen, object]] = []  # the two children and their output files, once started


def start_children() -> None:
    """Start the two children (once; nothing where the test would skip): ``-k gluon`` and ``-k "not gluon"``,
    together every ``sm90_compile`` test exactly once, at a lower CPU priority, their output to temporary files.
    ``tests/conftest.py`` calls it when collection selected this test, so the children compile on the core the
    rest of the suite leaves idle instead of holding the suite while they run."""
    if _CHILDREN or not NEEDED:
        return
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "sm90_compile", "-rs",
           "tests/ops/triton", "-k"]
    for k in ("gluon", "not gluon"):
        out = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(cmd + [k], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=functools.partial(os.nice, 10))
        _CHILDREN.append((proc, out))


def stop_children() -> None:
    """Kill children still running (the session ends without having run the test, e.g. ``-x``)."""
    for proc, _ in _CHILDREN:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.skipif(not INTERPRETED, reason="this process runs the sm90_compile tests itself (no interpreter)")
def test_sm90_compile_tests_pass_without_the_interpreter():
    """The two children of :func:`start_children` (started here unless already running) must each pass with
    nothing skipped."""
    start_children()
    outs = []
    for proc, out in _CHILDREN:
        proc.wait(timeout=900)
        out.seek(0)
        outs.append(out.read())
    total = 0
    for (proc, _), out in zip(_CHILDREN, outs):
        summary = out.strip().splitlines()[-1]
        assert proc.returncode == 0, out[-6000:]
        passed = re.search(r"(\d+) passed", summary)
        assert passed, summary
        total += int(passed.group(1))
        assert not re.search(r"skipped|failed|error", summary), out[-6000:]
    assert total >= 15, outs  # 15 at the time of writing: the fp8/sparse, decode and Gluon checks
