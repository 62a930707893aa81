"""Many serving nodes sharing one remote tier: a cluster-sized replay of a trace recorded on
a cluster, at its own time scale.

Each node is a :class:`~kvtier.benchmarks.policy_sim.simulator.Simulator` with its own GPU
pool, its own CPU and disk tiers and its own policy state; the ``redis`` tier (Redis, or any
remote store) is one :class:`Store` and one :class:`Link` that every node reads and writes,
with the profile's network bandwidth and latency. A router sends each turn to a node:

- ``round-robin``: turn by turn, whatever the session;
- ``session-affinity``: a session's first turn goes to the node that is free first, its
  later turns to the same node (sticky sessions);
- ``cache-aware``: the node where the turn's predicted TTFT is lowest, from its queue and
  the longest prefix of the turn it holds in its GPU or local tiers (as SGLang's
  cache-aware router balances prefix hits against load).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from kvtier.benchmarks.policy_sim.node import Link, SimResult, Store, TurnTime
from kvtier.benchmarks.policy_sim.simulator import Simulator
from kvtier.benchmarks.policy_sim.systems import SystemSpec
from kvtier.benchmarks.policy_sim.workloads import Turn, Workload
from kvtier.errors import InvalidArgumentError
from kvtier.policies.cost_model import CostModel
from kvtier.policies.eviction import CostAware, SessionAware, make_eviction

ROUTERS = ("round-robin", "session-affinity", "cache-aware")
SHARED_TIER = "redis"


class Cluster:
    def __init__(
        self,
        workload: Workload,
        system: SystemSpec,
        cost: CostModel,
        gpu_bytes_per_node: float,
        tier_bytes: dict[str, float],
        nodes: int,
        router: str = "cache-aware",
    ) -> None:
        """``tier_bytes``: the CPU and disk tiers' size on each node, and the shared
        ``redis`` tier's size for the whole cluster."""
        if nodes < 1:
            raise InvalidArgumentError(f"--nodes must be >= 1, got {nodes}")
        if router not in ROUTERS:
            raise InvalidArgumentError(f"unknown router {router!r}; choose from {', '.join(ROUTERS)}")
        self.w, self.spec, self.cost, self.router = workload, system, cost, router
        shared: dict[str, tuple[Store, Link]] = {}
        self._home: dict[Hashable, int] = {}
        """Session -> the node that served its latest turn."""
        if system.use_tiers and SHARED_TIER in cost.tiers and tier_bytes.get(SHARED_TIER, 0) > 0:
            store = Store(SHARED_TIER, tier_bytes[SHARED_TIER], self._shared_policy())
            shared[SHARED_TIER] = (store, Link.of(cost.tier(SHARED_TIER)))
        self.shared = shared
        self.nodes = [Simulator(workload, system, cost, gpu_bytes_per_node, tier_bytes,
                                shared=shared) for _ in range(nodes)]
        for store, _ in shared.values():
            store.on_remove = self._forgotten_everywhere
        self.assignments: list[int] = []
        """The node each turn (in workload order) was routed to."""
        self._free = [0.0] * nodes
        self._turns = [0] * nodes
        self._busy_s = [0.0] * nodes

    def _shared_policy(self):
        name = self.spec.tier_eviction
        if self.spec.retention_value and name == "cost-aware":
            return CostAware(half_life_s=1.0)
        pol = make_eviction(name)
        if isinstance(pol, SessionAware) and self.spec.predictive:
            # Ranked by the node that served the session last (it knows its think times).
            pol.predictor = lambda s, now: self.nodes[self._home.get(s, 0)].live.eviction_rank(s, now)
        return pol

    def _forgotten_everywhere(self, key: Hashable) -> None:
        for node in self.nodes:
            node._forget_if_gone(key)

    # ------------------------------------------------------------------- routing
    def _route(self, i: int, t: Turn) -> int:
        n = len(self.nodes)
        if n == 1:
            return 0
        if self.router == "round-robin":
            return i % n
        if self.router == "session-affinity":
            home = self._home.get(t.session)
            return home if home is not None else min(range(n), key=lambda j: self._free[j])
        return min(range(n), key=lambda j: (self._predicted_ttft(j, t), self._free[j]))

    def _predicted_ttft(self, j: int, t: Turn) -> float:
        """Queue wait plus prefill after the longest prefix node ``j`` holds (its GPU or
        its own tiers; every node reaches the shared tier alike)."""
        node = self.nodes[j]
        held = 0
        for i, key in enumerate(t.chunk_keys):
            where = node.gpu.has(key) or any(
                st.has(key) for st in node.tiers if st.name not in self.shared)
            if not where:
                break
            held += t.tokens_of(i)
        cached = min(held, t.prompt_tokens - 1)
        wait = max(0.0, self._free[j] - t.arrival_s)
        return wait + self.cost.prefill.time(cached, t.prompt_tokens - cached)

    # ----------------------------------------------------------------------- run
    def run(self) -> ClusterResult:
        for i, t in enumerate(self.w.turns):
            self.step(i, t)
        return self.finish()

    def step(self, i: int, t: Turn) -> TurnTime:
        """Route and replay turn ``i``; its times."""
        j = self._route(i, t)
        node = self.nodes[j]
        queued = node.res.breakdown["queue_s"]
        self._free[j] = node._turn(t, self._free[j])
        self.assignments.append(j)
        self._turns[j] += 1
        self._busy_s[j] = node.res.breakdown["compute_s"]
        self._home[t.session] = j
        return TurnTime(node.res.ttft_s[-1], node.res.breakdown["queue_s"] - queued)

    @property
    def through(self) -> bool:
        return self.nodes[0].through

    @through.setter
    def through(self, on: bool) -> None:
        for node in self.nodes:
            node.through = on

    def finish(self) -> ClusterResult:
        for node in self.nodes:
            node.res.peak_gpu_bytes = node.gpu.peak
        return ClusterResult(self)


class ClusterResult:
    """Every node's result merged (a turn's TTFT is a TTFT, whichever node served it),
    plus each node's load and the shared tier's traffic."""

    def __init__(self, cluster: Cluster) -> None:
        res = SimResult(cluster.spec.name)
        for node in cluster.nodes:
            r = node.res
            res.ttft_s.extend(r.ttft_s)
            for mine, theirs in ((res.hits, r.hits), (res.read_bytes, r.read_bytes),
                                 (res.write_bytes, r.write_bytes), (res.decisions, r.decisions),
                                 (res.breakdown, r.breakdown)):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            res.prompt_tokens += r.prompt_tokens
            res.saved_tokens += r.saved_tokens
            res.overcommits += r.overcommits
            res.peak_gpu_bytes = max(res.peak_gpu_bytes, r.peak_gpu_bytes)
        self.merged = res
        span = (cluster.w.turns[-1].arrival_s - cluster.w.turns[0].arrival_s) if cluster.w.turns else 0
        self.nodes = [
            {"node": j, "turns": cluster._turns[j], "busy_s": round(cluster._busy_s[j], 3),
             "utilisation": cluster._busy_s[j] / span if span > 0 else math.nan,
             "ttft_mean_s": (sum(n.res.ttft_s) / len(n.res.ttft_s)) if n.res.ttft_s else math.nan}
            for j, n in enumerate(cluster.nodes)
        ]
        self.shared_tier = {
            "read_bytes": res.read_bytes.get(SHARED_TIER, 0),
            "write_bytes": res.write_bytes.get(SHARED_TIER, 0),
            "peak_bytes": max((st.peak for st, _ in cluster.shared.values()), default=0),
        }

    @property
    def ttft_s(self) -> list[float]:
        return self.merged.ttft_s

    @property
    def timeline(self) -> list:
        return []

    def summary(self) -> dict:
        return {**self.merged.summary(), "nodes": self.nodes, "shared_tier": self.shared_tier}
