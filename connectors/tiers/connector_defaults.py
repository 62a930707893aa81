"""What the vLLM connector's own tiers (in-process, or its private sidecar) use where its
options say nothing: a serving engine's host differs from a ``kvtier serve`` host.

- ``cpu_free_reserve`` 5 % of the CPU arena's units kept free: vLLM holds a finished
  request's blocks until its saves land, and a save into a full arena would otherwise wait
  for a demotion
  (:mod:`kvtier.connectors.tiers.slot_reserve`).
- ``disk_o_direct``: the disk tier bypasses the kernel's page cache. The CPU arena is the
  RAM cache above the disk; caching the same chunks again in the page cache costs a copy
  of every demoted byte plus its writeback, on cores the engine's forward pass wants
  (measured with real vLLM on CPU: the private sidecar's CPU time down 45 %). Where the
  filesystem refuses O_DIRECT the tier falls back to buffered I/O with a warning.

A user's ``tiers`` options override each of them; a ``config`` file is taken as written.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

CONNECTOR_TIER_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "cpu_free_reserve": 0.05,
    "disk_o_direct": True,
})


def unset_defaults(given: Mapping[str, Any] | set[str]) -> dict[str, Any]:
    """The defaults whose field ``given`` (the user's options, or the fields a config set)
    does not name."""
    return {name: value for name, value in CONNECTOR_TIER_DEFAULTS.items() if name not in given}
