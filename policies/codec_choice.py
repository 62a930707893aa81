"""Which codec a tier keeps its chunks in, when told ``auto`` (issue 33): a pure decision.

A restore from a tier that compresses moves fewer bytes over the tier's link and then
decodes them; it is worth it where ``bytes_ratio / link + 1 / decode`` (seconds per byte of
KV delivered) is below ``1 / link``. Among the codecs whose error bound is within the
operator's quality budget (``policy.max_kv_error``: the largest error of a decoded value
relative to the largest magnitude of its group; lossless is always within it), ``auto``
takes the one whose restores are fastest, the fewer bytes breaking a tie (more tokens
held). Link speeds come from the engine's calibration profile, decode speeds from a
measurement on this machine; without a profile the link is unknown and ``auto`` takes the
smallest codec within the budget for disk and Redis (links slower than any decode) and
none for the CPU tier (a memory copy is faster than any decode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CodecOption:
    name: str
    bytes_ratio: float
    """Stored bytes per byte of KV (1 for none)."""
    error_bound: float
    """Largest error of a decoded value, relative to its group's largest magnitude."""
    decode_Bps: float = math.inf
    """KV bytes decoded per second on this machine (inf: nothing to decode)."""

    def restore_seconds_per_byte(self, link_Bps: float) -> float:
        return self.bytes_ratio / link_Bps + 1.0 / self.decode_Bps


def within_budget(options: Sequence[CodecOption], max_error: float) -> list[CodecOption]:
    """The options a quality budget allows (lossless ones always)."""
    return [o for o in options if o.error_bound == 0 or o.error_bound <= max_error]


def choose_codec(options: Sequence[CodecOption], max_error: float,
                 link_Bps: float | None, memory_tier: bool = False) -> CodecOption:
    """The codec ``auto`` resolves to for a tier whose reads run at ``link_Bps`` (None:
    unknown; ``memory_tier``: the CPU arena)."""
    allowed = within_budget(options, max_error)
    if not allowed:
        raise ValueError("no codec is within the quality budget (lossless always is: pass it)")
    if link_Bps is None:
        if memory_tier:
            return min(allowed, key=lambda o: (o.bytes_ratio != 1, o.bytes_ratio))
        return min(allowed, key=lambda o: o.bytes_ratio)
    return min(allowed, key=lambda o: (o.restore_seconds_per_byte(link_Bps), o.bytes_ratio))
