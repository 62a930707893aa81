"""``--real``: replay a workload on the reference engine with real tiers, at reduced scale.

The engine runs the turns one at a time in arrival order on a virtual clock: a turn starts
at ``max(arrival, when the previous turn's first token came)``, as in the simulator's FIFO
prefill server, and the clock the engine's think-time model reads is that virtual time, so
hours of user silence cost nothing. Each turn's TTFT is measured on the wall clock, from
queuing the turn (its restore included) to its first token. Messages are generated text of
about the workload's token counts; replies are generated (greedy, EOS ignored) up to the
workload's output length, capped by ``max_output_tokens``.

The replay also returns the workload *as run* (the real prompt and reply lengths, chunk
keys hashed from the real token ids), so the simulator can be checked against it on
exactly the same turns.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.benchmarks.policy_sim.simulator import SimResult
from kvtier.benchmarks.policy_sim.systems import SystemSpec
from kvtier.benchmarks.policy_sim.workloads import Turn, Workload
from kvtier.errors import InvalidArgumentError

REAL_SYSTEMS = ("recompute-only", "vllm-like", "kvtier")
"""Systems the reference engine can be: no reuse; pool-only prefix cache; kvtier's tiers
and live policies. The other baselines exist only in the simulator."""

_WORDS = ["river", "mountain", "cache", "layer", "token", "memory", "session", "answer", "question", "winter", "summer", "offload", "restore", "network", "latency", "bandwidth", "prefix", "block", "chunk", "model", "reply", "user"]


def _text(rng: random.Random, tokenizer, tokens: int) -> str:
    """Text of about ``tokens`` tokens (words until the tokenizer says so)."""
    words: list[str] = []
    while True:
        words.extend(rng.choice(_WORDS) for _ in range(max(1, (tokens - len(words)) // 2)))
        n = len(tokenizer.encode(" ".join(words)))
        if n >= tokens:
            break
    while len(words) > 1 and len(tokenizer.encode(" ".join(words[:-1]))) >= tokens:
        words.pop()
    return " ".join(words)


def _config(spec: SystemSpec, workload: Workload, gpu_tokens: int, tier_bytes: dict[str, float],
            profile: str | Path | None, block_size: int, root: Path):
    """The engine's config for ``spec``: a pool of ``gpu_tokens``, kvtier's tiers (CPU and
    disk without fsync) for kvtier only, the policy checked at every step."""
    from kvtier.config import KVTierConfig, TiersConfig

    chunk = workload.chunk_tokens
    tiers = TiersConfig.pool_only()
    if spec.name == "kvtier":
        tiers = TiersConfig(
            cpu_bytes=int(tier_bytes.get("cpu", 0)), disk_bytes=int(tier_bytes.get("disk", 0)),
            disk_dir=str(root / "chunks"), disk_fsync=False,
        )
    return KVTierConfig(
        pool={"num_blocks": max(gpu_tokens // block_size, 4), "block_size": block_size,
              "enable_prefix_caching": spec.restore != "none", "dtype": "float32"},
        tiers=tiers,
        chunk_tokens=chunk,
        engine={"max_num_batched_tokens": max(2048, chunk)},
        policy={"profile": None if profile is None else str(profile), "check_every_s": 0.0},
    )


@dataclass
class _Replay:
    """One replay's engine, virtual clock and what it has recorded so far."""

    engine: Any
    now: list[float]
    rng: random.Random
    system_text: str
    max_output_tokens: int
    res: SimResult
    as_run: list[Turn] = field(default_factory=list)
    context: dict[Hashable, int] = field(default_factory=dict)
    server_free: float = 0.0

    def turn(self, t: Turn) -> None:
        """Run one turn at ``max(arrival, server free)`` on the virtual clock; record its
        wall-clock TTFT and the turn as run."""
        from kvtier.chunk_keys import chunk_keys
        from kvtier.engine.sampling import SamplingParams

        engine, chunk, sid = self.engine, t.chunk_tokens, str(t.session)
        start = max(t.arrival_s, self.server_free)
        if t.arrival_s > self.server_free:
            # The server sits idle until this arrival: what it would do meanwhile
            # (background stores, watermark offloads) is done before the clock jumps.
            self.now[0] = self.server_free
            engine.drain()
        self.now[0] = start
        new = max(t.prompt_tokens - self.context.get(t.session, 0), 1)
        if t.session not in self.context and self.system_text:
            new = max(new - len(engine.tokenizer.encode(self.system_text)), 1)
        message = _text(self.rng, engine.tokenizer, new)
        params = SamplingParams(max_tokens=max(1, min(t.output_tokens, self.max_output_tokens)),
                                ignore_eos=True)
        t0 = time.perf_counter()
        turn = engine.begin_turn(sid, message, params, self.system_text or None)
        req = turn.request
        while req.timings.first_token is None and not req.finished:
            engine.step()
        ttft = (req.timings.first_token or time.perf_counter()) - t0
        engine.run_until_done([req])
        result = engine.finish_turn(turn)
        if result.error is not None:
            raise InvalidArgumentError(f"real replay: turn of session {sid} failed: {result.error}")
        prompt, fp = req.prompt_ids, engine.runner.fingerprint
        keys = tuple(k.key for k in chunk_keys(prompt, chunk, fp))
        # The session holds the reply's KV but for its last token (never fed back).
        held = [*prompt, *req.output_ids][:-1]
        reply = tuple(k.key for k in chunk_keys(held, chunk, fp, include_tail=False))
        self.as_run.append(Turn(t.session, t.arrival_s, keys, chunk, len(prompt), len(req.output_ids),
                                reply_keys=reply[len(prompt) // chunk:]))
        self.context[t.session] = len(prompt) + len(req.output_ids)
        res = self.res
        res.ttft_s.append(ttft)
        res.prompt_tokens += len(prompt)
        res.saved_tokens += result.stats.reused_tokens
        restored = result.stats.restored_tokens
        if restored:
            res.hits["restored"] = res.hits.get("restored", 0) + -(-restored // chunk)
        self.server_free = start + ttft


def replay_real(
    workload: Workload,
    spec: SystemSpec,
    model_dir: str | Path,
    gpu_tokens: int,
    tier_bytes: dict[str, float],
    profile: str | Path | None,
    block_size: int = 16,
    max_output_tokens: int = 8,
    seed: int = 0,
    work_dir: str | Path | None = None,
) -> tuple[SimResult, Workload]:
    """Run ``workload`` through an engine configured as ``spec``; returns its result (TTFTs,
    hits per tier, prefill tokens saved) and the workload as run."""
    from kvtier.engine.engine import Engine
    from kvtier.engine.sampling import SamplingParams

    if spec.name not in REAL_SYSTEMS:
        raise InvalidArgumentError(
            f"--real runs {', '.join(REAL_SYSTEMS)} on the reference engine; "
            f"{spec.name!r} exists only in the simulator"
        )
    chunk = workload.chunk_tokens
    if chunk % block_size:
        raise InvalidArgumentError(f"chunk_tokens {chunk} is not a multiple of block {block_size}")
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-real-") if work_dir is None else None
    root = Path(work_dir or tmp.name)
    now = [0.0]
    config = _config(spec, workload, gpu_tokens, tier_bytes, profile, block_size, root)
    engine = Engine(model_dir, config, clock=lambda: now[0])
    rng = random.Random(seed)
    system_text = _text(rng, engine.tokenizer, int(workload.meta.get("system_tokens", 0) or 0))
    replay = _Replay(engine, now, rng, system_text, max_output_tokens, SimResult(spec.name))
    res = replay.res
    try:
        # A served engine is warm: the first forward's one-off costs are not a TTFT.
        engine.generate([_text(rng, engine.tokenizer, chunk)], SamplingParams(max_tokens=2))
        for t in workload.turns:
            replay.turn(t)
        if engine.policy is not None:
            res.decisions = dict(engine.policy.decisions)
        if engine.tiers is not None:
            for tier in engine.tiers.tiers:
                res.read_bytes[tier.name] = tier.stats.bytes_read
    finally:
        engine.close()
        if tmp is not None:
            tmp.cleanup()
    res.peak_gpu_bytes = gpu_tokens  # the pool is allocated whole
    return res, replace(workload, name=f"{workload.name}-as-run", turns=replay.as_run)
