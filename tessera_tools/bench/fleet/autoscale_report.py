"""The autoscale scenario's figures: per fleet (autoscaled, static) SLO
attainment, latency and pod-minutes, and per pool (one mixed, or prefill and
decode) its pod-minutes with its replica timeline and decisions; the two
fleets compared against the acceptance over all their pods; scale from
zero's first request."""

from __future__ import annotations

from tessera_tools.bench.fleet.autoscaler import Autoscaler
from tessera_tools.bench.fleet.elastic_pool import ElasticPool
from tessera_tools.bench.fleet.scenario_figures import endings, latency_figures, slo_attainment_over_time
from tessera_tools.bench.fleet.scenario_replay import TracedReplay

# The acceptance (issue 18): the autoscaled fleet meets the SLO as often as
# this, on at most this share of the static fleet's pod-minutes.
MIN_SLO_ATTAINMENT = 0.95
MAX_POD_MINUTES_RATIO = 0.75
# Scale from zero: the first request's first token within the start-up delay plus this.
FROM_ZERO_MARGIN_S = 2.0
# The report's SLO attainment over time, in bins of this many seconds of the trace.
SLO_BIN_S = 15.0

MIXED_NOTE = ("one mixed pool: every pod prefills and decodes; --disaggregated runs prefill and decode pools "
              "instead, P/D through the KV store")
# What a disaggregated run does not show (docs/fleet-bench.md).
DISAGGREGATED_LIMITS = (
    "the gateways' admission queue is not split by pool: requests they hold count for both pools' concurrency "
    "and lift either pool from zero, as in the operator (observe.gateway_demand)",
    "the trace is sized for the static fleet's pools by capacity.py's P/D split of a request's cost, which "
    "charges no KV transfer",
    "pd.kv_store sums the counters of the pods still running at the trace's end; pods removed earlier took "
    "theirs with them (pd.redis counts every read and write)",
)


def limits(disaggregated: bool) -> list[str]:
    return list(DISAGGREGATED_LIMITS) if disaggregated else [MIXED_NOTE]


def _relative(rows: list[dict], t0: float) -> list[dict]:
    return [{**row, "t": round(row["t"] - t0, 3)} for row in rows]


def pool_record(pool: ElasticPool, autoscaler: Autoscaler | None, t0: float, t1: float) -> dict:
    """One pool's pods over the trace's window [t0, t1]: pod-minutes (every pod's process start to exit,
    clipped to the window; a static pool's pods exist through all of it), its ticks and lifecycle events."""
    pod_seconds = pool.pod_seconds(t0, t1)
    ticks = _relative(autoscaler.ticks, t0) if autoscaler else []
    return {
        "pod_minutes": pod_seconds / 60, "window_s": t1 - t0,
        "mean_pods": pod_seconds / (t1 - t0) if t1 > t0 else None,
        "pods_started": len(pool.pods),
        "peak_ready": max([t["ready"] for t in ticks], default=len(pool.in_state("ready"))),
        "timeline": [{k: t[k] for k in ("t", "asked", "ready", "starting", "terminating", "reason", "signal",
                                         "gateway_queued", "prefills_unplaced")} for t in ticks],
        "decisions": [{k: t[k] for k in ("t", "previous", "asked", "reason", "message")} for t in ticks
                      if t["asked"] != t["previous"]],
        "pod_events": _relative(pool.events, t0),
    }


def fleet_record(kind: str, replay: TracedReplay, pools: dict[str, ElasticPool],
                 autoscalers: dict[str, Autoscaler], slos: dict[str, float]) -> dict:
    """One fleet's run over the trace's window (offset 0 to the last request's end). A mixed pool's figures
    sit in the record itself; a P/D fleet's per pool under `pools`, their pod-minutes summed."""
    t0, t1 = replay.started_at, replay.ended_at
    record = {"fleet": kind, **latency_figures(replay, slos), "endings": endings(replay),
              "slo_over_time": slo_attainment_over_time(replay, slos, SLO_BIN_S)}
    per_pool = {role: pool_record(pool, autoscalers.get(role), t0, t1) for role, pool in pools.items()}
    if list(per_pool) == ["mixed"]:
        return {**record, **per_pool["mixed"]}
    pod_seconds = sum(p.pod_seconds(t0, t1) for p in pools.values())
    return {**record, "pod_minutes": pod_seconds / 60, "window_s": t1 - t0,
            "mean_pods": pod_seconds / (t1 - t0) if t1 > t0 else None,
            "pods_started": sum(len(p.pods) for p in pools.values()), "pools": per_pool}


def _ratio(autoscaled: float, static: float) -> float | None:
    return autoscaled / static if static > 0 else None


def comparison(autoscaled: dict, static: dict) -> dict:
    """The acceptance over every pod of each fleet (a P/D fleet's two pools together), and each pool's
    pod-minutes on their own."""
    ratio = _ratio(autoscaled["pod_minutes"], static["pod_minutes"])
    attainment = autoscaled["slo_attainment"]
    out = {
        "autoscaled_slo_attainment": attainment, "static_slo_attainment": static["slo_attainment"],
        "autoscaled_pod_minutes": autoscaled["pod_minutes"], "static_pod_minutes": static["pod_minutes"],
        "pod_minutes_ratio": ratio,
        "acceptance": {"min_slo_attainment": MIN_SLO_ATTAINMENT, "max_pod_minutes_ratio": MAX_POD_MINUTES_RATIO,
                       "met": attainment is not None and ratio is not None
                       and attainment >= MIN_SLO_ATTAINMENT and ratio <= MAX_POD_MINUTES_RATIO},
    }
    if "pools" in autoscaled:
        out["pools"] = {role: {"autoscaled_pod_minutes": pool["pod_minutes"],
                               "static_pod_minutes": static["pools"][role]["pod_minutes"],
                               "pod_minutes_ratio": _ratio(pool["pod_minutes"], static["pools"][role]["pod_minutes"])}
                        for role, pool in autoscaled["pools"].items()}
    return out


def scale_from_zero(replay: TracedReplay, record: dict, startup_delay_s: float) -> dict:
    """The first request of a fleet that started at zero pods: its first token against the start-up delay
    plus FROM_ZERO_MARGIN_S, and where the time went (t: seconds from the trace's start)."""
    first = replay.requests[0]
    sent = first.sent_at - replay.started_at
    lifted = next((d for d in record["decisions"] if d["reason"] == "ScaleFromZero"), None)
    listed = next((e for e in record["pod_events"] if e["event"] == "listed"), None)
    ttft = first.outcome.ttft_s if first.outcome.ok else None
    bound = startup_delay_s + FROM_ZERO_MARGIN_S
    return {
        "scaled_from_zero": lifted is not None,
        "first_request_ok": first.outcome.ok, "first_request_error": first.outcome.error,
        "first_request_sent_t": sent, "scale_from_zero_t": lifted and lifted["t"],
        "first_pod_listed_t": listed and listed["t"],
        "first_token_t": None if ttft is None else sent + ttft,
        "first_request_ttft_s": ttft, "bound_s": bound, "within_bound": ttft is not None and ttft <= bound,
        # The part of the TTFT that waits for the controller's next tick (at most --scale-interval):
        # an operator ticks on an interval too.
        "decision_lag_s": None if lifted is None else lifted["t"] - sent,
        "decision_to_first_token_s": None if lifted is None or ttft is None else sent + ttft - lifted["t"],
        "failed_requests": record["failed"],
    }


def summary_lines(report: dict) -> list[str]:
    lines = []
    for kind in report["order"]:
        r = report["runs"][kind]
        lines.append(f"{kind}: {r['ok']} ok / {r['failed']} failed, SLO attainment {_pct(r['slo_attainment'])}, "
                     f"TTFT p50/p99 {_ms(r['ttft_p50_ms'])}/{_ms(r['ttft_p99_ms'])} ms, ITL p50/p99 "
                     f"{_ms(r['itl_p50_ms'])}/{_ms(r['itl_p99_ms'])} ms, {r['pod_minutes']:.2f} pod-minutes "
                     f"({r['pods_started']} pods started)")
        for role, pool in r.get("pools", {}).items():
            lines.append(f"  {role}: {pool['pod_minutes']:.2f} pod-minutes, {pool['pods_started']} pods started, "
                         f"{len(pool['decisions'])} decision(s), peak {pool['peak_ready']} ready")
        if (pd := r.get("pd")) is not None:
            calls, decode = pd["gateway_calls"], pd["kv_store"]["decode"]
            lines.append(f"  P/D: {calls.get('prefill', 0):.0f} prefill calls, {calls.get('decode', 0):.0f} decode "
                         f"calls after one, {calls.get('route', 0):.0f} without; the decode pods still running loaded "
                         f"{decode['redis_hits']:.0f} blocks from Redis")
    c = report["comparison"]
    ratio = "n/a" if c["pod_minutes_ratio"] is None else f"{c['pod_minutes_ratio']:.2f}"
    lines.append(f"autoscaled / static pod-minutes: {ratio}; acceptance (SLO >= {MIN_SLO_ATTAINMENT:.0%}, ratio <= "
                 f"{MAX_POD_MINUTES_RATIO}): {'met' if c['acceptance']['met'] else 'NOT met'}")
    if (z := report.get("scale_from_zero")) is not None:
        lines.append(f"scale from zero: {'yes' if z['scaled_from_zero'] else 'NO'}; first request "
                     f"{'ok' if z['first_request_ok'] else 'FAILED'}, TTFT {_s(z['first_request_ttft_s'])} s "
                     f"(bound {z['bound_s']:.1f} s, decision lag {_s(z['decision_lag_s'])} s); "
                     f"{z['failed_requests']} request(s) failed")
    return lines


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
