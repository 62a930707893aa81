"""A multi-turn chat client for any OpenAI-compatible server (vLLM's, ``kvtier serve`` in
engine mode): conversations that share a system prompt, each turn sent back with the whole
history after a think time drawn per user, replies streamed so that every turn's
time-to-first-token and inter-token latencies are measured. Every conversation is active
from the start (users come and go while others think), and at most ``clients`` requests
are in flight at once.

Users think: the gap between a reply and the next message is lognormal around
``think_median_s`` (heavy-tailed, as real chat and agent traces are; vLLM's own client
has only a Poisson request rate, LMCache's a fixed gap). Replies are greedy (temperature 0) and
run to ``answer_tokens`` (EOS ignored), so every configuration does the same work and its
replies can be compared token for token (``return_token_ids``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

WORDS = ["river", "mountain", "cache", "layer", "token", "memory", "session", "answer", "question", "winter", "summer", "offload", "restore", "network", "latency", "bandwidth", "prefix", "block", "chunk", "model", "reply", "user", "garden", "lantern", "harbor", "pencil", "orbit", "meadow", "signal", "thunder", "velvet", "canyon"]


@dataclass(frozen=True)
class ChatWorkload:
    """What the users say: ``conversations`` of ``turns`` turns each."""

    conversations: int = 12
    turns: int = 10
    system_words: int = 700
    """The system prompt every conversation shares (about 1.3 tokens a word)."""
    user_words: int = 40
    answer_tokens: int = 40
    think_median_s: float = 2.0
    think_sigma: float = 0.8
    clients: int = 4
    seed: int = 0
    session_ids: bool = False
    """Each conversation's requests carry its session id (the ``X-Session-Id`` header, which
    vLLM's OpenAI server and ``kvtier serve`` both read): what a deployment whose clients
    name their sessions sends, and what session-aware eviction and prefetch act on. Off by
    default, as vLLM's own multi-turn benchmark client sends none."""

    def session_id(self, conversation: int) -> str | None:
        """The id conversation ``conversation``'s requests carry (none for the warm-ups)."""
        return f"chat-{self.seed}-{conversation}" if self.session_ids and conversation >= 0 else None

    def system_prompt(self) -> str:
        rng = random.Random(self.seed)
        return " ".join(rng.choice(WORDS) for _ in range(self.system_words))

    def message(self, conversation: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}:{conversation}:{turn}")
        return " ".join(rng.choice(WORDS) for _ in range(self.user_words))

    def warmup_messages(self, index: int = 0) -> list[dict]:
        """A request no conversation shares a token with (its own system prompt, as long as
        theirs), one of :data:`WARMUP_REQUESTS`: sent before the clock starts so that every
        server's first-request costs (connections, lazy allocations, compiled paths, for a
        KV connector its first save) are paid outside the measured turns, alike for every
        setup."""
        rng = random.Random(f"warmup:{self.seed}" if index == 0 else f"warmup:{self.seed}:{index}")
        text = " ".join(rng.choice(WORDS) for _ in range(self.system_words))
        return [{"role": "system", "content": "Warm-up. " + text},
                {"role": "user", "content": "Say something."}]

    def think_s(self, conversation: int, turn: int) -> float:
        rng = random.Random(f"think:{self.seed}:{conversation}:{turn}")
        return rng.lognormvariate(0.0, self.think_sigma) * self.think_median_s


WARMUP_REQUESTS = 2
"""Warm-up requests, one after the other. Two: with a kvtier connector (any: one that only
looks up too) vLLM's second long prefill after its start took 0.2-0.5 s longer, once, in
the worker's forward pass (docs/vllm.md, session 36); with one warm-up that cost fell on
the first measured turns."""


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    itl_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    error: str | None = None
    started_s: float = float("nan")
    """When the request was sent, seconds after the replay's clock started: which turns ran
    beside which (a first turn may share vLLM's steps with others' returning turns)."""


async def _turn(client: Any, url: str, model: str, messages: list[dict], work: ChatWorkload,
                conversation: int, turn: int) -> TurnResult:
    """One streamed chat completion: TTFT to the first content, the gaps after it."""
    body = {"model": model, "messages": messages, "stream": True, "temperature": 0,
            "max_tokens": work.answer_tokens, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    session = work.session_id(conversation)
    headers = {"X-Session-Id": session} if session else None
    t0 = last = time.perf_counter()
    out = TurnResult(conversation, turn, ttft_s=float("nan"), started_s=t0)
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            out.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                out.prompt_tokens = int(event["usage"].get("prompt_tokens", 0))
            for choice in event.get("choices", []):
                ids = choice.get("token_ids") or []
                piece = (choice.get("delta") or {}).get("content") or ""
                if not ids and not piece:
                    continue
                now = time.perf_counter()
                if not out.token_ids and not out.text:
                    out.ttft_s = now - t0
                else:
                    out.itl_s.append(now - last)
                last = now
                out.token_ids += ids
                out.text += piece
    return out


async def _conversation(client: Any, url: str, model: str, work: ChatWorkload, c: int,
                        gate: asyncio.Semaphore, results: list[TurnResult]) -> None:
    """One user: a turn, a think, the next turn with the whole history; at most
    ``work.clients`` requests of all users in flight at once."""
    messages = [{"role": "system", "content": work.system_prompt()}]
    for t in range(work.turns):
        if t:
            await asyncio.sleep(work.think_s(c, t))
        messages.append({"role": "user", "content": work.message(c, t)})
        async with gate:
            try:
                got = await _turn(client, url, model, messages, work, c, t)
            except Exception as exc:  # noqa: BLE001 - a failed turn is reported, not fatal
                got = TurnResult(c, t, float("nan"), error=f"{type(exc).__name__}: {exc}")
        results.append(got)
        if got.error:
            return
        messages.append({"role": "assistant", "content": got.text})


@dataclass
class Replay:
    """What a replay did: its turns (those finished, where it ran out of time) and when."""

    turns: list[TurnResult]
    wall_s: float
    finished: bool = True
    """Every turn ran within the replay's time limit."""


async def warm_up(url: str, model: str, work: ChatWorkload, timeout_s: float = 600.0) -> None:
    """The unmeasured warm-up requests (:data:`WARMUP_REQUESTS`), one after the other."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for i in range(WARMUP_REQUESTS):
            await _turn(client, url, model, work.warmup_messages(i), work, -1, 0)


async def replay(url: str, model: str | None, work: ChatWorkload, timeout_s: float = 600.0,
                 limit_s: float | None = None, warmup: bool = True) -> Replay:
    """Run every conversation against ``url`` (``model``: the first the server lists where
    None), after unmeasured warm-up requests (``warmup``, :data:`WARMUP_REQUESTS`). ``timeout_s`` bounds one
    request, ``limit_s`` the whole replay (a server that stalls is reported with the turns
    it finished, not waited on for hours)."""
    import httpx

    results: list[TurnResult] = []
    gate = asyncio.Semaphore(work.clients)
    finished = True
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        if model is None:
            listed = (await client.get(f"{url}/v1/models")).json()
            model = str(listed["data"][0]["id"])
        if warmup:
            await warm_up(url, model, work, timeout_s)
        t0 = time.perf_counter()
        everyone = asyncio.gather(*(_conversation(client, url, model, work, c, gate, results)
                                    for c in range(work.conversations)))
        try:
            await asyncio.wait_for(everyone, limit_s)
        except asyncio.TimeoutError:
            finished = False
        wall = time.perf_counter() - t0
    for r in results:  # sent at perf_counter() time: from the replay's start
        r.started_s -= t0
    results.sort(key=lambda r: (r.conversation, r.turn))
    return Replay(results, wall, finished)
