"""The autoscale scenario's PNG: replicas asked and ready over the trace,
the static fleet's size for comparison, and the offered rate on a second
axis. Agg backend: no display needed."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

TIMELINE_PNG = "autoscale_timeline.png"


def plot_timeline(timeline: list[dict], rate: list[dict], static_pods: int, path: Path) -> Path:
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    ax = fig.subplots()
    times = [row["t"] for row in timeline]
    ax.step(times, [row["asked"] for row in timeline], where="post", label="replicas asked")
    ax.step(times, [row["ready"] for row in timeline], where="post", label="ready (listed)")
    ax.axhline(static_pods, color="grey", linestyle="--", linewidth=1, label=f"static fleet ({static_pods})")
    ax.set_xlabel("seconds from the trace's start")
    ax.set_ylabel("pods")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    offered = ax.twinx()
    offered.step([b["t"] for b in rate], [b["rate"] for b in rate], where="post", color="tab:red", alpha=0.5,
                 label="offered rate")
    offered.set_ylabel("offered requests/s")
    offered.set_ylim(bottom=0)
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = offered.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, fontsize=8, loc="upper left")
    fig.savefig(path, dpi=120)
    return path


def write_timeline_plot(report: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = report["runs"]["autoscaled"]
    timeline = run["timeline"] + [{**run["timeline"][-1], "t": run["window_s"]}] if run["timeline"] else []
    return plot_timeline(timeline, report["offered_rate"], report["settings"]["max_replicas"], out / TIMELINE_PNG)
