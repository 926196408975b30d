"""Python floats that compiled graphs must see as constants.

Dynamo reads a float attribute (of a module, a config, any object) as a constant guarded on its value, until a
recompile sees a second value of it (a second model in the same process, say): from then on it is a graph input,
a ``SymFloat``, which a custom op's ``float`` argument refuses; and inside a nested compile region torch 2.11 fails
to lift such a float at all. A string is a constant Dynamo only guards on, so a float that must stay a constant
(a softmax scale, a routing scale handed to an op) is kept as :func:`freeze`'s text and read back with :func:`thaw`.
"""

from __future__ import annotations


def freeze(value: float) -> str:
    """``value`` as the exact text :func:`thaw` reads back (``repr`` round-trips a float)."""
    return repr(float(value))


def thaw(text: str) -> float:
    """The float :func:`freeze` kept: a constant of any graph that reads it."""
    return float(text)
