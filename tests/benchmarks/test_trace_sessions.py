"""Conversations rebuilt from Mooncake-format traces on hand-built cases: a shared system
prompt is not a conversation, a conversation whose prompts end in partial blocks stays one,
and two conversations over one document are two sessions sharing its chunks."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.benchmarks.policy_sim.trace_sessions import Request, rebuild_sessions, session_stats
from kvtier.benchmarks.policy_sim.workloads import mooncake

B = 512
TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_excerpt.jsonl"


def _write(tmp_path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": ts * 1000, "input_length": n, "output_length": out,
                    "hash_ids": ids}) + "\n" for ts, n, out, ids in rows))
    return path


def test_a_one_block_common_prefix_with_short_requests_merges_no_conversations(tmp_path):
    # Every request starts with system-prompt block 1. Short one-off requests (one full
    # block, the system prompt, then a partial one) come between two real conversations.
    rows = [
        (0, B + 100, 50, [1, 100]),            # one-off, only the system prompt is full
        (1, 2 * B + 10, 300, [1, 10, 11]),      # conversation A, turn 1
        (2, B + 200, 60, [1, 101]),            # one-off
        (3, 2 * B + 90, 200, [1, 20, 21]),      # conversation B, turn 1
        (4, 3 * B + 5, 100, [1, 10, 12, 13]),   # A, turn 2: extends A's full blocks [1, 10]
        (5, B + 7, 10, [1, 102]),              # one-off
        (6, 3 * B + 70, 100, [1, 20, 22, 23]),  # B, turn 2
        (7, 4 * B + 9, 10, [1, 10, 12, 14, 15]),  # A, turn 3
    ]
    wl = mooncake(_write(tmp_path, rows))
    s = [t.session for t in wl.turns]
    assert s[1] == s[4] == s[7]  # A is one session
    assert s[3] == s[6]  # B is one session
    assert len({s[0], s[2], s[5], s[1], s[3]}) == 5  # the one-offs merge with nothing
    stats = wl.meta["session_stats"]
    assert stats["sessions"] == 5 and stats["turns_per_session_max"] == 3
    assert stats["continuing_fraction"] == 3 / 8
    assert stats["shared_prefix_token_fraction"] > 0  # block 1 is in every session


def test_the_old_rule_would_merge_everything_through_the_system_prompt():
    # A short request whose only full block is the system prompt used to become the
    # "parent" of every later request that starts with it.
    reqs = [Request(0, B + 10, 5, (1, 100))] + [
        Request(i, 2 * B + 10, 5, (1, 200 + i, 300 + i)) for i in range(1, 6)]
    assert rebuild_sessions(reqs, B) == [0, 1, 2, 3, 4, 5]


def test_a_conversation_whose_prompts_end_in_partial_blocks_is_one_session(tmp_path):
    rows = [
        (0, int(2.5 * B), 400, [1, 2, 3]),         # full [1, 2], partial 3
        (10, int(3.6 * B), 300, [1, 2, 4, 5]),     # 3 became 4 once full; partial 5
        (20, int(4.7 * B), 200, [1, 2, 4, 6, 7]),  # and so on
        (30, int(1.2 * B), 100, [50, 51]),         # someone else
    ]
    wl = mooncake(_write(tmp_path, rows))
    assert [t.session for t in wl.turns] == [0, 0, 0, 1]
    assert wl.turns[0].reply_keys == (4,)  # the reply's block is the next prompt's block


def test_two_conversations_sharing_a_long_document_are_two_sessions_sharing_chunks(tmp_path):
    doc = [1, 2, 3, 4, 5, 6]  # a 6-block document both users paste
    rows = [
        (0, 7 * B + 100, 300, [*doc, 10, 11]),           # A asks about it
        (1, 7 * B + 200, 300, [*doc, 20, 21]),           # B asks something else
        (5, 8 * B + 300, 200, [*doc, 10, 12, 13]),       # A follows up
        (6, 8 * B + 400, 200, [*doc, 20, 22, 23]),       # B follows up
    ]
    wl = mooncake(_write(tmp_path, rows))
    a1, b1, a2, b2 = wl.turns
    assert a1.session == a2.session != b1.session == b2.session
    assert a1.chunk_keys[:6] == b1.chunk_keys[:6] == tuple(doc)  # the document's chunks are shared
    stats = wl.meta["session_stats"]
    assert stats["sessions"] == 2 and stats["continuing_fraction"] == 0.5
    assert stats["shared_prefix_token_fraction"] > 0.6


def test_a_continuation_must_be_longer_than_the_prompt_and_part_of_its_reply():
    reqs = [Request(0, 2 * B + 10, 1000, (1, 2, 3)),
            Request(1, 2 * B + 100, 5, (1, 2, 9))]  # longer, but not by half the reply
    assert rebuild_sessions(reqs, B) == [0, 1]
    reqs[1] = Request(1, 2 * B + 10 + 500, 5, (1, 2, 9, 10))
    assert rebuild_sessions(reqs, B) == [0, 0]


def test_the_real_excerpt_is_rebuilt_and_its_statistics_recorded():
    wl = mooncake(TRACE)
    stats = wl.meta["session_stats"]
    assert stats["requests"] == len(wl.turns) == 200
    assert stats["sessions"] == len({t.session for t in wl.turns})
    assert 0 <= stats["continuing_fraction"] < 1
    assert stats["turns_per_session_p50"] <= stats["turns_per_session_p90"] <= stats[
        "turns_per_session_max"]
    again = session_stats([Request(t.arrival_s, t.prompt_tokens, t.output_tokens,
                                   tuple(k if not isinstance(k, tuple) else k[0]
                                         for k in t.chunk_keys)) for t in wl.turns],
                          [t.session for t in wl.turns], B)
    assert again == stats
