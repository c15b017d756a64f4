"""The TP follower: a rank other than 0 samples nothing; it takes the tokens
rank 0 emitted, so every rank's request states (the next step's tokens)
stay identical."""

from __future__ import annotations

import torch

from engine_pod.core.scheduler_output import ModelRunnerOutput
from engine_pod.distributed.parallel_state import TensorParallelGroup
from engine_pod.worker.input_batch import BatchInputs
from engine_pod.worker.runner_output import append_emitted


def follow_first_rank(batch: BatchInputs, group: TensorParallelGroup) -> ModelRunnerOutput:
    """Receive rank 0's [B, 1 + max drafts] emitted table (PAD-filled) and
    append it; the engine reads its results from rank 0 only."""
    width = 1 + (batch.spec.max_num_drafts if batch.spec is not None else 0)
    emitted = torch.empty(len(batch.sampling_states), width, dtype=torch.int64, device=group.device)
    append_emitted(batch.sampling_states, group.broadcast_from_first(emitted).tolist())
    return ModelRunnerOutput({})
