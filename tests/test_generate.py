"""``greedy_generate`` / ``hf_greedy_reference``: exactly ``max_new_tokens`` tokens per prompt (none for 0,
without calling the model), and a negative count raises ``ValueError`` naming ``max_new_tokens``.

A counting step function stands in for the model (its logits pick ``last token + 1``), so the loop is
checked without compiling; the toy HF model checks the two functions agree at 0 and 1 tokens."""

from __future__ import annotations

import pytest
import torch

from mla_compile.app import toy
from mla_compile.serving.generate import greedy_generate, hf_greedy_reference
from mla_compile.models.model import patch

VOCAB = 32
PROMPTS = [[1, 2, 3], [7], [30, 4, 9, 12, 5]]


class NextToken:
    """A step function whose greedy choice after token ``t`` is ``(t + 1) % VOCAB``; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, positions, meta):
        self.calls += 1
        logits = torch.nn.functional.one_hot((input_ids + 1) % VOCAB, VOCAB).double()
        return logits if meta.logits_indices is None else logits[meta.logits_indices]


def _gen(step, n, prompts=PROMPTS):
    return greedy_generate(step, prompts, n, block_size=4, num_blocks=16, dynamic=False)


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_exactly_max_new_tokens_per_prompt(n):
    step = NextToken()
    res = _gen(step, n)
    want = [[(p[-1] + 1 + i) % VOCAB for i in range(n)] for p in PROMPTS]
    assert res.tokens == want
    assert step.calls == n and res.decode_steps == max(n - 1, 0)  # one prefill, then n - 1 decode steps


@pytest.mark.parametrize("n", [-1, -7])
def test_negative_max_new_tokens_names_the_argument(n):
    step = NextToken()
    with pytest.raises(ValueError, match=rf"max_new_tokens must be >= 0 .*got {n}"):
        _gen(step, n)
    assert step.calls == 0
    with pytest.raises(ValueError, match=rf"max_new_tokens must be >= 0 .*got {n}"):
        hf_greedy_reference(None, PROMPTS, n)


@pytest.mark.parametrize("n", [2.0, True])
def test_non_integer_max_new_tokens_is_a_type_error(n):
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        _gen(NextToken(), n)


@pytest.mark.parametrize("n", [0, 1])
def test_patched_model_and_hf_reference_agree_at_few_tokens(n):
    hf = toy.toy_hf_model("v2-lite", seed=5, num_hidden_layers=1)
    prompts = toy.random_prompts(torch.Generator().manual_seed(n), [4, 9])
    want_tokens, want_logits = hf_greedy_reference(hf, prompts, n)
    assert [len(t) for t in want_tokens] == [n, n]
    assert [tuple(w.shape) for w in want_logits] == [(n, hf.config.vocab_size)] * 2
    model = patch(hf)
    model.allocate_cache(16, 4, fill=float("nan"))
    res = greedy_generate(model, prompts, n, block_size=4, num_blocks=16, keep_logits=True, dynamic=False)
    assert res.tokens == want_tokens and len(res.step_logits) == n
    for s in range(n):
        want = torch.stack([want_logits[i][s] for i in range(len(prompts))])
        torch.testing.assert_close(res.step_logits[s], want, atol=2e-5, rtol=1e-4)
