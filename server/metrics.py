"""Prometheus metrics of the service (``GET /metrics``).

Two kinds. Histograms and counters the routes observe as requests run (TTFT, transfer and
recompute seconds, HTTP requests, errors by kind). And the state of the tiers, the pool, the
sessions and the policy, which is read as one snapshot at scrape time and exposed through a
custom collector, so the numbers on the page are consistent with each other and nothing is
double-counted. Every service has its own registry: two apps in one process (tests) never
share series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class _SnapshotCollector(Collector):
    """Turns the latest :meth:`ServiceState.snapshot` into metric families."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        yield from _tier_metrics(snap.get("tiers", []))
        yield from _manager_metrics(snap.get("manager"))
        yield from _tenant_metrics(snap.get("tenants", []))
        yield from _pool_metrics(snap.get("pool"))
        sessions = snap.get("sessions")
        if sessions is not None:
            g = GaugeMetricFamily(
                "kvtier_sessions", "Chat sessions by state", labels=["state"]
            )
            for state in ("resident", "offloaded", "busy"):
                g.add_metric([state], sessions.get(state, 0))
            yield g
        turns = snap.get("turns")
        if turns is not None:
            c = CounterMetricFamily("kvtier_session_turns_reported",
                                    "Sessions' turns (starts and ends) clients reported")
            c.add_metric([], turns["reported"])
            yield c
            g = GaugeMetricFamily("kvtier_session_turns_running", "Sessions whose turn runs, as reported")
            g.add_metric([], turns["running"])
            yield g
        yield from _region_metrics(snap.get("regions"))
        policy = snap.get("policy")
        if policy is not None:
            c = CounterMetricFamily(
                "kvtier_policy_decisions", "Policy decisions by kind", labels=["kind"]
            )
            for kind, n in sorted(policy.get("decisions", {}).items()):
                c.add_metric([kind], n)
            yield c
            yield from _policy_load_metrics(policy)
        reuse = snap.get("reuse")
        if reuse is not None:
            ceiling = GaugeMetricFamily(
                "kvtier_reuse_ceiling_ratio",
                "Share of recently requested blocks an unbounded cache could serve")
            ceiling.add_metric([], reuse["ceiling"])
            achieved = GaugeMetricFamily(
                "kvtier_reuse_achieved_ratio",
                "Share of the same requested blocks the cache did serve (pool or tiers)")
            achieved.add_metric([], reuse["achieved"])
            yield ceiling
            yield achieved


def _policy_load_metrics(policy: dict[str, Any]) -> Iterator[Metric]:
    """The load and victim reuse the policy's decisions weigh (docs/policies.md)."""
    load, victims = policy["load"], policy["victims"]
    gpu = GaugeMetricFamily("kvtier_policy_compute_busy_share",
                            "Share of recent time the model was busy (decaying over a minute)")
    gpu.add_metric([], load["compute_busy_share"])
    links = GaugeMetricFamily("kvtier_policy_link_busy_share",
                              "Share of recent time a tier's link carried a transfer", labels=["tier"])
    for tier, share in sorted(load["link_busy_share"].items()):
        links.add_metric([tier], share)
    reuse = GaugeMetricFamily("kvtier_policy_victim_reuse_ratio",
                              "Share of the blocks the pool let go that requests asked for again")
    reuse.add_metric([], victims["reuse_ratio"])
    turnover = GaugeMetricFamily("kvtier_policy_pool_turnover_ratio",
                                 "Blocks the pool let go per block requested")
    turnover.add_metric([], victims["turnover_ratio"])
    yield from (gpu, links, reuse, turnover)


def _tenant_metrics(tenants: list[dict[str, Any]]) -> Iterator[Metric]:
    labels = ["tenant", "tier"]
    held = GaugeMetricFamily("kvtier_tenant_stored_bytes", "Bytes a tenant's chunks hold in a tier",
                             labels=labels)
    quota = GaugeMetricFamily("kvtier_tenant_quota_bytes", "A tenant's quota in a tier",
                              labels=labels)
    pushed = CounterMetricFamily("kvtier_tenant_quota_evicted_bytes",
                                 "Bytes a tenant's quota made a tier evict", labels=labels)
    for row in tenants:
        key = [row["tenant"], row["tier"]]
        held.add_metric(key, row["bytes"])
        pushed.add_metric(key, row["quota_evicted_bytes"])
        if row["quota_bytes"] is not None:
            quota.add_metric(key, row["quota_bytes"])
    yield from (held, quota, pushed)


def _tier_metrics(tiers: list[dict[str, Any]]) -> Iterator[Metric]:
    def family(kind, name, doc):
        return kind(name, doc, labels=["tier"])

    hits = family(CounterMetricFamily, "kvtier_tier_hits", "Chunk reads served by the tier")
    misses = family(CounterMetricFamily, "kvtier_tier_misses", "Chunk reads the tier missed")
    ratio = family(GaugeMetricFamily, "kvtier_tier_hit_ratio", "hits / (hits + misses)")
    read = family(CounterMetricFamily, "kvtier_tier_read_bytes", "Bytes read from the tier")
    written = family(CounterMetricFamily, "kvtier_tier_written_bytes", "Bytes written to the tier")
    stored = family(CounterMetricFamily, "kvtier_tier_chunks_stored", "Chunks stored into the tier")
    evicted = family(CounterMetricFamily, "kvtier_tier_chunks_evicted", "Chunks the tier evicted")
    chunks = family(GaugeMetricFamily, "kvtier_tier_chunks", "Chunks held by the tier now")
    used = family(GaugeMetricFamily, "kvtier_tier_used_bytes", "Bytes held by the tier now")
    cap = family(GaugeMetricFamily, "kvtier_tier_capacity_bytes", "Bytes the tier may hold")
    corrupt = family(CounterMetricFamily, "kvtier_tier_corrupt_chunks", "Corrupt chunks found")
    held = family(CounterMetricFamily, "kvtier_tier_background_writes_held",
                  "Background write batches that waited for transfers someone waits for")
    held_s = family(CounterMetricFamily, "kvtier_tier_background_write_held_seconds",
                    "Seconds background writes waited for transfers someone waits for")
    errors = CounterMetricFamily(
        "kvtier_tier_errors", "Tier errors by kind", labels=["tier", "kind"]
    )
    for t in tiers:
        name = [t["name"]]
        hits.add_metric(name, t["hits"])
        misses.add_metric(name, t["misses"])
        ratio.add_metric(name, t["hit_rate"])
        read.add_metric(name, t["bytes_read"])
        written.add_metric(name, t["bytes_written"])
        stored.add_metric(name, t["puts"])
        evicted.add_metric(name, t["evictions"])
        chunks.add_metric(name, t["chunks"])
        used.add_metric(name, t["used_bytes"])
        if t["capacity_bytes"] is not None:
            cap.add_metric(name, t["capacity_bytes"])
        corrupt.add_metric(name, t["corrupt"])
        held.add_metric(name, t["writes_held"])
        held_s.add_metric(name, t["write_held_s"])
        for kind, n in sorted(t["errors"].items()):
            errors.add_metric([t["name"], kind], n)
    yield from (hits, misses, ratio, read, written, stored, evicted, chunks, used, cap)
    yield from (corrupt, held, held_s, errors)


def _manager_metrics(m: dict[str, Any] | None) -> Iterator[Metric]:
    if m is None:
        return
    for key, doc in (
        ("lookups", "Prefix lookups across the tiers"),
        ("promotions", "Chunks promoted to the fastest tier on a hit"),
        ("demotions", "Chunks moved down when a tier evicted them"),
        ("demotion_failures", "Evicted chunks no lower tier could take"),
        ("demotions_skipped", "Evicted chunks dropped: reloading from below would lose to recompute"),
    ):
        c = CounterMetricFamily(f"kvtier_{key}", doc)
        c.add_metric([], m[key])
        yield c
    rej = CounterMetricFamily(
        "kvtier_chunks_rejected", "Chunks refused on read, by reason", labels=["reason"]
    )
    for reason, n in sorted(m["rejected"].items()):
        rej.add_metric([reason], n)
    yield rej
    for key, doc in (
        ("chunks_stored", "Chunks a compressing tier stored, by codec"),
        ("bytes_stored", "Stored bytes of compressed chunks, by codec"),
        ("kv_bytes_stored", "KV bytes the compressed chunks hold, by codec (over bytes_stored: the ratio)"),
        ("reads", "Compressed chunks lent to readers, by codec"),
    ):
        c = CounterMetricFamily(f"kvtier_codec_{key}", doc, labels=["codec"])
        for codec, row in sorted(m.get("codecs", {}).items()):
            c.add_metric([codec], row[key])
        yield c


def _region_metrics(r: dict[str, Any] | None) -> Iterator[Metric]:
    if r is None:
        return
    c = CounterMetricFamily("kvtier_shm_region_transfers",
                            "Chunks same-host clients moved through shared-memory regions",
                            labels=["op"])
    b = CounterMetricFamily("kvtier_shm_region_transfer_bytes",
                            "Bytes same-host clients moved through shared-memory regions",
                            labels=["op"])
    for op in ("put", "get"):
        c.add_metric([op], r["transfers"][op])
        b.add_metric([op], r["transfer_bytes"][op])
    yield c
    yield b
    g = GaugeMetricFamily("kvtier_shm_regions_held", "Shared-memory regions held for clients")
    g.add_metric([], r["held"])
    yield g


def _pool_metrics(p: dict[str, Any] | None) -> Iterator[Metric]:
    if p is None:
        return
    blocks = GaugeMetricFamily("kvtier_gpu_pool_blocks", "KV pool blocks by state", labels=["state"])
    blocks.add_metric(["used"], p["blocks_used"])
    blocks.add_metric(["free"], p["blocks_free"])
    blocks.add_metric(["cached"], p["blocks_cached"])
    yield blocks
    usage = GaugeMetricFamily(
        "kvtier_gpu_pool_usage_ratio", "Share of the pool's blocks held by sequences"
    )
    usage.add_metric([], p["blocks_used"] / p["num_blocks"] if p["num_blocks"] else 0.0)
    yield usage
    util = GaugeMetricFamily(
        "kvtier_gpu_pool_utilisation_ratio", "Token slots holding KV / slots of held blocks"
    )
    util.add_metric([], p["utilisation"])
    yield util
    hit = GaugeMetricFamily("kvtier_prefix_cache_hit_ratio", "Prefix-cache hit tokens / queried")
    hit.add_metric([], p["prefix_hit_rate"])
    yield hit
    alloc = CounterMetricFamily("kvtier_gpu_pool_allocated_blocks", "Blocks allocated")
    alloc.add_metric([], p["alloc_blocks"])
    yield alloc
    lat = GaugeMetricFamily(
        "kvtier_gpu_pool_alloc_seconds_per_block", "Mean allocation latency per block (sampled)"
    )
    lat.add_metric([], p["alloc_ns_per_block"] * 1e-9)
    yield lat


class ServiceMetrics:
    """The registry of one service and the instruments its routes observe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "kvtier_ttft_seconds", "Time to first token of chat turns", buckets=_SECONDS_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.transfer = Histogram(
            "kvtier_transfer_seconds",
            "Seconds spent moving KV: chunk puts and gets, session offloads and restores",
            ["direction"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.tenant_bytes = Counter(
            "kvtier_tenant_transfer_bytes", "Chunk bytes each tenant put and got",
            ["tenant", "direction"], registry=r,
        )
        self.transfer_bytes = Counter(
            "kvtier_transfer_bytes", "Bytes moved by the data plane and sessions", ["direction"],
            registry=r,
        )  # fmt: skip
        self.recompute = Histogram(
            "kvtier_recompute_seconds",
            "Prefill compute of chat turns (time from first scheduled to first token)",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "kvtier_chat_tokens",
            "Chat prompt tokens by where their KV came from, and output tokens",
            ["kind"],
            registry=r,
        )
        self.requests = Counter(
            "kvtier_http_requests", "HTTP requests by route and status", ["method", "route", "status"],
            registry=r,
        )  # fmt: skip
        self.errors = Counter("kvtier_errors", "Errors by kind", ["kind"], registry=r)
        self.connections_open = Gauge(
            "kvtier_connections_open", "Client connections open now", registry=r)
        self.connections_closed = Counter(
            "kvtier_connections_closed",
            "Connections the server closed itself: head_timeout, evicted_idle (at the cap), "
            "refused_cap (at the cap, none idle), tenant_cap (503)", ["reason"], registry=r)
        self.descriptor_limit = Gauge(
            "kvtier_descriptor_limit", "The process's descriptor soft limit", registry=r)
        self.connection_cap = Gauge(
            "kvtier_connection_cap", "Connections held open at most", registry=r)
        self.chat_disconnects = Counter(
            "kvtier_chat_client_gone",
            "Chat turns whose client went away before the reply, aborted at the next step",
            ["stream"], registry=r)
        self._snapshot = _SnapshotCollector()
        r.register(self._snapshot)

    def count_error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self, snapshot: dict[str, Any]) -> bytes:
        self._snapshot.snapshot = snapshot
        return generate_latest(self.registry)

    def observe_turn(self, stats: dict[str, Any]) -> None:
        """Record one finished chat turn (a :class:`TurnStats` as a dict)."""
        if stats.get("ttft_s") is not None:
            self.ttft.observe(stats["ttft_s"])
            if stats.get("queue_s") is not None:
                self.recompute.observe(max(0.0, stats["ttft_s"] - stats["queue_s"]))
        restored = stats.get("restored_tokens", 0)
        self.tokens.labels("prompt").inc(stats["prompt_tokens"])
        self.tokens.labels("restored").inc(restored)
        self.tokens.labels("reused").inc(max(0, stats["reused_tokens"] - restored))
        self.tokens.labels("recomputed").inc(stats["recomputed_tokens"])
        self.tokens.labels("output").inc(stats["output_tokens"])
