"""Injected autotune timings: a test candidate charges its cost with :func:`charge`; the benchmarker that
``tests/lowerings/conftest.py`` installs runs a choice once and returns what it charged (in ms). The winner
then follows the costs the test states, never the wall clock of a loaded machine."""

from __future__ import annotations

COSTS: list[float] = []  # microseconds charged since the benchmarker last started a choice


def charge(cost_us: float) -> None:
    """Charge ``cost_us`` microseconds to the choice being benchmarked."""
    COSTS.append(float(cost_us))


def timed(call) -> float:
    """Run ``call()`` once; the microseconds it charged, in milliseconds. Fails when it charged nothing:
    such a choice could only be timed by the wall clock."""
    COSTS.clear()
    call()
    if not COSTS:
        raise AssertionError("a benchmarked choice charged no cost (tests/lowerings/_timings.charge): "
                             "the winner would come from wall-clock time")
    ms = sum(COSTS) / 1000.0
    COSTS.clear()
    return ms
