"""The figures the autoscale and faults scenarios share: how requests ended,
SLO attainment and latency percentiles, and the offered rate over time."""

from __future__ import annotations

import math
from collections import Counter

from tessera_tools.bench.fleet.scenario_replay import ENDINGS, TracedReplay
from tessera_tools.bench.serve.metrics import _meets_slos, summarize

PERCENTILES = [50.0, 99.0]
ERRORS_KEPT = 10


def slo_attainment(replay: TracedReplay, slos: dict[str, float]) -> float | None:
    """Share of ALL requests (failed ones miss) that met every SLO, as serve's goodput counts a request."""
    if not replay.requests:
        return None
    return sum(r.outcome.ok and _meets_slos(r.outcome, slos) for r in replay.requests) / len(replay.requests)


def slo_attainment_over_time(replay: TracedReplay, slos: dict[str, float], bin_s: float) -> list[dict]:
    """Per `bin_s` of the trace (by when each request was sent): requests and how many met every SLO,
    which shows where a fleet missed (the ramp, the spike, after a scale-down)."""
    bins: dict[int, list[int]] = {}
    for r in replay.requests:
        counts = bins.setdefault(int((r.sent_at - replay.started_at) // bin_s), [0, 0])
        counts[0] += 1
        counts[1] += r.outcome.ok and _meets_slos(r.outcome, slos)
    return [{"t": i * bin_s, "requests": n, "met": met} for i, (n, met) in sorted(bins.items())]


def endings(replay: TracedReplay) -> dict:
    """Per ending (scenario_replay.ENDINGS): the count and the most frequent errors."""
    out = {}
    for ending in ENDINGS:
        requests = [r for r in replay.requests if r.ending == ending]
        errors = Counter(r.outcome.error for r in requests if r.outcome.error)
        out[ending] = {"count": len(requests),
                       "errors": [{"error": e, "count": n} for e, n in errors.most_common(ERRORS_KEPT)]}
    # ok, but fewer tokens than asked (a simulated pod always runs to max_tokens with ignore_eos).
    out["ok"]["short"] = sum(r.ending == "ok" and r.outcome.output_tokens < r.requested_tokens
                             for r in replay.requests)
    return out


def latency_figures(replay: TracedReplay, slos: dict[str, float]) -> dict:
    summary = summarize(replay.outcomes, replay.duration_s, PERCENTILES, slos)
    return {"requests": len(replay.requests), "ok": summary["completed"], "failed": summary["failed"],
            "slo_attainment": slo_attainment(replay, slos), "slos_ms": slos,
            "ttft_p50_ms": summary["p50_ttft_ms"], "ttft_p99_ms": summary["p99_ttft_ms"],
            "itl_p50_ms": summary["p50_itl_ms"], "itl_p99_ms": summary["p99_itl_ms"],
            "duration_s": replay.duration_s, "latency": summary}


def offered_rate(offsets: list[float], duration_s: float, bin_s: float) -> list[dict]:
    """Arrivals per second of the trace, in bins of `bin_s` from its start."""
    bins = max(1, math.ceil(duration_s / bin_s))
    counts = [0] * bins
    for t in offsets:
        counts[min(bins - 1, int(t // bin_s))] += 1
    return [{"t": i * bin_s, "rate": c / bin_s} for i, c in enumerate(counts)]
