"""Tiers evict by a configurable policy: LRU by default, kvtier's session-aware policy when
chunks carry their session and position."""

from __future__ import annotations

import pytest

from kvtier.chunk_format import encode_chunk
from kvtier.config import TiersConfig
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.factory import build_tiers
from kvtier.errors import ConfigError
from kvtier.policies.eviction import LFU, ChunkInfo, SessionAware

FP = b"f" * 16


def _blob(i: int) -> tuple[str, bytes]:
    import torch

    key = f"{i:064x}"
    return key, encode_chunk(key, FP, torch.full((2, 2, 4, 1, 8), float(i)))


def _tier(kind: str, tmp_path, slots: int, eviction):
    key, blob = _blob(0)
    if kind == "cpu":
        return CPUTier(slots * len(blob), len(blob), eviction=eviction)
    return DiskTier(tmp_path / "d", slots * len(blob), fsync=False, eviction=eviction)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_session_aware_tier_gives_up_the_idle_sessions_tail_first(kind, tmp_path):
    away = {"idle": 10.0, "active": 0.1}
    policy = SessionAware(predictor=lambda s, now: away[s])
    tier = _tier(kind, tmp_path, 4, policy)
    try:
        chunks = {s: [_blob(10 * n + i) for i in range(2)] for n, s in enumerate(away, 1)}
        for sid, pairs in chunks.items():
            put_blobs(tier, dict(pairs), {k: ChunkInfo(len(b), sid, i) for i, (k, b) in enumerate(pairs)})
        assert tier.eviction is policy and len(tier) == 4
        put_blobs(tier, dict([_blob(99)]))  # one more chunk: the idle session's last chunk goes
        idle0, idle1 = (k for k, _ in chunks["idle"])
        assert tier.contains_prefix([idle0, idle1]) == 1
        put_blobs(tier, dict([_blob(98)]))  # then its first
        assert tier.contains_prefix([idle0]) == 0
        assert tier.contains_prefix([k for k, _ in chunks["active"]]) == 2
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("eviction", ["lru", "session-aware"])
def test_a_chain_read_head_to_tail_gives_up_its_tail_first(kind, eviction, tmp_path):
    """Chunks without a session under a recency policy (LRU, or the session-aware
    policy's shared chunks): reading a chain leaves its head the most recently used, so
    the tier lets its tail go first and what stays is a prefix a restore can use."""
    tier = _tier(kind, tmp_path, 3, eviction)
    try:
        chain = [_blob(i) for i in range(3)]
        put_blobs(tier, dict(chain))
        get_blobs(tier, [k for k, _ in chain])  # a restore reads it, head to tail
        put_blobs(tier, dict([_blob(7)]))
        assert tier.contains_prefix([k for k, _ in chain]) == 2  # the tail went, not the head
    finally:
        tier.close()


def test_tiers_default_to_lru_and_take_any_policy_by_name_or_instance(tmp_path):
    tier = _tier("cpu", tmp_path, 2, "lru")
    try:
        a, b, c = (_blob(i) for i in range(3))
        put_blobs(tier, dict([a, b]))
        get_blobs(tier, [a[0]])  # a is now the most recently used
        put_blobs(tier, dict([c]))
        assert tier.contains_prefix([a[0]]) == 1 and tier.contains_prefix([b[0]]) == 0
    finally:
        tier.close()
    lfu = _tier("disk", tmp_path, 2, LFU())
    try:
        assert isinstance(lfu.eviction, LFU)
    finally:
        lfu.close()


def test_unknown_tier_eviction_policy_is_a_config_error(tmp_path):
    cfg = TiersConfig(cpu_eviction="mru", disk_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="tiers.cpu_eviction: unknown eviction policy 'mru'.*session-aware"):
        build_tiers(cfg, cpu_unit_bytes=1 << 16, fingerprint=b"fp")
    assert not any(tmp_path.iterdir()), "nothing is built before the names are checked"
    assert TiersConfig().cpu_eviction == "session-aware"


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_prefix_two_sessions_share_is_not_lost_with_its_first_owner(kind, tmp_path):
    """Session "a" stores [sys, a1]; "b" stores [sys, b1], sys being there already. When
    the tier then gives up "a" (away longest), sys stays: losing it would cut "b"'s stored
    prefix at its start."""
    away = {"a": 10.0, "b": 0.1}
    tier = _tier(kind, tmp_path, 3, SessionAware(predictor=lambda s, now: away[s]))
    try:
        sys_key, sys_blob = _blob(1)
        (a1, a1_blob), (b1, b1_blob) = _blob(2), _blob(3)
        put_blobs(tier, {sys_key: sys_blob, a1: a1_blob}, {sys_key: ChunkInfo(len(sys_blob), "a", 0),
                                                     a1: ChunkInfo(len(a1_blob), "a", 1)})
        res = put_blobs(tier, {sys_key: sys_blob, b1: b1_blob}, {sys_key: ChunkInfo(len(sys_blob), "b", 0),
                                                          b1: ChunkInfo(len(b1_blob), "b", 1)})
        assert res.present == [sys_key]
        put_blobs(tier, dict([_blob(98)]))  # "a"'s own chunk goes...
        put_blobs(tier, dict([_blob(97)]))  # ...and then "b"'s, not the shared one
        assert tier.contains_prefix([sys_key]) == 1 and tier.contains_prefix([a1]) == 0
    finally:
        tier.close()


def test_sharing_a_chunk_already_stored_moves_it_out_of_its_first_owners_session():
    policy = SessionAware(predictor=lambda s, now: {"a": 10.0, "b": 0.1}[s])
    policy.insert("sys", ChunkInfo(1, "a", 0), 0.0)
    policy.insert("b1", ChunkInfo(1, "b", 1), 0.0)
    policy.share("sys", "a")  # its own owner: nothing changes
    assert policy.victim(0.0) == "sys"
    policy.share("sys", "b")
    assert policy.victim(0.0) == "b1"  # the shared chunk goes last


def test_a_demoted_chunk_keeps_its_session_in_the_tier_below(tmp_path):
    """A chunk the CPU tier hands down is still its session's on the disk: the disk's
    session-aware policy gives it up before a prefix sessions share (a demoted chunk
    that lost its session would rank as shared, kept last, and crowd out the copies that
    let the pool free blocks with no write)."""
    from kvtier.connectors.tiers.manager import TierManager

    cpu = _tier("cpu", tmp_path, 1, SessionAware(predictor=lambda s, now: 1.0))
    disk = DiskTier(tmp_path / "d", 2 * len(_blob(0)[1]), fsync=False,
                    eviction=SessionAware(predictor=lambda s, now: 1.0))
    manager = TierManager([cpu, disk])
    try:
        (shared, shared_blob), (own, own_blob), (nxt, nxt_blob) = _blob(1), _blob(2), _blob(3)
        put_blobs(disk, {shared: shared_blob}, {shared: ChunkInfo(len(shared_blob))})
        put_blobs(manager, {own: own_blob}, {own: ChunkInfo(len(own_blob), "s", 1)})
        put_blobs(manager, {nxt: nxt_blob}, {nxt: ChunkInfo(len(nxt_blob), "t", 0)})
        assert manager.stats.demotions == 1 and disk.contains_prefix([own]) == 1
        put_blobs(disk, dict([_blob(99)]))  # the disk is full: the session's chunk goes
        assert disk.contains_prefix([own]) == 0 and disk.contains_prefix([shared]) == 1
    finally:
        manager.close()


@pytest.mark.parametrize("how", ["read", "prefetch"])
def test_a_promoted_chunk_keeps_its_session_in_the_fastest_tier(tmp_path, how):
    """A chunk read from the disk (or prefetched) is copied into the CPU tier ranked as its
    session's, as the disk held it: not as a prefix sessions share, kept last."""
    from kvtier.connectors.tiers.manager import TierManager

    cpu = _tier("cpu", tmp_path, 2, SessionAware(predictor=lambda s, now: 1.0))
    disk = DiskTier(tmp_path / "d", 4 * len(_blob(0)[1]), fsync=False,
                    eviction=SessionAware(predictor=lambda s, now: 1.0))
    manager = TierManager([cpu, disk])
    try:
        key, blob = _blob(5)
        put_blobs(manager, {key: blob}, {key: ChunkInfo(len(blob), "s", 2)}, tier="disk")
        assert cpu.chunk_info(key) is None and disk.chunk_info(key) == ChunkInfo(len(blob), "s", 2)
        if how == "read":
            assert get_blobs(manager, [key])[0] is not None
        else:
            assert manager.prefetch([key]) == 1
        assert cpu.contains_prefix([key]) == 1
        assert cpu.chunk_info(key) == ChunkInfo(len(blob), "s", 2)
    finally:
        manager.close()
