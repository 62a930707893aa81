"""Multi-turn workloads for the policy benchmark: synthetic sessions, Mooncake traces, CSV.

A workload is a list of :class:`Turn` in arrival order. Each turn names its session and the
chain of chunk keys its prompt covers (so shared system prompts share keys, as chained
content hashes do), how many tokens the last, partial chunk holds, and how many tokens it
generates. The simulator needs nothing else.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvtier.benchmarks.policy_sim.trace_sessions import Request, rebuild_sessions, session_stats
from kvtier.errors import InvalidArgumentError, TraceFormatError


@dataclass(frozen=True)
class Turn:
    session: Hashable
    arrival_s: float
    chunk_keys: tuple[Hashable, ...]
    """Keys of the prompt's chunks, first to last (the last may be partial)."""
    chunk_tokens: int
    prompt_tokens: int
    output_tokens: int
    hint_lead_s: float = 0.0
    """Seconds before arrival that the chat backend announced the turn (user typing)."""
    reply_keys: tuple[Hashable, ...] = ()
    """Keys of the full chunks the reply completes after the prompt's full chunks (the
    session's next prompt starts with them): what a system that keeps the KV of generated
    tokens can reuse next turn."""

    def tokens_of(self, i: int) -> int:
        """Tokens of chunk ``i`` of the prompt."""
        return min(self.chunk_tokens, self.prompt_tokens - i * self.chunk_tokens)


@dataclass
class Workload:
    name: str
    turns: list[Turn]
    chunk_tokens: int
    meta: dict = field(default_factory=dict)

    def reuse_ceiling(self) -> dict[str, float]:
        """The share of prompt chunks an unbounded cache could serve (seen before in a
        prompt, or completed by a reply): ``exact`` by counting, ``estimate`` as the live
        metric computes it (:class:`~kvtier.policies.reuse_ceiling.ReuseCeiling`, a
        window as long as the workload)."""
        from kvtier.policies.reuse_ceiling import ReuseCeiling

        total = sum(len(t.chunk_keys) for t in self.turns)
        sketch = ReuseCeiling(window=max(total, 1))
        seen: set[Hashable] = set()
        new = 0
        for t in sorted(self.turns, key=lambda t: t.arrival_s):
            new += sum(1 for k in dict.fromkeys(t.chunk_keys) if k not in seen)
            seen.update(t.chunk_keys)
            sketch.requested(t.chunk_keys)
            seen.update(t.reply_keys)
            sketch.produced(t.reply_keys)
        exact = (total - new) / total if total else 0.0
        return {"exact": exact, "estimate": sketch.ratio(), "prompt_chunks": total}

    def longest_context_tokens(self) -> int:
        """The longest turn's context (prompt and reply): what one request needs of a GPU
        pool at once, as a serving engine's ``max_model_len`` must cover."""
        return max((t.prompt_tokens + t.output_tokens for t in self.turns), default=0)

    def peak_live_tokens(self) -> int:
        """Largest sum of live sessions' context (first to last turn): the working set
        that is actually live at once."""
        spans: dict[Hashable, list[float]] = {}
        size: dict[Hashable, int] = {}
        for t in self.turns:
            s = spans.setdefault(t.session, [t.arrival_s, t.arrival_s])
            s[1] = t.arrival_s
            size[t.session] = max(size.get(t.session, 0), t.prompt_tokens + t.output_tokens)
        events = sorted(
            [(a, size[k]) for k, (a, _) in spans.items()]
            + [(b + 1e-9, -size[k]) for k, (_, b) in spans.items()]
        )
        cur = peak = 0
        for _, d in events:
            cur += d
            peak = max(peak, cur)
        return peak


def _reply_keys(context_keys: list, prompt_tokens: int, context_tokens: int, chunk: int) -> tuple:
    """The full chunks of a session's context after a turn that its prompt had not filled."""
    return tuple(context_keys[prompt_tokens // chunk: context_tokens // chunk])


def _keys_for(prefix: tuple, tokens: int, chunk: int, start_index: int = 0) -> list:
    """Chained keys of a session's own chunks; a partial tail is keyed by its length."""
    out = []
    n = math.ceil(tokens / chunk)
    for i in range(n):
        full = (i + 1) * chunk <= tokens
        out.append((*prefix, start_index + i) if full else (*prefix, start_index + i, tokens - i * chunk))
    return out


# ------------------------------------------------------------------------ synthetic
@dataclass(frozen=True)
class SyntheticSpec:
    """Sessions arrive as a Poisson process; each has a number of turns, user and reply
    lengths and think times between turns. Defaults follow published ShareGPT statistics
    (about 3.5 turns per conversation on average, user turns of ~100 tokens and replies of
    ~250, heavy-tailed), with think times lognormal around half a minute."""

    sessions: int = 500
    session_rate_per_s: float = 0.5
    turns_mean: float = 3.5
    system_prompts: int = 4
    system_tokens: int = 512
    user_tokens_median: int = 100
    user_tokens_sigma: float = 0.8
    output_tokens_median: int = 250
    output_tokens_sigma: float = 0.6
    first_turn_extra_tokens: int = 0
    """A document pasted into the first turn (long-context chat)."""
    think: str = "lognormal"
    think_median_s: float = 30.0
    think_sigma: float = 0.6
    """Spread of one user's think times around their own median."""
    think_between_sigma: float = 1.0
    """Spread of users' medians around the population's (some users are quick, some slow)."""
    hint_fraction: float = 0.5
    """Turns the chat backend announces (typing) before they arrive."""
    hint_lead_s: float = 5.0
    chunk_tokens: int = 256
    max_context: int = 32768


def synthetic(spec: SyntheticSpec, seed: int = 0, name: str = "synthetic") -> Workload:
    if spec.think not in ("lognormal", "exponential"):
        raise InvalidArgumentError(f"think must be lognormal or exponential, got {spec.think!r}")
    if spec.sessions < 1 or spec.session_rate_per_s <= 0 or spec.turns_mean < 1:
        raise InvalidArgumentError("synthetic workload needs sessions >= 1, rate > 0, turns >= 1")
    rng = random.Random(seed)
    chunk = spec.chunk_tokens
    turns: list[Turn] = []
    t0 = 0.0
    for sid in range(spec.sessions):
        t0 += rng.expovariate(spec.session_rate_per_s)
        n_turns = 1 + int(rng.expovariate(1.0 / max(spec.turns_mean - 1, 1e-9))) if spec.turns_mean > 1 else 1
        sys_id = rng.randrange(spec.system_prompts) if spec.system_prompts else None
        sys_keys = _keys_for(("sys", sys_id), spec.system_tokens, chunk) if sys_id is not None else []
        # The system prompt is a whole number of chunks here so sessions share its keys.
        sys_tokens = spec.system_tokens if sys_id is not None else 0
        context = sys_tokens
        now = t0
        user_median = spec.think_median_s * math.exp(rng.gauss(0.0, spec.think_between_sigma))
        for k in range(n_turns):
            user = max(1, int(rng.lognormvariate(math.log(spec.user_tokens_median), spec.user_tokens_sigma)))
            if k == 0:
                user += spec.first_turn_extra_tokens
            out = max(1, int(rng.lognormvariate(math.log(spec.output_tokens_median), spec.output_tokens_sigma)))
            prompt = context + user
            if prompt + out > spec.max_context:
                break
            own = _keys_for(("s", seed, sid), prompt - sys_tokens, chunk, len(sys_keys))
            keys = tuple(sys_keys[: sys_tokens // chunk]) + tuple(own)
            hint = spec.hint_lead_s if rng.random() < spec.hint_fraction else 0.0
            ctx = tuple(sys_keys[: sys_tokens // chunk]) + tuple(
                _keys_for(("s", seed, sid), prompt + out - sys_tokens, chunk, len(sys_keys)))
            turns.append(Turn(sid, now, keys, chunk, prompt, out, hint,
                              _reply_keys(list(ctx), prompt, prompt + out, chunk)))
            context = prompt + out
            if spec.think == "lognormal":
                gap = rng.lognormvariate(math.log(user_median), spec.think_sigma)
            else:
                gap = rng.expovariate(1.0 / user_median)
            now += gap + out * 0.02  # the reply streams before the user starts thinking
    turns.sort(key=lambda t: t.arrival_s)
    return Workload(name, turns, chunk, {"generator": "synthetic", "seed": seed, **spec.__dict__})


# ------------------------------------------------------------------------ Mooncake
def mooncake(path: str | Path, block_tokens: int = 512, limit: int | None = None) -> Workload:
    """A Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids`` of 512-token chained blocks). Conversations are rebuilt
    by :func:`~kvtier.benchmarks.policy_sim.trace_sessions.rebuild_sessions` (a request
    continues an earlier one whose full blocks it extends past any prefix that several
    conversations share); what the rebuild found is in ``meta["session_stats"]``."""
    path = Path(path)
    requests: list[Request] = []
    try:
        fh = path.open()
    except OSError as exc:
        raise InvalidArgumentError(f"{path}: cannot read the trace: {exc}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts = float(rec["timestamp"]) / 1000.0
                inp = int(rec["input_length"])
                out = int(rec["output_length"])
                ids = tuple(int(h) for h in rec["hash_ids"])
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceFormatError(
                    str(path), lineno,
                    f"not a Mooncake trace record ({type(exc).__name__}: {exc}); "
                    "need timestamp (ms), input_length, output_length, hash_ids",
                ) from None
            if inp < 1 or out < 0 or not ids or len(ids) != math.ceil(inp / block_tokens):
                raise TraceFormatError(
                    str(path), lineno,
                    f"input_length {inp} needs {math.ceil(inp / block_tokens)} "
                    f"hash_ids of {block_tokens} tokens, got {len(ids)}",
                )
            requests.append(Request(ts, inp, out, ids))
    if not requests:
        raise InvalidArgumentError(f"{path}: no requests in the trace")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)  # stable
    requests = [requests[i] for i in order]
    sessions = rebuild_sessions(requests, block_tokens)
    turns = []
    for r, session in zip(requests, sessions, strict=True):
        ids = r.hash_ids
        keys = ids[:-1] + ((ids[-1], r.input_tokens - (len(ids) - 1) * block_tokens),)
        turns.append(Turn(session, r.arrival_s, keys, block_tokens, r.input_tokens,
                          r.output_tokens))
    turns = _with_reply_keys(turns, [list(r.hash_ids) for r in requests], block_tokens)
    stats = session_stats(requests, sessions, block_tokens)
    return Workload(path.stem, turns, block_tokens,
                    {"trace": str(path), "sessions": stats["sessions"], "session_stats": stats})


def _with_reply_keys(turns: list[Turn], ids: list[list[int]], block: int) -> list[Turn]:
    """A trace names a reply's blocks only through the session's next request: when that
    request's prompt holds this prompt and the whole reply, the reply's blocks are its
    blocks at those positions; otherwise the reply gets keys of its own (nothing reuses
    them)."""
    nxt: dict[Hashable, int] = {}
    out = list(turns)
    for i in range(len(turns) - 1, -1, -1):  # file order: the session's next request is later
        t = turns[i]
        full, ctx_full = t.prompt_tokens // block, (t.prompt_tokens + t.output_tokens) // block
        j = nxt.get(t.session)
        follow = ids[j] if j is not None else []
        grows = j is not None and turns[j].prompt_tokens >= t.prompt_tokens + t.output_tokens
        if grows and follow[:full] == ids[i][:full]:
            reply = tuple(follow[full:ctx_full])
        else:
            reply = tuple(("reply", i, k) for k in range(full, ctx_full))
        out[i] = replace(t, reply_keys=reply)
        nxt[t.session] = i
    return out


# ----------------------------------------------------------------------------- CSV
CSV_COLUMNS = ("session_id", "arrival_s", "new_tokens", "output_tokens")


def from_csv(path: str | Path, chunk_tokens: int = 256, system_column: str = "system_tokens") -> Workload:
    """Sessionised turns: one row per turn with ``session_id``, ``arrival_s``,
    ``new_tokens`` (the user's message), ``output_tokens``, and optionally
    ``system_tokens`` and ``system_id`` (turns with the same system id share its chunks).
    A session's prompt is its previous context plus the new tokens."""
    path = Path(path)
    try:
        fh = path.open(newline="")
    except OSError as exc:
        raise InvalidArgumentError(f"{path}: cannot read: {exc}") from None
    rows: list[tuple[float, str, int, int, int, str]] = []
    with fh:
        reader = csv.DictReader(fh)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceFormatError(str(path), 1, f"missing column(s) {', '.join(missing)}; need {CSV_COLUMNS}")
        for lineno, row in enumerate(reader, 2):
            try:
                rows.append((
                    float(row["arrival_s"]), row["session_id"], int(row["new_tokens"]),
                    int(row["output_tokens"]), int(row.get(system_column) or 0),
                    row.get("system_id") or "",
                ))
            except (TypeError, ValueError) as exc:
                raise TraceFormatError(str(path), lineno, f"bad value ({exc})") from None
            if rows[-1][2] < 1 or rows[-1][3] < 0:
                raise TraceFormatError(str(path), lineno, "new_tokens must be >= 1, output_tokens >= 0")
    rows.sort()
    context: dict[str, int] = {}
    turns: list[Turn] = []
    for arrival, sid, new, out, sys_tokens, sys_id in rows:
        sys_full = (sys_tokens // chunk_tokens) * chunk_tokens
        sys_keys = _keys_for(("sys", sys_id), sys_full, chunk_tokens) if sys_full else []
        prev = context.get(sid, sys_tokens)
        prompt = prev + new
        own = _keys_for(("csv", sid), prompt - sys_full, chunk_tokens, len(sys_keys))
        ctx = sys_keys + _keys_for(("csv", sid), prompt + out - sys_full, chunk_tokens, len(sys_keys))
        turns.append(Turn(sid, arrival, tuple(sys_keys) + tuple(own), chunk_tokens, prompt, out,
                          reply_keys=_reply_keys(ctx, prompt, prompt + out, chunk_tokens)))
        context[sid] = prompt + out
    if not turns:
        raise InvalidArgumentError(f"{path}: no turns")
    return Workload(path.stem, turns, chunk_tokens, {"csv": str(path)})


def scale_time(w: Workload, factor: float) -> Workload:
    """Stretch (factor > 1) or compress arrival times and hint leads."""
    turns = [replace(t, arrival_s=t.arrival_s * factor, hint_lead_s=t.hint_lead_s * factor)
             for t in w.turns]
    return Workload(w.name, turns, w.chunk_tokens, {**w.meta, "time_scale": factor})

