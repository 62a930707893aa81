"""Who ran a benchmark: recorded beside every result so numbers from different machines are
never compared by accident."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    """Host, CPU, memory, accelerator and library versions."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
    }
    with contextlib.suppress(ValueError, OSError):
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
        else:
            info["gpu"] = None
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def bench_device(choice: str) -> Any:
    """The torch device of a ``--device auto|cuda|cpu`` option: CUDA where asked for or,
    with ``auto``, present; ``cuda`` without CUDA is an error, not a silent CPU run."""
    import torch

    from kvtier.errors import InvalidArgumentError

    if choice == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("--device cuda asked for but CUDA is not available")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")
