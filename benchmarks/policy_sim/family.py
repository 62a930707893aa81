"""A family of synthetic workloads spanning what production traces publish (issue 34), and
the robustness of a policy across it.

A policy tuned to the traces it was developed on loses on the next one. The family draws
``n`` members by Latin hypercube sampling over the axes below, so that every axis is spread
over its whole range even with a few dozen members: session turn counts from mostly
single-turn to long conversations, think times from agents' seconds to chat's minutes with
light to heavy tails, user messages from short to pasted documents, shared system prompts
from none to long ones shared by many, and arrival rates from light to overload (the
replay then stretches overloaded members to ``--target-load``). Ranges are the published
spans (ShareGPT, LMSYS-Chat, Mooncake, agent traces), never fitted to a result.

:func:`robustness` reads a replay's results: per member and budget, kvtier's mean and p99
TTFT over the best other system's.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict
from typing import Any

from kvtier.benchmarks.policy_sim.workloads import SyntheticSpec, Workload, synthetic

PREFIX = "family-"

AXES: dict[str, tuple[str, float, float]] = {
    # name: (scale, low, high); "log" axes are sampled uniformly in log space
    "turns_mean": ("log", 1.05, 10.0),
    "think_median_s": ("log", 2.0, 600.0),
    "think_sigma": ("lin", 0.3, 2.0),
    "user_tokens_median": ("log", 30.0, 3000.0),
    "first_turn_extra_tokens": ("log", 1.0, 24000.0),
    "system_tokens": ("log", 1.0, 4096.0),
    "system_prompts": ("log", 1.0, 64.0),
    "session_rate_per_s": ("log", 0.02, 5.0),
}
"""The axes the members span, and their ranges."""

INTEGER_AXES = ("user_tokens_median", "first_turn_extra_tokens", "system_tokens", "system_prompts")


def _value(axis: str, u: float) -> float:
    scale, lo, hi = AXES[axis]
    x = math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))) if scale == "log" else (
        lo + u * (hi - lo))
    return float(round(x)) if axis in INTEGER_AXES else x


def member_specs(n: int, seed: int = 0, sessions: int = 400) -> list[SyntheticSpec]:
    """``n`` specs by Latin hypercube sampling over :data:`AXES` (each axis's range cut into
    ``n`` strata, each stratum used once, in a seeded random order per axis)."""
    if n < 1:
        raise ValueError(f"a family needs at least one member, not {n}")
    rng = random.Random(f"family:{seed}")
    columns: dict[str, list[float]] = {}
    for axis in AXES:
        strata = list(range(n))
        rng.shuffle(strata)
        columns[axis] = [_value(axis, (k + rng.random()) / n) for k in strata]
    specs = []
    for i in range(n):
        values: dict[str, Any] = {axis: columns[axis][i] for axis in AXES}
        for axis in INTEGER_AXES:
            values[axis] = int(values[axis])
        if values["system_tokens"] <= 1:
            values["system_tokens"] = 0
        if values["first_turn_extra_tokens"] <= 1:
            values["first_turn_extra_tokens"] = 0
        specs.append(SyntheticSpec(sessions=sessions, **values))
    return specs


def family(n: int, seed: int = 0, sessions: int = 400) -> list[Workload]:
    """The members as workloads (``family-00`` ...), each with its spec in ``meta``."""
    out = []
    for i, spec in enumerate(member_specs(n, seed, sessions)):
        wl = synthetic(spec, seed=seed * 1000 + i, name=f"{PREFIX}{i:02d}")
        wl.meta["family_spec"] = {k: v for k, v in asdict(spec).items() if k in AXES}
        out.append(wl)
    return out


def robustness(results: dict[str, Any], system: str = "kvtier") -> dict[str, Any]:
    """Over the family members in ``results`` (by workload name, as the replay writes them):
    for each member and budget, ``system``'s mean and p99 TTFT over the best other
    system's (below 1: ``system`` is best; kvtier's own variants are not others), and the
    summary: the worst ratios, the share of cells within 1 % (mean) and 3 % (p99), and how
    often ``system`` has the lowest mean."""
    cells = []
    for name, entry in results.items():
        if not name.startswith(PREFIX):
            continue
        for budget, rows in entry["budgets"].items():
            if system not in rows or len(rows) < 2:
                continue
            ours = rows[system]
            others = {k: r for k, r in rows.items() if k != system and not k.startswith("kvtier")}
            if not others:
                continue
            best_mean = min(r["ttft_mean_s"] for r in others.values())
            best_p99 = min(r["ttft_p99_s"] for r in others.values())
            cells.append({"workload": name, "budget": budget,
                          "mean_vs_best": ours["ttft_mean_s"] / best_mean if best_mean else math.nan,
                          "p99_vs_best": ours["ttft_p99_s"] / best_p99 if best_p99 else math.nan,
                          "best_other": min(others, key=lambda k: others[k]["ttft_mean_s"])})
    if not cells:
        return {"cells": [], "members": 0}
    means = [c["mean_vs_best"] for c in cells]
    p99s = [c["p99_vs_best"] for c in cells]
    return {
        "system": system,
        "members": len({c["workload"] for c in cells}),
        "cells": cells,
        "worst_mean_vs_best": max(means),
        "worst_p99_vs_best": max(p99s),
        "mean_within_1pct": sum(m <= 1.01 for m in means) / len(means),
        "p99_within_3pct": sum(p <= 1.03 for p in p99s) / len(p99s),
        "lowest_mean_share": sum(m < 1.0 for m in means) / len(means),
        "geomean_mean_vs_best": math.exp(sum(math.log(m) for m in means) / len(means)),
    }
