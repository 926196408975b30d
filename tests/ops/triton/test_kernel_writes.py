"""What Inductor believes our Triton kernels write (torch's own TTIR mutation analysis) is exactly their
outputs: metadata they only read (slot mappings, seq_lens, cu_seqlens) is never taken as mutated. A
graph input believed mutated is cloned and copied back around the kernel, and makes Inductor's CUDA
graphs (``mode="reduce-overhead"``) skip the whole graph for "mutated inputs". Every ``triton_op``'s kernels are
launched (the ``custom_op`` kernels are opaque to Inductor). The analysis reads a TTIR ``tt.call``'s results as
derived from every argument of the call: a store through a pointer a ``@triton.jit`` helper returned counts as a
write of each argument of that helper (a sorted-groups GEMM whose output pointer came from a helper taking
``cu_ptr`` showed ``cu_ptr`` written), so the kernels here form their store pointers inline."""

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
    "_fp8_linear_kernel": ["y_ptr"],
    "_fp4_linear_kernel": ["y_ptr"],
    "_fp4_gemv_kernel": ["y_ptr"],
    "_lightning_score_kernel": ["out_ptr"],
    "_topk_positions_kernel": ["o_ptr"],
    "_sparse_split_kernel": ["lse_ptr", "o_ptr"],
    "_v4_attention_kernel": ["lse_ptr", "o_ptr", "ws_acc_ptr", "ws_ml_ptr"],  # direct launch / split workspaces
    "_v4_merge_kernel": ["lse_ptr", "o_ptr"],
    "_compress_entry_kernel": ["cache_ptr"],  # mla::v4_compress_write mutates cache, state_kv and state_gate
    "_state_write_kernel": ["sg_ptr", "skv_ptr"],
    "_moe_fp8_gate_up_kernel": ["h_ptr"],
    "_moe_fp8_down_kernel": ["out_ptr"],
    "_fp8_sorted_kernel": ["y_ptr"],
    "_fp4_sorted_kernel": ["y_ptr"],
    "_moe_fp4_gate_up_kernel": ["h_ptr"],
    "_moe_fp4_down_kernel": ["out_ptr"],
}


@pytest.fixture(scope="module")
def report() -> dict[str, list[str]]:
    # a fresh interpreter without TRITON_INTERPRET: the analysis needs compiled (not interpreted) kernels
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("_kernel_writes.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_write_only_their_outputs(report):
    assert report == WRITES
