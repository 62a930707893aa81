"""Workloads for the fragmentation analyzer: who arrives when, with how many tokens.

Four synthetic patterns, each built to show one regime of KV allocation, plus Mooncake-format
traces. Time is counted in decode steps: every running sequence grows by one token a step.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import InvalidArgumentError, TraceFormatError


@dataclass(frozen=True)
class Request:
    arrival_step: int
    prompt_len: int
    output_len: int
    max_len: int
    """What a contiguous max-length allocator must reserve (the model's or request's cap)."""

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: list[Request]
    memory_tokens: int
    """KV memory given to every strategy, in token slots."""
    contiguous_expected_fine: bool | None = None
    """For the built-in patterns, the regime they were built to show."""


def _poisson_arrivals(rng: random.Random, n: int, rate_per_step: float) -> list[int]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_step)
        out.append(int(t))
    return out


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def uniform_long(scale: float = 1.0, seed: int = 0) -> Workload:
    """Long sequences of one known length: contiguous reservation wastes little."""
    n = max(8, int(160 * scale))
    rng = random.Random(seed)
    arrivals = _poisson_arrivals(rng, n, rate_per_step=1 / 16)
    reqs = [Request(a, 1792, 256, 2048) for a in arrivals]
    return Workload(
        "uniform-long",
        "long sequences of one known length (prompt 1792 + 256 generated, max 2048)",
        reqs,
        memory_tokens=16 * 2048,
        contiguous_expected_fine=True,
    )


def mixed_dynamic(scale: float = 1.0, seed: int = 0) -> Workload:
    """Mixed prompt and output lengths under dynamic batching, max length 2048."""
    n = max(16, int(1000 * scale))
    rng = random.Random(seed + 1)
    arrivals = _poisson_arrivals(rng, n, rate_per_step=0.6)
    reqs = [
        Request(
            a,
            _lognormal_int(rng, 300, 0.9, 16, 1536),
            _lognormal_int(rng, 150, 0.8, 8, 512),
            2048,
        )
        for a in arrivals
    ]
    return Workload(
        "mixed-dynamic",
        "mixed lengths with dynamic batching (lognormal prompts ~300, outputs ~150, max 2048)",
        reqs,
        memory_tokens=65536,
        contiguous_expected_fine=False,
    )


def short_turnover(scale: float = 1.0, seed: int = 0) -> Workload:
    """Many short sequences arriving fast: small blocks win, big blocks and copies lose."""
    n = max(32, int(3000 * scale))
    rng = random.Random(seed + 2)
    arrivals = _poisson_arrivals(rng, n, rate_per_step=4.0)
    reqs = [Request(a, rng.randint(8, 64), rng.randint(4, 48), 2048) for a in arrivals]
    return Workload(
        "short-turnover",
        "short sequences with high turnover (prompts 8-64, outputs 4-48, max 2048)",
        reqs,
        memory_tokens=8192,
        contiguous_expected_fine=False,
    )


def rare_long(scale: float = 1.0, seed: int = 0) -> Workload:
    """Mostly short requests with a few very long ones: contiguous space fragments."""
    n = max(32, int(800 * scale))
    rng = random.Random(seed + 3)
    arrivals = _poisson_arrivals(rng, n, rate_per_step=1.2)
    reqs = []
    for a in arrivals:
        if rng.random() < 0.03:
            reqs.append(Request(a, rng.randint(6144, 12288), rng.randint(256, 512), 16384))
        else:
            reqs.append(Request(a, rng.randint(32, 256), rng.randint(16, 128), 16384))
    return Workload(
        "rare-long",
        "rare long sequences among mostly short (3% of 6-12K tokens, max 16384)",
        reqs,
        memory_tokens=32768,
        contiguous_expected_fine=False,
    )


BUILTIN: dict[str, Callable[[float, int], Workload]] = {
    "uniform-long": uniform_long,
    "mixed-dynamic": mixed_dynamic,
    "short-turnover": short_turnover,
    "rare-long": rare_long,
}


def builtin_workload(name: str, scale: float = 1.0, seed: int = 0) -> Workload:
    try:
        factory = BUILTIN[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown workload {name!r}; choose from {', '.join(BUILTIN)} or pass --trace FILE"
        ) from None
    return factory(scale, seed)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def load_mooncake_trace(
    path: str | Path,
    ms_per_step: float = 20.0,
    memory_tokens: int | None = None,
    max_len: int | None = None,
    limit: int | None = None,
) -> Workload:
    """Read a Mooncake JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``). Each line becomes one request; timestamps become decode steps."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if ms_per_step <= 0:
        raise InvalidArgumentError(f"ms_per_step must be > 0, got {ms_per_step}")
    raw: list[tuple[float, int, int]] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(str(path), no, f"not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise TraceFormatError(str(path), no, "each line must be a JSON object")
        for field in ("timestamp", "input_length", "output_length"):
            if field not in rec:
                raise TraceFormatError(str(path), no, f"missing field {field!r}")
        ts, inp, out = rec["timestamp"], rec["input_length"], rec["output_length"]
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            raise TraceFormatError(str(path), no, f"timestamp must be a number >= 0, got {ts!r}")
        for field, v in (("input_length", inp), ("output_length", out)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TraceFormatError(str(path), no, f"{field} must be an integer >= 0, got {v!r}")
        if inp + out == 0:
            raise TraceFormatError(str(path), no, "request with no tokens")
        raw.append((float(ts), inp, out))
        if limit is not None and len(raw) >= limit:
            break
    if not raw:
        raise InvalidArgumentError(f"trace {path} holds no requests")
    t0 = min(ts for ts, _, _ in raw)
    longest = max(i + o for _, i, o in raw)
    cap = max_len or _next_pow2(longest)
    if cap < longest:
        raise InvalidArgumentError(
            f"max_len {cap} is shorter than the trace's longest request ({longest} tokens)"
        )
    reqs = sorted(
        (Request(int((ts - t0) / ms_per_step), max(i, 1), o, cap) for ts, i, o in raw),
        key=lambda r: r.arrival_step,
    )
    return Workload(
        f"trace:{path.name}",
        f"Mooncake trace {path.name} ({len(reqs)} requests, {ms_per_step:g} ms per step)",
        reqs,
        memory_tokens=memory_tokens or cap,
    )
