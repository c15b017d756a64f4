"""PNG plots of the sweep, one line per policy against the fleet size: hit
rate, TTFT p99 and prefix-query RPCs per request. One panel per
(workload, gateway replicas). Agg backend: no display needed."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

PLOTS = {
    "hit_rate_vs_pods.png": ("hit_rate", "prefix-cache hit rate"),
    "ttft_p99_vs_pods.png": ("ttft_p99_ms", "TTFT p99 (ms)"),
    "rpcs_per_request_vs_pods.png": ("prefix_queries_per_request", "prefix-query RPCs per request"),
}


def plot_metric(runs: list[dict], key: str, label: str, path: Path) -> Path:
    runs = [r for r in runs if "error" not in r]
    panels = sorted({(r["workload"], r["gateways"]) for r in runs})
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    fig = Figure(figsize=(5.5 * max(1, len(panels)), 4.2), layout="constrained")
    axes = fig.subplots(1, max(1, len(panels)), squeeze=False)[0]
    for ax, (workload, gateways) in zip(axes, panels):
        for policy in policies:
            points = sorted((r["pods"], r[key]) for r in runs if (r["workload"], r["gateways"], r["policy"])
                            == (workload, gateways, policy) and r[key] is not None)
            if points:
                ax.plot([p for p, _ in points], [v for _, v in points], "o-", label=policy)
        ax.set_xscale("log", base=2)
        sizes = sorted({r["pods"] for r in runs})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_title(f"{workload}, {gateways} gateway{'s' if gateways > 1 else ''}")
        ax.set_xlabel("simulated pods")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return path


def write_plots(runs: list[dict], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot_metric(runs, key, label, out / name) for name, (key, label) in PLOTS.items()]
