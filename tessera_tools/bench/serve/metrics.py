"""A run's figures from its requests' outcomes, named and defined as in
`vllm bench serve`.

- Latencies (ms): TTFT, TPOT and E2E latency have one value per successful
  request (TPOT only for outputs of 2+ tokens); ITL pools every gap of every
  successful request. Each gets mean, median, std and the asked percentiles
  (stats.percentile: linear interpolation, as vLLM).
- Throughput over the run's duration (first request sent -> last one ended):
  completed requests/s, output tokens/s, (prompt + output) tokens/s.
- Goodput: requests/s of those that meet every given SLO (TTFT, TPOT, E2E
  latency in ms); a 1-token output has TPOT 0, so it meets a TPOT SLO.
- Failed requests are counted and their first errors kept; they add to no
  latency or throughput.
"""

from __future__ import annotations

import statistics

from tessera_tools.bench.serve.stream import RequestOutcome
from tessera_tools.bench.stats import percentile

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
MAX_ERRORS_KEPT = 5


def parse_slos(specs: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"goodput SLO {spec!r}: the bound must be > 0 ms")
        slos[name] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    """"50,90,99" -> [50.0, 90.0, 99.0]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"percentiles {text!r}: expected comma-separated numbers") from None
    if not values or any(not 0 < p < 100 for p in values):
        raise ValueError(f"percentiles {text!r}: each must be strictly between 0 and 100")
    return values


def percentile_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")  # p99, p99_9


def latency_stats(name: str, values_ms: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """mean_/median_/std_/pNN_ NAME _ms; None when there are no values."""
    keys = ["mean", "median", "std", *(percentile_key(p) for p in percentiles)]
    if not values_ms:
        return {f"{k}_{name}_ms": None for k in keys}
    values = [statistics.fmean(values_ms), statistics.median(values_ms), statistics.pstdev(values_ms),
              *(percentile(values_ms, p) for p in percentiles)]
    return {f"{k}_{name}_ms": float(v) for k, v in zip(keys, values)}


def _meets_slos(outcome: RequestOutcome, slos: dict[str, float]) -> bool:
    measured_ms = {"ttft": outcome.ttft_s * 1e3, "tpot": (outcome.tpot_s or 0.0) * 1e3, "e2el": outcome.e2el_s * 1e3}
    return all(measured_ms[name] <= bound for name, bound in slos.items())


def summarize(outcomes: list[RequestOutcome], duration_s: float, percentiles: list[float],
              slos: dict[str, float] | None = None) -> dict:
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    input_tokens = sum(o.prompt_tokens for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    per_second = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    summary = {
        "completed": len(ok),
        "failed": len(failed),
        "errors": [o.error for o in failed[:MAX_ERRORS_KEPT]],
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
    }
    if slos:
        summary["goodput_slos_ms"] = dict(slos)
        summary["request_goodput"] = per_second(sum(_meets_slos(o, slos) for o in ok))
    samples_ms = {
        "ttft": [o.ttft_s * 1e3 for o in ok],
        "tpot": [o.tpot_s * 1e3 for o in ok if o.tpot_s is not None],
        "itl": [gap * 1e3 for o in ok for gap in o.itl_s],
        "e2el": [o.e2el_s * 1e3 for o in ok],
    }
    for name in LATENCY_METRICS:
        summary.update(latency_stats(name, samples_ms[name], percentiles))
    return summary
