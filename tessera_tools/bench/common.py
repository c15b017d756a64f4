"""Flags every benchmark takes, and the helpers several share."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

# The checkpoint benchmarks serve when given none (built once, deterministic).
DEFAULT_TINY = Path(".cache/bench-models/tiny")


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint folder (make bench-models builds models/bench)")
    p.add_argument("--dtype", default="auto", help="engine dtype (auto: the engine's choice for the device)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--output", help="write the results as JSON here")


def resolve_model(path: str | None) -> Path:
    """The checkpoint to serve: `path`, or the tiny preset built once into
    .cache (make-model is deterministic, so a cached copy is exact)."""
    if path:
        return Path(path)
    if not (DEFAULT_TINY / "model.safetensors").is_file():
        from tessera_tools.fixtures import make_model

        tmp = DEFAULT_TINY.with_suffix(".tmp")
        make_model("tiny", tmp)
        tmp.rename(DEFAULT_TINY)
    return DEFAULT_TINY


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN when there are no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def write_report(report: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
