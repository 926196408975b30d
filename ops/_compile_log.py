"""What the compiler decided about the MLA ops, for the inspection report (compile-time facts only).

:mod:`mla_compile.lowerings` appends an :class:`AutotuneRecord` each time Inductor lowers an autotuned
MLA op; :mod:`mla_compile.graphs.inspect` reads the records made while it watches a compile. Fusion
passes count their rewrites in ``torch._dynamo.utils.counters["mla_passes"]``. Nothing here is read
on the hot path; the list is bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX = 1000
_RECORDS: list["AutotuneRecord"] = []
_TOTAL = [0]  # records ever made (positions for records_since)


@dataclass
class AutotuneRecord:
    """One autotuned lowering: the op, its input shapes, every choice's time (ms; None: not timed) and the winner."""

    op: str
    shapes: str
    dtype: str
    device: str
    timings_ms: dict[str, float | None] = field(default_factory=dict)
    winner: str = ""
    winner_backend: str = ""
    note: str = ""


def record(rec: AutotuneRecord) -> None:
    """Append ``rec`` (only the last 1000 are kept)."""
    _TOTAL[0] += 1
    _RECORDS.append(rec)
    del _RECORDS[:-_MAX]


def records() -> list[AutotuneRecord]:
    """Every record kept, oldest first (a copy)."""
    return list(_RECORDS)


def mark() -> int:
    """A position in the log: ``records_since(mark())`` later gives what was recorded in between."""
    return _TOTAL[0]


def records_since(position: int) -> list[AutotuneRecord]:
    """Records made after ``position`` (from :func:`mark`) that are still kept."""
    new = min(_TOTAL[0] - position, len(_RECORDS))
    return list(_RECORDS[-new:]) if new > 0 else []
