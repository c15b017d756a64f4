"""PNG plots of a sweep: latency vs achieved throughput, and the TTFT and ITL
distributions at each rate. Agg backend: no display needed (CI, servers)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from tessera_tools.bench.serve.metrics import percentile_key  # noqa: E402

TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def _rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}/s"


def plot_latency_vs_throughput(runs: list[dict], tail: float, path: Path) -> Path:
    """One panel per latency (TTFT, TPOT, ITL, E2E): median and the tail
    percentile against output tokens/s, each point labelled with its rate."""
    fig = Figure(figsize=(11, 8), layout="constrained")
    tail_key = percentile_key(tail)
    points = sorted((r for r in runs if r["output_throughput"] is not None), key=lambda r: r["output_throughput"])
    x = [r["output_throughput"] for r in points]
    for ax, name in zip(fig.subplots(2, 2).flat, TITLES):
        for stat, style in (("median", "o-"), (tail_key, "s--")):
            y = [r[f"{stat}_{name}_ms"] for r in points]
            ax.plot(x, [np.nan if v is None else v for v in y], style, label=stat)
        for r, xi in zip(points, x):
            if r[f"median_{name}_ms"] is not None:
                ax.annotate(_rate_label(r["request_rate"]), (xi, r[f"median_{name}_ms"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        ax.set_title(f"{TITLES[name]} vs throughput")
        ax.set_xlabel("output tokens/s (achieved)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=120)
    return path


def plot_distribution(samples_ms: dict[float, list[float]], name: str, path: Path) -> Path:
    """Histogram and empirical CDF of one latency, one line per rate."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    hist_ax, cdf_ax = fig.subplots(1, 2)
    populated = {rate: values for rate, values in samples_ms.items() if values}
    everything = [v for values in populated.values() for v in values]
    bins = np.histogram_bin_edges(everything, bins=40) if everything else 10
    for rate, values in sorted(populated.items()):
        label = _rate_label(rate)
        hist_ax.hist(values, bins=bins, histtype="step", label=label)
        ordered = np.sort(values)
        cdf_ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)
    hist_ax.set_title(f"{TITLES[name]} histogram")
    hist_ax.set_xlabel("ms")
    hist_ax.set_ylabel("count")
    cdf_ax.set_title(f"{TITLES[name]} CDF")
    cdf_ax.set_xlabel("ms")
    cdf_ax.set_ylabel("fraction of samples")
    for ax in (hist_ax, cdf_ax):
        ax.grid(alpha=0.3)
        if populated:
            ax.legend(title="request rate")
    fig.savefig(path, dpi=120)
    return path
