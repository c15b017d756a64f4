"""Outputs: each sampling request's emitted tokens appended to its state,
and the ModelRunnerOutput the engine reads (tokens, logprobs, next drafts)."""

from __future__ import annotations

import torch

from engine_pod.core.scheduler_output import Logprobs, ModelRunnerOutput
from engine_pod.sample.sampler import SamplerOutput
from engine_pod.spec_decode.fallback import can_speculate
from engine_pod.spec_decode.ngram_proposer import NgramProposer
from engine_pod.spec_decode.rejection_sampler import PAD
from engine_pod.worker.input_batch import BatchInputs, PromptLogprobRows
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


def score_prompt_rows(
    logits: torch.Tensor, chunks: list[PromptLogprobRows]
) -> dict[str, tuple[int, list[Logprobs]]]:
    """Each prompt-logprob row's score of its prompt token: the model's own log-softmax (no
    temperature or penalties, as vLLM reports them), the token's rank, and the top-k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out, row = {}, 0
    for chunk in chunks:
        n = len(chunk.rows)
        lp = logprobs[row:row + n]
        row += n
        targets = torch.from_numpy(chunk.target_ids).to(lp.device)
        target_lp = lp.gather(1, targets[:, None])[:, 0]
        ranks = (lp > target_lp[:, None]).sum(dim=1) + 1
        top = lp.topk(chunk.top_k, dim=-1) if chunk.top_k else None
        entries = []
        for j, (token, value, rank) in enumerate(zip(chunk.target_ids.tolist(), target_lp.tolist(), ranks.tolist())):
            ids, values = [token], [value]
            if top is not None:
                ids += top.indices[j].tolist()
                values += top.values[j].tolist()
            entries.append(Logprobs(ids, values, rank))
        out[chunk.req_id] = (chunk.first_position, entries)
    return out


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
