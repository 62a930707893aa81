"""Writing benchmark results: JSON with the machine it ran on, in benchmarks/results/."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvtier.benchmarks.machine import machine_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_result(path: str | os.PathLike[str], suite: str, payload: dict[str, Any]) -> Path:
    """Write ``{"suite", "machine", ...payload}`` atomically (temp file + rename)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"suite": suite, "machine": machine_info(), **payload}
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, out)
    return out
