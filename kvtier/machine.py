"""Which machine this is, as far as costs go: calibration profiles are trusted only on the
machine that measured them (see :mod:`kvtier.policies.profile`)."""

from __future__ import annotations

import os
import platform


def this_machine() -> str:
    """What makes two machines the same for costs: CPU model, cores, GPU."""
    cpu = platform.processor() or "unknown-cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = "no-gpu"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"{cpu} x{os.cpu_count()} / {gpu}"
