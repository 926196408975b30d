"""Shared setup for the Triton kernel tests: interpreter marks and a NumPy >= 2.4 interpreter fix."""

from __future__ import annotations

import importlib.util
import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" and importlib.util.find_spec("triton") is not None


def _fix_interpreter() -> None:
    """Two Triton 3.6 interpreter bugs, fixed for these tests only.

    - Scalars (1-element arrays) become loop bounds through ``int(array)``, which NumPy >= 2.4 refuses;
      ``.item()`` works for every 1-element array.
    - ``tl.dot`` on bfloat16 multiplies the raw uint16 storage; convert to float32 first (exact).
    """
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_mla_fixed", False):
        return
    builder = interpreter.InterpreterBuilder
    dot = builder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return dot(self, a, b, d, *args, **kwargs)

    builder.create_dot = create_dot

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._mla_fixed = True
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _fix_interpreter()
