"""Batch building: every scheduled token of a step flattened into one batch
(no padding), with positions, slot mapping and block tables."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine_pod.attention.abstract import AttentionMetadata
from engine_pod.core.scheduler_output import SchedulerOutput
from engine_pod.spec_decode.metadata import SpecDecodeMetadata
from engine_pod.worker.request_state import CachedRequestState


@dataclass(frozen=True)
class PromptLogprobRows:
    """The rows of one request's prompt chunk whose next token is also a prompt token: each
    row's logits score that token (prompt_logprobs)."""

    req_id: str
    first_position: int
    """The prompt position of the first row (its target is the token at first_position + 1)."""
    rows: np.ndarray
    """Rows of the flattened batch, one per position."""
    target_ids: np.ndarray
    """The prompt token each row scores."""
    top_k: int
    """Alternatives to report per position."""


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    # Set by prepare_inputs for a real step: rows to compute logits for, and
    # the requests that sample this step, in logits row order.
    logits_indices: torch.Tensor | None = None
    sampling_states: list[CachedRequestState] = field(default_factory=list)
    # Set when a sampling request carries drafts this step.
    spec: SpecDecodeMetadata | None = None
    # logits_indices on the host, and each row's LoRA slot (-1: the base model;
    # None: no row runs on an adapter this step).
    logits_indices_cpu: np.ndarray | None = None
    token_lora_slots: np.ndarray | None = None
    # Prompt chunks of requests that asked for prompt_logprobs (their logits follow the sampling rows').
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)

    @property
    def output_rows_cpu(self) -> np.ndarray:
        """Every row the step computes logits for: the sampling rows, then the prompt-logprob rows."""
        if not self.prompt_logprobs:
            return self.logits_indices_cpu
        return np.concatenate([self.logits_indices_cpu, *(p.rows for p in self.prompt_logprobs)])


def prepare_inputs(
    so: SchedulerOutput, requests: dict[str, CachedRequestState], block_size: int, device: torch.device
) -> BatchInputs:
    """The step's batch: single-token queries first, then prefill chunks; the
    requests whose scheduled tokens reach their end (past their drafts) sample."""
    # Single-token queries first: the backend runs them as one batched decode.
    order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
    states = [requests[r] for r in order]
    drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in order]
    token_chunks = []
    for state, state_drafts in zip(states, drafts):
        start = state.num_computed_tokens
        end = start + so.num_scheduled_tokens[state.req_id] - len(state_drafts)
        token_chunks.append(state.token_ids[start:end] + state_drafts)
    batch = build_batch(
        token_chunks, [s.num_computed_tokens for s in states], [s.block_ids for s in states], block_size, device
    )
    ends = batch.metadata.seq_lens_cpu
    sampling_rows = [i for i, s in enumerate(states) if ends[i] == s.num_tokens + len(drafts[i])]
    batch.sampling_states = [states[i] for i in sampling_rows]
    last_token = batch.metadata.query_start_loc_cpu[1:] - 1
    indices = last_token[sampling_rows]
    if any(drafts[i] for i in sampling_rows):
        batch.spec = SpecDecodeMetadata([drafts[i] for i in sampling_rows])
        num_drafts = np.array([len(drafts[i]) for i in sampling_rows], dtype=np.int64)
        indices = SpecDecodeMetadata.logits_indices(indices, num_drafts)
    batch.logits_indices_cpu = indices
    batch.logits_indices = torch.from_numpy(indices).to(device)
    batch.prompt_logprobs = _prompt_logprob_rows(states, batch.metadata.query_start_loc_cpu)
    if so.lora_slots:
        request_slots = np.array([so.lora_slots.get(s.req_id, -1) for s in states], dtype=np.int32)
        batch.token_lora_slots = np.repeat(request_slots, np.diff(batch.metadata.query_start_loc_cpu))
    return batch


def _prompt_logprob_rows(states: list[CachedRequestState], query_start_loc: np.ndarray) -> list[PromptLogprobRows]:
    out = []
    for i, state in enumerate(states):
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        start = state.num_computed_tokens
        # Positions start.. of this chunk whose next token is a prompt token (the last prompt
        # position predicts the first output token: that is the sample, not a prompt logprob).
        end = min(start + int(query_start_loc[i + 1] - query_start_loc[i]), len(state.prompt_token_ids) - 1)
        if end <= start:
            continue
        rows = np.arange(query_start_loc[i], query_start_loc[i] + end - start, dtype=np.int64)
        targets = np.asarray(state.prompt_token_ids[start + 1:end + 1], dtype=np.int64)
        out.append(PromptLogprobRows(state.req_id, start, rows, targets, k))
    return out


def build_batch(
    token_chunks: list[list[int]], starts: list[int], block_ids: list[list[int]], block_size: int,
    device: torch.device,
) -> BatchInputs:
    """Flatten per-request token chunks into one batch with its metadata."""
    bs = block_size
    q_lens = np.fromiter((len(c) for c in token_chunks), dtype=np.int64, count=len(token_chunks))
    starts_np = np.asarray(starts, dtype=np.int64)
    seq_lens = starts_np + q_lens
    query_start_loc = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    req_idx = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = np.arange(num_tokens) - query_start_loc[:-1][req_idx] + starts_np[req_idx]
    table = np.zeros((len(q_lens), max(len(b) for b in block_ids)), dtype=np.int64)
    for i, ids in enumerate(block_ids):
        table[i, : len(ids)] = ids
    slot_mapping = table[req_idx, positions // bs] * bs + positions % bs
    input_ids = np.fromiter((t for c in token_chunks for t in c), dtype=np.int64, count=num_tokens)

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    num_decodes = int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else len(q_lens)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_decodes=num_decodes,
        slot_mapping=dev(slot_mapping),
        query_start_loc=dev(query_start_loc),
        seq_lens=dev(seq_lens),
        block_table=dev(table),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        block_size=bs,
    )
    return BatchInputs(dev(input_ids), dev(positions), metadata)
