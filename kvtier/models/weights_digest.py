"""A digest of a checkpoint's weights, the part of a model's identity its config cannot give.

Two checkpoints with the same ``config.json`` (another seed, a fine-tune, a new revision, a
re-quantised file at the same path) compute different KV for the same tokens, so the model
fingerprint that keys every stored chunk must name the weights themselves. Hashing a large
checkpoint takes seconds, so each weight file's SHA-256 is kept beside the checkpoint
(``kvtier_weights.json``) with the file's size and modification time, and computed again
only for a file whose size or mtime changed. Where the directory is read-only, the record
goes to kvtier's cache directory, keyed by the checkpoint's path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from kvtier.hashing import file_sha256

log = logging.getLogger(__name__)

RECORD_FILE = "kvtier_weights.json"


def state_dict_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes (for in-memory models)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def weights_digest(model_dir: str | Path, files: list[Path]) -> str:
    """The SHA-256 of the checkpoint's weight ``files`` (names and contents), reusing the
    recorded hash of every file whose size and mtime are unchanged."""
    model_dir = Path(model_dir)
    record_path = _record_path(model_dir)
    record = _read_record(record_path)
    entries: dict[str, dict] = {}
    changed = False
    for path in sorted(files):
        st = path.stat()
        name = path.name
        old = record.get(name)
        if old and old.get("size") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns:
            entries[name] = old
            continue
        entries[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                         "sha256": file_sha256(path)}
        changed = True
    if changed or set(record) != set(entries):
        _write_record(record_path, entries)
    h = hashlib.sha256()
    for name in sorted(entries):
        h.update(f"{name}:{entries[name]['sha256']}\n".encode())
    return h.hexdigest()


def checkpoint_digest(model_dir: str | Path) -> str | None:
    """:func:`weights_digest` of every weight file in a checkpoint directory (safetensors,
    or PyTorch ``.bin``/``.pt`` files); None when it holds none (a hub id, not a path)."""
    d = Path(model_dir)
    if not d.is_dir():
        return None
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt"))
    return weights_digest(d, files) if files else None


def _record_path(model_dir: Path) -> Path:
    if os.access(model_dir, os.W_OK):
        return model_dir / RECORD_FILE
    from kvtier.paths import cache_dir

    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "weights" / f"{key}.json"


def _read_record(path: Path) -> dict[str, dict]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = doc.get("files") if isinstance(doc, dict) else None
    return files if isinstance(files, dict) else {}


def _write_record(path: Path, entries: dict[str, dict]) -> None:
    """Atomically; a record that cannot be written only costs hashing again next time."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"files": entries}, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot record weight digests in %s (%s); they are computed at each load",
                    path, exc)
        tmp.unlink(missing_ok=True)
