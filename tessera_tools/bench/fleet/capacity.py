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

    def fleet_rps(self, num_pods: int) -> float:
        return self.pod_rps * num_pods

    def as_dict(self) -> dict:
        return {"pod_seconds_per_request": self.pod_seconds_per_request, "pod_rps": self.pod_rps,
                "mean_prompt_tokens": self.mean_prompt_tokens, "mean_output_tokens": self.mean_output_tokens,
                "decode_batch_assumed": DECODE_BATCH, "assumes": "no prefix-cache hit"}


def request_pod_seconds(profile: StepTimeProfile, prompt_tokens: int, output_tokens: int) -> float:
    decode_steps = max(0, output_tokens - 1)
    mean_context = prompt_tokens + output_tokens / 2
    return (profile.per_prefill_token_s * prompt_tokens
            + decode_steps * (profile.per_decode_seq_s + profile.per_context_token_s * mean_context)
            + profile.base_s * (1 + decode_steps) / DECODE_BATCH)


def estimate_capacity(profile: StepTimeProfile, lengths: list[tuple[int, int]]) -> Capacity:
    """`lengths`: (prompt tokens, output tokens) of a sample of the workload."""
    if not lengths:
        raise ValueError("estimate_capacity needs at least one request")
    cost = sum(request_pod_seconds(profile, p, o) for p, o in lengths) / len(lengths)
    return Capacity(cost, 1.0 / cost, sum(p for p, _ in lengths) / len(lengths),
                    sum(o for _, o in lengths) / len(lengths))
