import importlib.util, sys
import torch
sys.path.insert(0, "benchmarks")
import kernel_resources as kr  # noqa
import mla_compile  # noqa
from mla_compile.ops.triton import decode

NEW = {"bf16": decode._decode_split_kernel, "fp8": decode._decode_fp8_split_kernel}


def load(name, attr):
    spec = importlib.util.spec_from_file_location(f"v_{name}", f"benchmarks/_fp8_variants/{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return getattr(m, attr)


OLD = {"bf16": load("bf16_old", "_decode_split_kernel"), "fp8": load("old", "_decode_fp8_split_kernel")}
S = [(128, 16, 8192), (128, 128, 4096), (16, 16, 8192)]
for rep in range(2):
    for which in ("old", "new"):
        decode._decode_split_kernel = (OLD if which == "old" else NEW)["bf16"]
        decode._decode_fp8_split_kernel = (OLD if which == "old" else NEW)["fp8"]
        print(f"== {which} (round {rep})", flush=True)
        cf = [{}] if which == "old" else [{}, dict(num_stages=3), dict(num_stages=4), dict(BLOCK_N=32, num_stages=3)]
        kr.time_decode(tuple((128, 16, 8192, c) for c in cf) + ((128, 128, 4096, {}), (16, 16, 8192, {}))
                       + (((128, 128, 4096, dict(PAGE_TILES=True, num_stages=2)),) if which == "new" else ()))
        cf8 = [{}] if which == "old" else [{}, dict(num_stages=4), dict(num_stages=2)]
        kr.time_decode(tuple((128, 16, 8192, c) for c in cf8) + ((128, 128, 4096, {}),), fp8=True)
