"""Reuse by content: any turn finds the longest stored prefix of its prompt in every tier,
whoever stored it — a new session sharing a long system prompt, the first turn after a
restart — and never a prefix stored under another model's fingerprint."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import TiersConfig
from kvtier.engine.engine import Engine
from kvtier.engine.sampling import SamplingParams
from kvtier.make_model.writer import make_model
from tests import redis_servers
from tests.engine_config import engine_config

redis_server = redis_servers.redis_server  # the real-server fixture, used by name

GREEDY = SamplingParams(max_tokens=8)
CHUNK = 64
LONG_SYSTEM = (
    "You are the storage team's assistant. You know paged KV caches, prefix caching, CPU "
    "arenas, NVMe files and Redis, and you answer in two sentences at most. "
) * 6
TIERS = {
    "cpu": dict(cpu_bytes=64 << 20, disk_bytes=0),
    "disk": dict(cpu_bytes=0, disk_bytes=256 << 20),
    "redis": dict(cpu_bytes=0, disk_bytes=0),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=7).path


def _engine(model_dir, chunks_dir, tiers: dict | None) -> Engine:
    cfg = None
    if tiers is not None:
        cfg = TiersConfig(disk_dir=str(chunks_dir), disk_fsync=False, **tiers)
    return Engine(model_dir, engine_config(num_blocks=128, tiers=cfg, chunk_tokens=CHUNK))


def _system_chunks(engine: Engine) -> int:
    """Tokens of the full chunks the system prompt alone fills."""
    ids = engine.tokenizer.apply_chat_template([{"role": "system", "content": LONG_SYSTEM}],
                                               add_generation_prompt=False)
    assert len(ids) >= 2 * CHUNK  # the prompt spans whole chunks, or nothing could be shared
    return len(ids) // CHUNK * CHUNK


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_new_session_loads_a_system_prompt_another_session_stored(model_dir, tmp_path,
                                                                     request, tier):
    tiers = dict(TIERS[tier])
    if tier == "redis":
        tiers["redis_url"] = request.getfixturevalue("redis_server").url
    plain = _engine(model_dir, tmp_path / "plain", None)
    expected = plain.chat("b", "Where do idle sessions go?", GREEDY, system=LONG_SYSTEM)
    plain.close()

    eng = _engine(model_dir, tmp_path / "chunks", tiers)
    try:
        eng.chat("a", "What is a KV cache?", GREEDY, system=LONG_SYSTEM)
        off = eng.offload("a", tier)  # a's blocks leave the pool; its KV is only in the tier
        assert off.freed_blocks > 0 and not off.failed
        turn = eng.chat("b", "Where do idle sessions go?", GREEDY, system=LONG_SYSTEM)
        shared = _system_chunks(eng)
    finally:
        eng.close()
    assert turn.stats.restored_tokens >= shared
    assert turn.stats.restored_from == {tier: turn.stats.restored_tokens}
    assert turn.stats.restored_bytes > 0
    assert turn.token_ids == expected.token_ids  # the same reply as computing it all


def test_the_first_turn_after_a_restart_restores_from_disk(model_dir, tmp_path):
    plain = _engine(model_dir, tmp_path / "plain", None)
    expected = plain.chat("s", "What is a KV cache?", GREEDY, system=LONG_SYSTEM)
    plain.close()
    first = _engine(model_dir, tmp_path / "chunks", TIERS["disk"])
    try:
        turn1 = first.chat("s", "What is a KV cache?", GREEDY, system=LONG_SYSTEM)
        first.offload("s", "disk")
    finally:
        first.close()
    assert turn1.stats.restored_tokens == 0

    second = _engine(model_dir, tmp_path / "chunks", TIERS["disk"])  # a restarted server
    try:
        again = second.chat("s", "What is a KV cache?", GREEDY, system=LONG_SYSTEM)
    finally:
        second.close()
    # Every whole chunk of the prompt (a stored tail too, where one ends on the same
    # block), never the last token: its logits start the reply.
    n = again.stats.prompt_tokens
    assert (n - 1) // CHUNK * CHUNK <= again.stats.restored_tokens <= n - 1
    assert again.stats.restored_from == {"disk": again.stats.restored_tokens}
    assert again.token_ids == expected.token_ids


def test_a_prefix_another_model_stored_is_never_used(model_dir, tmp_path):
    other = make_model("tiny", tmp_path / "other-tiny", seed=8).path
    writer = _engine(other, tmp_path / "chunks", TIERS["disk"])
    try:
        writer.chat("s", "What is a KV cache?", GREEDY, system=LONG_SYSTEM)
        writer.offload("s", "disk")
    finally:
        writer.close()
    files_before = sorted(p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file())
    assert files_before

    reader = _engine(model_dir, tmp_path / "chunks", TIERS["disk"])
    try:
        turn = reader.chat("s", "What is a KV cache?", GREEDY, system=LONG_SYSTEM)
    finally:
        reader.close()
    assert turn.stats.restored_tokens == 0 and turn.stats.restored_from == {}
    files_after = sorted(p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file())
    assert set(files_before) <= set(files_after)  # the other model's chunks are left alone
