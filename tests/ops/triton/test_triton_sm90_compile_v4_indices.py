"""The FlashMLA V4 adapter's index-list kernel (``ops/triton/v4_finish.py``) compiled for sm_90 on the CPU (Triton's
front end and bundled ptxas, no GPU) at V4-Flash's shapes (a sliding layer's window, a CSA layer's window and top-512
side by side, int32 and int64 slots): it compiles, and where cuobjdump is bundled, without register spills. Marked
``sm90_compile``."""

from __future__ import annotations

import pytest
import torch
from _triton_test_util import SM90_COMPILE

pytestmark = SM90_COMPILE


@pytest.mark.parametrize("la,lb,dtype", [(128, 0, torch.int32), (128, 512, torch.int32), (128, 512, torch.int64)])
def test_index_kernel_compiles_for_sm90(la, lb, dtype):
    import mla_compile  # noqa: F401
    from mla_compile.ops.adapters.flashmla_v4 import index_width
    from mla_compile.ops.triton import _sm90, v4_finish

    b = torch.zeros(64, lb, dtype=dtype) if lb else None
    launches = _sm90.record(v4_finish, v4_finish.sparse_indices_triton, torch.zeros(64, la, dtype=dtype), 10 ** 6, b,
                            index_width(la + lb), gluon=("_sparse_indices_kernel",))
    assert [grid for _, grid, _, _ in launches] == [(64,)]
    kernel, _, args, kwargs = launches[0]
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"
