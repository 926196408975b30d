"""The SASS loop reader of ``mla_compile.ops.triton._sm90`` on a hand-written listing (no compiler needed), and
``benchmarks/kernel_resources.py --fp4``'s hot-loop line on a real sm_90 compile (``sm90_compile``)."""

from __future__ import annotations

from _triton_test_util import sm90_compile

from mla_compile.ops.triton._sm90 import innermost_loops, opcode
from tests import bench_module


def _listing(lines: list[str]) -> str:
    """cuobjdump-style lines, 16 bytes an instruction from address 0."""
    return "\n".join(f"        /*{16 * i:04x}*/        {text} ;   /* 0x000 */" for i, text in enumerate(lines))


# 0: MOV; 1-6: an outer loop (back to 1) around an inner loop 2-4 (back to 2) that holds an HGMMA; 7-9: a second
# loop (back to 7) without one; 10: a forward branch
LISTING = _listing(["MOV R1, RZ", "IADD3 R2, R2, 0x1, RZ", "HGMMA.64x16x16.F32.BF16 R24, gdesc[UR4], R24",
                    "@P0 STL [R1], R2", "@!P1 BRA 0x20", "FFMA R3, R4, R5, R3", "@P2 BRA 0x10",
                    "LOP3.LUT R6, R6, 0xf, RZ, 0xc0, !PT", "IMAD.SHL.U32 R7, R6, 0x200, RZ", "@P3 BRA 0x70",
                    "BRA 0xb0"])


def test_innermost_loops_of_a_listing():
    loops = innermost_loops(LISTING)
    assert [len(loop) for loop in loops] == [3, 3]  # the inner loop (2-4) and the second loop (7-9), not the outer
    assert loops[0][0].startswith("HGMMA") and loops[1][1].startswith("IMAD.SHL")
    assert innermost_loops(LISTING, "HGMMA") == [loops[0]]
    (outer,) = innermost_loops(LISTING, "FFMA")  # only the outer loop holds one: innermost among those
    assert len(outer) == 6 and outer[0].startswith("IADD3") and outer[-1] == "@P2 BRA 0x10"
    assert [opcode(t) for t in loops[0]] == ["HGMMA.64x16x16.F32.BF16", "STL", "BRA"]


@sm90_compile
def test_fp4_hot_loop_line():
    """The fused fp4 experts' gate-up kernel at one token: its hot loop decodes (LOP3), widens (HADD2.F32) and
    multiplies (FFMA) every weight, so it issues more than 3 instructions a weight; far fewer than 50."""
    import re

    kernel_resources = bench_module.load("kernel_resources")
    launch = next(x for x in kernel_resources.fp4_launches() if x[0].__name__ == "_moe_fp4_gate_up_kernel")
    line = kernel_resources.hot_loop(launch)
    per_weight = float(re.search(r"([\d.]+) a weight", line).group(1))
    assert 3 < per_weight < 50, line
    assert all(op in line for op in ("LOP3.LUT", "HADD2.F32", "FFMA")), line
