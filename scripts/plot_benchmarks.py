"""Charts (PNG) from the JSON that bench_throughput.py, bench_serving.py and bench_sharing.py write.

    python scripts/plot_benchmarks.py tp.json serving.json sharing.json --out-dir charts
    python scripts/plot_benchmarks.py before.json after.json --labels before,after --out-dir charts

Each input is recognized by its content and labelled by its file name (or --labels, in order). Written,
for the kinds present:
  throughput.png  output tokens/s of every run and peer of every throughput file, as bars
  kv_budget.png   paged against the reservation policies across KV budgets: output tokens/s and the ratios,
                  one line per model and policy (throughput files whose policy runs cover two budgets or more)
  serving.png     TTFT, TPOT and ITL (p50 solid, p99 dashed) and output tokens/s against the request rate,
                  one colour per serving file
  sharing.png     output tokens/s, TTFT p50 and peak KV blocks of every sharing run, as bars
Needs matplotlib (requirements-dev.txt); the benchmark scripts themselves do not.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

Report = tuple[str, dict[str, Any]]  # (label, the benchmark's JSON)


def kind_of(report: dict[str, Any]) -> str:
    """`serving`, `sharing` or `throughput` (whose JSON predates the `benchmark` field)."""
    if report.get("benchmark") in ("serving", "sharing"):
        return report["benchmark"]
    if "runs" in report and all("output_tokens_per_s" in r for r in report["runs"]):
        return "throughput"
    raise ValueError("not the JSON of a benchmark script")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bars(ax: Any, labels: list[str], values: list[float], title: str, fmt: str = "{:,.0f}") -> None:
    bars = ax.bar(range(len(values)), values, color=[f"C{i % 10}" for i in range(len(values))])
    ax.set_xticks(range(len(labels)), labels, rotation=30 if len(labels) > 3 else 0, ha="right")
    ax.set_title(title)
    ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _numbered(runs: list[dict]) -> dict[str, float]:
    """Output tokens/s by bar name: the run's name (with its batch size, for a peer that has one), and
    "name #2", "name #3" for its repeats in one file."""
    bars: dict[str, float] = {}
    for run in runs:
        base = run["name"] if run.get("batch_size") is None else f"{run['name']} (batch {run['batch_size']})"
        name, k = base, 1
        while name in bars:
            k += 1
            name = f"{base} #{k}"
        bars[name] = run["output_tokens_per_s"]
    return bars


def plot_throughput(reports: list[Report], path: Path) -> Path:
    """One group of bars per file, one bar (and legend entry) per run or peer name."""
    plt = _pyplot()
    bars_of = [_numbered(r["runs"] + r.get("peers", [])) for _, r in reports]
    names = list(dict.fromkeys(name for bars in bars_of for name in bars))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + len(reports) * (0.6 * len(names) + 0.8)), 5.0))
    for j, name in enumerate(names):
        points = [(i, bars[name]) for i, bars in enumerate(bars_of) if name in bars]
        xs = [i + (j - (len(names) - 1) / 2) * width for i, _ in points]
        bars = ax.bar(xs, [v for _, v in points], width, label=name, color=f"C{j % 10}")
        ax.bar_label(bars, labels=[f"{v:,.0f}" for _, v in points], fontsize=8)
    ax.set_xticks(
        range(len(reports)), [label for label, _ in reports], rotation=15 if len(reports) > 2 else 0
    )
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


POLICIES = ("paged", "reserved", "reserved-max")


def kv_budget_points(reports: list[Report]) -> dict[tuple[str, str], dict[int, float]]:
    """Output tokens/s by (model, policy) and KV blocks, the median where a budget was run more than once.
    Only the plain policy runs count (a run named after its policy, on the model's own KV dtype and a pool
    of a given size): paged-sync, the FP8 runs and the default-sized pools are other comparisons."""
    samples: dict[tuple[str, str], dict[int, list[float]]] = {}
    for _, report in reports:
        model = Path(str(report.get("model", "model"))).name
        for run in report["runs"]:
            policy, blocks = run.get("kv_policy"), run.get("num_kv_blocks") or 0
            if run["name"] != policy or policy not in POLICIES or blocks <= 0:
                continue
            if run.get("kv_cache_dtype", "auto") != "auto":
                continue
            samples.setdefault((model, policy), {}).setdefault(blocks, []).append(run["output_tokens_per_s"])
    return {
        key: {b: statistics.median(v) for b, v in by_blocks.items()} for key, by_blocks in samples.items()
    }


def plot_kv_budget(points: dict[tuple[str, str], dict[int, float]], path: Path) -> Path:
    """Left: output tokens/s against the KV budget. Right: paged over each reservation policy, where both
    ran at the same budget."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    models = list(dict.fromkeys(model for model, _ in points))
    styles = {"paged": "-", "reserved": "--", "reserved-max": ":"}
    budgets = sorted({blocks for by_blocks in points.values() for blocks in by_blocks})
    for i, model in enumerate(models):
        for policy in POLICIES:
            by_blocks = points.get((model, policy))
            if by_blocks:
                xs = sorted(by_blocks)
                left.plot(xs, [by_blocks[x] for x in xs], styles[policy], marker="o", color=f"C{i % 10}",
                          label=f"{model} {policy}")  # fmt: skip
            paged = points.get((model, "paged"), {})
            common = sorted(set(paged) & set(by_blocks or {}))
            if policy != "paged" and common:
                ratios = [paged[b] / by_blocks[b] for b in common]
                right.plot(common, ratios, styles[policy], marker="o", color=f"C{i % 10}",
                           label=f"{model}: paged / {policy}")  # fmt: skip
                for b, r in zip(common, ratios, strict=True):
                    right.annotate(
                        f"{r:.2f}x",
                        (b, r),
                        textcoords="offset points",
                        xytext=(6, 4 - 14 * (i % 2)),
                        fontsize=8,
                    )
    right.axhline(1.0, color="grey", linewidth=0.8)
    for ax, title in ((left, "output tokens/s"), (right, "paged throughput / reservation's")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [f"{b:,}" for b in budgets])
        ax.set_xlabel("KV blocks (the same budget for every policy)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.suptitle("Paged against reservation at equal KV budgets")
    return _save(plt, fig, path)


def _rate_order(rate: str) -> float:
    return math.inf if rate == "inf" else float(rate)


def plot_serving(reports: list[Report], path: Path) -> Path:
    """Latencies and throughput against the offered request rate; `inf` (all at once) is the last tick."""
    plt = _pyplot()
    rates = sorted({run["rate"] for _, r in reports for run in r["runs"]}, key=_rate_order)
    position = {rate: i for i, rate in enumerate(rates)}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)")]
    for ax, (metric, title) in zip(axes.flat, panels, strict=False):
        for i, (label, report) in enumerate(reports):
            runs = sorted(report["runs"], key=lambda run: _rate_order(run["rate"]))
            for q, style in (("p50", "-"), ("p99", "--")):
                points = [
                    (position[r["rate"]], r[metric].get(q)) for r in runs if r[metric].get(q) is not None
                ]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, style, marker="o", color=f"C{i % 10}", label=f"{label} {q}")
        ax.set_title(title)
        if all(line.get_ydata().min() > 0 for line in ax.get_lines()) and ax.get_lines():
            ax.set_yscale("log")
    ax = axes.flat[3]
    for i, (label, report) in enumerate(reports):
        runs = sorted(report["runs"], key=lambda run: _rate_order(run["rate"]))
        xs = [position[r["rate"]] for r in runs]
        ax.plot(xs, [r["output_tokens_per_s"] for r in runs], marker="o", color=f"C{i % 10}", label=label)
    ax.set_title("output tokens/s")
    for ax in axes.flat:
        ax.set_xticks(range(len(rates)), [f"{r}" if r != "inf" else "inf\n(all at once)" for r in rates])
        ax.set_xlabel("request rate (requests/s)")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.suptitle("Online serving: latency against load")
    return _save(plt, fig, path)


def plot_sharing(reports: list[Report], path: Path) -> Path:
    plt = _pyplot()
    runs = [
        (f"{label}\n{run['name']}" if len(reports) > 1 else run["name"], run)
        for label, r in reports
        for run in r["runs"]
    ]
    labels = [name for name, _ in runs]
    fig, axes = plt.subplots(1, 3, figsize=(max(12.0, 3 * len(runs) + 3), 4.5))
    _bars(axes[0], labels, [r["output_tokens_per_s"] for _, r in runs], "output tokens/s")
    _bars(axes[1], labels, [r["ttft_ms"]["p50"] or 0.0 for _, r in runs], "TTFT p50 (ms)", "{:,.1f}")
    _bars(axes[2], labels, [r["peak_kv_blocks_used"] for _, r in runs], "peak KV blocks used")
    fig.suptitle("KV sharing: prefix caching and parallel sampling")
    return _save(plt, fig, path)


PLOTS = {"throughput": plot_throughput, "serving": plot_serving, "sharing": plot_sharing}


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="JSON files written by the benchmark scripts' --json-out")
    p.add_argument("--labels", default=None, help="comma-separated, one per input; default: file names")
    p.add_argument("--out-dir", default=".", help="where the PNG files go")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [Path(f).stem for f in args.inputs]
    if len(labels) != len(args.inputs):
        p.error("give one label per input")
    by_kind: dict[str, list[Report]] = {}
    for label, name in zip(labels, args.inputs, strict=True):
        report = json.loads(Path(name).read_text())
        try:
            by_kind.setdefault(kind_of(report), []).append((label, report))
        except ValueError as e:
            p.error(f"{name}: {e}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [PLOTS[kind](reports, out_dir / f"{kind}.png") for kind, reports in by_kind.items()]
    budgets = kv_budget_points(by_kind.get("throughput", []))
    if len({blocks for by_blocks in budgets.values() for blocks in by_blocks}) >= 2:
        written.append(plot_kv_budget(budgets, out_dir / "kv_budget.png"))
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
