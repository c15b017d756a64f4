"""A fleet's capacity, estimated from the pods' step-time profile: what
`--load` is a fraction of.

A request's pod-seconds, cold (no prefix-cache hit, every prompt token
prefilled):

    prefill: per_prefill_token_s x prompt tokens
    decode:  (output tokens - 1) x (per_decode_seq_s + per_context_token_s x mean context)
    steps:   base_s x (1 + output tokens - 1) / DECODE_BATCH

The base time of a step is shared by the requests batched in it; the
estimate assumes DECODE_BATCH of them. A pod's capacity is 1 / the mean
pod-seconds of the workload's requests, the fleet's N times that. Cache
hits make real requests cheaper, so a good router leaves headroom at a
load where a cache-blind one queues.

A disaggregated fleet splits each request's cost between its pools: the
prefill pod pays the prompt's tokens and its first step's share of the
base, the decode pod the rest. P prefill and D decode pods serve the lesser
of P / prefill cost and D / decode cost. The KV moved between them is not
charged (a profile's per_kv_byte_s would need the model's bytes a token).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_pod.sim.step_profile import StepTimeProfile

DECODE_BATCH = 8


@dataclass(frozen=True)
class Capacity:
    """The estimate and what it rests on (written into the report)."""

    pod_seconds_per_request: float
    """Mean cold cost of one of the workload's requests on one pod."""
    pod_rps: float
    """Requests per second one pod serves at that cost."""
    mean_prompt_tokens: float
    mean_output_tokens: float
    prefill_pod_seconds_per_request: float
    """The part of pod_seconds_per_request a prefill pod pays under P/D."""
    decode_pod_seconds_per_request: float
    """The rest: what a decode pod pays."""

    def fleet_rps(self, num_pods: int) -> float:
        """Requests per second `num_pods` mixed pods serve."""
        return self.pod_rps * num_pods

    def disaggregated_fleet_rps(self, prefill_pods: int, decode_pods: int) -> float:
        """Requests per second a prefill and a decode pool serve together: the slower pool's."""
        return min(prefill_pods / self.prefill_pod_seconds_per_request,
                   decode_pods / self.decode_pod_seconds_per_request)

    def as_dict(self) -> dict:
        return {"pod_seconds_per_request": self.pod_seconds_per_request, "pod_rps": self.pod_rps,
                "mean_prompt_tokens": self.mean_prompt_tokens, "mean_output_tokens": self.mean_output_tokens,
                "prefill_pod_seconds_per_request": self.prefill_pod_seconds_per_request,
                "decode_pod_seconds_per_request": self.decode_pod_seconds_per_request,
                "decode_batch_assumed": DECODE_BATCH, "assumes": "no prefix-cache hit"}


def request_pod_seconds_by_pool(profile: StepTimeProfile, prompt_tokens: int,
                                output_tokens: int) -> tuple[float, float]:
    """A cold request's pod-seconds as (its prefill, its decode): what a
    prefill and a decode pod pay under P/D; a mixed pod pays the sum."""
    decode_steps = max(0, output_tokens - 1)
    mean_context = prompt_tokens + output_tokens / 2
    prefill = profile.per_prefill_token_s * prompt_tokens + profile.base_s / DECODE_BATCH
    decode = (decode_steps * (profile.per_decode_seq_s + profile.per_context_token_s * mean_context)
              + profile.base_s * decode_steps / DECODE_BATCH)
    return prefill, decode


def request_pod_seconds(profile: StepTimeProfile, prompt_tokens: int, output_tokens: int) -> float:
    return sum(request_pod_seconds_by_pool(profile, prompt_tokens, output_tokens))


def estimate_capacity(profile: StepTimeProfile, lengths: list[tuple[int, int]]) -> Capacity:
    """`lengths`: (prompt tokens, output tokens) of a sample of the workload."""
    if not lengths:
        raise ValueError("estimate_capacity needs at least one request")
    costs = [request_pod_seconds_by_pool(profile, p, o) for p, o in lengths]
    prefill = sum(c[0] for c in costs) / len(costs)
    decode = sum(c[1] for c in costs) / len(costs)
    return Capacity(prefill + decode, 1.0 / (prefill + decode), sum(p for p, _ in lengths) / len(lengths),
                    sum(o for _, o in lengths) / len(lengths), prefill, decode)
