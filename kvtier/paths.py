"""Where kvtier keeps files of its own between runs (wheels, converted GGUF files, weight
digests of read-only checkpoints): one cache directory, chosen by the environment."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``."""
    if os.environ.get("KVTIER_CACHE_DIR"):
        return Path(os.environ["KVTIER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"
