"""When decode attention splits the KV sequence across programs (flash-decoding).

One program per (sequence, KV head) leaves most SMs idle when there are few sequences; then
long contexts are cut into splits that run in parallel and a small reduction merges them.
Pure integer logic, so it is tested without a GPU.
"""

from __future__ import annotations

MIN_SPLIT_CONTEXT = 1024
"""Below this many tokens one program per (sequence, KV head) is already short enough."""
MIN_TOKENS_PER_SPLIT = 256
"""A split shorter than this costs more in reduction traffic than it saves."""
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4
"""Resident programs per SM the grid aims for: decode is bound by memory latency, and
the partial results a split adds are tiny next to the KV it reads."""


def choose_num_splits(batch: int, kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Splits per (sequence, KV head): 1 means the single-pass kernel.

    Split only when the context is long and the grid of ``batch * kv_heads`` programs gives
    fewer than ``PROGRAMS_PER_SM`` programs per SM; then aim for about that many.
    """
    work = max(1, batch * kv_heads)
    if max_context_len < MIN_SPLIT_CONTEXT:
        return 1
    want = -(-PROGRAMS_PER_SM * num_sms // work)
    cap = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))
