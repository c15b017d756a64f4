"""The SLOs a tuning run holds: a latency metric at a percentile of the
requests, e.g. `e2el:p99:500` (p99 end-to-end latency at most 500 ms).

A run meets its SLOs when every percentile is within its bound and no
request failed. Its goodput counts the requests that each met every bound of
TTFT, TPOT and E2E latency (vLLM's goodput; ITL has no per-request value, so
it bounds the percentile only)."""

from __future__ import annotations

import re
from dataclasses import dataclass

METRICS = ("ttft", "itl", "tpot", "e2el")
_SPEC = re.compile(r"^(?P<metric>[a-z0-9]+):p(?P<percentile>[0-9]+(?:\.[0-9]+)?):(?P<ms>[0-9]+(?:\.[0-9]+)?)$")


@dataclass(frozen=True)
class SLO:
    metric: str
    """ttft, itl, tpot or e2el (vLLM's names)."""
    percentile: float
    """Of the run's requests (of its inter-token gaps for itl), in (0, 100)."""
    bound_ms: float
    """The most that percentile may be, in milliseconds."""

    @property
    def summary_key(self) -> str:
        """Its figure in a serve summary (bench/serve/metrics.py)."""
        return f"p{self.percentile:g}".replace(".", "_") + f"_{self.metric}_ms"

    def __str__(self) -> str:
        return f"{self.metric} p{self.percentile:g} <= {self.bound_ms:g} ms"


def parse_slo(text: str) -> SLO:
    match = _SPEC.match(text.strip())
    if match is None:
        raise ValueError(f"SLO {text!r}: expected METRIC:pNN:MS, e.g. e2el:p99:500")
    metric, percentile, ms = match["metric"], float(match["percentile"]), float(match["ms"])
    if metric not in METRICS:
        raise ValueError(f"SLO {text!r}: metric {metric!r} is not one of {', '.join(METRICS)}")
    if not 0 < percentile < 100:
        raise ValueError(f"SLO {text!r}: the percentile must be strictly between 0 and 100")
    if not ms > 0:
        raise ValueError(f"SLO {text!r}: the bound must be > 0 ms")
    return SLO(metric, percentile, ms)


def per_request_bounds(slos: list[SLO]) -> dict[str, float]:
    """The bounds each request is held to for goodput: the tightest per metric, ITL left out."""
    bounds: dict[str, float] = {}
    for slo in slos:
        if slo.metric != "itl":
            bounds[slo.metric] = min(bounds.get(slo.metric, slo.bound_ms), slo.bound_ms)
    return bounds


def misses(slos: list[SLO], summary: dict) -> list[str]:
    """The SLOs a run's summary misses, as "e2el p99 612 ms > 500 ms"; failures count as a miss."""
    missed = [f"{summary['failed']} requests failed"] if summary["failed"] else []
    for slo in slos:
        value = summary.get(slo.summary_key)
        if value is None or value > slo.bound_ms:
            shown = "no value" if value is None else f"{value:.0f} ms"
            missed.append(f"{slo.metric} p{slo.percentile:g} {shown} > {slo.bound_ms:g} ms")
    return missed
