"""Writing a batch of chunk files with group commit, for the disk tier's store.

Every chunk of the batch goes to a temp file (``.<key>.<random>.tmp``) in the chunk's own
directory and its data is synced, then all of them are renamed into place, then each
touched directory is synced once: a chunk becomes visible only once its bytes are durable,
a crash never leaves a torn chunk under a chunk name, and the directory sync is paid once
per batch, not once per chunk. Nothing that failed stays on disk. A foreign object in the
way (a directory where a chunk file or a shard directory belongs, which a rename cannot
replace) is moved aside first, so no key is unstorable for good.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.disk_io import failure_reason, fsync_dir, unlink_if_present
from kvtier.connectors.tiers.disk_layout import ChunkPaths
from kvtier.connectors.tiers.disk_quarantine import Quarantine
from kvtier.connectors.tiers.host_buffers import StagingPool

log = logging.getLogger(__name__)

@dataclass
class WriteOutcome:
    """One chunk of a batch: None (stored, ``length`` bytes) or why it failed."""

    reason: str | None
    length: int = 0


@dataclass
class _TempWrite:
    path: str
    reason: str | None
    length: int = 0
    error: Exception | None = None
    """What the chunk's fill raised (the caller's error: the batch re-raises it)."""


@dataclass
class GroupCommit:
    """Writes batches into ``paths``. ``write_file(path, data)`` writes and syncs one
    file (with the tier's ``O_DIRECT`` choice); ``map`` runs a function over items on the
    tier's pool; fills land in ``staging`` buffers; foreign objects in the way go into
    ``quarantine``."""

    paths: ChunkPaths
    fsync: bool
    staging: StagingPool
    write_file: Callable[[str, Any], None]
    map: Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]
    quarantine: Quarantine

    def write(self, todo: Sequence[ChunkWrite]) -> dict[str, WriteOutcome]:
        """Write + sync every temp file, rename all, sync each directory once. An error a
        fill raised is raised once the batch's files are gone."""
        outcomes: dict[str, WriteOutcome] = {}
        if not todo:
            return outcomes
        new_dirs = self._make_dirs(todo, outcomes)
        pending = [w for w in todo if w.key not in outcomes]
        temps: list[_TempWrite] = self.map(self._write_temp, pending)
        failure = next((t.error for t in temps if t.error is not None), None)
        if failure is not None:  # a fill's error is the caller's: nothing of the batch stays
            for t in temps:
                unlink_if_present(t.path)
            raise failure
        renamed: dict[str, list[str]] = {}
        for write, temp in zip(pending, temps, strict=True):
            reason = temp.reason
            if reason is None:
                try:
                    self._rename_into_place(temp.path, self.paths.path(write.key))
                except OSError as exc:
                    unlink_if_present(temp.path)
                    reason = failure_reason(exc)
                else:
                    renamed.setdefault(self.paths.shard(write.key), []).append(write.key)
            outcomes[write.key] = WriteOutcome(reason, temp.length if reason is None else 0)
        if self.fsync:
            self._sync_dirs(renamed, new_dirs, outcomes)
        return outcomes

    def _rename_into_place(self, temp: str, path: str) -> None:
        """Rename ``temp`` to ``path``; a directory there (which no rename replaces; any
        other object is replaced) is moved aside first."""
        try:
            os.rename(temp, path)
        except IsADirectoryError:
            self.quarantine.move_aside(path)
            os.rename(temp, path)

    def _make_dirs(self, todo: Sequence[ChunkWrite], outcomes: dict[str, WriteOutcome]) -> bool:
        """Create the batch's missing shard directories (anything else in a shard's place,
        a symlink included, moved aside first); whether any was new."""
        new_dirs = False
        for sub in {self.paths.shard(w.key) for w in todo}:
            path = self.paths.directory / sub
            if _is_real_dir(path):
                continue
            try:
                self.quarantine.move_aside(str(path), keep_files=False)
                path.mkdir(exist_ok=True)
                new_dirs = True
            except OSError as exc:
                for w in todo:
                    if self.paths.shard(w.key) == sub:
                        outcomes[w.key] = WriteOutcome(failure_reason(exc))
        return new_dirs

    def _sync_dirs(self, renamed: dict[str, list[str]], new_dirs: bool,
                   outcomes: dict[str, WriteOutcome]) -> None:
        dirs = [str(self.paths.directory / sub) for sub in renamed]
        if new_dirs:
            dirs.append(str(self.paths.directory))
        for d in dirs:
            try:
                fsync_dir(d)
            except OSError as exc:
                for key in renamed.get(os.path.basename(d), []):
                    unlink_if_present(self.paths.path(key))
                    outcomes[key] = WriteOutcome(failure_reason(exc))

    def _write_temp(self, write: ChunkWrite) -> _TempWrite:
        """The chunk synced to a temp file (on the tier's pool)."""
        temp = self.paths.temp_path(write.key)
        try:
            with write.bytes_from(self.staging) as blob:
                self.write_file(temp, blob)
                return _TempWrite(temp, None, len(blob))
        except OSError as exc:
            unlink_if_present(temp)
            log.warning("disk tier %s: writing chunk %s failed: %s",
                        self.paths.directory, write.key, exc)
            return _TempWrite(temp, failure_reason(exc))
        except Exception as exc:  # noqa: BLE001 - a fill's error, raised by the batch
            unlink_if_present(temp)
            return _TempWrite(temp, None, error=exc)


def _is_real_dir(path: os.PathLike[str]) -> bool:
    """A directory itself (by ``lstat``: a symlink to one is not)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
