"""Multi-turn chat sessions: the exact token ids a conversation holds, turn after turn.

The next turn's prompt is the previous prompt plus the tokens the model actually generated
(not a re-tokenisation of their text, which may split differently), then the chat
template's continuation: so every earlier token is a prefix of the new prompt and its KV
can be reused (from the pool's prefix cache now, from the lower tiers later).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvtier.engine.scheduler import Request
from kvtier.errors import InvalidArgumentError
from kvtier.models.chat_template import Message, render_ids
from kvtier.models.tokenizer import Tokenizer
from kvtier.transfer.restore import LoadReport


@dataclass(frozen=True)
class TurnStats:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    """Prompt tokens whose KV was found in the pool's prefix cache."""
    recomputed_tokens: int
    """Prompt tokens that ran through prefill."""
    output_tokens: int
    queue_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    total_s: float | None
    finish_reason: str | None
    preemptions: int = 0
    restored_tokens: int = 0
    """Prompt tokens whose KV was brought back from a lower tier for this turn."""
    restored_from: dict[str, int] = field(default_factory=dict)
    """Of those, how many each tier brought (tier name -> tokens)."""
    restored_bytes: int = 0
    """KV bytes read from the tiers for them."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TurnResult:
    session_id: str
    text: str
    token_ids: list[int]
    stats: TurnStats
    error: str | None = None
    """Why the turn failed (the session is then unchanged); None on success."""
    internal_error: bool = False
    """The engine failed, not the request (an HTTP service answers 500, not 400)."""


@dataclass
class ChatSession:
    session_id: str
    messages: list[Message] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    """Prompt and generated ids of the last turn: what the KV cache holds for this session."""
    turns: list[TurnStats] = field(default_factory=list)
    stored_tokens: int = 0
    """Leading tokens of ``token_ids`` whose KV is stored in the lower tiers."""
    offloaded: bool = False
    """True once the session's blocks were dropped from the pool (they live in the tiers)."""

    def next_prompt(
        self, tokenizer: Tokenizer, user_message: str, system: str | None = None
    ) -> list[int]:
        fmt = tokenizer.chat_format
        if fmt is None:
            raise InvalidArgumentError(
                f"{tokenizer.source}: the tokenizer has no known chat format (Llama 3 headers, "
                "ChatML or [INST]), so chat turns cannot be rendered; use generate() instead"
            )
        if not isinstance(user_message, str):
            raise InvalidArgumentError(
                f"a chat message must be a string, got {type(user_message).__name__}"
            )
        if system is not None and self.messages:
            raise InvalidArgumentError("a system prompt can only open a session (turn 1)")
        first = [{"role": "system", "content": system}] if system is not None else []
        new = [*self.messages, *first, {"role": "user", "content": user_message}]
        if not self.token_ids:
            return render_ids(tokenizer, fmt, new, add_generation_prompt=True)
        before_reply = self.messages[:-1]
        base = render_ids(tokenizer, fmt, self.messages)
        full = render_ids(tokenizer, fmt, new, add_generation_prompt=True)
        opened = render_ids(tokenizer, fmt, before_reply, add_generation_prompt=True)
        closed = render_ids(tokenizer, fmt, [*before_reply, {"role": "assistant", "content": ""}])
        if full[: len(base)] != base or closed[: len(opened)] != opened:
            raise InvalidArgumentError(  # the chat format broke its prefix promise
                f"chat format {fmt.name} does not render turns as prefixes; cannot continue"
            )
        closing = closed[len(opened) :]
        if closing and self.token_ids[-1] == closing[0]:
            closing = closing[1:]  # the model generated the end-of-turn token itself
        return self.token_ids + closing + full[len(base) :]

    def record(
        self, user_message: str, system: str | None, req: Request,
        restored: LoadReport | None = None,
    ) -> TurnResult:
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self.messages.append({"role": "user", "content": user_message})
        self.messages.append({"role": "assistant", "content": req.text})
        self.token_ids = req.all_ids
        t = req.timings
        stats = TurnStats(
            turn=len(self.turns) + 1,
            prompt_tokens=len(req.prompt_ids),
            reused_tokens=req.num_cached_tokens,
            recomputed_tokens=len(req.prompt_ids) - req.num_cached_tokens,
            output_tokens=len(req.output_ids),
            queue_s=t.queue_s,
            ttft_s=t.ttft_s,
            tpot_s=t.tpot_s,
            total_s=None if t.finished is None else t.finished - t.arrival,
            finish_reason=req.finish_reason,
            preemptions=req.num_preemptions,
            restored_tokens=restored.from_tiers if restored else 0,
            restored_from=dict(restored.tier_tokens) if restored else {},
            restored_bytes=_bytes_read(restored),
        )
        self.offloaded = False
        self.turns.append(stats)
        return TurnResult(self.session_id, req.text, list(req.output_ids), stats)


def _bytes_read(report: LoadReport | None) -> int:
    """Bytes a restore read (a streamed one has finished by the time its turn has)."""
    if report is None:
        return 0
    return report.pending.bytes if report.pending is not None else report.bytes
