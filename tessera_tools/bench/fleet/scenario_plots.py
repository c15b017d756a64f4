"""The autoscale scenario's PNG: replicas asked and ready over the trace,
the static fleet's size for comparison, and the offered rate on a second
axis; a panel per pool (one mixed, or prefill and decode). Agg backend: no
display needed."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

TIMELINE_PNG = "autoscale_timeline.png"


def _panel(ax, title: str | None, timeline: list[dict], rate: list[dict], static_pods: int) -> None:
    times = [row["t"] for row in timeline]
    ax.step(times, [row["asked"] for row in timeline], where="post", label="replicas asked")
    ax.step(times, [row["ready"] for row in timeline], where="post", label="ready (listed)")
    ax.axhline(static_pods, color="grey", linestyle="--", linewidth=1, label=f"static fleet ({static_pods})")
    if title:
        ax.set_title(title, fontsize=10)
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


def plot_timeline(pools: dict[str, tuple[list[dict], int]], rate: list[dict], path: Path) -> Path:
    """`pools`: {role: (its timeline, the static fleet's pods of that role)}, a panel each, one above the other."""
    fig = Figure(figsize=(9, 4.2 * len(pools)), layout="constrained")
    axes = fig.subplots(len(pools), 1, squeeze=False)[:, 0]
    for ax, (role, (timeline, static_pods)) in zip(axes, pools.items()):
        _panel(ax, None if role == "mixed" else f"{role} pool", timeline, rate, static_pods)
    fig.savefig(path, dpi=120)
    return path


def _until_the_end(run: dict) -> list[dict]:
    """The timeline with its last row held to the window's end (a step plot ends at its last point)."""
    timeline = run["timeline"]
    return timeline + [{**timeline[-1], "t": run["window_s"]}] if timeline else []


def write_timeline_plot(report: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run, settings = report["runs"]["autoscaled"], report["settings"]
    if "pools" in run:
        pools = {role: (_until_the_end(pool), settings["pools"][role]["max_replicas"])
                 for role, pool in run["pools"].items()}
    else:
        pools = {"mixed": (_until_the_end(run), settings["max_replicas"])}
    return plot_timeline(pools, report["offered_rate"], out / TIMELINE_PNG)
