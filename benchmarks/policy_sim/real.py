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
from dataclasses import replace
from pathlib import Path

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
    from kvtier.chunk_keys import chunk_keys
    from kvtier.config import KVTierConfig, TiersConfig
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
    tiers = TiersConfig.pool_only()
    if spec.name == "kvtier":
        tiers = TiersConfig(
            cpu_bytes=int(tier_bytes.get("cpu", 0)), disk_bytes=int(tier_bytes.get("disk", 0)),
            disk_dir=str(root / "chunks"), disk_fsync=False,
        )
    now = [0.0]
    config = KVTierConfig(
        pool={"num_blocks": max(gpu_tokens // block_size, 4), "block_size": block_size,
              "enable_prefix_caching": spec.restore != "none", "dtype": "float32"},
        tiers=tiers,
        chunk_tokens=chunk,
        engine={"max_num_batched_tokens": max(2048, chunk)},
        policy={"profile": None if profile is None else str(profile), "check_every_s": 0.0},
    )
    engine = Engine(model_dir, config, clock=lambda: now[0])
    rng = random.Random(seed)
    res = SimResult(spec.name)
    as_run: list[Turn] = []
    context: dict[Hashable, int] = {}
    system_text = _text(rng, engine.tokenizer, int(workload.meta.get("system_tokens", 0) or 0))
    fp = engine.runner.fingerprint
    server_free = 0.0
    try:
        # A served engine is warm: the first forward's one-off costs are not a TTFT.
        engine.generate([_text(rng, engine.tokenizer, chunk)], SamplingParams(max_tokens=2))
        for t in workload.turns:
            sid = str(t.session)
            start = max(t.arrival_s, server_free)
            if t.arrival_s > server_free:
                # The server sits idle until this arrival: what it would do meanwhile
                # (background stores, watermark offloads) is done before the clock jumps.
                now[0] = server_free
                engine.drain()
            now[0] = start
            new = max(t.prompt_tokens - context.get(t.session, 0), 1)
            if t.session not in context and system_text:
                new = max(new - len(engine.tokenizer.encode(system_text)), 1)
            message = _text(rng, engine.tokenizer, new)
            params = SamplingParams(max_tokens=max(1, min(t.output_tokens, max_output_tokens)),
                                    ignore_eos=True)
            t0 = time.perf_counter()
            turn = engine.begin_turn(sid, message, params, system_text or None)
            req = turn.request
            while req.timings.first_token is None and not req.finished:
                engine.step()
            ttft = (req.timings.first_token or time.perf_counter()) - t0
            engine.run_until_done([req])
            result = engine.finish_turn(turn)
            if result.error is not None:
                raise InvalidArgumentError(f"real replay: turn of session {sid} failed: {result.error}")
            prompt = req.prompt_ids
            keys = tuple(k.key for k in chunk_keys(prompt, chunk, fp))
            # The session holds the reply's KV but for its last token (never fed back).
            held = [*prompt, *req.output_ids][:-1]
            reply = tuple(k.key for k in chunk_keys(held, chunk, fp, include_tail=False))
            as_run.append(Turn(t.session, t.arrival_s, keys, chunk, len(prompt), len(req.output_ids),
                               reply_keys=reply[len(prompt) // chunk:]))
            context[t.session] = len(prompt) + len(req.output_ids)
            res.ttft_s.append(ttft)
            res.prompt_tokens += len(prompt)
            res.saved_tokens += result.stats.reused_tokens
            if turn.restored_tokens:
                res.hits["restored"] = res.hits.get("restored", 0) + -(-turn.restored_tokens // chunk)
            server_free = start + ttft
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
    return res, replace(workload, name=f"{workload.name}-as-run", turns=as_run)

