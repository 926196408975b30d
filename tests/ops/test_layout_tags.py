"""Every ``mla::`` custom op declares its layout constraint (``needs_exact_strides``) itself, so a user
who changes Inductor's default for custom ops cannot make Inductor hand our kernels other strides."""

from __future__ import annotations

import math

import torch
from torch._library.utils import get_layout_constraint_tag

import mla_compile  # noqa: F401  (registers the ops)
import mla_compile.ops.adapters  # noqa: F401  (and the peer adapters' ops)
from mla_compile import ops


def _load_triton_ops() -> None:
    """Import every module of ``mla_compile.ops.triton`` (each registers its ops on first use otherwise): the set of
    ops the test sees then does not depend on which tests ran before it in the same process."""
    import importlib
    import importlib.util
    import pkgutil

    if importlib.util.find_spec("triton") is None:
        return
    import mla_compile.ops.triton as kernels

    for module in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{module.name}")


def _mla_ops():
    """Every ``mla::`` op (the Triton modules loaded first), but the Triton kernels' ``triton_op`` s (named
    ``*_triton``): Inductor traces into those down to their kernels, so no layout tag applies, and only our ops' own
    dispatch calls them, on the strides it checked."""
    _load_triton_ops()
    out = []
    for name in dir(torch.ops.mla):
        if name.endswith("_triton"):
            continue
        packet = getattr(torch.ops.mla, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            out.append(packet.default)
    return out


# torch's config modules are patched with their own ``patch`` (pytest 9's monkeypatch deletes a config
# entry on undo: config values are not in the module's __dict__)
FLEXIBLE = dict(custom_op_default_layout_constraint="flexible_layout")


def test_every_mla_op_declares_exact_strides():
    with torch._functorch.config.patch(**FLEXIBLE):
        found = _mla_ops()
        assert len(found) >= 25, [str(op) for op in found]
        missing = [str(op) for op in found
                   if get_layout_constraint_tag(op, with_default=False) is not torch.Tag.needs_exact_strides]
        assert not missing, f"ops without the layout tag: {missing}"


def test_compiled_op_on_strided_inputs_matches_eager_under_a_flexible_default(fresh_dynamo):
    """Inputs that are transposed / sliced views inside the compiled graph reach the op as they would in
    eager, and the results agree with eager, with the global default set to flexible_layout. (It also
    caught the merge fake copying a strided input's layout while every implementation returns
    contiguous outputs: Inductor's output stride assert failed.)"""
    gen = torch.Generator().manual_seed(3)
    T, H, D = 7, 4, 40
    base_a, base_b = (torch.randn(H, T, D + 8, generator=gen, dtype=torch.float64) for _ in range(2))
    la, lb = (torch.randn(H, T, generator=gen, dtype=torch.float64).float() for _ in range(2))

    def fn(base_a, base_b, la, lb):
        a = (base_a * 2).transpose(0, 1)[..., :D]  # [T, H, D], neither contiguous nor dense
        b = (base_b + 1).transpose(0, 1)[..., 4:D + 4]
        return ops.merge_attn_states(a, la.t(), b, lb.t(), backend="reference")

    want = fn(base_a, base_b, la, lb)
    # a cached graph would hide changes of a fake function: compile fresh
    with torch._functorch.config.patch(**FLEXIBLE), torch._inductor.config.patch(force_disable_caches=True):
        got = torch.compile(fn, fullgraph=True)(base_a, base_b, la, lb)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert math.isfinite(float(got[0].abs().sum()))
