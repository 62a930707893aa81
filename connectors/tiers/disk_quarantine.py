"""Foreign objects found where a disk tier keeps its chunks, moved aside.

A FIFO, a directory, a symlink, a socket or a device under a chunk's name (an operator's
mistake, or a hostile one) is never read (opening a FIFO for reading would block a worker
for good) and never left in place (a directory there would make its key unstorable, a
rename cannot replace it): it is renamed into ``<dir>/.quarantine/`` (the same
filesystem, so one atomic rename whatever it is), logged, and kept for the operator to
look at. Its key is then a miss, and storable again.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

QUARANTINE_DIR = ".quarantine"
"""The folder of a disk tier's directory foreign objects are moved into (its name is not
two characters long, so the start-up scan never takes it for a shard)."""


class Quarantine:
    """Moves foreign objects of ``directory`` aside and counts them (``moved``)."""

    def __init__(self, directory: Path) -> None:
        self.folder = directory / QUARANTINE_DIR
        self._lock = threading.Lock()
        self.moved = 0
        """Objects moved aside since the tier started."""

    def move_aside(self, path: str, keep_files: bool = True) -> bool:
        """Rename ``path`` into the quarantine folder, unless it is a regular file and
        ``keep_files`` (a chunk stored there meanwhile is kept); False when nothing was
        moved (gone, kept, or it could not be moved: logged, its key stays a miss)."""
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return False  # gone (or its directory is): nothing in the way
        if keep_files and stat.S_ISREG(mode):
            return False
        dest = self.folder / f"{os.path.basename(path)}.{uuid.uuid4().hex[:12]}"
        try:
            self.folder.mkdir(exist_ok=True)
            os.rename(path, dest)
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.error("disk tier: %s is not a chunk file and could not be moved aside: %s",
                      path, exc)
            return False
        log.warning("disk tier: %s is not a chunk file; moved aside to %s", path, dest)
        with self._lock:
            self.moved += 1
        return True

    def discard(self, path: str | os.PathLike[str]) -> None:
        """Remove a chunk or temp file that is to go; a directory in its place (which
        ``unlink`` cannot remove) is moved aside instead."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            self.move_aside(os.fspath(path))


def is_regular_file(path: str) -> bool:
    """Whether ``path`` is a regular file itself (by ``lstat``: a symlink is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
