"""``import mla_compile`` registers every adapter but imports no peer library (checked in a fresh
interpreter, where the libraries would be importable if installed). Modules torch itself loads with
``torch._dynamo`` (triton, when it is installed) are part of the baseline: they are not ours to avoid."""

from __future__ import annotations

import json
import subprocess
import sys

PEERS = ("flash_mla", "flashinfer", "flash_attn", "triton")


def test_import_mla_compile_imports_no_peer_library():
    code = ("import sys, json, torch, torch._dynamo; before = set(sys.modules); import mla_compile; "
            "from mla_compile.ops import backends_for; "
            "print(json.dumps({'loaded': sorted(m for m in set(sys.modules) - before if m.split('.')[0] in %r), "
            "'decode': sorted(backends_for('mla.decode')), 'prefill': sorted(backends_for('mla.prefill'))}))" % (PEERS,))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    assert {"flashmla", "flashinfer", "flashinfer-trtllm", "flashinfer-cutlass"} <= set(report["decode"])
    assert {"flashinfer", "flashinfer-trtllm", "sdpa-cudnn", "flash-attn"} <= set(report["prefill"])
