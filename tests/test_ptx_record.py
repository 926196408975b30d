"""benchmarks/ptx_record.py: what it drops from the PTX (line information, debug sections, debug-scope labels: they
move with the source, not with the code) and what its comparison reports."""

from __future__ import annotations

from tests.bench_module import load

PTX = """.version 8.7
.target sm_90a
.visible .entry k(
\t.param .u64 k_param_0
)
{
\t.loc\t1 10 5
$L__tmp3:
\tld.global.b32 \t%r1, [%rd1];
$L__BB0_2:
\tst.global.b32 \t[%rd2], %r1;
\tret;
}
\t.file\t1 "kernel.py"
\t.section\t.debug_abbrev
{
.b8 1
}
"""


def test_normalized_ptx_keeps_the_code_and_drops_what_moves_with_the_source():
    rec = load("ptx_record")
    got = rec.normalized_ptx(PTX)
    assert "ld.global.b32" in got and "st.global.b32" in got and "$L__BB0_2:" in got  # code and branch labels kept
    assert ".loc" not in got and "$L__tmp3" not in got and ".file" not in got and "debug" not in got
    moved = PTX.replace("1 10 5", "1 99 7").replace("$L__tmp3", "$L__tmp8")
    assert rec.normalized_ptx(moved) == got
    assert rec.normalized_ptx(PTX.replace("%r1, [%rd1]", "%r2, [%rd1]")) != got


def test_compare_reports_differing_and_one_sided_compiles(tmp_path, capsys):
    rec = load("ptx_record")
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir(), after.mkdir()
    for d in (before, after):
        (d / "k.1.ptx").write_text("same")
    (before / "k.2.sass").write_text("a")
    (after / "k.2.sass").write_text("b")
    (after / "k.3.ptx").write_text("new")
    assert rec.compare(str(before), str(after)) == 2
    out = capsys.readouterr().out
    assert "differs: k.2.sass" in out and "only in after: k.3.ptx" in out and "k.1.ptx" not in out
    assert rec.compare(str(before), str(before)) == 0
