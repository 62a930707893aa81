"""The multi-turn replay client of ``kvtier bench vllm`` against a real OpenAI-compatible
server (``kvtier serve`` in engine mode on a tiny model, over loopback HTTP): every turn of
every conversation runs with its history, streams a TTFT and inter-token gaps, and two
replays of the same greedy workload give the same replies; think times follow the seed."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

from kvtier.benchmarks.chat_replay import ChatWorkload, replay
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_server_engine import _config, model_dir  # noqa: F401 - fixture by name


def test_conversations_replay_with_their_history_and_stream(model_dir, tmp_path):  # noqa: F811
    work = ChatWorkload(conversations=3, turns=3, system_words=30, user_words=8,
                        answer_tokens=6, think_median_s=0.01, clients=2)
    state = ServiceState.with_engine(_config(tmp_path), model_dir)
    with running(state) as url:
        done = asyncio.run(replay(url, None, work))
        again = asyncio.run(replay(url, None, work)).turns
        cut = asyncio.run(replay(url, None, ChatWorkload(turns=50, think_median_s=5.0), limit_s=1.0))
    first, wall = done.turns, done.wall_s
    assert done.finished and not cut.finished and cut.wall_s < 10  # a stalled replay stops
    assert [(t.conversation, t.turn) for t in first] == [(c, t) for c in range(3) for t in range(3)]
    assert all(t.error is None and t.text for t in first)
    assert all(t.ttft_s > 0 and not math.isnan(t.ttft_s) for t in first) and wall > 0
    assert all(len(t.itl_s) >= 1 for t in first)  # streamed, not one blob
    for c in range(3):  # sent after the clock started, each turn after the last one's reply
        starts = [t.started_s for t in first if t.conversation == c]
        assert 0 <= starts[0] < starts[1] < starts[2] < wall
    prompts = [t.prompt_tokens for t in first if t.conversation == 0]
    assert prompts == sorted(prompts) and prompts[0] < prompts[-1]  # each turn carries the last
    assert [t.text for t in first] == [t.text for t in again]  # greedy: the same replies


def test_session_ids_reach_the_server_one_per_conversation(model_dir, tmp_path):  # noqa: F811
    """With ``session_ids`` each conversation's turns carry its id (``X-Session-Id``): the
    engine keeps one session a conversation, where anonymous turns leave none behind, and
    the replies are the same."""
    import httpx

    work = ChatWorkload(conversations=3, turns=2, system_words=30, user_words=8,
                        answer_tokens=6, think_median_s=0.01, clients=2)
    state = ServiceState.with_engine(_config(tmp_path), model_dir)
    with running(state) as url:
        anonymous = asyncio.run(replay(url, None, work)).turns
        kept_anonymous = httpx.get(f"{url}/v1/stats").json()["sessions"]["total"]
        named = asyncio.run(replay(url, None, replace(work, session_ids=True))).turns
        kept_named = httpx.get(f"{url}/v1/stats").json()["sessions"]["total"]
    assert kept_anonymous == 0 and kept_named == 3
    assert work.session_id(-1) is None and replace(work, session_ids=True).session_id(2) == "chat-0-2"
    assert all(t.error is None for t in named)
    assert [t.text for t in named] == [t.text for t in anonymous]


def test_think_times_are_seeded_and_heavy_tailed():
    work = ChatWorkload(think_median_s=2.0)
    gaps = [work.think_s(c, t) for c in range(50) for t in range(1, 20)]
    assert gaps == [ChatWorkload(think_median_s=2.0).think_s(c, t) for c in range(50) for t in range(1, 20)]
    gaps.sort()
    assert 1.5 < gaps[len(gaps) // 2] < 2.5 and gaps[-1] > 4 * gaps[len(gaps) // 2]
    assert ChatWorkload(seed=1).message(0, 0) != work.message(0, 0)


def test_the_warm_ups_share_no_prefix_with_the_conversations_or_each_other():
    from kvtier.benchmarks.chat_replay import WARMUP_REQUESTS

    work = ChatWorkload(system_words=50)
    warm = [work.warmup_messages(i)[0]["content"] for i in range(WARMUP_REQUESTS)]
    assert WARMUP_REQUESTS >= 2 and warm[0] == work.warmup_messages()[0]["content"]
    for text in warm:
        assert len(text.split()) > 50 and not text.startswith(work.system_prompt()[:20])
        assert text.split()[1:6] != work.system_prompt().split()[:5]
    assert warm[0].split()[1:6] != warm[1].split()[1:6]
