"""Runs strategies over workloads and judges, per workload, whether contiguous allocation
is good enough or paging is essential."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.benchmarks.fragmentation.simulator import ReplayResult, replay
from kvtier.benchmarks.fragmentation.strategies import make_strategy
from kvtier.benchmarks.fragmentation.workloads import Workload

REFERENCE_STRATEGY = "paged-16"
# A contiguous strategy is "fine" for a workload when it stays this close to paged-16 ...
FINE_UTILISATION_RATIO = 0.9
FINE_CONCURRENCY_RATIO = 0.9
# ... rejects no more requests, and copies at most this share of the tokens it generates.
FINE_MAX_COPY_SHARE = 0.05


@dataclass
class WorkloadAnalysis:
    workload: Workload
    results: list[ReplayResult]
    verdict: str = ""
    contiguous_fine: bool | None = None
    best_contiguous: str | None = None
    notes: list[str] = field(default_factory=list)

    def result(self, strategy: str) -> ReplayResult | None:
        return next((r for r in self.results if r.strategy == strategy), None)

    def as_dict(self) -> dict:
        w = self.workload
        return {
            "workload": w.name,
            "description": w.description,
            "requests": len(w.requests),
            "memory_tokens": w.memory_tokens,
            "contiguous_expected_fine": w.contiguous_expected_fine,
            "contiguous_fine": self.contiguous_fine,
            "best_contiguous": self.best_contiguous,
            "verdict": self.verdict,
            "results": [r.as_dict() for r in self.results],
        }


def _contiguous_ok(c: ReplayResult, ref: ReplayResult) -> bool:
    return (
        c.utilisation >= FINE_UTILISATION_RATIO * ref.utilisation
        and c.mean_concurrency >= FINE_CONCURRENCY_RATIO * ref.mean_concurrency
        and c.rejected <= ref.rejected
        and c.tokens_copied <= FINE_MAX_COPY_SHARE * max(c.tokens_generated, 1)
    )


def judge(analysis: WorkloadAnalysis) -> None:
    """Fill in the verdict: which contiguous strategy fares best and whether it is fine."""
    ref = analysis.result(REFERENCE_STRATEGY)
    contiguous = [r for r in analysis.results if r.strategy.startswith("contiguous")]
    if ref is None or not contiguous:
        analysis.verdict = f"no verdict: needs {REFERENCE_STRATEGY} and a contiguous strategy"
        return
    ok = [c for c in contiguous if _contiguous_ok(c, ref)]
    best = max(ok or contiguous, key=lambda c: (c.mean_concurrency, c.utilisation))
    analysis.best_contiguous = best.strategy
    analysis.contiguous_fine = bool(ok)
    if ok:
        analysis.verdict = (
            f"contiguous allocation is fine: {best.strategy} holds {best.utilisation:.0%} "
            f"utilisation and {best.mean_concurrency:.1f} concurrent sequences vs "
            f"{ref.utilisation:.0%} / {ref.mean_concurrency:.1f} for {REFERENCE_STRATEGY}"
        )
        return
    reasons = []
    if best.utilisation < FINE_UTILISATION_RATIO * ref.utilisation:
        reasons.append(f"utilisation {best.utilisation:.0%} vs {ref.utilisation:.0%}")
    if best.mean_concurrency < FINE_CONCURRENCY_RATIO * ref.mean_concurrency:
        reasons.append(
            f"{best.mean_concurrency:.1f} vs {ref.mean_concurrency:.1f} concurrent sequences"
        )
    if best.rejected > ref.rejected:
        reasons.append(f"{best.rejected} vs {ref.rejected} requests rejected")
    if best.tokens_copied > FINE_MAX_COPY_SHARE * max(best.tokens_generated, 1):
        reasons.append(f"{best.tokens_copied} tokens copied by reallocation")
    analysis.verdict = f"paging is essential: best contiguous ({best.strategy}) has " + ", ".join(
        reasons
    )


def analyse(
    workloads: Sequence[Workload],
    strategies: Sequence[str],
    max_wait_steps: int = 4096,
    progress: Callable[[str, str], None] | None = None,
) -> list[WorkloadAnalysis]:
    out = []
    for w in workloads:
        results = []
        for name in strategies:
            if progress:
                progress(w.name, name)
            results.append(replay(w, make_strategy(name, w.memory_tokens), max_wait_steps))
        a = WorkloadAnalysis(w, results)
        judge(a)
        out.append(a)
    return out
