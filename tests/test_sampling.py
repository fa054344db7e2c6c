"""kvcourse.sampling: greedy is argmax, temperature/top-k/top-p keep exactly the hand-computed sets (in
that order), a seeded generator reproduces its draws, and bad parameters are refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from kvcourse.sampling import SamplingParams, allowed_logits, make_generator, sample


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is ``probs``."""
    return torch.tensor([math.log(p) for p in probs])


def allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    return set(torch.nonzero(torch.isfinite(allowed_logits(logits, params))).flatten().tolist())


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 300, seed: int = 0) -> list[int]:
    g = make_generator(seed)
    return [sample(logits, params, g) for _ in range(n)]


def test_docstring_examples():
    assert sample(torch.tensor([1.0, 3.0, 2.0]), SamplingParams()) == 1
    assert SamplingParams(temperature=1.0, seed=10).seed_of(2) == 12
    assert SamplingParams().seed_of(3) is None


def test_greedy_is_argmax_and_ignores_the_generator():
    rows = torch.randn(50, 1000, generator=torch.Generator().manual_seed(0))  # (50, vocab)
    expected = rows.argmax(-1).tolist()
    assert [sample(row, SamplingParams()) for row in rows] == expected
    assert [sample(row, SamplingParams(top_k=3, top_p=0.5), make_generator(1)) for row in rows] == expected


def test_top_k_1_is_argmax_at_any_temperature():
    rows = torch.randn(50, 1000, generator=torch.Generator().manual_seed(1))
    g = make_generator(0)
    params = SamplingParams(temperature=2.5, top_k=1)
    assert [sample(row, params, g) for row in rows] == rows.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), {0, 1, 2, 3}),
        (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),  # 0.5 < 0.7, then 0.5 + 0.3 >= 0.7
        (SamplingParams(temperature=1.0, top_p=0.45), {0}),  # 0.5 alone reaches it
        (SamplingParams(temperature=1.0, top_p=0.81), {0, 1, 2}),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.7), {0, 1}),
        # temperature first: at 0.5 the probabilities become ~[.69, .25, .06, .01]: 0.69 >= 0.6
        (SamplingParams(temperature=0.5, top_p=0.6), {0}),
        (SamplingParams(temperature=4.0, top_p=0.6), {0, 1, 2}),  # flatter: [.31, .28, .23, .18]
    ],
)
def test_allowed_sets_are_the_hand_computed_ones(params, expected):
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    assert allowed(logits, params) == expected
    assert set(draws(logits, params)) == expected  # every allowed token is drawn, no other


def test_top_k_is_applied_before_top_p():
    """probs [0.4, 0.3, 0.2, 0.1], top_k 2, top_p 0.5: top-k leaves [4/7, 3/7], and 4/7 alone reaches
    0.5, so only token 0 is left. (Top-p first would keep {0, 1}: 0.4 < 0.5.)"""
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    assert allowed(logits, params) == {0}
    assert set(draws(logits, params)) == {0}


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0])
    assert allowed(logits, SamplingParams(temperature=1.0, top_k=2)) == {0, 1, 2}


def test_temperature_divides_the_logits():
    logits = torch.tensor([1.0, -2.0, 0.5])
    assert torch.equal(allowed_logits(logits, SamplingParams(temperature=0.5)), logits / 0.5)


def test_draw_frequencies_follow_the_probabilities():
    """A fixed seed makes this deterministic; 4000 draws put each frequency within 0.03 of its
    probability."""
    probs = [0.5, 0.3, 0.15, 0.05]
    got = draws(logits_of(probs), SamplingParams(temperature=1.0), n=4000, seed=3)
    for token, p in enumerate(probs):
        assert abs(got.count(token) / len(got) - p) < 0.03


def test_a_seeded_generator_reproduces_its_draws():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, top_p=0.95)
    assert draws(logits, params, seed=7) == draws(logits, params, seed=7)
    assert draws(logits, params, seed=7) != draws(logits, params, seed=8)
    first, second = draws(logits, params, n=20, seed=None), draws(logits, params, n=20, seed=None)
    assert first != second  # no seed: a fresh random stream each time


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, r"temperature must be >= 0 \(0 = greedy\), got -0.5"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"top_k": -1}, r"top_k must be an integer >= 0 \(0 = off\), got -1"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0 .*got 2.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\] \(1 = off\), got 1.5"),
        ({"seed": "7"}, "seed must be an integer or None, got '7'"),
    ],
)
def test_bad_params_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
