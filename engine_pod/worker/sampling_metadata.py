"""Sampling metadata: the per-row sampling inputs (temperatures, filters,
penalties, min_tokens bans, grammar masks) of the requests that sample."""

from __future__ import annotations

import torch

from engine_pod.core.scheduler_output import SchedulerOutput
from engine_pod.sample.metadata import SamplingMetadata
from engine_pod.worker.input_batch import BatchInputs
from engine_pod.worker.request_state import CachedRequestState


def build_sampling_metadata(
    states: list[CachedRequestState], device: torch.device, vocab_size: int
) -> SamplingMetadata:
    """One row per state, in order; optional inputs are None when no row uses them."""
    params = [s.sampling_params for s in states]
    V = vocab_size

    def tensor(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    temps = [0.0 if p.is_greedy else p.temperature for p in params]
    all_greedy = all(t == 0.0 for t in temps)
    all_random = all(t > 0.0 for t in temps)
    use_top_k = any(0 < p.top_k < V for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
    md = SamplingMetadata(
        temperature=tensor(temps),
        all_greedy=all_greedy,
        all_random=all_random,
        top_k=tensor([p.top_k if 0 < p.top_k < V else V for p in params], torch.int64) if use_top_k else None,
        top_p=tensor([p.top_p for p in params]) if use_top_p else None,
        min_p=tensor([p.min_p for p in params]) if use_min_p else None,
        generators=generators,
        presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
        output_token_ids=None, prompt_token_mask=None,
        min_tokens_mask=_min_tokens_mask(states, device, vocab_size),
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
    )
    if any(p.has_penalties for p in params):
        _add_penalties(md, states, device, vocab_size)
    return md


def grammar_bitmask_rows(so: SchedulerOutput, batch: BatchInputs, device: torch.device) -> torch.Tensor | None:
    """The scheduler's grammar masks in this batch's logits row order
    (a request with drafts has one row per draft position and one more)."""
    if so.grammar_bitmask is None:
        return None
    states = batch.sampling_states
    num_rows = [1] * len(states) if batch.spec is None else [len(d) + 1 for d in batch.spec.draft_token_ids]
    rows = so.grammar_bitmask.rows_for([s.req_id for s in states], num_rows)
    return None if rows is None else torch.from_numpy(rows).to(device)


def _min_tokens_mask(states: list[CachedRequestState], device: torch.device, vocab_size: int) -> torch.Tensor | None:
    rows = [
        (i, s.sampling_params.all_stop_token_ids)
        for i, s in enumerate(states)
        if len(s.output_token_ids) < s.sampling_params.min_tokens and s.sampling_params.all_stop_token_ids
    ]
    if not rows:
        return None
    mask = torch.zeros(len(states), vocab_size, dtype=torch.bool)
    for i, ids in rows:
        mask[i, [t for t in ids if t < vocab_size]] = True
    return mask.to(device)


def _add_penalties(md: SamplingMetadata, states: list[CachedRequestState], device: torch.device,
                   vocab_size: int) -> None:
    params = [s.sampling_params for s in states]
    dev, V = device, vocab_size
    md.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)
    md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)
    md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
    width = max(1, max(len(s.output_token_ids) for s in states))
    out = torch.full((len(states), width), V, dtype=torch.int64)
    for i, s in enumerate(states):
        out[i, : len(s.output_token_ids)] = torch.tensor(s.output_token_ids, dtype=torch.int64)
    md.output_token_ids = out.to(dev)
    for s in states:
        if s.prompt_mask is None:
            s.prompt_mask = torch.zeros(V, dtype=torch.bool, device=dev)
            s.prompt_mask[torch.tensor(s.prompt_token_ids, device=dev)] = True
    md.prompt_token_mask = torch.stack([s.prompt_mask for s in states])
