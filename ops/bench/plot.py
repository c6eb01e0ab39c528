"""Pictures and tables from the benchmarks' own reports: latency against load (end_to_end.py --loads) and the
priority lanes' high-request latency per run (priority.py --repeats).

    python ops/bench/plot.py --e2e OUT/e2e-2b-bf16 OUT/e2e-2b-fp8-late --priority OUT/priority-2b-bf16 --out docs

Reads each directory's ``report.json``; writes ``latency-load.png`` and ``priority-lanes.png`` into ``--out`` and
prints the tables beside them as Markdown. Needs matplotlib (not a dependency of the project: a bench tool).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def label(report: dict) -> str:
    if report.get("dtype") != "fp8":
        return "bf16"
    layers = report.get("fp8_layers", "all")
    return "FP8" if layers == "all" else f"FP8, layers {layers}"


def latency_table(reports: list[dict]) -> str:
    lines = ["| setting | load (x peak) | offered requests/s | p50 ms | p99 ms | max ms | GPU busy |",
             "|---|---|---|---|---|---|---|"]
    for report in reports:
        for phase in report.get("sweep", []):
            lines.append(f"| {label(report)} | {phase['load']:.1f} | {phase['offered_requests_per_s']:.1f} | "
                         f"{phase['p50_ms']:.0f} | {phase['p99_ms']:.0f} | {phase['max_ms']:.0f} | "
                         f"{phase['gpu_busy_fraction']:.0%} |")
    return "\n".join(lines)


def priority_table(report: dict) -> str:
    lines = ["| run | high offered/s | high p50 ms | high p99 ms | high max ms | normal / peak | total / peak |",
             "|---|---|---|---|---|---|---|"]
    for number, run in enumerate(report.get("runs") or [report["with_high"]], 1):
        lines.append(f"| {number} | {run['high_offered_per_s']:.1f} | {run['high_p50_ms']:.0f} | "
                     f"{run['high_p99_ms']:.0f} | {run['high_max_ms']:.0f} | {run['normal_over_peak']:.1%} | "
                     f"{run['total_over_peak']:.1%} |")
    return "\n".join(lines)


def plot_latency(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for number, report in enumerate(reports):
        sweep = report.get("sweep", [])
        if not sweep:
            continue
        peak = report["peak"]["tokens_per_s"]
        loads = [phase["load"] * 100 for phase in sweep]
        color = f"C{number}"
        ax.plot(loads, [p["p99_ms"] for p in sweep], "o-", color=color,
                label=f"{label(report)} p99 (peak {peak / 1000:.0f}k tokens/s)")
        ax.plot(loads, [p["p50_ms"] for p in sweep], "s--", color=color, label=f"{label(report)} p50")
    ax.set_yscale("log")
    ax.set_yticks([t for t in (10, 20, 30, 50, 100, 200, 300, 500, 1000, 2000, 5000)
                   if any(t <= p["p99_ms"] * 1.5 for r in reports for p in r.get("sweep", []))])
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("offered load, % of the end-to-end peak")
    ax.set_ylabel("enqueue to result, ms")
    ax.set_title("2B standard workload, one H200: latency against load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_priority(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report.get("runs") or [report["with_high"]]
    numbers = list(range(1, len(runs) + 1))
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    width = 0.35
    ax.bar([n - width / 2 for n in numbers], [r["high_p50_ms"] for r in runs], width, label="high p50")
    ax.bar([n + width / 2 for n in numbers], [r["high_p99_ms"] for r in runs], width, label="high p99")
    target = report.get("targets", {}).get("high_p99_ms")
    if target:
        ax.axhline(target, color="red", linestyle=":", label=f"p99 target {target} ms")
    for n, run in zip(numbers, runs):
        ax.annotate(f"total {run['total_over_peak']:.0%} of peak", (n, run["high_p99_ms"]), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_ylim(0, max([r["high_p99_ms"] for r in runs] + [target or 0]) * 1.15)
    ax.set_xticks(numbers, [f"run {n}" for n in numbers])
    ax.set_ylabel("high request, enqueue to result, ms")
    ax.set_title(f"Priority lanes: high at {report.get('high_load', 0.1):.0%} of the peak over a saturating backlog",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e2e", nargs="*", default=[], help="end_to_end.py output directories with a sweep")
    parser.add_argument("--priority", default="", help="a priority.py output directory")
    parser.add_argument("--out", default="docs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = [json.loads((Path(d) / "report.json").read_text()) for d in args.e2e]
    if reports:
        plot_latency(reports, out / "latency-load.png")
        print(latency_table(reports), end="\n\n")
    if args.priority:
        report = json.loads((Path(args.priority) / "report.json").read_text())
        plot_priority(report, out / "priority-lanes.png")
        print(priority_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
