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
         torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
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


def record(module, fn, *args, sms: int | None = None, pdl: bool = False, gluon: tuple[str, ...] = (),
           **kwargs) -> list[tuple]:
    """Run ``fn(*args, **kwargs)`` with ``module.wrap_triton`` (where it has one) and the Gluon kernels named in
    ``gluon`` (launched as ``kernel[grid](...)``) replaced by a :func:`recorder` (and ``module.num_sms`` returning
    ``sms`` when given, e.g. an H200's 132; with ``pdl``, ``module.launch_kwargs`` giving the launch an sm_90 device
    gets: PDL on); returns ``(kernel, grid, args, kwargs)`` per launch."""
    launches: list[tuple] = []
    Recorder = recorder(launches)
    saved = getattr(module, "num_sms", None), getattr(module, "launch_kwargs", None)
    kernels = {name: getattr(module, name) for name in gluon}
    if hasattr(module, "wrap_triton"):
        kernels["wrap_triton"] = module.wrap_triton
    for name, kernel in kernels.items():
        setattr(module, name, Recorder if name == "wrap_triton" else Recorder(kernel))
    if sms is not None:
        module.num_sms = lambda device: sms
    if pdl:
        from mla_compile.ops.triton._pdl import OFF, ON
        module.launch_kwargs = lambda device, waits=True, eager_only=False: dict(ON if waits else OFF)
    try:
        fn(*args, **kwargs)
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
        if sms is not None:
            module.num_sms = saved[0]
        if pdl:
            module.launch_kwargs = saved[1]
    return launches


def signature(kernel, args, kwargs, floats: str = "fp32") -> tuple[dict, dict, dict]:
    """Triton's ``(signature, constexprs, attrs)`` of one launch (16-byte divisibility where it holds; a host TMA
    descriptor typed by its tensor's dtype, box and shared layout; None a constexpr, as the JIT binds it). ``floats``:
    the type of Python float arguments, "fp32" as Triton's launcher binds them, or "fp64" as Inductor's launch of a
    ``triton_op``'s kernel does (torch's ``_use_fp64_for_unbacked_floats``)."""
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
            sig[p.name] = floats
    return sig, consts, attrs


def compile_sm90(kernel, args, kwargs, floats: str = "fp32"):
    """The sm_90 compile of one recorded launch, a Triton or a Gluon kernel (its constexprs, warps and stages;
    ``floats``: see :func:`signature`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, consts, attrs = signature(kernel, args, kwargs, floats)
    opts = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    return triton.compile(source(kernel, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def bundled_tool(name: str) -> str | None:
    """Path of the CUDA tool ``name`` (cuobjdump, ptxas) bundled with Triton (None when the wheel has none)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return tool if os.path.exists(tool) else None


def cuobjdump() -> str | None:
    """Path of the cuobjdump bundled with Triton (None when the wheel has none)."""
    return bundled_tool("cuobjdump")


def _cuobjdump(compiled, *flags: str) -> list[str]:
    """cuobjdump's output for each of ``flags`` on the compile's cubin."""
    tool = cuobjdump()
    if tool is None:
        raise FileNotFoundError("no cuobjdump in the Triton wheel")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return [subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                for flag in flags]


def resources(compiled) -> dict[str, int]:
    """``regs``, ``stack`` (spill bytes), ``smem`` and the count of each ``COUNTED`` SASS instruction."""
    res, sass = _cuobjdump(compiled, "-res-usage", "-sass")
    out = {"regs": int(re.search(r"REG:(\d+)", res).group(1)), "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
           "smem": int(compiled.metadata.shared)}
    out.update({op: len(re.findall(rf"\b{op}\b", sass)) for op in COUNTED})
    return out


def ptxas_infos(compiled) -> list[str]:
    """ptxas's numbered infos on the compile's PTX (``ptxas -arch=sm_90a -v``, Triton's bundled ptxas), e.g.
    ``C7517`` (a ``wgmma`` wait it injects) or ``C7511`` (``wgmma`` serialized for want of registers)."""
    tool = bundled_tool("ptxas")
    if tool is None:
        raise FileNotFoundError("no ptxas in the Triton wheel")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([tool, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    return re.findall(r"\((C\d{4})\)", out.stdout + out.stderr)


def innermost_loops(sass: str, holding: str | None = None) -> list[list[str]]:
    """The innermost loops of a SASS listing (cuobjdump ``-sass``), in address order: the ranges of backward branches
    (those with an instruction containing ``holding``, when given) that hold no other such range, each as its
    instructions (predicates kept, ``;`` dropped)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for at, text in ins:
        m = re.search(r"\bBRA\s+(?:\.U\.ANY\s+)?0x([0-9a-f]+)\s*$", text)
        lo = int(m.group(1), 16) if m else at
        if lo < at and (holding is None or any(holding in t for a, t in ins if lo <= a <= at)):
            loops.append((lo, at))
    inner = [(lo, hi) for lo, hi in loops if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in loops)]
    return [[text for at, text in ins if lo <= at <= hi] for lo, hi in sorted(inner)]


def opcode(instruction: str) -> str:
    """A SASS instruction's opcode with its modifiers (``IMAD.SHL.U32``), its predicate (``@!P0``) dropped."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def spills_in_mma_loops(compiled) -> int:
    """Spill instructions (``LDL`` / ``STL``) inside the innermost SASS loops that hold a ``wgmma`` (``HGMMA``): the
    hot loops, where a spill costs each iteration."""
    (sass,) = _cuobjdump(compiled, "-sass")
    return sum(1 for loop in innermost_loops(sass, "HGMMA") for t in loop if re.match(r"\s*(LDL|STL)\b", t))
