"""The asyncio wrapper: concurrent sessions from many coroutines, streaming, errors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtier.engine.async_engine import AsyncEngine
from kvtier.engine.engine import Engine, RequestError
from kvtier.engine.sampling import SamplingParams
from kvtier.make_model.writer import make_model
from tests.engine_config import engine_config

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("tiny") / "model", seed=5).path


def _engine(model_dir, **kw):
    return Engine(model_dir, engine_config(num_blocks=128, tiers=None, **kw))


def test_concurrent_sessions_match_the_sync_engine(model_dir):
    sync = _engine(model_dir)
    expected = {}
    for i in range(4):
        expected[f"s{i}"] = [
            sync.chat(f"s{i}", f"message {i} turn 1", GREEDY).token_ids,
            sync.chat(f"s{i}", f"message {i} turn 2", GREEDY).token_ids,
        ]

    async def conversation(aeng: AsyncEngine, sid: str, i: int) -> list[list[int]]:
        first = await aeng.chat(sid, f"message {i} turn 1", GREEDY)
        second = await aeng.chat(sid, f"message {i} turn 2", GREEDY)
        assert second.stats.reused_tokens > 0
        return [first.token_ids, second.token_ids]

    async def main():
        aeng = AsyncEngine(_engine(model_dir))
        try:
            got = await asyncio.gather(*(conversation(aeng, f"s{i}", i) for i in range(4)))
        finally:
            aeng.close()
        return dict(zip(expected, got, strict=True))

    assert asyncio.run(main()) == expected


def test_stream_yields_deltas_then_the_result(model_dir):
    async def main():
        aeng = AsyncEngine(_engine(model_dir))
        try:
            items = [item async for item in aeng.stream("x", "stream me", GREEDY)]
        finally:
            aeng.close()
        return items

    items = asyncio.run(main())
    *deltas, result = items
    assert all(isinstance(d, str) for d in deltas)
    assert "".join(deltas) == result.text and result.stats.output_tokens == 8


def test_errors_reach_the_caller_and_the_loop_survives(model_dir):
    async def main():
        aeng = AsyncEngine(_engine(model_dir, max_model_len=48))
        try:
            with pytest.raises(RequestError, match="max_model_len"):
                await aeng.chat("long", "word " * 100, GREEDY)
            ok = await aeng.chat("short", "hi", GREEDY)
        finally:
            aeng.close()
        return ok

    assert asyncio.run(main()).stats.output_tokens == 8


def test_one_turn_per_session_at_a_time(model_dir):
    async def main():
        aeng = AsyncEngine(_engine(model_dir))
        try:
            first = asyncio.ensure_future(aeng.chat("s", "one", SamplingParams(max_tokens=30)))
            await asyncio.sleep(0)
            with pytest.raises(Exception, match="already has a turn in flight"):
                await aeng.chat("s", "two", GREEDY)
            await first
        finally:
            aeng.close()

    asyncio.run(main())
