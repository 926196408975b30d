"""The session's pinned torch state (``tests/torch_state.py``): a test that monkeypatches ``torch.empty`` while
a ``torch.device`` context is first used leaves later meta-device models on the meta device."""

import torch
import torch.utils._device as _device

from tests.poison import poisoned_empty
from tests.torch_state import pin_device_constructors


def _poisoned_first_use():
    """The first use of a device context inside a test that poisons ``torch.empty``."""
    with poisoned_empty(), torch.device("cpu"):
        torch.ones(1)


def test_meta_models_stay_on_meta_after_a_poisoned_empty():
    _device._device_constructors.cache_clear()  # as in a fresh worker process
    try:
        pin_device_constructors()
        _poisoned_first_use()
        with torch.device("meta"):
            linear = torch.nn.Linear(3, 2)
        assert linear.weight.is_meta and linear.bias.is_meta
    finally:
        _device._device_constructors.cache_clear()
        pin_device_constructors()  # the real functions again, for the tests after this one
