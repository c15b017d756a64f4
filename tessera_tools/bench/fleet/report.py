"""A run's figures from what it measured, the markdown table of all runs,
and the notes the JSON report carries on where each figure comes from."""

from __future__ import annotations

from dataclasses import dataclass

from tessera_tools.bench.common import markdown_table
from tessera_tools.bench.fleet.measure import GATEWAY_ADDED_LATENCY_METRIC, buckets_of, histogram_quantile
from tessera_tools.bench.fleet.replay import ReplayResult
from tessera_tools.bench.serve.metrics import summarize
from tessera_tools.bench.stats import percentile

PERCENTILES = [50.0, 99.0]
# A send later than this after its arrival time counts as late in the report.
LATE_SEND_S = 0.5

SOURCES = {
    "hit_rate": "cached prompt tokens / prompt tokens from the usage of every response, as the gateways sum it "
                "(tessera_gateway_cached_prompt_tokens_total / tessera_gateway_prompt_tokens_total, all replicas)",
    "pod_counter_hit_rate": "the pods' tessera_prefix_cache_hits_total / tessera_prefix_cache_queries_total "
                            "(counts a preempted request's lookups again)",
    "routed_hit_rate": "tokens the chosen pod said it held when routed / prompt tokens "
                       "(tessera_gateway_routed_prefix_hit_tokens_total): what the router believed",
    "ttft_itl": "client side, per streamed chunk (tessera bench serve's definitions); ITL pools every gap",
    "goodput_rps": "requests/s over the run that met every SLO (itl: a request's mean inter-token latency, "
                   "serve's TPOT)",
    "gateway_cpu_s": "utime + stime of /proc/<pid>/stat of every gateway process, during the trace",
    "gateway_idle_cpu_per_s": "the gateways' CPU seconds per second before the trace: load reports alone",
    "prefix_queries_per_request": "tessera_gateway_prefix_queries_total (Engine.GetLoad RPCs, every outcome) / "
                                  "requests sent",
    "gateway_added_latency": f"p50/p99 of the histogram {GATEWAY_ADDED_LATENCY_METRIC} (arrival at the gateway -> "
                             "engine call sent, less the admission queue wait)",
    "gateway_added_ttft_mean_ms": "mean gateway TTFT - mean pod TTFT (histogram sums): time a request spends in "
                                  "the gateway before its pod gets it, admission queueing included",
    "send_delay": "seconds a request went out after its arrival time: its conversation's previous turn had not "
                  "ended yet",
}


@dataclass(frozen=True)
class RunSpec:
    """One cell of the sweep."""

    pods: int
    gateways: int
    workload: str
    policy: str

    @property
    def tag(self) -> str:
        return f"{self.pods}pods-{self.gateways}gw-{self.workload}-{self.policy}"


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _mean_ms(total_s: float, count: float) -> float | None:
    return total_s / count * 1e3 if count > 0 else None


def _added_latency(delta: dict[str, float]) -> dict[str, float | None]:
    buckets = buckets_of(delta, "added_latency_bucket")
    out = {}
    for p in PERCENTILES:
        value = histogram_quantile(buckets, p / 100) if buckets else None
        out[f"gateway_added_latency_p{p:g}_ms"] = None if value is None else value * 1e3
    return out


def run_record(spec: RunSpec, result: ReplayResult, delta: dict[str, float], idle_cpu_per_s: float,
               slos: dict[str, float]) -> dict:
    """Everything one run reports; `delta`: the measure.snapshot difference over the trace."""
    summary = summarize(result.outcomes, result.duration_s, PERCENTILES, slos)
    sent = len(result.outcomes)
    queries = {key.partition("/")[2]: value for key, value in delta.items() if key.startswith("prefix_queries/")}
    total_queries = sum(queries.values())
    prompt = delta.get("prompt_tokens", 0.0)
    gateway_cpu = delta.get("gateway_cpu_s", 0.0)
    gateway_ttft = _mean_ms(delta.get("gateway_ttft_sum", 0.0), delta.get("gateway_ttft_count", 0.0))
    pod_ttft = _mean_ms(delta.get("pod_ttft_sum", 0.0), delta.get("pod_ttft_count", 0.0))
    return {
        "pods": spec.pods, "gateways": spec.gateways, "workload": spec.workload, "policy": spec.policy,
        "requests": sent, "ok": summary["completed"], "failed": summary["failed"], "errors": summary["errors"],
        "duration_s": result.duration_s,
        "hit_rate": _ratio(delta.get("cached_tokens", 0.0), prompt),
        "pod_counter_hit_rate": _ratio(delta.get("pod_hit_tokens", 0.0), delta.get("pod_query_tokens", 0.0)),
        "routed_hit_rate": _ratio(delta.get("routed_hit_tokens", 0.0), prompt),
        "prompt_tokens": prompt, "cached_tokens": delta.get("cached_tokens", 0.0),
        "ttft_p50_ms": summary["p50_ttft_ms"], "ttft_p99_ms": summary["p99_ttft_ms"],
        "itl_p50_ms": summary["p50_itl_ms"], "itl_p99_ms": summary["p99_itl_ms"],
        "goodput_rps": summary.get("request_goodput"), "throughput_rps": summary["request_throughput"],
        "gateway_cpu_s": gateway_cpu,
        "gateway_cpu_ms_per_request": gateway_cpu / sent * 1e3 if sent else None,
        "gateway_idle_cpu_per_s": idle_cpu_per_s,
        "prefix_queries": total_queries, "prefix_queries_by_outcome": queries,
        "prefix_queries_per_request": total_queries / sent if sent else None,
        **_added_latency(delta),
        "gateway_added_ttft_mean_ms": None if gateway_ttft is None or pod_ttft is None else gateway_ttft - pod_ttft,
        "client_cpu_s": delta.get("client_cpu_s"), "pods_cpu_s": delta.get("pods_cpu_s"),
        "send_delay_p50_s": percentile(result.send_delays_s, 50),
        "send_delay_p99_s": percentile(result.send_delays_s, 99),
        "late_sends": sum(d > LATE_SEND_S for d in result.send_delays_s),
        "latency": summary,
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _num(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


HEADER = ("pods", "gw", "workload", "policy", "ok / failed", "hit rate", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
          "goodput req/s", "gw CPU s", "gw CPU ms/req", "RPCs/req")


def table_row(run: dict) -> list[str]:
    if "error" in run:
        return [str(run["pods"]), str(run["gateways"]), run["workload"], run["policy"], "run failed", *["-"] * 7]
    return [str(run["pods"]), str(run["gateways"]), run["workload"], run["policy"], f"{run['ok']} / {run['failed']}",
            _pct(run["hit_rate"]), f"{_num(run['ttft_p50_ms'])} / {_num(run['ttft_p99_ms'])}",
            f"{_num(run['itl_p50_ms'])} / {_num(run['itl_p99_ms'])}", _num(run["goodput_rps"], 2),
            _num(run["gateway_cpu_s"], 1), _num(run["gateway_cpu_ms_per_request"], 2),
            _num(run["prefix_queries_per_request"], 1)]


def runs_table(runs: list[dict]) -> str:
    ordered = sorted(runs, key=lambda r: (r["workload"], r["gateways"], r["pods"], r["policy"]))
    return markdown_table(HEADER, [table_row(r) for r in ordered])


def one_line(run: dict) -> str:
    """A finished run, as the progress output prints it."""
    if "error" in run:
        return f"{run['pods']} pods, {run['gateways']} gw, {run['workload']}, {run['policy']}: FAILED {run['error']}"
    return (f"{run['pods']} pods, {run['gateways']} gw, {run['workload']}, {run['policy']}: "
            f"{run['ok']} ok / {run['failed']} failed, hit rate {_pct(run['hit_rate'])}, TTFT p99 "
            f"{_num(run['ttft_p99_ms'])} ms, {_num(run['prefix_queries_per_request'], 1)} RPCs/req, gateway CPU "
            f"{_num(run['gateway_cpu_s'], 1)} s")
