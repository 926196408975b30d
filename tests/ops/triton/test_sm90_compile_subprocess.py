"""The ``sm90_compile`` tests in a child process without Triton's interpreter: where this process runs the
Triton tests interpreted (CI: no GPU, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), its kernels are
interpreter objects that Triton's compiler cannot take, so those tests skip here and run there. Every
selected test must pass (none skipped). The children start when collection ends (``tests/conftest.py``: in this
process, or under pytest-xdist in the controller once a worker has collected this test), so they run beside the
rest of the suite; they write their output and exit status to files in a folder of the run, which the test reads
on whichever process runs it."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
NEEDED = HAS_TRITON and INTERPRETED  # the test runs (its two skip conditions below)
SELECTIONS = ("gluon", "not gluon")  # the children's -k: together every sm90_compile test exactly once
_CHILDREN: list[subprocess.Popen] = []  # the children this process started
_RUN: list[Path] = []  # their folder, where this process started them
_WRAP = ("import subprocess, sys; out = open(sys.argv[1] + '.out', 'w'); "
         "rc = subprocess.call(sys.argv[2:], stdout=out, stderr=subprocess.STDOUT); out.close(); "
         "open(sys.argv[1] + '.rc.tmp', 'w').write(str(rc)); __import__('os').replace(sys.argv[1] + '.rc.tmp', "
         "sys.argv[1] + '.rc')")


def run_folder(testrunuid: str) -> Path:
    """The children's folder of the pytest-xdist run ``testrunuid`` (the same on the controller and every worker)."""
    return Path(tempfile.gettempdir()) / f"mla_compile-sm90-{testrunuid}"


def start_children(folder: Path | None = None) -> None:
    """Start the two children (once; nothing where the test would skip): ``-k gluon`` and ``-k "not gluon"``, at
    a lower CPU priority, each writing ``<i>.out`` and then ``<i>.rc`` (its exit status) into ``folder`` (None: a
    new temporary folder of this process). ``tests/conftest.py`` calls it when collection selected this test, so
    the children compile on the cores the rest of the suite leaves idle instead of holding the suite while they
    run."""
    if _CHILDREN or not NEEDED:
        return
    folder = Path(tempfile.mkdtemp(prefix="mla_compile-sm90-")) if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    _RUN.append(folder)
    env = dict(os.environ, TRITON_INTERPRET="0")
    for k in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "sm90_compile",
           "-rs", "tests/ops/triton", "-k"]
    for i, k in enumerate(SELECTIONS):
        _CHILDREN.append(subprocess.Popen([sys.executable, "-c", _WRAP, str(folder / str(i)), *cmd, k], cwd=ROOT,
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          preexec_fn=functools.partial(os.nice, 10), start_new_session=True))


def stop_children() -> None:
    """At the end of the session that started them: kill children still running (the session ends without having
    run the test, e.g. ``-x``) and remove their folder."""
    for proc in _CHILDREN:
        if proc.poll() is None:  # the wrapper and its pytest: one process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for folder in _RUN:
        shutil.rmtree(folder, ignore_errors=True)


def _folder() -> Path:
    """Where this run's children write: the run's folder under pytest-xdist (started by the controller; started
    here if it is missing), else this process's (started here unless already running)."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is not None:
        folder = run_folder(uid)
        if not folder.exists():
            start_children(folder)
        return folder
    start_children()
    return _RUN[0]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.skipif(not INTERPRETED, reason="this process runs the sm90_compile tests itself (no interpreter)")
def test_sm90_compile_tests_pass_without_the_interpreter():
    """The two children of :func:`start_children` must each pass with nothing skipped."""
    folder = _folder()
    deadline = time.monotonic() + 900
    outs = []
    for i in range(len(SELECTIONS)):
        rc_file = folder / f"{i}.rc"
        while not rc_file.exists():
            assert time.monotonic() < deadline, f"the sm90_compile child {i} did not finish in 900 s ({folder})"
            time.sleep(1)
        outs.append((int(rc_file.read_text()), (folder / f"{i}.out").read_text()))
    total = 0
    for rc, out in outs:
        summary = out.strip().splitlines()[-1]
        assert rc == 0, out[-6000:]
        passed = re.search(r"(\d+) passed", summary)
        assert passed, summary
        total += int(passed.group(1))
        assert not re.search(r"skipped|failed|error", summary), out[-6000:]
    assert total >= 15, outs  # 15 at the time of writing: the fp8/sparse, decode and Gluon checks
