"""The follower: every rank but the one that samples (rank 0; under pipeline
parallelism the last stage's TP rank 0) takes the tokens that rank emitted,
so every rank's request states (the next step's tokens) stay identical."""

from __future__ import annotations

import torch

from engine_pod.core.scheduler_output import ModelRunnerOutput
from engine_pod.distributed.parallel_state import PipelineGroup
from engine_pod.worker.input_batch import BatchInputs
from engine_pod.worker.runner_output import append_emitted


def follow_sampler(batch: BatchInputs, pp: PipelineGroup) -> ModelRunnerOutput:
    """Receive the sampling rank's [B, 1 + max drafts] emitted table
    (PAD-filled) and append it; the engine reads its results from that rank
    only."""
    width = 1 + (batch.spec.max_num_drafts if batch.spec is not None else 0)
    emitted = torch.empty(len(batch.sampling_states), width, dtype=torch.int64, device=pp.device)
    append_emitted(batch.sampling_states, pp.broadcast_from_sampler(emitted).tolist())
    return ModelRunnerOutput({})
