"""What one running service holds: its tiers, its engine (engine mode) and its metrics.

Sidecar mode (no model) serves the chunk data plane over a tier stack of its own. Engine
mode runs the reference engine on a dedicated thread (:class:`AsyncEngine`) and serves the
data plane over the engine's own tiers, so chunks put by a connector and sessions offloaded
by the engine share one cache and one eviction policy.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig, ServerConfig
from kvtier.connectors.tiers.factory import build_tiers
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.tiers.session_turns import SessionTurns
from kvtier.engine.async_engine import AsyncEngine
from kvtier.engine.engine import Engine
from kvtier.engine.session import ChatSession
from kvtier.policies.live import LivePolicy
from kvtier.policies.reuse_ceiling import ReuseCeiling
from kvtier.server.chunk_versions import KeyLocks
from kvtier.server.identity import identities
from kvtier.server.metrics import ServiceMetrics
from kvtier.server.reply_budget import ReplyBudget
from kvtier.server.shm_regions import RegionTable


class ServiceState:
    def __init__(
        self,
        config: KVTierConfig,
        manager: TierManager | None,
        engine: AsyncEngine | None = None,
        model_name: str | None = None,
    ) -> None:
        self.config = config
        self.manager = manager
        self.engine = engine
        names = list(config.server.served_model_names) if engine is not None else []
        self.model_names: list[str] = names or ([model_name] if model_name else [])
        """What /v1/models lists and chat requests may name (aliases of the one model)."""
        self.model_name = self.model_names[0] if self.model_names else None
        self.model_root = model_name
        """The model directory's name."""
        if manager is not None:
            manager.quotas = {t: q.per_tier() for t, q in config.server.quotas.items()}
        self.turns = (SessionTurns(t.eviction for t in manager.tiers)
                      if manager is not None and engine is None else None)
        """Sessions' turns as clients report them (a sidecar's; an engine ranks its own)."""
        self.metrics = ServiceMetrics()
        server = config.server
        self.tenant_share = tenant_share(server)
        """The part of each shared budget one tenant may hold (1.0 with a single tenant)."""
        self.regions = RegionTable(server.shm_dir, server.shm_bytes, server.shm_regions_per_tenant,
                                   per_tenant_bytes=region_bytes_per_tenant(server),
                                   lease_s=server.shm_lease_s)
        """Same-host clients' shared-memory regions (server/shm_regions.py)."""
        self.key_locks = KeyLocks()
        """PUTs of one key run one at a time (server/chunk_versions.py)."""
        self.replies = ReplyBudget(1 << 62, write_timeout_s=server.reply_write_timeout_s)
        """Bytes read for clients, held until let go (sized by the app: size_budgets)."""
        self.started = time.monotonic()
        self.created = int(time.time())

    def size_budgets(self, budget: int) -> None:
        """What requests may hold at once: ``budget`` bytes of request bodies (the app's
        body guard), of uploads copied out of regions, and of chunks read for clients
        (:attr:`replies`). The staging pool keeps idle what those budgets let requests
        hold together (and, in engine mode, the engine's stores in flight): above the
        steady working set, so no buffer is freed and pinned again; what a burst past it
        grew is freed as it comes back."""
        server = self.config.server
        self.regions.inflight_budget = budget
        self.replies = ReplyBudget(budget, self.tenant_share, server.reply_write_timeout_s,
                                   ceiling=server.max_body_bytes)
        if self.manager is not None:
            engine_stores = self.config.engine.max_inflight_bytes if self.engine is not None else 0
            self.manager.staging.cap_idle(2 * budget + engine_stores)

    @property
    def mode(self) -> str:
        return "engine" if self.engine is not None else "sidecar"

    # ---------------------------------------------------------------- construction
    @classmethod
    def sidecar(cls, config: KVTierConfig) -> ServiceState:
        """Tiers only: chunks of any model, keyed by their callers (no fingerprint check)."""
        manager = build_tiers(config.tiers, config.server.chunk_slot_bytes, fingerprint=None)
        return cls(config, manager)

    @classmethod
    def with_engine(cls, config: KVTierConfig, model_dir: str | Path) -> ServiceState:
        """The reference engine on ``model_dir``, configured by the same config (pool,
        engine, tiers, policy) the service reads."""
        engine = Engine(model_dir, config)
        return cls(config, engine.tiers, AsyncEngine(engine), Path(model_dir).name)

    def close(self) -> None:
        self.regions.close()
        if self.engine is not None:
            self.engine.close()
            self.engine.engine.close()  # closes its tiers too
        elif self.manager is not None:
            self.manager.close()

    # -------------------------------------------------------------------- snapshots
    async def snapshot(self) -> dict[str, Any]:
        """Every counter and gauge of the service, read consistently (the engine's part on
        the engine thread, between steps)."""
        snap: dict[str, Any] = {
            "mode": self.mode,
            "model": self.model_name,
            "uptime_s": time.monotonic() - self.started,
            "tiers": tier_stats(self.manager),
            "manager": manager_stats(self.manager),
            "tenants": tenant_stats(self.manager),
            "pool": None,
            "sessions": None,
            "turns": None if self.turns is None else self.turns.stats(),
            "regions": self.regions.stats(),
            "policy": None,
            "reuse": None,
        }
        if self.engine is not None:
            snap.update(await self.engine.call(engine_stats, self.engine.engine))
        return snap


def tenant_share(server: ServerConfig) -> float:
    """The part of a shared budget one tenant may hold: ``server.tenant_inflight_share``
    where the tokens name several tenants, else all of it."""
    several = len({i.tenant for i in identities(server).values()}) > 1
    return server.tenant_inflight_share if several else 1.0


def region_bytes_per_tenant(server: ServerConfig) -> int:
    """Bytes one tenant's shared-memory regions may hold: ``server.shm_bytes_per_tenant``;
    unset, its share of ``server.shm_bytes`` (all of it with a single tenant), never
    below one largest region (``server.max_body_bytes``), so no tenant takes every byte
    from the others."""
    if server.shm_bytes_per_tenant is not None:
        return server.shm_bytes_per_tenant
    total = server.shm_bytes
    return max(int(total * tenant_share(server)), min(server.max_body_bytes, total))


def tier_stats(manager: TierManager | None) -> list[dict[str, Any]]:
    out = []
    for tier in manager.tiers if manager is not None else []:
        s = tier.stats.as_dict()
        reads = s["hits"] + s["misses"]
        chunks, used = tier.gauges()  # counters: never a Redis SCAN or a wait on a tier lock
        out.append(
            {
                "name": tier.name,
                "capacity_bytes": tier.capacity_bytes,
                "used_bytes": used,
                "chunks": chunks,
                "hit_rate": s["hits"] / reads if reads else 0.0,
                **s,
            }
        )
    return out


def tenant_stats(manager: TierManager | None) -> list[dict[str, Any]]:
    """Per tenant and tier: bytes held, its quota, bytes its quota pushed down."""
    if manager is None:
        return []
    held = manager.tenant_bytes()
    evicted = dict(manager.stats.quota_evicted_bytes)
    quotas = {(t, tier): q for t, per in manager.quotas.items() for tier, q in per.items()}
    return [
        {
            "tenant": tenant,
            "tier": tier,
            "bytes": held.get((tenant, tier), 0),
            "quota_bytes": quotas.get((tenant, tier)),
            "quota_evicted_bytes": evicted.get((tenant, tier), 0),
        }
        for tenant, tier in sorted(held.keys() | quotas.keys() | evicted.keys())
    ]


def manager_stats(manager: TierManager | None) -> dict[str, Any] | None:
    if manager is None:
        return None
    s = manager.stats
    return {
        "lookups": s.lookups,
        "hits_by_tier": dict(s.hits_by_tier),
        "misses": s.misses,
        "promotions": s.promotions,
        "demotions": s.demotions,
        "demotion_failures": s.demotion_failures,
        "demotions_skipped": s.demotions_skipped,
        "rejected": dict(s.rejected),
        "codecs": {c: {"chunks_stored": s.codec_chunks_stored.get(c, 0),
                       "bytes_stored": s.codec_bytes_stored.get(c, 0),
                       "kv_bytes_stored": s.codec_kv_bytes_stored.get(c, 0),
                       "reads": s.codec_reads.get(c, 0)}
                   for c in sorted(s.codec_chunks_stored.keys() | s.codec_reads.keys())},
    }


def engine_stats(engine: Engine) -> dict[str, Any]:
    """The engine's part of a snapshot; runs on the engine thread."""
    sessions = engine.sessions.values()
    return {
        "pool": engine.runner.pool.stats().as_dict(),
        "sessions": {
            "total": len(engine.sessions),
            "offloaded": sum(1 for s in sessions if s.offloaded),
            "resident": sum(1 for s in sessions if not s.offloaded),
            "busy": len(engine.busy_sessions),
        },
        "policy": None if engine.policy is None else policy_stats(engine.policy),
        "reuse": reuse_stats(engine.scheduler.reuse),
    }


def policy_stats(policy: LivePolicy) -> dict[str, Any]:
    """What the live policy decided, and what it weighs: how busy the GPU and each tier's
    link have been, and how often what the pool let go was asked for again."""
    now = policy.clock()
    victims = policy.victims
    return {
        "decisions": dict(policy.decisions),
        "load": {"compute_busy_share": policy.load.compute.share(now),
                 "link_busy_share": {t: b.share(now) for t, b in policy.load.links.items()}},
        "victims": {"let_go_blocks": victims.let_go_total, "reused_blocks": victims.reused_total,
                    "reuse_ratio": victims.rate(), "turnover_ratio": victims.turnover()},
    }


def reuse_stats(reuse: ReuseCeiling) -> dict[str, Any]:
    """The reuse ceiling over the recent window, beside the hit rate achieved there."""
    return {"ceiling": reuse.ratio(), "achieved": reuse.achieved(),
            "window_blocks": reuse.window, "requested_blocks": reuse.requested_total}


def session_info(engine: Engine, session: ChatSession, detail: bool = False) -> dict[str, Any]:
    """A session as the API shows it; runs on the engine thread."""
    sid = session.session_id
    info: dict[str, Any] = {
        "id": sid,
        "turns": len(session.turns),
        "tokens": len(session.token_ids),
        "stored_tokens": session.stored_tokens,
        "offloaded": session.offloaded,
        "busy": sid in engine.busy_sessions,
    }
    policy = engine.policy
    if policy is not None and sid in policy.idle_since:
        info["idle_s"] = max(0.0, policy.clock() - policy.idle_since[sid])
        nxt = policy.predicted_next_s(sid)
        info["predicted_next_s"] = nxt if math.isfinite(nxt) else None
    if detail:
        info["messages"] = len(session.messages)
        info["history"] = [asdict(t) for t in session.turns]
    return info
