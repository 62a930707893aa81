"""Following the best candidate (issue 34's adaptive layer): the live rule is the one whose
shadow served its last ``window`` turns fastest, judged only once every shadow has served
``min_turns``, and a tie keeps the current rule."""

from __future__ import annotations

import pytest

from kvtier.errors import InvalidArgumentError
from kvtier.policies.follow_the_best import FollowTheBest


def test_the_first_candidate_leads_until_every_candidate_has_min_turns():
    judge = FollowTheBest(["pays", "through"], window=8, min_turns=3)
    for _ in range(3):
        judge.observe("through", 0.1)
        judge.observe("pays", 1.0)
        assert judge.choose() == ("pays" if judge.mean("pays") is None else "through")
    assert judge.current == "through" and judge.switches == 1
    assert judge.mean("through") == pytest.approx(0.1)  # judged on the 3 it has of 8


def test_it_follows_the_recent_best_and_ties_keep_the_current():
    judge = FollowTheBest(["pays", "through"], window=2, min_turns=2)
    for ttft in (0.5, 0.5):
        judge.observe("pays", ttft)
        judge.observe("through", ttft)
    assert judge.choose() == "pays"  # a tie: stays
    for _ in range(2):  # "pays" slows down: its window now holds only slow turns
        judge.observe("pays", 2.0)
        judge.observe("through", 0.5)
    assert judge.choose() == "through"
    judge.observe("through", 3.0)
    judge.observe("through", 3.0)  # the old fast turns have left the window
    assert judge.mean("through") == pytest.approx(3.0) and judge.choose() == "pays"
    assert judge.switches == 2 and sum(judge.turns_followed.values()) == 3


def test_bad_candidates_are_refused():
    with pytest.raises(InvalidArgumentError):
        FollowTheBest([])
    with pytest.raises(InvalidArgumentError):
        FollowTheBest(["a", "a"])
    with pytest.raises(InvalidArgumentError):
        FollowTheBest(["a"], window=0)
    with pytest.raises(InvalidArgumentError):
        FollowTheBest(["a"], window=4, min_turns=5)
