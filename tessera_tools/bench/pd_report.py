"""`tessera bench pd`'s figures: each set-up's client-side latencies (medians
over rounds), the pods' own account of the hand-off (counters summed over
rounds), the TTFT ratios, the checks that each set-up moved the KV the way
it claims, and the markdown table."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from tessera_tools.bench.common import markdown_table

# Client-side figures per round (bench serve's summary keys) -> the report's names.
LATENCY_KEYS = {"ttft_p50_ms": "p50_ttft_ms", "ttft_p90_ms": "p90_ttft_ms", "itl_p50_ms": "p50_itl_ms",
                "e2e_p50_ms": "p50_e2el_ms", "goodput_rps": "request_goodput"}
# (ratio name, numerator mode, denominator mode) of TTFT p50.
RATIOS = (("direct/redis", "direct", "redis"), ("direct-grpc/redis", "direct-grpc", "redis"),
          ("redis/mixed", "redis", "mixed"))


@dataclass(frozen=True)
class RoundResult:
    """One set-up's run of one round."""

    # 0-based round.
    round: int
    # Its place in the round's order of set-ups (0: it ran first).
    position: int
    # bench serve's summary of the requests (serve/metrics.py summarize).
    summary: dict
    # What each role's pod counters grew by during the run (pd_platform.counter_deltas).
    pods: dict[str, dict[str, float]]

    def as_json(self) -> dict:
        return {"round": self.round, "position": self.position, "summary": self.summary, "pods": self.pods}


def _median(values: list[float | None]) -> float:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else math.nan


def _summed(rounds: list[RoundResult]) -> dict[str, dict[str, float]]:
    total: dict[str, dict[str, float]] = {}
    for r in rounds:
        for role, counters in r.pods.items():
            into = total.setdefault(role, {})
            for key, value in counters.items():
                into[key] = into.get(key, 0.0) + value
    return total


def _per(numerator: float, denominator: float, scale: float = 1.0) -> float:
    return numerator / denominator * scale if denominator else math.nan


def hand_off(pods: dict[str, dict[str, float]]) -> dict[str, float]:
    """The pods' account of a set-up's requests, from counters summed over its rounds.

    - pod_ttft_mean_ms: arrival -> first token on the pod that computes the prompt (the prefill
      pod; the mixed pods): queueing plus prefill compute.
    - transfer_ms_per_request: the prefill pod's transfer seconds (Redis: the steps' synchronous
      writes; direct: first pushed block -> the decode pod's reply) per prefilled request.
    - load_ms_per_load: the decode pod reading a prompt's blocks out of its store (inbox or Redis).
    - decode_pod_ttft_mean_ms: arrival -> first token on the decode pod (the load, the prompt's
      last tokens, the first sample); the client's TTFT less both pods' is the gateway's hand-off
      (for direct, it includes the wait for the push to end: the prefill answer waits for it).
    """
    compute = pods.get("prefill") or pods.get("mixed") or {}
    prefill, decode = pods.get("prefill", {}), pods.get("decode", {})
    prefilled = prefill.get("pod_requests", 0.0)
    transfer_s = prefill.get("transfer_seconds/redis", 0.0) + prefill.get("transfer_seconds/direct", 0.0)
    return {
        "pod_ttft_mean_ms": _per(compute.get("pod_ttft_seconds", 0.0), compute.get("pod_requests", 0.0), 1e3),
        "prefilled_requests": prefilled,
        "transfer_ms_per_request": _per(transfer_s, prefilled, 1e3),
        "transfer_seconds_redis": prefill.get("transfer_seconds/redis", 0.0),
        "transfer_seconds_direct": prefill.get("transfer_seconds/direct", 0.0),
        "transfer_bytes_redis": prefill.get("transfer_bytes/redis", 0.0),
        "transfer_bytes_direct": prefill.get("transfer_bytes/direct", 0.0),
        "pushes_ok": prefill.get("pushes/ok", 0.0),
        "pushes_fallback": prefill.get("pushes/fallback", 0.0),
        "pushes_failed": prefill.get("pushes/failed", 0.0),
        "pushes_socket": prefill.get("push_paths/socket", 0.0),
        "pushes_grpc": prefill.get("push_paths/grpc", 0.0),
        "decode_hits_inbox": decode.get("store_hits/inbox", 0.0),
        "decode_hits_redis": decode.get("store_hits/redis", 0.0),
        "decode_hits_host": decode.get("store_hits/host", 0.0),
        "decode_lookups": decode.get("store_lookups", 0.0),
        "load_ms_per_load": _per(decode.get("store_load_seconds", 0.0), decode.get("store_loads", 0.0), 1e3),
        "decode_pod_ttft_mean_ms": _per(decode.get("pod_ttft_seconds", 0.0), decode.get("pod_requests", 0.0), 1e3),
        # Prompt tokens the pods that compute prompts found cached: 0 when every prompt is new.
        "computing_pods_prefix_hit_tokens": compute.get("prefix_hit_tokens", 0.0),
    }


def mode_result(rounds: list[RoundResult]) -> dict:
    """One set-up at one TP degree: medians over rounds, counters summed, every round kept."""
    medians = {name: _median([r.summary.get(key) for r in rounds]) for name, key in LATENCY_KEYS.items()}
    pods = _summed(rounds)
    return {"median": medians, "completed": sum(r.summary["completed"] for r in rounds),
            "failed": sum(r.summary["failed"] for r in rounds), "hand_off": hand_off(pods), "pods": pods,
            "rounds": [r.as_json() for r in rounds]}


def ttft_ratios(results: dict[str, list[RoundResult]]) -> dict[str, dict]:
    """TTFT p50 ratios of the set-ups that ran: per round (the same prompts, the same minutes of
    the machine's load) and their median."""
    out = {}
    for name, top, bottom in RATIOS:
        if top in results and bottom in results:
            per_round = [_per(a.summary.get("p50_ttft_ms") or math.nan, b.summary.get("p50_ttft_ms") or math.nan)
                         for a, b in zip(results[top], results[bottom])]
            out[name] = {"per_round": per_round, "median": _median(per_round)}
    return out


def checks(mode: str, result: dict, requests: int) -> list[str]:
    """What contradicts the set-up's claim about where the prompts' KV went."""
    h, problems = result["hand_off"], []
    if result["failed"]:
        problems.append(f"{mode}: {result['failed']} request(s) failed")
    if h["computing_pods_prefix_hit_tokens"]:
        problems.append(f"{mode}: the pods computing prompts found {h['computing_pods_prefix_hit_tokens']:.0f} "
                        "prompt tokens in their prefix cache (every prompt was meant to be new)")
    if mode == "mixed":
        return problems
    if h["prefilled_requests"] < requests:
        problems.append(f"{mode}: {h['prefilled_requests']:.0f} of {requests} requests were prefilled on the "
                        "prefill pod")
    found = h["decode_hits_inbox"] + h["decode_hits_redis"] + h["decode_hits_host"]
    if found < h["decode_lookups"]:
        problems.append(f"{mode}: the decode pod found {found:.0f} of the {h['decode_lookups']:.0f} blocks it looked "
                        "up (the rest were recomputed)")
    if mode.startswith("direct"):
        if not h["pushes_ok"] or h["pushes_fallback"] or h["pushes_failed"]:
            problems.append(f"{mode}: pushes ok {h['pushes_ok']:.0f}, fallback {h['pushes_fallback']:.0f}, "
                            f"failed {h['pushes_failed']:.0f}")
        path = "pushes_socket" if mode == "direct" else "pushes_grpc"
        if h[path] != h["pushes_ok"]:
            problems.append(f"{mode}: {h[path]:.0f} of {h['pushes_ok']:.0f} pushes took the "
                            f"{path.removeprefix('pushes_')} path")
        if not h["decode_hits_inbox"] or h["decode_hits_redis"]:
            problems.append(f"{mode}: decode pod hits inbox {h['decode_hits_inbox']:.0f}, "
                            f"redis {h['decode_hits_redis']:.0f}")
    elif not h["decode_hits_redis"] or h["decode_hits_inbox"] or h["pushes_ok"]:
        problems.append(f"redis: decode pod hits redis {h['decode_hits_redis']:.0f}, inbox "
                        f"{h['decode_hits_inbox']:.0f}; pushes {h['pushes_ok']:.0f}")
    return problems


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _channel_cells(h: dict) -> list[str]:
    if not h["prefilled_requests"]:
        return ["-", "-", "-", "-"]
    seconds = f"{h['transfer_seconds_redis']:.2f} / {h['transfer_seconds_direct']:.2f}"
    megabytes = f"{h['transfer_bytes_redis'] / 1e6:.1f} / {h['transfer_bytes_direct'] / 1e6:.1f}"
    pushes = f"{h['pushes_ok']:.0f} / {h['pushes_fallback']:.0f} / {h['pushes_failed']:.0f}"
    hits = f"{h['decode_hits_inbox']:.0f} / {h['decode_hits_redis']:.0f}"
    return [seconds, megabytes, pushes, hits]


HEADER = ("TP", "mode", "TTFT p50 (ms)", "TTFT p90 (ms)", "ITL p50 (ms)", "E2E p50 (ms)", "goodput (req/s)",
          "pod TTFT mean (ms)", "transfer s redis / direct", "MB redis / direct", "pushes ok / fallback / failed",
          "decode hits inbox / redis")


def table(by_tp: list[dict]) -> str:
    """One row per TP degree and set-up; latencies are medians over rounds, counters sums."""
    rows = []
    for entry in by_tp:
        for mode, result in entry["modes"].items():
            m, h = result["median"], result["hand_off"]
            goodput = "-" if math.isnan(m["goodput_rps"]) else f"{m['goodput_rps']:.3f}"
            rows.append([entry["tp"], mode, *(_ms(m[k]) for k in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms",
                                                                  "e2e_p50_ms")),
                         goodput, _ms(h["pod_ttft_mean_ms"]), *_channel_cells(h)])
    return markdown_table(HEADER, rows)


def ratio_lines(by_tp: list[dict]) -> list[str]:
    lines = []
    for entry in by_tp:
        parts = [f"{name} {r['median']:.2f}x (rounds: {', '.join(f'{x:.2f}' for x in r['per_round'])})"
                 for name, r in entry["ratios"].items()]
        if parts:
            lines.append(f"TP={entry['tp']}: TTFT p50 " + "; ".join(parts))
    return lines
