"""What a real engine step computes, read off its SchedulerOutput as the
StepFeatures of the step-time model."""

from __future__ import annotations

from engine_pod.core.scheduler_output import SchedulerOutput
from engine_pod.sim.step_profile import StepFeatures


def step_features(output: SchedulerOutput, kv_bytes_per_block: int = 0) -> StepFeatures:
    """A request whose computed tokens (before this step) have not reached
    the end of its prompt is prefilling: all its scheduled tokens are prefill
    tokens. Otherwise it decodes one token, and any further scheduled tokens
    (drafts it verifies, outputs recomputed after a preemption) are computed
    in parallel like prefill tokens. Every request attends to the tokens it
    has in the KV cache already (num_computed_tokens), loaded ones included.

    The KV bytes moved are ``kv_bytes_per_block`` (the engine's block, K and
    V of every layer) for each block the KV connector copies between the
    cache and the store around the step: loaded, saved or offloaded."""
    progress = [(r.req_id, r.num_computed_tokens, len(r.prompt_token_ids)) for r in output.scheduled_new_reqs]
    progress += [(r.req_id, r.num_computed_tokens, r.num_prompt_tokens) for r in output.scheduled_cached_reqs]
    prefill = decode = context = 0
    for req_id, num_computed, num_prompt in progress:
        num_scheduled = output.num_scheduled_tokens[req_id]
        context += num_computed
        if num_computed < num_prompt:
            prefill += num_scheduled
        else:
            decode += 1
            prefill += num_scheduled - 1
    return StepFeatures(num_prefill_tokens=prefill, num_decode_seqs=decode, num_context_tokens=context,
                        kv_bytes_moved=kv_bytes_per_block * _blocks_moved(output))


def _blocks_moved(output: SchedulerOutput) -> int:
    meta = output.kv_connector
    return 0 if meta is None else len(meta.loads) + len(meta.saves) + len(meta.offloads)
