"""What Inductor believes our Triton kernels write (torch's own TTIR mutation analysis) is exactly their
outputs: metadata they only read (slot mappings, seq_lens, cu_seqlens) is never taken as mutated. A
graph input believed mutated is cloned and copied back around the kernel, and makes Inductor's CUDA
graphs (``mode="reduce-overhead"``) skip the whole graph for "mutated inputs"."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs an importable triton")

WRITES = {
    "_cache_write_kernel": ["cache_ptr"],
    "_fp8_write_kernel": ["cache_ptr"],
    "_index_write_kernel": ["cache_ptr"],
    "_decode_split_kernel": ["lse_ptr", "o_ptr"],
    "_decode_reduce_kernel": ["lse_ptr", "out_ptr"],
    "_decode_fp8_split_kernel": ["lse_ptr", "o_ptr"],
    "_prefill_kernel": ["lse_ptr", "o_ptr"],
    "_gather_kernel": ["out_ptr"],
    "_merge_kernel": ["lse_ptr", "out_ptr"],
    "_moe_route_kernel": ["ids_ptr", "w_ptr"],
    "_moe_gate_up_kernel": ["h_ptr"],
    "_moe_gate_up_dot_kernel": ["h_ptr"],
    "_moe_gate_up_pipe_kernel": ["h_ptr"],
    "_moe_down_kernel": ["out_ptr"],
    "_moe_down_dot_kernel": ["out_ptr"],
    "_moe_align_kernel": ["bcnt_ptr", "bexp_ptr", "rows_ptr"],
    "_moe_sort_kernel": ["offs_ptr", "order_ptr", "sorted_e_ptr"],
    "_moe_grouped_gate_up_kernel": ["h_ptr"],
    "_moe_grouped_down_kernel": ["y_ptr"],
    "_moe_combine_kernel": ["out_ptr"],
}


def test_kernels_write_only_their_outputs():
    # a fresh interpreter without TRITON_INTERPRET: the analysis needs compiled (not interpreted) kernels
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("_kernel_writes.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == WRITES
