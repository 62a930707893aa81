"""How much conversation a chat request may carry, checked before the engine sees it.

A history far past the model's context used to be tokenized on the engine thread (every
other tenant's turns waited for it) and only then refused, its session left stored. Here a
request is measured twice, before anything of it reaches the engine:

1. in characters, at once: no token stands for more bytes of text than the vocabulary's
   longest token (nor, in UTF-8, for more characters), so messages of more characters
   than ``context x longest token`` cannot fit; nor more than ``server.max_chat_chars``;
2. in tokens, rendered with the chat template on a worker thread, against what the
   engine admits (the context less one generated token, and the pool's blocks).

Either refusal is a 400 ``context_length_exceeded`` (OpenAI's code for it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.engine.engine import Engine
from kvtier.models.chat_template import Message, render_ids
from kvtier.server.errors import RouteError

CONTEXT_EXCEEDED = "context_length_exceeded"


@dataclass(frozen=True)
class ChatBounds:
    """``max_chars``: characters a request's messages may hold; ``max_tokens``: prompt
    tokens the engine admits."""

    max_chars: int
    max_tokens: int

    @classmethod
    def of(cls, engine: Engine, max_chat_chars: int) -> ChatBounds:
        """The bounds of ``engine``'s model and pool (reads only what never changes)."""
        runner = engine.runner
        tok = engine.tokenizer
        longest = max((len(tok.token_bytes(i)) for i in range(tok.vocab_size)), default=1)
        pool_tokens = runner.pool.block_pool.num_blocks * runner.pool.block_size
        max_tokens = min(runner.max_model_len, pool_tokens) - 1
        return cls(max_chars=min(max_chat_chars, runner.max_model_len * max(longest, 1)),
                   max_tokens=max_tokens)

    def check_size(self, messages: Sequence[Message]) -> None:
        """Refuse messages of more characters than can fit, before any tokenizing."""
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.max_chars:
            raise RouteError(
                400,
                f"the messages hold {chars} characters, more than the {self.max_chars} this "
                "server takes (the model's context times its longest token, and "
                "server.max_chat_chars): shorten the conversation",
                CONTEXT_EXCEEDED,
            )

    async def check_tokens(self, engine: Engine, messages: Sequence[Message]) -> None:
        """Render the conversation on a worker thread and refuse it where its prompt would
        not fit (no engine thread time, no session touched)."""
        fmt = engine.tokenizer.chat_format
        if fmt is None:
            return  # the engine refuses the turn with its own reason
        ids = await asyncio.to_thread(render_ids, engine.tokenizer, fmt, list(messages), True)
        if len(ids) > self.max_tokens:
            raise RouteError(
                400,
                f"the conversation is {len(ids)} tokens; this server admits at most "
                f"{self.max_tokens} prompt tokens (max_model_len less one generated "
                "token, within the KV pool): shorten the conversation",
                CONTEXT_EXCEEDED,
            )
