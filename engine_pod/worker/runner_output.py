"""Outputs: each sampling request's emitted tokens appended to its state,
and the ModelRunnerOutput the engine reads (tokens, logprobs, next drafts)."""

from __future__ import annotations

from engine_pod.core.scheduler_output import Logprobs, ModelRunnerOutput
from engine_pod.sample.sampler import SamplerOutput
from engine_pod.spec_decode.fallback import can_speculate
from engine_pod.spec_decode.ngram_proposer import NgramProposer
from engine_pod.spec_decode.rejection_sampler import PAD
from engine_pod.worker.input_batch import BatchInputs
from engine_pod.worker.request_state import CachedRequestState


def append_emitted(states: list[CachedRequestState], emitted: list[list[int]]) -> list[list[int]]:
    """Append each request's emitted tokens (its row without the PAD fill)
    to its state, identically on every rank; returns them."""
    appended = []
    for state, row in zip(states, emitted):
        tokens = [t for t in row if t != PAD]
        for token in tokens:
            state.append_output(token)
        appended.append(tokens)
    return appended


def make_runner_output(
    batch: BatchInputs, emitted: list[list[int]], out: SamplerOutput | None, drafter: NgramProposer | None
) -> ModelRunnerOutput:
    """Rank 0's result of a step that sampled: ``emitted`` ([B, 1 + max
    drafts], PAD-filled) and the plain sampler's output (for logprobs)."""
    states = batch.sampling_states
    appended = append_emitted(states, emitted)
    sampled_ids = {state.req_id: tokens for state, tokens in zip(states, appended)}
    logprobs = {}
    if out is not None and out.logprobs is not None:
        # Only requests without drafts ask for logprobs (spec_decode/fallback.py).
        plain = [states[i] for i in batch.spec.plain] if batch.spec is not None else states
        lp_ids, lp_vals, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
        for i, state in enumerate(plain):
            k = state.sampling_params.logprobs
            if k is not None:
                logprobs[state.req_id] = [Logprobs(lp_ids[i][: k + 1], lp_vals[i][: k + 1], ranks[i])]
    return ModelRunnerOutput(sampled_ids, logprobs, propose_drafts(states, drafter))


def propose_drafts(states: list[CachedRequestState], drafter: NgramProposer | None) -> dict[str, list[int]]:
    """Next step's drafts, from each request's context as it now stands."""
    if drafter is None:
        return {}
    drafts = {}
    for state in states:
        if can_speculate(state.sampling_params, len(state.output_token_ids)):
            proposal = drafter.propose(state.token_ids)
            if proposal:
                drafts[state.req_id] = proposal
    return drafts
