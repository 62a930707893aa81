"""Presenting fragmentation results: a terminal table, JSON payload and a PNG plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvtier.benchmarks.fragmentation.analysis import REFERENCE_STRATEGY, WorkloadAnalysis


def print_tables(analyses: Sequence[WorkloadAnalysis], console: Console | None = None) -> None:
    console = console or Console()
    for a in analyses:
        w = a.workload
        t = Table(
            title=f"{w.name}: {w.description}; memory {w.memory_tokens} token slots, "
            f"{len(w.requests)} requests",
            title_justify="left",
        )
        for col in (
            "strategy",
            "util",
            "int frag",
            "ext frag",
            "reserved",
            "held",
            "peak seqs",
            "mean seqs",
            "rejected",
            "preempt",
            "copies",
            "tok copied",
            "steps",
        ):
            t.add_column(col, justify="left" if col == "strategy" else "right")
        for r in a.results:
            t.add_row(
                r.strategy,
                f"{r.utilisation:.1%}",
                f"{r.internal_fragmentation:.1%}",
                f"{r.external_fragmentation:.1%}",
                f"{r.memory_reserved_fraction:.1%}",
                f"{r.memory_held_fraction:.1%}",
                str(r.peak_concurrency),
                f"{r.mean_concurrency:.1f}",
                str(r.rejected),
                str(r.preemptions),
                str(r.copies),
                str(r.tokens_copied),
                str(r.steps),
            )
        console.print(t)
        console.print(f"  verdict: {a.verdict}\n")


def plot(analyses: Sequence[WorkloadAnalysis], path: str | Path) -> Path:
    """Four panels, one group of bars per workload and one bar per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = [r.strategy for r in analyses[0].results]
    names = [a.workload.name.removeprefix("trace:") for a in analyses]
    panels = [
        ("utilisation (tokens held / reserved)", lambda r, ref: r.utilisation),
        ("tokens held / total memory", lambda r, ref: r.memory_held_fraction),
        (
            f"mean concurrent sequences / {REFERENCE_STRATEGY}",
            lambda r, ref: (
                r.mean_concurrency / ref.mean_concurrency if ref and ref.mean_concurrency else 0.0
            ),
        ),
        (
            "external fragmentation (free but unusable / memory)",
            lambda r, ref: r.external_fragmentation,
        ),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(15, 9), constrained_layout=True)
    width = 0.8 / max(len(strategies), 1)
    cmap = plt.get_cmap("tab10")
    for ax, (title, metric) in zip(axes.flat, panels, strict=True):
        for i, s in enumerate(strategies):
            vals = []
            for a in analyses:
                r, ref = a.result(s), a.result(REFERENCE_STRATEGY)
                vals.append(metric(r, ref) if r else 0.0)
            xs = [j + (i - len(strategies) / 2 + 0.5) * width for j in range(len(analyses))]
            ax.bar(xs, vals, width, label=s, color=cmap(i % 10))
        ax.set_title(title)
        ax.set_xticks(range(len(analyses)))
        ax.set_xticklabels(names, rotation=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(strategies), fontsize=9)
    fig.suptitle("KV allocation strategies: memory efficiency per workload")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
