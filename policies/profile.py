"""Calibration profiles on disk: a cost model plus who measured it, where, on what.

The policies trust a profile only for the model and machine it was measured on: loading
one from another model (fingerprint) or machine (host, CPU, GPU) yields warnings that the
caller shows, so numbers from elsewhere are never used silently.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.policies.cost_model import CostModel

PROFILE_VERSION = 1


def save_profile(path: str | os.PathLike[str], cost: CostModel, extra: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"kvtier_profile": PROFILE_VERSION, "cost_model": cost.to_dict(), **extra}
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, out)
    return out


def load_profile(
    path: str | os.PathLike[str],
    model_fingerprint: str | None = None,
    machine: str | None = None,
) -> tuple[CostModel, list[str]]:
    """The cost model in ``path`` and warnings when it was measured for another model
    or machine than the ones given. A modelled profile (a GPU machine described from its
    datasheets, ``"modelled": true``) is for the machine it names, not this one: no
    machine warning."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"calibration profile {p} does not exist; create one with "
            "`kvtier calibrate --model DIR --out {p}`"
        )
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"calibration profile {p} is not readable JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kvtier_profile") != PROFILE_VERSION:
        raise ConfigError(f"{p} is not a kvtier calibration profile (version {PROFILE_VERSION})")
    try:
        cost = CostModel.from_dict(doc["cost_model"])
    except (KeyError, InvalidArgumentError) as exc:
        raise ConfigError(f"calibration profile {p}: {exc}") from None
    warnings: list[str] = []
    if model_fingerprint is not None and cost.model != model_fingerprint:
        warnings.append(
            f"profile {p.name} was measured for another model (fingerprint {cost.model[:12]}, "
            f"this one is {model_fingerprint[:12]}): its prefill costs do not apply"
        )
    if machine is not None and cost.machine != machine and not doc.get("modelled"):
        warnings.append(
            f"profile {p.name} was measured on another machine ({cost.machine}; this is "
            f"{machine}): recalibrate with `kvtier calibrate`"
        )
    return cost, warnings
