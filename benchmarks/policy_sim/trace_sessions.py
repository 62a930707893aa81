"""Conversations rebuilt from a trace that names no sessions (Mooncake's format): which
request continues which, and what the rebuild found.

A trace gives each request the chained hashes of its prompt's blocks, so two requests with
the same block hash share the whole prefix up to it. That alone does not make them one
conversation: every request of a service may start with the same system prompt, and many
users may paste the same document. The rule:

- Request R **continues** an earlier request P when P's full blocks are a prefix of R's
  chain, R's input is longer than P's by at least half of P's output (the next prompt holds
  the previous prompt and, mostly, the reply), and P's last full block is not a **fork**:
  a block that different requests go on from in different ways (in the trie of full
  blocks, two or more children). A conversation's turns extend each other along one path
  (a prompt's last, partial block is not in the trie: its hash changes as the conversation
  grows), so a fork is a prefix that several conversations share — a system prompt, a
  document — and ending there says nothing about whose conversation R continues.
- Of several such P, R continues the one with the longest prefix (the latest of equals).

Shared prefixes stay shared: their blocks keep their keys in every session that uses
them, which is prefix sharing across sessions, as the tiers see it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def _forks(requests: Sequence[Request], block: int) -> set[int]:
    """Blocks that requests go on from in two or more ways (full blocks only)."""
    first_child: dict[int | None, int] = {}
    forks: set[int] = set()
    for r in requests:
        full = r.input_tokens // block
        parent: int | None = None
        for h in r.hash_ids[:full]:
            seen = first_child.setdefault(parent, h)
            if seen != h and parent is not None:
                forks.add(parent)
            parent = h
    return forks


def rebuild_sessions(requests: Sequence[Request], block: int) -> list[int]:
    """Each request's session id (0, 1, … in order of first request), by the rule above.
    ``requests`` in arrival order."""
    forks = _forks(requests, block)
    ends: dict[int, int] = {}  # last full block -> the latest request whose full blocks end there
    session_of: list[int] = []
    next_session = 0
    for i, r in enumerate(requests):
        session = None
        for h in reversed(r.hash_ids):
            j = ends.get(h)
            if j is None or h in forks:
                continue
            p = requests[j]
            if r.input_tokens > p.input_tokens and (
                r.input_tokens >= p.input_tokens + p.output_tokens // 2
            ):
                session = session_of[j]
                break
        if session is None:
            session = next_session
            next_session += 1
        session_of.append(session)
        full = r.input_tokens // block
        if full:
            ends[r.hash_ids[full - 1]] = i
    return session_of


def session_stats(requests: Sequence[Request], sessions: Sequence[int], block: int) -> dict:
    """What the rebuild found: sessions, turns per session (p50, p90, max), the fraction of
    requests that continue a session, and the fraction of prompt tokens in blocks that
    more than one session uses (prefix sharing across sessions)."""
    turns = sorted(Counter(sessions).values())

    def pct(p: float) -> int:
        return turns[min(len(turns) - 1, int(p * len(turns)))] if turns else 0

    users: dict[int, set[Hashable]] = {}
    for r, s in zip(requests, sessions, strict=True):
        for h in r.hash_ids[: r.input_tokens // block]:
            users.setdefault(h, set()).add(s)
    shared = total = 0
    for r in requests:
        full = r.input_tokens // block
        total += r.input_tokens
        shared += block * sum(1 for h in r.hash_ids[:full] if len(users[h]) > 1)
    n = len(requests)
    return {
        "requests": n,
        "sessions": len(turns),
        "turns_per_session_p50": pct(0.5),
        "turns_per_session_p90": pct(0.9),
        "turns_per_session_max": turns[-1] if turns else 0,
        "continuing_fraction": (n - len(turns)) / n if n else 0.0,
        "shared_prefix_token_fraction": shared / total if total else 0.0,
    }
