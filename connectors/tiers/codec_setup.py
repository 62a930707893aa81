"""Each tier's codec, resolved from configuration (``auto`` chosen by the policy, issue 33)
and described for the cost model: the bytes a codec stores per byte of KV (at the model's
chunk shape) and how fast this machine decodes it (measured once per process)."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.config import TiersConfig
from kvtier.connectors.tiers.base import Tier
from kvtier.kv_codecs import ERROR_BOUND, Codec, decode, encode, layout
from kvtier.policies.codec_choice import CodecOption, choose_codec
from kvtier.policies.cost_model import CostModel, TierCodec


@dataclass(frozen=True)
class CodecContext:
    """What resolving ``auto`` needs: the model's chunk shape and KV dtype, the quality
    budget, and the calibrated link speeds (None: no profile)."""

    chunk_shape: tuple[int, int, int, int, int]
    dtype: torch.dtype
    max_error: float
    cost: CostModel | None = None


_SPEED_SHAPE = (1, 2, 256, 8, 128)
MEMORY_TIERS = {"cpu": True, "disk": False, "redis": False}
"""Each tier a configuration names, and whether it lends its memory (the CPU arena: a
copy out of it is faster than any decode)."""


@functools.lru_cache(maxsize=16)
def decode_Bps(codec: Codec, dtype: torch.dtype) -> float:
    """KV bytes per second this machine decodes ``codec`` into ``dtype`` (best of 3 decodes
    of one layer of a 256-token, 8-head chunk; a few milliseconds)."""
    if codec is Codec.NONE:
        return float("inf")
    kv = torch.randn(_SPEED_SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)
    payload = encode(kv, codec)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        decode(payload, codec, _SPEED_SHAPE, dtype)
        best = min(best, time.perf_counter() - t0)
    return kv.numel() * kv.element_size() / max(best, 1e-9)


@functools.lru_cache(maxsize=16)
def encode_Bps(codec: Codec, dtype: torch.dtype) -> float:
    """KV bytes per second this machine encodes into ``codec`` (as :func:`decode_Bps`)."""
    if codec is Codec.NONE:
        return float("inf")
    kv = torch.randn(_SPEED_SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        encode(kv, codec)
        best = min(best, time.perf_counter() - t0)
    return kv.numel() * kv.element_size() / max(best, 1e-9)


def tier_codec(codec: Codec, chunk_shape: tuple[int, int, int, int, int],
               dtype: torch.dtype) -> TierCodec:
    """``codec`` as the cost model weighs it, for chunks of ``chunk_shape`` and ``dtype``."""
    kv_bytes = layout(Codec.NONE, chunk_shape, dtype).nbytes
    return TierCodec(codec.value, layout(codec, chunk_shape, dtype).nbytes / kv_bytes,
                     decode_Bps(codec, dtype), encode_Bps(codec, dtype))


def options(ctx: CodecContext) -> list[CodecOption]:
    kv_bytes = layout(Codec.NONE, ctx.chunk_shape, ctx.dtype).nbytes
    return [CodecOption(c.value, layout(c, ctx.chunk_shape, ctx.dtype).nbytes / kv_bytes,
                        ERROR_BOUND[c], decode_Bps(c, ctx.dtype)) for c in Codec]


def auto_codec(tier: str, memory_tier: bool, ctx: CodecContext) -> Codec:
    """What ``auto`` resolves to for tier ``tier`` (``memory_tier``: the CPU arena): the
    codec whose restores over its calibrated link are fastest within the budget."""
    link = None
    if ctx.cost is not None and tier in ctx.cost.tiers:
        link = ctx.cost.tiers[tier].read.bandwidth_bps
    return Codec(choose_codec(options(ctx), ctx.max_error, link, memory_tier).name)


def resolve_codecs(tiers: Sequence[Tier], configured: dict[str, str],
                   ctx: CodecContext | None) -> None:
    """Set each tier's codec: as configured, ``auto`` chosen (without a context: none)."""
    for tier in tiers:
        name = configured.get(tier.name, "none")
        if name != "auto":
            tier.codec = Codec(name)
        else:
            tier.codec = Codec.NONE if ctx is None else auto_codec(tier.name, tier.lends_memory, ctx)


def resolved_auto_fields(tiers: TiersConfig, ctx: CodecContext) -> dict[str, str]:
    """``<tier>_codec`` fields set to ``auto`` in ``tiers``, each with the codec it resolves
    to: what a process that knows the chunks (a vLLM connector) hands to tiers built
    without that knowledge (its private sidecar, which sees no model)."""
    out = {}
    for name, memory in MEMORY_TIERS.items():
        if getattr(tiers, f"{name}_codec") == "auto":
            out[f"{name}_codec"] = auto_codec(name, memory, ctx).value
    return out


def tier_codecs(tiers: Sequence[Tier], chunk_shape: tuple[int, int, int, int, int],
                dtype: torch.dtype) -> dict[str, TierCodec]:
    """The lossy tiers' codecs as the cost model weighs them."""
    return {t.name: tier_codec(t.codec, chunk_shape, dtype)
            for t in tiers if t.codec is not Codec.NONE}
