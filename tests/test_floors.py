"""The package's floors: models <- serving <- app, and the pre-floor module names still import."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mla_compile
from mla_compile._moved import FLOORS, MOVED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_old_name_is_the_new_module(old):
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(old) is new
    assert getattr(importlib.import_module("mla_compile"), old.rsplit(".", 1)[1]) is new


def test_from_imports_and_monkeypatching_through_an_old_name_reach_the_one_module(monkeypatch):
    from mla_compile import engine as old_engine
    from mla_compile.model import patch
    from mla_compile.serving import engine

    assert patch is mla_compile.patch and old_engine is engine
    monkeypatch.setattr("mla_compile.engine.Engine", None)
    assert engine.Engine is None


def test_every_old_name_points_at_a_module_of_its_floor_and_no_stale_file_is_left():
    """The aliases cover the modules that moved (modules added since have only their floor name)."""
    listed = [(floor, name) for floor, names in FLOORS.items() for name in names]
    assert len({name for _, name in listed}) == len(listed)
    assert all((ROOT / "mla_compile" / floor / f"{name}.py").exists() for floor, name in listed)
    assert not [n for _, n in listed if (ROOT / "mla_compile" / f"{n}.py").exists()]


def test_floors_import_only_downwards():
    """models imports neither serving nor app; serving does not import app (checked in the source)."""
    above = {"models": ("serving", "app"), "serving": ("app",)}
    offenders = []
    for floor, banned in above.items():
        names = "|".join(banned)
        pattern = re.compile(rf"^\s*(from|import) mla_compile\.({names})\b|^\s*from mla_compile import .*\b({names})\b",
                             re.M)
        offenders += [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in (ROOT / "mla_compile" / floor).glob("*.py")
                      for m in pattern.finditer(p.read_text())]
    assert offenders == []


def test_python_dash_m_with_the_old_cli_name_runs_the_command_line():
    out = subprocess.run([sys.executable, "-m", "mla_compile.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage: mla-compile" in out.stdout, out.stderr
