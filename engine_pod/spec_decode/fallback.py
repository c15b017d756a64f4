"""Which requests get drafts: those the rejection sampler serves exactly."""

from __future__ import annotations

from engine_pod.sampling_params import SamplingParams


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """False (decode one token per step) when a draft position's target
    distribution would depend on the tokens before it in ways verification
    does not model, or when the output needs per-token extras:

    - penalties: counts of earlier output tokens change at every position;
    - min_tokens not reached: the stop-token ban lifts part-way through;
    - logprobs: only the plain sampler reports them.
    """
    return (
        not params.has_penalties
        and num_output_tokens >= params.min_tokens
        and params.logprobs is None
    )
