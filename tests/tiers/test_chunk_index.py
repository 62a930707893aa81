"""The chunk index the CPU and disk tiers and the policy simulator share: eviction under
an injected clock, and the tier manager's demotion hook."""

from __future__ import annotations

import torch

from kvtier.chunk_format import encode_chunk
from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.connectors.tiers.chunk_index import ChunkIndex
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.policies.eviction import LRU, ChunkInfo

FP = b"fp"


class _Timed(LRU):
    """LRU that records the times the index passes it."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def insert(self, key, info, now):
        self.times.append(now)
        super().insert(key, info, now)

    def access(self, key, now):
        self.times.append(now)
        super().access(key, now)


def test_evict_while_gives_up_lru_victims_on_the_injected_clock():
    now = [0.0]
    policy = _Timed()
    index: ChunkIndex[str] = ChunkIndex(policy, clock=lambda: now[0])
    for i, key in enumerate("abc"):
        now[0] = float(i)
        index.add(key, f"value-{key}", 100)
    now[0] = 10.0
    assert index.get("a") == ("value-a", 100)  # a is now the most recent
    gone = list(index.evict_while(lambda: index.used_bytes > 100))
    assert gone == [("b", "value-b", 100, None), ("c", "value-c", 100, None)]
    assert index.used_bytes == 100 and "a" in index
    index.add("d", "value-d", 100, now=5.0)  # an explicit time overrides the clock
    assert policy.times == [0.0, 1.0, 2.0, 10.0, 5.0]
    assert index.victim() == "a"
    assert list(index.evict_while(lambda: True, exclude={"a", "d"})) == []  # all excluded


def _blob(i: int) -> tuple[str, bytes]:
    key = f"{i:064x}"
    return key, encode_chunk(key, FP, torch.full((2, 2, 4, 1, 8), float(i)))


def _stack(tmp_path, slots: int) -> TierManager:
    _, blob = _blob(0)
    cpu = CPUTier(slots * len(blob), len(blob), eviction="lru")
    disk = DiskTier(tmp_path / "d", 100 * len(blob), fsync=False)
    return TierManager([cpu, disk], fingerprint=FP)


def test_the_demotion_hook_decides_where_a_victim_goes(tmp_path):
    blobs = [_blob(i) for i in range(3)]
    plain = _stack(tmp_path / "plain", 2)
    try:
        for key, blob in blobs:
            put_blobs(plain, {key: blob})
        assert plain.tiers[1].contains_prefix([blobs[0][0]]) == 1  # demoted to disk
        assert (plain.stats.demotions, plain.stats.demotions_skipped) == (1, 0)
    finally:
        plain.close()
    asked = []
    dropping = _stack(tmp_path / "dropping", 2)
    dropping.demotion = lambda index, nbytes: asked.append((index, nbytes))  # -> None: drop
    try:
        for key, blob in blobs:
            put_blobs(dropping, {key: blob})
        assert asked == [(0, len(blobs[0][1]))]
        assert dropping.lookup([blobs[0][0]]).length == 0  # gone from every tier
        assert (dropping.stats.demotions, dropping.stats.demotions_skipped) == (0, 1)
    finally:
        dropping.close()


def test_an_evicted_chunk_carries_what_its_writer_said_of_it():
    index: ChunkIndex[str] = ChunkIndex(LRU(), clock=lambda: 0.0)
    index.add("a", "va", 10, ChunkInfo(10, "s", 3))
    index.add("b", "vb", 10)
    index.add("c", "vc", 10, ChunkInfo(10, "s", 4))
    index.share("c", "t")  # two sessions use it: no one session's any more
    gone = {g.key: g.info for g in index.evict_while(lambda: index.used_bytes > 0)}
    assert gone == {"a": ChunkInfo(10, "s", 3), "b": None, "c": ChunkInfo(10, None, 4)}
    index.add("a", "va", 10, ChunkInfo(10, "s", 3))
    index.add("a", "va", 10)  # rewritten with nothing said: nothing is remembered
    assert [g.info for g in index.evict_while(lambda: index.used_bytes > 0)] == [None]
