"""The package's front door: the public names import from ``mla_compile``; graphs stays lazy."""

import subprocess
import sys

import pytest

import mla_compile

FRONT_DOOR = ("patch", "Engine", "MetadataBuilder", "DecodeGraphRunner", "greedy_generate", "MLAConfig",
              "PRESETS", "preset", "CacheLayout", "allocate_latent_cache", "fp8_row_bytes", "is_mla_model",
              "is_sparse_mla_model", "ops", "from_pretrained")


def test_front_door_names_import_from_the_package():
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.serving.engine import Engine
    from mla_compile.serving.generate import greedy_generate
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from mla_compile.models.model import patch

    for name in FRONT_DOOR:
        assert name in mla_compile.__all__ and getattr(mla_compile, name) is not None, name
    assert (mla_compile.patch, mla_compile.Engine, mla_compile.MetadataBuilder, mla_compile.DecodeGraphRunner,
            mla_compile.greedy_generate) == (patch, Engine, MetadataBuilder, DecodeGraphRunner, greedy_generate)


def test_import_does_not_import_graphs_or_lowerings():
    code = ("import sys, mla_compile\n"
            "eager = sorted(m for m in sys.modules if m.startswith(('mla_compile.graphs', 'mla_compile.lowerings')))\n"
            "assert not eager, eager\n"
            "from mla_compile import DecodeGraphRunner\n"
            "assert DecodeGraphRunner.__module__ == 'mla_compile.graphs.cuda_graph'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        mla_compile.no_such_name
