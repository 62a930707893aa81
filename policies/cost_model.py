"""Measured costs: moving bytes through a tier and recomputing tokens on the model.

Every decision kvtier makes (restore or recompute, how far down to offload, what to evict)
compares these two costs, so they come from measurements on the machine it runs on
(``kvtier calibrate``), refined online from observed transfers, never from guesses:

* a tier moves ``n`` bytes in ``latency + n / bandwidth`` seconds (read and write apart);
* prefill of ``new`` tokens after ``cached`` tokens takes
  ``overhead + per_token * new + per_token_ctx * new * (cached + new / 2)`` seconds: the
  weights' work is linear in new tokens, attention also grows with the context they see.

Pure data and arithmetic: no I/O here (profiles are read and written by the caller).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from kvtier.errors import InvalidArgumentError


@dataclass(frozen=True)
class LinearCost:
    """``latency + nbytes / bandwidth`` seconds."""

    latency_s: float
    bandwidth_bps: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bps <= 0:
            raise InvalidArgumentError(
                f"a transfer cost needs latency >= 0 and bandwidth > 0, got "
                f"{self.latency_s} s and {self.bandwidth_bps} B/s"
            )

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bps

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> LinearCost:
        """Least squares over (bytes, seconds) samples; needs two distinct sizes."""
        x = np.array([s[0] for s in samples], dtype=float)
        y = np.array([s[1] for s in samples], dtype=float)
        if len(set(x.tolist())) < 2:
            raise InvalidArgumentError("fitting a transfer cost needs samples of >= 2 sizes")
        slope, intercept = np.polyfit(x, y, 1)
        if slope <= 0:
            raise InvalidArgumentError(
                "transfer samples do not grow with size (noisy or too small): measure larger transfers"
            )
        return cls(max(float(intercept), 0.0), float(1.0 / slope))


@dataclass(frozen=True)
class TierCost:
    name: str
    read: LinearCost
    write: LinearCost
    duplex: bool = False
    """Reads and writes move at once, each at its own speed, neither queued behind the
    other: the two directions of PCIe (a GPU host's RAM tier) or of a full-duplex network
    link. False: they share one path (a drive; host memory on a CPU-only machine)."""

    def observe_read(self, nbytes: float, seconds: float, weight: float = 0.1) -> TierCost:
        """Online refinement: move the read bandwidth toward an observed transfer (EWMA)."""
        if nbytes <= 0 or seconds <= self.read.latency_s:
            return self
        seen = nbytes / (seconds - self.read.latency_s)
        bw = (1 - weight) * self.read.bandwidth_bps + weight * seen
        return replace(self, read=LinearCost(self.read.latency_s, bw))


@dataclass(frozen=True)
class PrefillCost:
    overhead_s: float
    per_token_s: float
    per_token_ctx_s: float

    def time(self, cached: int, new: int) -> float:
        """Seconds to prefill ``new`` tokens after ``cached`` tokens already in the pool."""
        if new <= 0:
            return 0.0
        return (
            self.overhead_s
            + self.per_token_s * new
            + self.per_token_ctx_s * new * (cached + new / 2)
        )

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> PrefillCost:
        """Non-negative least squares over (cached, new, seconds) samples."""
        if len(samples) < 3:
            raise InvalidArgumentError("fitting a prefill cost needs >= 3 samples")
        a = np.array([[1.0, n, n * (c + n / 2)] for c, n, _ in samples])
        y = np.array([t for _, _, t in samples])
        coef = _nnls(a, y)
        return cls(*(float(v) for v in coef))


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop negative terms and refit)."""
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        coef[active] = sol
        neg = [i for i in active if coef[i] < 0]
        if not neg:
            return coef
        active = [i for i in active if i not in neg]
        if not active:
            return np.zeros(a.shape[1])


@dataclass(frozen=True)
class TierCodec:
    """A tier's codec as the cost model sees it."""

    name: str
    bytes_ratio: float
    """Stored bytes per byte of KV."""
    decode_Bps: float
    """KV bytes decoded per second."""
    encode_Bps: float = float("inf")
    """KV bytes encoded per second (a store's extra cost)."""


@dataclass(frozen=True)
class CostModel:
    """Costs of one model on one machine."""

    model: str
    """Model fingerprint (hex): a profile of another model is flagged, not trusted."""
    machine: str
    kv_bytes_per_token: int
    num_layers: int
    prefill: PrefillCost
    tiers: dict[str, TierCost] = field(default_factory=dict)
    stream_min_tokens: int = 0
    """Restores of fewer tokens load every layer before the forward starts (no overlap):
    the engine streams them layer by layer only from this size (on a CPU from 2,048 tokens:
    below, the loader thread competes with the forward for the same cores; on CUDA the
    engine does not stream today, and `kvtier calibrate` says so; the shipped GPU profiles
    model the overlap a layer-wise restore can reach)."""

    codecs: dict[str, TierCodec] = field(default_factory=dict)
    """How each tier keeps its chunks (none where absent): its reads move fewer bytes and
    then decode them. Set by the engine from its tiers, not part of a profile."""

    def tier(self, name: str) -> TierCost:
        try:
            return self.tiers[name]
        except KeyError:
            raise InvalidArgumentError(
                f"the cost model has no tier {name!r}; calibrated: {', '.join(self.tiers)}"
            ) from None

    def overlaps(self, restored_tokens: int) -> bool:
        """Whether a restore of this many tokens streams under the forward."""
        return restored_tokens >= self.stream_min_tokens

    def load_time(self, tier: str, tokens: int, chunks: int = 1) -> float:
        """Seconds to restore ``tokens`` tokens of KV from ``tier`` into the pool in
        ``chunks`` requests (a restore reads each tier's share in one request)."""
        t = self.tier(tier).read
        kv = tokens * self.kv_bytes_per_token
        codec = self.codecs.get(tier)
        if codec is None:
            return chunks * t.latency_s + kv / t.bandwidth_bps
        return chunks * t.latency_s + kv * codec.bytes_ratio / t.bandwidth_bps + kv / codec.decode_Bps

    def store_time(self, tier: str, tokens: int, chunks: int = 1) -> float:
        t = self.tier(tier).write
        kv = tokens * self.kv_bytes_per_token
        codec = self.codecs.get(tier)
        if codec is None:
            return chunks * t.latency_s + kv / t.bandwidth_bps
        return chunks * t.latency_s + kv * codec.bytes_ratio / t.bandwidth_bps + kv / codec.encode_Bps

    def decode_time(self, tier: str, tokens: int) -> float:
        """The part of :meth:`load_time` spent decoding (on the host's cores, not the link)."""
        codec = self.codecs.get(tier)
        return 0.0 if codec is None else tokens * self.kv_bytes_per_token / codec.decode_Bps

    def encode_time(self, tier: str, tokens: int) -> float:
        """The part of :meth:`store_time` spent encoding (before the link)."""
        codec = self.codecs.get(tier)
        return 0.0 if codec is None else tokens * self.kv_bytes_per_token / codec.encode_Bps

    def stored_bytes(self, tier: str, tokens: float) -> float:
        """Bytes ``tokens`` tokens of KV take in ``tier`` (fewer where it compresses)."""
        codec = self.codecs.get(tier)
        return tokens * self.kv_bytes_per_token * (1.0 if codec is None else codec.bytes_ratio)

    def tokens_in(self, tier: str, nbytes: float) -> int:
        """Tokens of KV that ``nbytes`` stored in ``tier`` hold."""
        per = self.stored_bytes(tier, 1)
        return max(1, int(round(nbytes / per))) if per > 0 else 1

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc.pop("codecs")  # the engine's tiers', not the machine's: never in a profile
        return doc

    @classmethod
    def from_dict(cls, doc: dict) -> CostModel:
        try:
            tiers = {
                name: TierCost(name, LinearCost(**t["read"]), LinearCost(**t["write"]),
                               bool(t.get("duplex", False)))
                for name, t in doc.get("tiers", {}).items()
            }
            return cls(
                model=str(doc["model"]),
                machine=str(doc["machine"]),
                kv_bytes_per_token=int(doc["kv_bytes_per_token"]),
                num_layers=int(doc["num_layers"]),
                prefill=PrefillCost(**doc["prefill"]),
                tiers=tiers,
                stream_min_tokens=int(doc.get("stream_min_tokens", 0)),
            )
        except (KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"not a kvtier cost profile: missing or bad {exc}") from None
