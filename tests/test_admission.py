"""Admission checks: what a request may hold, and errors that name the request, argument and position."""

import numpy as np
import pytest
import torch

from mla_compile.serving.admission import RequestLimits, RequestRejected, check_int, validate_request
from mla_compile.serving.sampling import SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_seq_tokens=64, cache_tokens=128, max_positions=50)


@pytest.mark.parametrize("prompt", [[0, 99], (5,), range(3), [np.int64(7), np.int32(8), np.uint8(9)],
                                    np.array([1, 2], dtype=np.int16), torch.tensor([3, 4]),
                                    torch.tensor([5], dtype=torch.uint8)])
def test_int_token_ids_are_accepted_as_python_ints(prompt):
    tokens, params = validate_request(0, prompt, np.int64(2), LIMITS)
    assert tokens == [int(t) for t in prompt] and all(type(t) is int for t in tokens)
    assert params == SamplingParams(max_new_tokens=2) and type(params.max_new_tokens) is int


@pytest.mark.parametrize("prompt, position, message", [
    ([1, 2, 100], 2, r"prompt\[2\] = 100 is not a token id in \[0, 100\)"),
    ([-1], 0, r"prompt\[0\] = -1 is not a token id in \[0, 100\)"),
    ([1, 1.5, 200], 1, r"prompt\[1\] = 1.5 \(float\) is not an int token id"),
    ([1.0], 0, r"prompt\[0\] = 1.0 \(float\) is not an int token id"),
    ([3, True], 1, r"prompt\[1\] = True \(bool\) is not an int token id"),
    ([np.bool_(True)], 0, r"prompt\[0\] = .*True.* is not an int token id"),
    ([np.float32(2)], 0, r"prompt\[0\] = .* is not an int token id"),
    ([torch.tensor(3)], 0, r"prompt\[0\] = tensor\(3\) \(Tensor\) is not an int token id"),
    (["a"], 0, r"prompt\[0\] = 'a' \(str\) is not an int token id"),
    ([None], 0, r"prompt\[0\] = None \(NoneType\) is not an int token id"),
    ([], None, "prompt is empty; it must be non-empty"),
    ("hello", None, "prompt must be a sequence of int token ids, got str"),
    (iter([1]), None, "prompt must be a sequence of int token ids, got list_iterator"),
    (7, None, "prompt must be a sequence of int token ids, got int"),
    (torch.tensor([1.0, 2.0]), None, "prompt must be a 1-D integer tensor or array, got 1-D of .*float32"),
    (torch.tensor([[1, 2]]), None, "prompt must be a 1-D integer tensor or array, got 2-D"),
    (torch.tensor([True]), None, ".*dtype torch.bool"),
    (np.array([0.5]), None, ".*dtype float64"),
])
def test_bad_prompts_name_the_request_and_the_first_bad_position(prompt, position, message):
    with pytest.raises(RequestRejected, match="^request 7: " + message) as info:
        validate_request(7, prompt, 3, LIMITS)
    assert isinstance(info.value, ValueError)
    assert (info.value.request_id, info.value.field, info.value.position) == (7, "prompt", position)


@pytest.mark.parametrize("n, message", [(0, "max_new_tokens = 0 must be >= 1"), (-2, "must be >= 1"),
                                        (2.0, r"max_new_tokens = 2.0 \(float\) must be an int"),
                                        (True, r"True \(bool\) must be an int"), ("3", r"'3' \(str\)"),
                                        (None, "None")])
def test_bad_max_new_tokens(n, message):
    with pytest.raises(RequestRejected, match="^request 3: .*" + message) as info:
        validate_request(3, [1], n, LIMITS)
    assert info.value.field == "max_new_tokens"


@pytest.mark.parametrize("limits, bound, what", [(LIMITS, 50, "max_position_embeddings"),
                                                 (RequestLimits(100, 48, 128), 48, "max_blocks_per_seq"),
                                                 (RequestLimits(100, 64, 40), 40, "paged cache")])
def test_lengths_fit_positions_block_table_and_cache(limits, bound, what):
    validate_request(0, [1] * (bound - 4), 4, limits)  # exactly at the bound
    with pytest.raises(RequestRejected, match=f"= {bound + 1} tokens exceed .*{what}.* = {bound}") as info:
        validate_request(0, [1] * (bound - 4), 5, limits)
    assert info.value.field == "prompt + max_new_tokens"


def test_the_prompt_is_checked_before_its_length_and_check_int_bounds():
    with pytest.raises(RequestRejected, match=r"prompt\[60\] = 100"):
        validate_request(0, [1] * 60 + [100], 1, LIMITS)  # too long too, but the bad id is named
    assert check_int(0, "top_k", np.int8(5), 1, 10) == 5
    with pytest.raises(RequestRejected, match=r"request 0: top_k = 11 must be in \[1, 10\]"):
        check_int(0, "top_k", 11, 1, 10)


@pytest.mark.parametrize("kw", [dict(vocab_size=0), dict(max_seq_tokens=-1), dict(cache_tokens=1.5),
                                dict(max_positions=True)])
def test_limits_are_positive_ints(kw):
    with pytest.raises(ValueError, match=f"RequestLimits.{next(iter(kw))} must be a positive int"):
        RequestLimits(**{**dict(vocab_size=10, max_seq_tokens=8, cache_tokens=8), **kw})


def test_sampling_params_are_admitted_and_bad_ones_named():
    params = SamplingParams(temperature=0.5, stop_token_ids=(3, 99), max_new_tokens=4)
    assert validate_request(0, [1], params, LIMITS) == ([1], params)
    with pytest.raises(RequestRejected, match=r"request 5: stop_token_ids\[1\] = 100 is not a token id") as info:
        validate_request(5, [1], SamplingParams(stop_token_ids=(3, 100)), LIMITS)
    assert info.value.field == "stop_token_ids" and info.value.position == 1
    with pytest.raises(RequestRejected, match=r"request 6: max_new_tokens = .*\(dict\) must be an int"):
        validate_request(6, [1], {"max_new_tokens": 2}, LIMITS)
    with pytest.raises(RequestRejected, match="exceed"):
        validate_request(7, [1] * 60, SamplingParams(max_new_tokens=8), LIMITS)
