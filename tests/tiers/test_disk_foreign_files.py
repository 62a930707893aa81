"""The disk tier on a real filesystem where something other than its own chunk files sits
in a chunk's place: a FIFO (opening it to read would block a worker for good), a
directory (a rename cannot replace it), a symlink, a file grown sparse far past what its
header says. Each is a miss of its own key only, never opened to read (nothing blocks),
moved aside or deleted, and the key is storable again; a file's header sizes every buffer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtier.chunk_format import encode_chunk
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.disk_quarantine import QUARANTINE_DIR
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.connectors.tiers.lent_chunk import ReadingBuffer

pytestmark = pytest.mark.timeout(60)  # on code that opens a FIFO to read, a hang fails here
FP = b"model-fp"


def key(i: int) -> str:
    return f"{i:064x}"


def chunk(i: int) -> bytes:
    g = torch.Generator().manual_seed(i)
    return encode_chunk(key(i), FP, torch.randn(4, 2, 16, 2, 8, generator=g).to(torch.float16))


def chunk_path(directory: Path, k: str) -> Path:
    return directory / k[:2] / f"{k}.kvc"


def replace_with(path: Path, kind: str) -> None:
    """Put a ``kind`` object where the chunk file ``path`` was."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"x")  # not even an empty one
    elif kind == "symlink":
        os.symlink("/dev/zero", path)
    else:
        raise ValueError(kind)


def quarantined(directory: Path) -> list[str]:
    folder = directory / QUARANTINE_DIR
    return sorted(p.name.split(".")[0] for p in folder.iterdir()) if folder.exists() else []


def stored(directory: Path, keys: list[int]) -> None:
    with DiskTier(directory, fsync=False) as t:
        assert put_blobs(t, {key(i): chunk(i) for i in keys}).ok


def keys_read(t: DiskTier, ids: list[int], background: bool) -> list[bytes | None]:
    with t.lease([key(i) for i in ids], background=background) as views:
        out = []
        for v in views:
            if v is None:
                out.append(None)
                continue
            if isinstance(v, ReadingBuffer):  # still being read: wait for its last bytes
                v.done.result()
                v = v.buf
            out.append(bytes(v.numpy()))
        return out


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_foreign_object_found_at_start_is_moved_aside_and_its_key_stored_again(
        tmp_path: Path, kind: str) -> None:
    stored(tmp_path, [1, 2, 3])
    replace_with(chunk_path(tmp_path, key(2)), kind)
    with DiskTier(tmp_path, fsync=False) as t:
        assert quarantined(tmp_path) == [key(2)] and t.quarantined == 1
        assert len(t) == 2 and t.contains_prefix([key(2)]) == 0
        assert keys_read(t, [1, 2, 3], background=True) == [chunk(1), None, chunk(3)]
        assert put_blobs(t, {key(2): chunk(2)}).stored == [key(2)]
        assert get_blobs(t, [key(2)]) == [chunk(2)]
        assert chunk_path(tmp_path, key(2)).is_file()


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_foreign_object_appearing_under_a_stored_key_is_one_miss(
        tmp_path: Path, kind: str, background: bool) -> None:
    with DiskTier(tmp_path, fsync=False) as t:
        assert put_blobs(t, {key(i): chunk(i) for i in (1, 2, 3)}).ok
        replace_with(chunk_path(tmp_path, key(2)), kind)  # behind the tier's back
        assert keys_read(t, [1, 2, 3], background) == [chunk(1), None, chunk(3)]
        assert quarantined(tmp_path) == [key(2)]
        assert t.stats.errors.get("not_a_file") == 1 and t.staging.lent == 0
        assert put_blobs(t, {key(2): chunk(2)}).stored == [key(2)]  # storable again
        assert get_blobs(t, [key(1), key(2), key(3)]) == [chunk(1), chunk(2), chunk(3)]


def test_a_directory_where_a_new_chunk_goes_is_moved_aside_by_the_put(tmp_path: Path) -> None:
    with DiskTier(tmp_path, fsync=False) as t:
        path = chunk_path(tmp_path, key(4))
        path.parent.mkdir(exist_ok=True)
        path.mkdir()
        assert put_blobs(t, {key(4): chunk(4), key(5): chunk(5)}).stored == [key(4), key(5)]
        assert get_blobs(t, [key(4), key(5)]) == [chunk(4), chunk(5)]
        assert quarantined(tmp_path) == [key(4)]


def test_a_file_where_a_shard_directory_goes_is_moved_aside_by_the_put(tmp_path: Path) -> None:
    with DiskTier(tmp_path, fsync=False) as t:
        (tmp_path / key(6)[:2]).write_bytes(b"not a directory")
        assert put_blobs(t, {key(6): chunk(6)}).stored == [key(6)]
        assert get_blobs(t, [key(6)]) == [chunk(6)]


def test_deleting_and_evicting_a_key_whose_file_became_a_directory(tmp_path: Path) -> None:
    with DiskTier(tmp_path, fsync=False) as t:
        assert put_blobs(t, {key(7): chunk(7), key(8): chunk(8)}).ok
        replace_with(chunk_path(tmp_path, key(7)), "directory")
        assert t.delete([key(7)]) == 1  # unlink cannot remove it: moved aside
        assert not chunk_path(tmp_path, key(7)).exists()
    room = 2 * len(chunk(1)) + 100  # two chunks
    with DiskTier(tmp_path / "small", capacity_bytes=room, fsync=False, read_evicted=True) as t:
        evicted: list[tuple[str, bytes | None]] = []
        t.add_eviction_listener(lambda k, blob, info: evicted.append((k, blob)))
        for i in (1, 2):
            assert put_blobs(t, {key(i): chunk(i)}).ok
        replace_with(chunk_path(tmp_path / "small", key(1)), "fifo")
        assert put_blobs(t, {key(3): chunk(3)}).ok  # evicts key(1), read for the tier below
        assert evicted == [(key(1), None)]  # the FIFO was never opened to read
        assert t.contains_prefix([key(2), key(3)]) == 2


@pytest.mark.parametrize("background", [True, False])
def test_a_file_grown_past_its_header_costs_a_header_read(tmp_path: Path, background: bool) -> None:
    staging = StagingPool()
    with DiskTier(tmp_path, fsync=False, staging=staging) as t:
        assert put_blobs(t, {key(1): chunk(1), key(2): chunk(2)}).ok
        os.truncate(chunk_path(tmp_path, key(1)), 256 << 20)  # sparse: no disk used
        assert keys_read(t, [1, 2], background) == [None, chunk(2)]
        assert staging.idle_bytes <= 2 << 20  # no buffer sized by the file was taken
        assert not chunk_path(tmp_path, key(1)).exists() and t.stats.corrupt == 1
        assert put_blobs(t, {key(1): chunk(1)}).stored == [key(1)]


_OUT_OF_DESCRIPTORS = """
import os, resource, sys
from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.errors import DescriptorsExhaustedError
from tests.tiers.test_disk_foreign_files import chunk, chunk_path, key
from pathlib import Path

resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
d = Path(sys.argv[1])
with DiskTier(d, fsync=False) as t:
    assert put_blobs(t, {key(1): chunk(1), key(2): chunk(2)}).ok
    manager = TierManager([t], promote_on_hit=False)
    held = []

    def exhaust():  # every descriptor taken (again: a failed read may have let one go)
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass

    exhaust()
    try:
        with t.lease([key(1), key(2)]):
            raised = False
    except DescriptorsExhaustedError:
        raised = True
    exhaust()
    with manager.lease_chunks([key(1), key(2)]) as lent:  # a reader that can recompute
        missed = [c is None for c in lent]
    exhaust()
    try:
        with manager.lease_chunks([key(1), key(2)], strict=True):
            strict = False
    except DescriptorsExhaustedError:
        strict = True
    for fd in held:
        os.close(fd)
    kept = chunk_path(d, key(1)).is_file() and chunk_path(d, key(2)).is_file()
    with t.lease([key(1), key(2)]) as views:
        after = [bytes(v.numpy()) for v in views] == [chunk(1), chunk(2)]
    print(raised, missed, strict, kept, after)
"""


def test_running_out_of_descriptors_deletes_nothing_and_is_told_apart_from_a_miss(
        tmp_path: Path) -> None:
    """EMFILE is no fault of the file: the tier's lease raises
    DescriptorsExhaustedError (whether the keys are stored is unknown), a manager's lease
    makes it a miss for a reader that can recompute and raises it for one that asks
    (``strict``: the service, which answers 503); no file is deleted or moved, and the
    chunks are served once descriptors are back."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "[True,", "True]", "True", "True", "True"]
