"""Compile recorded Triton launches for sm_90 on any machine (Triton's front end and bundled ptxas, no
GPU) and read their resources off the cubin. Used by the kernel resource tests and
``benchmarks/kernel_resources.py``; needs Triton, not the interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
         torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages", "launch_pdl")
# SASS instructions counted by resources(): matrix (wgmma, mma.sync), spills, global loads (cp.async, TMA, plain)
COUNTED = ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS", "UTMALDG", "LDG")


def recorder(launches: list) -> type:
    """A stand-in for ``wrap_triton`` / a kernel object: ``recorder(launches)(kernel)[grid](*args, **kwargs)``
    appends ``(kernel, grid, args, kwargs)`` to ``launches`` instead of launching."""

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **k: launches.append((self.kernel, grid, a, k))

    return Recorder


def record(module, fn, *args, sms: int | None = None, pdl: bool = False, **kwargs) -> list[tuple]:
    """Run ``fn(*args, **kwargs)`` with ``module.wrap_triton`` replaced by a :func:`recorder` (and ``module.num_sms``
    returning ``sms`` when given, e.g. an H200's 132; with ``pdl``, ``module.launch_kwargs`` giving the launch an
    sm_90 device gets: PDL on); returns ``(kernel, grid, args, kwargs)`` per launch."""
    launches: list[tuple] = []
    Recorder = recorder(launches)
    saved = module.wrap_triton, getattr(module, "num_sms", None), getattr(module, "launch_kwargs", None)
    module.wrap_triton = Recorder
    if sms is not None:
        module.num_sms = lambda device: sms
    if pdl:
        from mla_compile.ops.triton._pdl import OFF, ON
        module.launch_kwargs = lambda device, waits=True, eager_only=False: dict(ON if waits else OFF)
    try:
        fn(*args, **kwargs)
    finally:
        module.wrap_triton = saved[0]
        if sms is not None:
            module.num_sms = saved[1]
        if pdl:
            module.launch_kwargs = saved[2]
    return launches


def signature(kernel, args, kwargs) -> tuple[dict, dict, dict]:
    """Triton's ``(signature, constexprs, attrs)`` of one launch (16-byte divisibility where it holds; a host TMA
    descriptor typed by its tensor's dtype, box and shared layout; None a constexpr, as the JIT binds it)."""
    bound = dict(zip(kernel.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = bound[p.name]
        if p.is_constexpr or v is None:
            sig[p.name], consts[p.name] = "constexpr", v
        elif hasattr(v, "block_shape") and hasattr(v, "layout"):  # a Gluon host TensorDescriptor
            sig[p.name] = (f"tensordesc<{TYPES[v.base.dtype]}[{', '.join(str(n) for n in v.block_shape)}],"
                           f"{v.layout!r}>")
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # CUDA allocations are 256-byte aligned
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0 and v != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "fp32"
    return sig, consts, attrs


def compile_sm90(kernel, args, kwargs):
    """The sm_90 compile of one recorded launch (its constexprs, warps and stages)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = signature(kernel, args, kwargs)
    opts = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    return triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def cuobjdump() -> str | None:
    """Path of the cuobjdump bundled with Triton (None when the wheel has none)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return tool if os.path.exists(tool) else None


def resources(compiled) -> dict[str, int]:
    """``regs``, ``stack`` (spill bytes), ``smem`` and the count of each ``COUNTED`` SASS instruction."""
    tool = cuobjdump()
    if tool is None:
        raise FileNotFoundError("no cuobjdump in the Triton wheel")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    out = {"regs": int(re.search(r"REG:(\d+)", res).group(1)), "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
           "smem": int(compiled.metadata.shared)}
    out.update({op: len(re.findall(rf"\b{op}\b", sass)) for op in COUNTED})
    return out
