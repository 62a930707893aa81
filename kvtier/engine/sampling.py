"""Turning logits into next tokens: greedy, temperature, top-k, top-p, with per-request seeds.

Each request owns its random generator, so a seeded request samples the same tokens
whatever else shares its batch; that is what makes continuous batching testable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates and when it stops."""

    max_tokens: int = 256
    temperature: float = 0.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the text contains one (it is cut off)."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not self.temperature >= 0.0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            raise InvalidArgumentError(f"seed must fit in 64 bits, got {self.seed}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise InvalidArgumentError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def _filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if 0 < k < logits.shape[-1]:
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def _filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches p (the token crossing p stays).
    drop = probs.cumsum(-1) - probs >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Next token for one request from its ``[vocab]`` logits."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    x = logits.float()
    # Shift so the largest logit is 0 before scaling: a tiny temperature then sends the
    # others to -inf (greedy in the limit) instead of the largest to +inf (NaN probabilities).
    x = (x - x.max()) / params.temperature
    x = _filter_top_p(_filter_top_k(x, params.top_k), params.top_p)
    probs = torch.softmax(x, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return int(torch.argmax(logits).item())  # degenerate logits: fall back to greedy
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Next token for each row of ``[batch, vocab]`` logits."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise InvalidArgumentError(
            f"sample() needs [batch, vocab] logits with one params and generator per row, got "
            f"logits {tuple(logits.shape)}, {len(params)} params, {len(generators)} generators"
        )
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [
        sample_one(logits[i], p, g) for i, (p, g) in enumerate(zip(params, generators, strict=True))
    ]


@dataclass
class StopChecker:
    """Decides when a request is finished, from its tokens and its text so far."""

    params: SamplingParams
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    def check_token(self, token_id: int, num_generated: int) -> str | None:
        """``"stop"`` on EOS or a stop token, ``"length"`` at max_tokens, else None."""
        if token_id in self.params.stop_token_ids:
            return "stop"
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if num_generated >= self.params.max_tokens:
            return "length"
        return None

    def find_stop_string(self, text: str, new_from: int = 0) -> int | None:
        """Index where the earliest stop string starts in ``text``, looking only at
        matches that end after ``new_from`` (text already checked is not searched again)."""
        best = None
        for s in self.params.stop:
            i = text.find(s, max(0, new_from - len(s) + 1))
            if i != -1 and (best is None or i < best):
                best = i
        return best
