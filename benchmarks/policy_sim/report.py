"""Tables and plots of a policy benchmark run."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def print_tables(console, results: dict[str, Any]) -> None:
    from rich.table import Table

    for wname, entry in results.items():
        for budget, rows in entry["budgets"].items():
            t = Table(
                title=f"{wname}: {entry['turns']} turns, {entry['sessions']} sessions, GPU budget "
                f"{budget} of the working set ({_gb(entry['working_set_bytes'])} GB), "
                f"time x{entry['time_scale']:.1f}"
                + (f"; reuse ceiling {100 * entry['reuse_ceiling']['exact']:.0f}% of prompt chunks"
                   if "reuse_ceiling" in entry else ""),
                title_justify="left",
            )
            for col in ("system", "TTFT mean s", "p50 s", "p99 s", "vs recompute",
                        "hits gpu/cpu/disk", "hits of ceiling", "read GB", "written GB", "prefill saved",
                        "peak GPU GB"):
                t.add_column(col, justify="left" if col == "system" else "right")
            base = rows.get("recompute-only", {}).get("ttft_mean_s")
            best = min(r["ttft_mean_s"] for r in rows.values())
            for name, r in rows.items():
                hr = r["hit_rate"]
                t.add_row(
                    f"[bold]{name}[/]" if r["ttft_mean_s"] == best else name,
                    f"{r['ttft_mean_s']:.3f}", f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p99_s']:.3f}",
                    f"{r['ttft_mean_s'] / base:.3g}x" if base else "-",
                    "/".join(f"{100 * hr.get(k, 0):.0f}%" for k in ("gpu", "cpu", "disk")),
                    _of_ceiling(hr, entry),
                    _gb(sum(r["read_bytes"].values())),
                    _gb(sum(r["write_bytes"].values())),
                    f"{100 * r['prefill_tokens_saved_frac']:.0f}%",
                    _gb(r["peak_gpu_kv_bytes"]),
                )
            console.print(t)


def print_robustness(console, robust: dict[str, Any]) -> None:
    """Each family member and budget: kvtier's mean and p99 TTFT over the best other's."""
    from rich.table import Table

    if not robust.get("cells"):
        return
    t = Table(title=f"{robust['system']} across the trace family ({robust['members']} members): "
              "TTFT over the best other system (below 1: lowest)", title_justify="left")
    for col in ("workload", "budget", "mean vs best", "p99 vs best", "best other"):
        t.add_column(col, justify="left" if col in ("workload", "best other") else "right")
    for c in robust["cells"]:
        t.add_row(c["workload"], c["budget"], f"{c['mean_vs_best']:.3f}",
                  f"{c['p99_vs_best']:.3f}", c["best_other"])
    console.print(t)
    console.print(
        f"worst mean {robust['worst_mean_vs_best']:.3f}x, worst p99 "
        f"{robust['worst_p99_vs_best']:.3f}x; mean within 1 % in "
        f"{100 * robust['mean_within_1pct']:.0f} % of cells, p99 within 3 % in "
        f"{100 * robust['p99_within_3pct']:.0f} %; lowest mean in "
        f"{100 * robust['lowest_mean_share']:.0f} %; geometric mean "
        f"{robust['geomean_mean_vs_best']:.3f}x")


def _of_ceiling(hit_rate: dict[str, float], entry: dict[str, Any]) -> str:
    """The prompt chunks a system served, as a share of what the workload allows."""
    ceiling = entry.get("reuse_ceiling", {}).get("exact")
    if not ceiling:
        return "-"
    return f"{100 * (1 - hit_rate.get('miss', 0.0)) / ceiling:.0f}%"


def plot_results(results: dict[str, Any], directory: Path) -> list[Path]:
    """Per workload: TTFT CDFs (one panel per budget) and memory per tier over time for
    kvtier at the smallest budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    for wname, entry in results.items():
        budgets = list(entry["budgets"])
        fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
        for ax, b in zip(axes[0], budgets, strict=True):
            for name, r in entry["budgets"][b].items():
                xs = r["ttft_sorted_s"]
                if not xs:
                    continue
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.plot(xs, ys, label=name, lw=2 if name == "kvtier" else 1)
            ax.set_xscale("log")
            ax.set_xlabel("TTFT (s, log)")
            ax.set_ylabel("fraction of turns")
            ax.set_title(f"{wname}: GPU budget {b}")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = directory / f"policies-{wname}-ttft-cdf.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)

        rows = entry["budgets"][budgets[0]]
        if not any(r["timeline"] for r in rows.values()):
            continue  # a cluster's nodes sample apart: no one memory timeline to draw
        fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.2), squeeze=False,
                                 sharey=True)
        for ax, (name, r) in zip(axes[0], rows.items(), strict=True):
            tl = r["timeline"]
            if tl:
                times = [t for t, _ in tl]
                for tier in tl[-1][1]:
                    ax.plot(times, [m.get(tier, 0) / 1e9 for _, m in tl], label=tier)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("time (s)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(f"KV GB (budget {budgets[0]})")
        axes[0][-1].legend(fontsize=8)
        fig.tight_layout()
        path = directory / f"policies-{wname}-memory.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
