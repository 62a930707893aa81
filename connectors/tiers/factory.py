"""Building the tier stack from configuration (the embedded default: CPU arena + disk)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from kvtier.config import TiersConfig
from kvtier.connectors.tiers.base import Tier
from kvtier.connectors.tiers.codec_setup import CodecContext, resolve_codecs
from kvtier.connectors.tiers.manager import TierManager
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.policies.eviction import EvictionPolicy, eviction_policy

log = logging.getLogger(__name__)


def default_disk_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "chunks"


def configured_eviction(cfg: TiersConfig, field: str) -> EvictionPolicy:
    """The eviction policy ``tiers.<field>`` names; an unknown name is a config error that
    lists the known ones (checked here, where the name is used: config stays a leaf)."""
    try:
        return eviction_policy(getattr(cfg, field))
    except InvalidArgumentError as exc:
        raise ConfigError(f"tiers.{field}: {exc}") from None


def build_tiers(cfg: TiersConfig, cpu_unit_bytes: int, fingerprint: bytes,
                codecs: CodecContext | None = None) -> TierManager | None:
    """CPU, disk and Redis tiers as configured, fastest first; None when all are off.
    ``cpu_unit_bytes``: the CPU arena's allocation unit (one full chunk where the model is
    known; a chunk of any size takes as many units as it needs), rounded up to a page.
    ``codecs``: what resolving a tier's ``auto`` codec needs (None: ``auto`` is none)."""
    from kvtier.connectors.tiers.host_buffers import StagingPool, round_up

    tiers: list[Tier] = []
    staging = StagingPool()  # one pool of reused buffers: the manager's writes, disk and Redis reads
    unit = round_up(cpu_unit_bytes)  # page-aligned chunks: a demotion writes them with O_DIRECT as they are
    cpu_eviction = configured_eviction(cfg, "cpu_eviction")
    disk_eviction = configured_eviction(cfg, "disk_eviction")
    if cfg.cpu_bytes:
        from kvtier.connectors.tiers.cpu_tier import CPUTier

        if cfg.cpu_bytes < unit:
            raise ConfigError(
                f"tiers.cpu_bytes={cfg.cpu_bytes} holds not one unit of the CPU arena "
                f"({unit} bytes); raise it or set 0 to disable the CPU tier"
            )
        reserve = math.ceil(cfg.cpu_free_reserve * (cfg.cpu_bytes // unit))
        tiers.append(CPUTier(cfg.cpu_bytes, unit, eviction=cpu_eviction, reserve_units=reserve))
    if cfg.disk_bytes != 0:
        from kvtier.connectors.tiers.disk_tier import DiskTier

        directory = Path(cfg.disk_dir).expanduser() if cfg.disk_dir else default_disk_dir()
        # Hand evicted bytes over only when a tier below can take them (demotion to Redis).
        tiers.append(
            DiskTier(
                directory,
                cfg.disk_bytes,
                cfg.disk_fsync,
                cfg.disk_o_direct,
                read_evicted=bool(cfg.redis_url),
                eviction=disk_eviction,
                staging=staging,
            )
        )
    if cfg.redis_url:
        from kvtier.connectors.tiers.redis_tier import RedisTier

        tiers.append(RedisTier(
            cfg.redis_url, ttl_s=cfg.redis_ttl_s, timeout_s=cfg.redis_timeout_s,
            max_connections=cfg.redis_max_connections,
            min_bandwidth_Bps=float(cfg.redis_min_bandwidth), staging=staging,
        ))
    if not tiers:
        return None
    resolve_codecs(tiers, {t.name: getattr(cfg, f"{t.name}_codec") for t in tiers}, codecs)
    for tier in tiers:
        log.info("tier %s keeps its chunks as %s", tier.name, tier.codec.value)
    manager = TierManager(tiers, cfg.write_policy, fingerprint=fingerprint, staging=staging)
    if cfg.accept_codecs is not None:
        manager.accept_codecs = frozenset(cfg.accept_codecs)
    return manager
