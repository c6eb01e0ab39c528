"""Pictures and tables from the benchmarks' own reports: latency against load (end_to_end.py --loads), the
priority lanes' high-request latency per run (priority.py, one or more fresh workers) and where a lone request's
time goes (lone.py).

    python ops/bench/plot.py --e2e OUT/before/e2e-2b-bf16=before OUT/e2e-2b-bf16=after \
        --priority OUT/priority-2b-bf16 OUT/priority-2b-bf16-2 OUT/priority-2b-bf16-3 --lone OUT/lone-2b-bf16 --out docs

Reads each directory's ``report.json`` (``DIR=LABEL`` names its line); writes ``latency-load.png``,
``priority-lanes.png`` and ``lone-latency.png`` into ``--out`` and prints the tables beside them as Markdown. Needs
matplotlib (not a dependency of the project: a bench tool).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def label(report: dict) -> str:
    if report.get("label"):
        return report["label"]
    if report.get("dtype") != "fp8":
        return "bf16"
    layers = report.get("fp8_layers", "all")
    return "FP8" if layers == "all" else f"FP8, layers {layers}"


def latency_table(reports: list[dict]) -> str:
    lines = ["| setting | load (x peak) | offered requests/s | p50 ms | p99 ms | max ms | GPU busy |",
             "|---|---|---|---|---|---|---|"]
    for report in reports:
        for phase in report.get("sweep", []):
            lines.append(f"| {label(report)} | {phase['load']:g} | {phase['offered_requests_per_s']:.1f} | "
                         f"{phase['p50_ms']:.0f} | {phase['p99_ms']:.0f} | {phase['max_ms']:.0f} | "
                         f"{phase['gpu_busy_fraction']:.0%} |")
    return "\n".join(lines)


def crossings(report: dict) -> str:
    """The offered loads (x the peak) at which p99 first crosses 50 and 100 ms, interpolated between phases (the
    gate's figure: ops/bench/gate_targets.py)."""
    from gate_targets import crossing

    out = []
    for limit in (50, 100):
        at, under = crossing(report.get("sweep", []), limit)
        out.append(f"p99 crosses {limit} ms at {at:.0%} of the peak" if at is not None else
                   f"p99 stays under {limit} ms up to {under:.0%}" if under is not None else "-")
    return f"{label(report)} (peak {report['peak']['tokens_per_s'] / 1000:.1f}k tokens/s): " + "; ".join(out)


def priority_table(runs: list[dict]) -> str:
    lines = ["| run | high offered/s | high p50 ms | high p99 ms | high max ms | normal / peak | total / peak |",
             "|---|---|---|---|---|---|---|"]
    for number, run in enumerate(runs, 1):
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
    ax.set_title(f"2B standard workload, one {reports[0].get('gpu', 'GPU')}: latency against load", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_priority(report: dict, runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def plot_lone(reports: list[dict], path: Path) -> None:
    """One stacked bar per report: the lone request's mean per step, its client p50 and p99 beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 1.8 + 0.7 * len(reports)), dpi=100)
    for row, report in enumerate(reports):
        steps, left = report["client"]["breakdown_ms"], 0.0
        for number, (step, ms) in enumerate(steps.items()):
            ax.barh(row, ms, left=left, color=f"C{number}", label=step if row == 0 else None)
            if ms >= 1.0:
                ax.text(left + ms / 2, row, f"{ms:.1f}", ha="center", va="center", fontsize=7, color="white")
            left += max(ms, 0.0)
        client, gateway = report["client"], report["gateway"]
        ax.text(left + 0.3, row, f"client p50 {client['p50_ms']:.1f}, p99 {client['p99_ms']:.1f} ms; "
                f"gateway p50 {gateway['p50_ms']:.1f}", va="center", fontsize=8)
    ax.set_yticks(range(len(reports)), [report.get("label") or "lone" for report in reports])
    ax.set_xlabel("ms, mean per request (one at a time)")
    ax.set_xlim(0, max(sum(max(v, 0) for v in r["client"]["breakdown_ms"].values()) for r in reports) * 2.0)
    ax.set_title(f"A lone request, 2B bf16, {reports[0].get('gpu', '')}: where its time goes", fontsize=10)
    ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def lone_table(reports: list[dict]) -> str:
    lines = ["| run | client p50 ms | client p99 ms | gateway p50 ms | gateway p99 ms | " +
             " | ".join(reports[0]["client"]["breakdown_ms"]) + " |", "|---" * (5 + len(
                 reports[0]["client"]["breakdown_ms"])) + "|"]
    for report in reports:
        client, gateway = report["client"], report["gateway"]
        lines.append(f"| {report.get('label') or 'lone'} | {client['p50_ms']:.1f} | {client['p99_ms']:.1f} | "
                     f"{gateway['p50_ms']:.1f} | {gateway['p99_ms']:.1f} | " +
                     " | ".join(f"{ms:.2f}" for ms in client["breakdown_ms"].values()) + " |")
    return "\n".join(lines)


def read(spec: str) -> dict:
    """``DIR`` or ``DIR=LABEL``: the directory's report, labelled."""
    directory, _, name = spec.partition("=")
    report = json.loads((Path(directory) / "report.json").read_text())
    return {**report, "label": name} if name else report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e2e", nargs="*", default=[], help="end_to_end.py output directories with a sweep")
    parser.add_argument("--priority", nargs="*", default=[], help="priority.py output directories (fresh workers)")
    parser.add_argument("--lone", nargs="*", default=[], help="lone.py output directories")
    parser.add_argument("--out", default="docs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = [read(spec) for spec in args.e2e]
    if reports:
        plot_latency(reports, out / "latency-load.png")
        print(latency_table(reports), *(crossings(report) for report in reports), sep="\n", end="\n\n")
    if args.priority:
        priorities = [read(spec) for spec in args.priority]
        runs = [run for report in priorities for run in report.get("runs") or [report["with_high"]]]
        plot_priority(priorities[0], runs, out / "priority-lanes.png")
        print(priority_table(runs), end="\n\n")
    if args.lone:
        lones = [read(spec) for spec in args.lone]
        plot_lone(lones, out / "lone-latency.png")
        print(lone_table(lones))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
