"""Sampling and stop conditions on hand-checkable distributions."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.sampling import SamplingParams, StopChecker, sample, sample_one
from kvtier.errors import InvalidArgumentError


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 4.9]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]) == [1, 0]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=123)
    alone = [sample_one(logits[1], p, p.make_generator()) for _ in range(1)]
    gens = [SamplingParams(temperature=1.0, seed=s).make_generator() for s in (7, 123, 9)]
    params = [SamplingParams(temperature=1.0, seed=s) for s in (7, 123, 9)]
    batched = sample(logits, params, gens)
    assert batched[1] == alone[0]
    g1, g2 = p.make_generator(), p.make_generator()
    seq1 = [sample_one(logits[0], p, g1) for _ in range(20)]
    seq2 = [sample_one(logits[0], p, g2) for _ in range(20)]
    assert seq1 == seq2 and len(set(seq1)) > 1


def test_top_k_only_returns_the_k_best():
    logits = torch.tensor([1.0, 5.0, 4.0, 3.0, 0.0, 2.0])
    p = SamplingParams(temperature=1.0, top_k=2, seed=1)
    g = p.make_generator()
    assert {sample_one(logits, p, g) for _ in range(200)} == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=3)  # 0.5 < 0.7 <= 0.8: keep 2
    g = p.make_generator()
    assert {sample_one(logits, p, g) for _ in range(300)} == {0, 1}
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=3)  # the top token alone reaches 0.5
    g = p.make_generator()
    assert {sample_one(logits, p, g) for _ in range(100)} == {0}


def test_low_temperature_concentrates_mass():
    logits = torch.tensor([2.0, 1.9, 0.0])
    p = SamplingParams(temperature=0.01, seed=5)  # odds e^10 : 1
    g = p.make_generator()
    draws = [sample_one(logits, p, g) for _ in range(200)]
    assert draws.count(0) > 190


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ("",)}, "stop strings"),
    ],
)
def test_bad_params_are_rejected(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SamplingParams(**kwargs)


def test_sample_checks_shapes():
    with pytest.raises(InvalidArgumentError, match="one params and generator per row"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None])


def test_stop_checker_tokens_and_length():
    c = StopChecker(SamplingParams(max_tokens=3, stop_token_ids=(9,)), frozenset({2}))
    assert c.check_token(5, 1) is None
    assert c.check_token(2, 1) == "stop"
    assert c.check_token(9, 1) == "stop"
    assert c.check_token(5, 3) == "length"
    ignore = StopChecker(SamplingParams(ignore_eos=True), frozenset({2}))
    assert ignore.check_token(2, 1) is None


def test_stop_strings_found_across_increments():
    c = StopChecker(SamplingParams(stop=("END", "\n\n")))
    assert c.find_stop_string("hello EN", 0) is None
    assert c.find_stop_string("hello END", new_from=8) == 6  # match straddles the boundary
    assert c.find_stop_string("a\n\nb END", 0) == 1  # earliest wins
    assert c.find_stop_string("END then more", new_from=12) is None  # old match not rescanned
