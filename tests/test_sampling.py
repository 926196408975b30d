"""The batched sampler against its contract: exact argmax when greedy, per-row (seed, step) streams
independent of the batch, the top-k / top-p distributions against a float64 reference, compiled."""

from __future__ import annotations

import pytest
import torch

from mla_compile.serving.sampling import SamplingParams, sample

VOCAB = 32
N_DRAWS = 100_000
P_MIN = 1e-4


def _row() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1234)) * 1.5


def _batch(rows, temperature, top_k, top_p, seeds, steps):
    n = rows.shape[0]

    def full(value, dtype):
        return torch.as_tensor(value, dtype=dtype).expand(n).clone()

    return (rows, full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
            full(seeds, torch.int64), full(steps, torch.int64))


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_k=2.0), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"),
    (dict(seed=True), "seed"), (dict(stop_token_ids=[1]), "stop_token_ids"), (dict(stop_token_ids=(1, -2)),
                                                                               "stop_token_ids"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=None), "max_new_tokens"),
])
def test_params_reject_bad_fields_naming_field_and_value(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message) as info:
        SamplingParams(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_params_defaults_are_greedy_and_valid_values_are_kept():
    assert SamplingParams().greedy
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2**63 - 1, stop_token_ids=(3,))
    assert not params.greedy and params.seed == 2**63 - 1


def test_greedy_rows_are_argmax_bit_exactly():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    args = _batch(logits, 0.0, 7, 0.3, torch.arange(64), 5)
    assert torch.equal(sample(*args), logits.argmax(-1))


def _mixed_rows(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 200, generator=gen) * 2
    temperature = torch.where(torch.rand(n, generator=gen) < 0.2, 0.0, torch.rand(n, generator=gen) + 0.3)
    top_k = torch.randint(0, 20, (n,), generator=gen)
    top_p = torch.rand(n, generator=gen) * 0.9 + 0.1
    seeds = torch.randint(0, 2**62, (n,), generator=gen) * 2
    steps = torch.randint(0, 1000, (n,), generator=gen)
    return logits, temperature, top_k, top_p, seeds, steps


def test_a_rows_token_depends_on_its_seed_and_step_only_not_on_the_batch():
    rows = _mixed_rows(16, 0)
    tokens = sample(*rows)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(*(t[perm] for t in rows)), tokens[perm])
    others = _mixed_rows(24, 2)
    extended = sample(*(torch.cat([o, t]) for o, t in zip(others, rows)))
    assert torch.equal(extended[24:], tokens)
    alone = torch.cat([sample(*(t[i:i + 1] for t in rows)) for i in range(16)])
    assert torch.equal(alone, tokens)
    moved = sample(*rows[:5], rows[5] + 1)  # another step is another stream
    assert not torch.equal(moved, tokens)


def _reference(row: torch.Tensor, temperature: float, top_k: int, top_p: float, strict: bool = False):
    """float64 probabilities of the sampler's contract; ``strict``: a wrong nucleus that drops the token
    crossing ``top_p`` (used to show the test would catch it)."""
    scaled = row.double() / temperature
    order = torch.sort(scaled, descending=True, stable=True).indices
    probs = torch.softmax(scaled[order], 0)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    mass = 0.0
    for i in range(VOCAB):
        reached = mass + probs[i] >= top_p if strict else mass >= top_p
        if i > 0 and reached:
            keep[i] = False
        mass += float(probs[i])
    probs = torch.where(keep, probs, 0.0)
    out = torch.zeros(VOCAB, dtype=torch.float64)
    out[order] = probs / probs.sum()
    return out


def _chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square; bins expecting < 5 draws are pooled; draws outside the support: 0."""
    expected = expected_probs * counts.sum()
    if counts[expected_probs == 0].sum() > 0:
        return 0.0
    small = (expected < 5) & (expected > 0)
    obs = torch.cat([counts[expected >= 5], counts[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[expected >= 5], expected[small].sum(0, keepdim=True)])
    obs, exp = (obs, exp) if exp[-1] >= 5 else (obs[:-1], exp[:-1])
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(obs.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (1.0, 8, 0.9)])
def test_draws_follow_the_float64_reference_distribution(temperature, top_k, top_p):
    row = _row()
    args = _batch(row.expand(N_DRAWS, VOCAB), temperature, top_k, top_p, 20240601, torch.arange(N_DRAWS))
    counts = torch.bincount(sample(*args), minlength=VOCAB).double()
    assert _chi_square_p(counts, _reference(row, temperature, top_k, top_p)) > P_MIN
    if top_p < 1:  # the same check rejects a nucleus off by one token
        assert _chi_square_p(counts, _reference(row, temperature, top_k, top_p, strict=True)) < P_MIN


def test_compiled_fullgraph_matches_eager_across_batch_sizes_without_recompiling():
    torch._dynamo.reset()
    compiled = torch.compile(sample, fullgraph=True, dynamic=True)
    rows = _mixed_rows(40, 3)
    assert torch.equal(compiled(*(t[:2] for t in rows)), sample(*(t[:2] for t in rows)))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (3, 17, 40):
            part = [t[:n] for t in rows]
            assert torch.equal(compiled(*part), sample(*part))


def test_sampling_rows_fill_fixed_views_with_greedy_padding_and_refuse_bad_rows():
    from mla_compile.serving.sampling import SamplingRows

    rows = SamplingRows(6, "cpu")
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11),
              SamplingParams(temperature=1.3, seed=2**63 - 1)]
    before = {k: v.data_ptr() for k, v in rows.views(4).items()}
    views = rows.fill(params, [3, 0], 4)
    assert {k: v.data_ptr() for k, v in views.items()} == before, "the same addresses every step"
    assert views["temperature"].tolist() == [0.7, 1.3, 0.0, 0.0] and views["top_k"].tolist() == [5, 0, 0, 0]
    assert views["top_p"].tolist() == [0.9, 1.0, 1.0, 1.0] and views["seeds"].tolist() == [11, 2**63 - 1, 0, 0]
    assert views["steps"].tolist() == [3, 0, 0, 0]
    logits = torch.randn(4, 50, dtype=torch.float64)
    want = sample(logits, torch.tensor([0.7, 1.3, 0, 0]), torch.tensor([5, 0, 0, 0]), torch.tensor([0.9, 1, 1, 1]),
                  torch.tensor([11, 2**63 - 1, 0, 0]), torch.tensor([3, 0, 0, 0]))
    assert torch.equal(sample(logits, **views), want)
    assert torch.equal(sample(logits, **views)[2:], logits.argmax(-1)[2:]), "padding rows are greedy"
    views = rows.fill(params[:1], [1], 2)  # row 1 is padding now: cleared to greedy
    assert rows.views(4)["temperature"].tolist() == [0.7, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 params and 1 steps for 2 rows"):
        rows.fill(params, [1], 2)
    with pytest.raises(ValueError, match="at most max_batch=6"):
        rows.fill(params, [1, 2], 7)
    with pytest.raises(ValueError, match="seed must be set"):
        rows.fill([SamplingParams()], [0], 2)
