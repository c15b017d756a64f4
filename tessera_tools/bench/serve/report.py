"""The sweep's results: a block per rate as it finishes, a markdown table at
the end (ready for docs/benchmarks.md), and the JSON file's per-request
records (common.write_report writes the file)."""

from __future__ import annotations

import math

from tessera_tools.bench.common import markdown_table
from tessera_tools.bench.serve.metrics import LATENCY_METRICS, percentile_key
from tessera_tools.bench.serve.stream import RequestOutcome

NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def rate_json(rate: float) -> float | str:
    """JSON has no infinity: an unbounded rate is written "inf"."""
    return "inf" if math.isinf(rate) else rate


def _ms(value: float) -> float | None:
    return None if math.isnan(value) else value * 1e3


def request_records(outcomes: list[RequestOutcome]) -> list[dict]:
    """Per-request measurements (ms), for plots or analysis after the run."""
    return [{"ttft_ms": _ms(o.ttft_s), "tpot_ms": None if o.tpot_s is None or not o.ok else o.tpot_s * 1e3,
             "e2el_ms": _ms(o.e2el_s), "itl_ms": [g * 1e3 for g in o.itl_s], "prompt_tokens": o.prompt_tokens,
             "output_tokens": o.output_tokens, "error": o.error} for o in outcomes]


def _rate_text(rate: float | str) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


def _fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_rate(summary: dict, percentiles: list[float]) -> None:
    rate = _rate_text(summary["request_rate"])
    print(f"\n==== rate {rate} req/s: {summary['completed']} completed, {summary['failed']} failed "
          f"in {summary['duration_s']:.2f} s ====")
    print(f"request throughput {_fmt(summary['request_throughput'])} req/s | output "
          f"{_fmt(summary['output_throughput'], 1)} tok/s | total {_fmt(summary['total_token_throughput'], 1)} tok/s"
          + (f" | goodput {_fmt(summary['request_goodput'])} req/s" if "request_goodput" in summary else ""))
    for name in LATENCY_METRICS:
        stats = [f"mean {_fmt(summary[f'mean_{name}_ms'])}", f"median {_fmt(summary[f'median_{name}_ms'])}"]
        stats += [f"{percentile_key(p)} {_fmt(summary[f'{percentile_key(p)}_{name}_ms'])}" for p in percentiles]
        print(f"  {NAMES[name]:<12} (ms): " + ", ".join(stats))
    for error in summary["errors"]:
        print(f"  error: {error}")


def print_sweep_table(summaries: list[dict], tail: float) -> None:
    tail_key = percentile_key(tail)
    header = ["rate (req/s)", "completed", "failed", "req/s", "output tok/s",
              *(f"{name} median / {tail_key} (ms)" for name in ("TTFT", "TPOT", "ITL", "E2E")), "goodput (req/s)"]
    rows = []
    for s in summaries:
        cells = [_rate_text(s["request_rate"]), str(s["completed"]), str(s["failed"]), _fmt(s["request_throughput"]),
                 _fmt(s["output_throughput"], 1)]
        cells += [f"{_fmt(s[f'median_{n}_ms'], 1)} / {_fmt(s[f'{tail_key}_{n}_ms'], 1)}" for n in LATENCY_METRICS]
        cells.append(_fmt(s.get("request_goodput")) if "request_goodput" in s else "-")
        rows.append(cells)
    print("\n" + markdown_table(header, rows))

