"""Prove a kernel refactor leaves the sm_90 code unchanged, without a GPU.

As a pytest plugin, records every ``triton.compile`` the selected tests make (the ``sm90_compile`` tests compile our
Triton and Gluon kernels for sm_90 with Triton's bundled ptxas): per compile, its PTX (``.loc`` / ``.file`` lines,
debug sections and the debug-scope labels ``$L__tmpN`` dropped) and its SASS, named by the kernel and a hash of its
signature, constexprs, attributes and options (not of its source). Then compare two recordings:

    TRITON_INTERPRET=0 PTX_RECORD=/tmp/before python -m pytest -q -p benchmarks.ptx_record -m sm90_compile tests/ops
    (change the kernels)
    TRITON_INTERPRET=0 PTX_RECORD=/tmp/after python -m pytest -q -p benchmarks.ptx_record -m sm90_compile tests/ops
    python benchmarks/ptx_record.py /tmp/before /tmp/after

The comparison prints each compile whose PTX or SASS differs, those present on one side only, and the counts.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile

_LABEL = re.compile(r"^\$L__tmp\d+:$")


def normalized_ptx(ptx: str) -> str:
    """The PTX without line information, debug sections and debug-scope labels (they move with the source)."""
    keep = []
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and "debug" in s:
            break
        if s.startswith((".loc", ".file")) or _LABEL.match(s):
            continue
        keep.append(line)
    return "\n".join(keep)


def sass(cubin: bytes) -> str:
    """The cubin's SASS (``cuobjdump -sass`` of Triton's wheel), without its header lines."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))


def _key(src, args, kwargs) -> str:
    def items(d):
        return sorted((str(k), str(v)) for k, v in (d or {}).items())

    name = getattr(getattr(src, "fn", None), "__name__", "?")
    return (f"{name}|{items(getattr(src, 'constants', {}))}|{items(getattr(src, 'signature', {}))}|"
            f"{items(getattr(src, 'attrs', {}))}|{args}|{sorted(kwargs.items(), key=str)}")


def pytest_configure(config) -> None:
    """Wrap ``triton.compile`` when ``PTX_RECORD`` names a folder (else do nothing)."""
    out = os.environ.get("PTX_RECORD")
    if not out:
        return
    import triton

    os.makedirs(out, exist_ok=True)
    compile_ = triton.compile

    def recorded(src, *args, **kwargs):
        compiled = compile_(src, *args, **kwargs)
        key = _key(src, args, kwargs)
        stem = os.path.join(out, f"{key.split('|')[0]}.{hashlib.sha1(key.encode()).hexdigest()[:16]}")
        with open(stem + ".ptx", "w") as f:
            f.write(normalized_ptx(compiled.asm["ptx"]))
        with open(stem + ".sass", "w") as f:
            f.write(sass(compiled.asm["cubin"]))
        return compiled

    triton.compile = recorded


def compare(before: str, after: str) -> int:
    """Print the compiles that differ between two recordings; returns how many differ or are one-sided."""
    a, b = set(os.listdir(before)), set(os.listdir(after))
    bad = 0
    for name in sorted(a | b):
        if name not in a or name not in b:
            print(f"only in {'after' if name in b else 'before'}: {name}")
            bad += 1
        elif open(os.path.join(before, name)).read() != open(os.path.join(after, name)).read():
            print(f"differs: {name}")
            bad += 1
    print(f"{len(a & b)} files on both sides, {bad} differing or one-sided")
    return bad


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    raise SystemExit(1 if compare(sys.argv[1], sys.argv[2]) else 0)
