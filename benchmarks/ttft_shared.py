"""The shared-prefix case of ``kvtier bench ttft``: a new session whose long system prompt
another session stored, found by content in each tier.

A writer session opens with the system prompt and goes idle (offloaded to the tier, its
blocks freed); then new sessions open with the same system prompt and a short question.
Each one's TTFT is measured on the engine as a chat turn, the engine's lookup by content and
its restore-vs-recompute plan included, next to the same turn recomputed (prefix caching
off) and the same turn with the system prompt still in the pool, in the same run. After each
sample the reader is offloaded too, so the next reader finds the prefix in the tier again,
not in the pool.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

QUESTION = "In two sentences, what should I know first?"
_SENTENCE = (
    "Keep every answer short and precise, cite the document section you rely on, and say so "
    "plainly when the document does not cover the question. "
)


def system_prompt(tokenizer, tokens: int) -> str:
    """A system prompt of at least ``tokens`` tokens, numbered so no sentence repeats."""
    parts: list[str] = []
    i = 0
    while len(tokenizer.encode("".join(parts), add_bos=False)) < tokens:
        i += 1
        parts.append(f"Rule {i}. {_SENTENCE}")
    return "".join(parts)


def _tiers(case: str, disk_dir: Path, redis_url: str | None):
    from kvtier.config import TiersConfig

    if case in ("recompute", "pool_hit"):
        return TiersConfig.pool_only()
    if case == "cpu":
        return TiersConfig(cpu_bytes=1 << 30, disk_bytes=0)
    if case == "disk":
        return TiersConfig(cpu_bytes=0, disk_dir=str(disk_dir / "shared"), disk_bytes=4 << 30)
    return TiersConfig(cpu_bytes=0, disk_bytes=0, redis_url=redis_url)


def measure_shared_prefix(
    model_dir: Path,
    dtype: str,
    device: str,
    prefix_tokens: int,
    chunk_tokens: int,
    repeats: int,
    disk_dir: Path,
    redis_url: str | None,
    threads: int | None,
) -> list[dict[str, Any]]:
    """One row per case: recompute, pool_hit, then each tier."""
    from kvtier.config import KVTierConfig
    from kvtier.engine.engine import Engine

    cases = ["recompute", "pool_hit", "cpu", "disk"] + (["redis"] if redis_url else [])
    rows: list[dict[str, Any]] = []
    text: str | None = None
    for case in cases:
        config = KVTierConfig(
            pool={"dtype": dtype, "device": device, "memory_bytes": 512 << 20,
                  "enable_prefix_caching": case != "recompute"},
            engine={"num_threads": threads} if threads else {},
            tiers=_tiers(case, disk_dir, redis_url),
            chunk_tokens=chunk_tokens,
        )
        engine = Engine(model_dir, config)
        try:
            if text is None:
                text = system_prompt(engine.tokenizer, prefix_tokens)
            rows.append(_readers(engine, case, text, repeats))
        finally:
            engine.close()
    base = rows[0]["ttft_s"]
    for r in rows:
        r["vs_recompute"] = r["ttft_s"] / base
    return rows


def _readers(engine: Any, case: str, text: str, repeats: int) -> dict[str, Any]:
    """A writer stores the system prompt, then readers with questions of their own come,
    each offloaded after (so the next finds the prompt in the tier, not the pool): the
    median TTFT of the readers after a warm-up one, and where the last one's KV came from."""
    from kvtier.engine.sampling import SamplingParams

    one = SamplingParams(max_tokens=1)
    tiered = case not in ("recompute", "pool_hit")
    engine.chat("writer", "Hello.", one, system=text)
    if tiered:
        engine.offload("writer", case)
    samples, restored, prompt = [], [], 0
    for i in range(repeats + 1):  # the first is a warm-up
        # A question of its own per reader: only the system prompt is shared.
        turn = engine.chat(f"reader-{i}", f"{QUESTION} (reader {i})", one, system=text)
        if tiered:
            engine.offload(f"reader-{i}", case)
        if i:
            samples.append(turn.stats.ttft_s)
            restored.append(turn.stats)
        prompt = turn.stats.prompt_tokens
    last = restored[-1]
    return {
        "case": case,
        "prompt_tokens": prompt,
        "ttft_s": statistics.median(samples),
        "restored_tokens": last.restored_tokens,
        "restored_from": dict(last.restored_from),
        "restored_bytes": last.restored_bytes,
        "reused_tokens": last.reused_tokens,
        "recomputed_tokens": last.recomputed_tokens,
    }


def print_shared_table(console, rows: list[dict[str, Any]], what: str) -> None:
    from rich.table import Table

    t = Table(title=f"TTFT of a new session whose system prompt is stored: {what}",
              title_justify="left")
    for col in ("case", "prompt", "restored", "from the pool", "computed", "TTFT ms",
                "x recompute"):
        t.add_column(col, justify="right")
    for r in rows:
        pool = r["reused_tokens"] - r["restored_tokens"]
        t.add_row(r["case"], str(r["prompt_tokens"]), str(r["restored_tokens"]), str(pool),
                  str(r["recomputed_tokens"]), f"{r['ttft_s'] * 1e3:.1f}",
                  f"{r['vs_recompute']:.2f}")
    console.print(t)
