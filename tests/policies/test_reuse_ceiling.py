"""The reuse ceiling (issue 34): the share of requested blocks an unbounded cache could
serve, estimated with HyperLogLog sketches, on traces whose ceiling is known by counting."""

from __future__ import annotations

import random

import pytest

from kvtier.policies.reuse_ceiling import ReuseCeiling


def conversations(sessions: int, turns: int, shared: int, seed: int = 0):
    """Chat sessions over one shared system prompt of ``shared`` blocks; each turn's
    prompt is the previous prompt and reply plus 1-3 new blocks. Yields (prompt, reply)."""
    rng = random.Random(seed)
    history = {s: [f"sys{i}" for i in range(shared)] for s in range(sessions)}
    order = [(t, s) for t in range(turns) for s in range(sessions)]
    for t, s in order:
        prompt = history[s] + [f"{s}.{t}.u{i}" for i in range(rng.randint(1, 3))]
        reply = [f"{s}.{t}.r"]
        history[s] = prompt + reply
        yield prompt, reply


def exact(trace) -> float:
    seen: set[str] = set()
    n = new = 0
    for prompt, reply in trace:
        n += len(prompt)
        new += sum(1 for k in prompt if k not in seen)
        seen.update(prompt)
        seen.update(reply)
    return (n - new) / n


@pytest.mark.parametrize(("sessions", "turns", "shared"), [(500, 4, 8), (2000, 1, 0), (300, 6, 0)])
def test_the_estimate_follows_the_counted_ceiling(sessions, turns, shared):
    trace = list(conversations(sessions, turns, shared))
    r = ReuseCeiling()
    for prompt, reply in trace:
        r.requested(prompt)
        r.produced(reply)
    want = exact(trace)
    assert r.ratio() == pytest.approx(want, abs=0.03)
    if turns == 1 and shared == 0:
        assert want == 0.0 and r.ratio() < 0.03  # nothing repeats: nothing can hit


def test_replies_count_as_reusable_only_where_produced():
    """Without the replies fed, the blocks they completed are first sightings."""
    trace = list(conversations(400, 3, 0, seed=1))
    with_replies, prompts_only = ReuseCeiling(), ReuseCeiling()
    for prompt, reply in trace:
        with_replies.requested(prompt)
        with_replies.produced(reply)
        prompts_only.requested(prompt)
    assert prompts_only.ratio() < with_replies.ratio() - 0.05


def test_the_window_forgets_what_it_no_longer_holds():
    """Two phases that share nothing: once the window has moved past the first, the
    ceiling is the second phase's alone."""
    r = ReuseCeiling(window=1000)
    for i in range(3000):  # every block requested twice in a row: ceiling 1/2
        r.requested([f"a{i // 2}"])
    assert r.ratio() == pytest.approx(0.5, abs=0.03)
    for i in range(3000):  # all new: the window holds only these
        r.requested([f"b{i}"])
    assert r.ratio() < 0.03
    assert r.requested_total == 6000


def test_achieved_hits_are_reported_beside_the_ceiling():
    r = ReuseCeiling()
    assert (r.ratio(), r.achieved()) == (0.0, 0.0)
    r.requested([b"\x01" * 16, b"\x02" * 16], served=0)
    r.requested([b"\x01" * 16, b"\x02" * 16, b"\x03" * 16], served=2)
    assert r.achieved() == pytest.approx(2 / 5)
    assert r.ratio() == pytest.approx(2 / 5, abs=0.01)
    with pytest.raises(ValueError):
        ReuseCeiling(window=0)
