"""How a disk tier lays its directory out, and what it finds there at start-up.

``<dir>/<first 2 key chars>/<key>.kvc``, one file per chunk; ``.<key>.<random>.tmp`` for a
write in flight; ``<dir>/.lock`` for the tiers (in one or several processes) sharing it;
``<dir>/.quarantine/`` for what was found in a chunk's place and is no regular file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvtier.chunk_format import logical_key
from kvtier.connectors.tiers.disk_quarantine import Quarantine

log = logging.getLogger(__name__)

CHUNK_SUFFIX = ".kvc"
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"


@dataclass(frozen=True)
class StoredFile:
    """A chunk file found at start-up."""

    key: str
    size: int
    mtime: float


@dataclass(frozen=True)
class ChunkPaths:
    """Where a directory keeps its chunks."""

    directory: Path

    @staticmethod
    def shard(key: str) -> str:
        """The subdirectory of ``key``: its chunk key's first two characters (a namespace
        would put all of a tenant's chunks in one)."""
        return logical_key(key)[:2]

    def path(self, key: str) -> str:
        return os.path.join(self.directory, self.shard(key), key + CHUNK_SUFFIX)

    def temp_path(self, key: str) -> str:
        return os.path.join(self.directory, self.shard(key),
                            f".{key}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")

    def acquire_lock(self) -> tuple[int, bool]:
        """A shared ``flock`` on ``<dir>/.lock`` for the tier's lifetime, and whether this
        tier is the directory's only user (it got the lock exclusively first). Only the
        only user may delete temp files at start-up: another live tier may be writing them."""
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            sole = True
        except BlockingIOError:
            sole = False
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd, sole

    def scan(self, remove_temps: bool, quarantine: Quarantine) -> tuple[list[StoredFile], int]:
        """The chunk files, oldest first (least recently used first), and how many temp
        files of interrupted writes were deleted (only with ``remove_temps``). Only regular
        files count (by ``lstat``: nothing is opened); anything else under a chunk's name
        is moved aside into ``quarantine``."""
        found: list[StoredFile] = []
        removed = 0
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(TEMP_SUFFIX):
                    if remove_temps:
                        quarantine.discard(entry.path)
                        removed += 1
                elif entry.name.endswith(CHUNK_SUFFIX):
                    st = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode):
                        quarantine.move_aside(entry.path)
                        continue
                    found.append(StoredFile(entry.name[: -len(CHUNK_SUFFIX)], st.st_size,
                                            st.st_mtime))
        if removed:
            log.info("disk tier %s: removed %d temp files of interrupted writes",
                     self.directory, removed)
        return sorted(found, key=lambda f: (f.mtime, f.key)), removed
