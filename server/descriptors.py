"""File descriptors: the one resource every socket, chunk file and Redis connection takes.

The usual soft limit is 1,024, which a few hundred idle sockets and the tiers' files
exhaust together; then every ``open()`` fails with EMFILE. ``kvtier serve`` therefore
raises the soft limit at start (to the hard limit, or ``server.open_files_limit``) and caps
its connections below it, so that the files the tiers open always find a descriptor.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DescriptorLimit:
    """The process's ``RLIMIT_NOFILE`` after start-up, and what it was before."""

    soft: int
    hard: int
    before: int

    def connection_cap(self, wanted: int, reserved: int) -> int:
        """The most connections to hold: ``wanted``, but never more than the soft limit
        less the descriptors kept for files (at most half of a low limit is kept)."""
        return max(1, min(wanted, self.soft - min(reserved, self.soft // 2)))


def raise_open_files_limit(wanted: int | None) -> DescriptorLimit:
    """Set the soft descriptor limit to ``wanted`` (unset: the hard limit), within the hard
    limit; a limit that cannot be raised stays as it is, with a warning."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if wanted is None else wanted
    if hard != resource.RLIM_INFINITY:
        target = min(target, hard)
    if target == resource.RLIM_INFINITY:  # an unlimited hard limit: keep the count finite
        target = max(soft, 1 << 20)
    if target != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("kvtier serve: could not set the descriptor limit to %d (stays %d): %s",
                        target, soft, exc)
            target = soft
    if wanted is not None and wanted > target:
        log.warning("kvtier serve: server.open_files_limit %d is over the hard limit %d",
                    wanted, hard)
    log.info("kvtier serve: descriptor limit %d (was %d, hard %s)", target, soft,
             "unlimited" if hard == resource.RLIM_INFINITY else hard)
    return DescriptorLimit(soft=target, hard=hard, before=soft)


def current_limit() -> DescriptorLimit:
    """The limit as it stands, changing nothing (an app served by something else)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return DescriptorLimit(soft=soft, hard=hard, before=soft)
