"""What the model runner keeps per request between steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_pod.core.scheduler_output import SchedulerOutput
from engine_pod.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    # [V] bool of prompt tokens, built on first use by the repetition penalty.
    prompt_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def take_new_tokens(self, token_ids: list[int], index: int) -> None:
        """Append those of the scheduler's ``token_ids`` (the request's tokens
        from ``index`` on) this state lacks. The sampling rank appended them as
        it sampled, so it takes none; every other rank learns them here, a step
        later, without waiting for the sampler."""
        held = self.num_tokens - index
        if held < 0 or held > len(token_ids):
            raise RuntimeError(
                f"request {self.req_id}: the runner holds {self.num_tokens} tokens, the scheduler sent "
                f"{len(token_ids)} from index {index}"
            )
        for token_id in token_ids[held:]:
            self.append_output(token_id)


def update_request_states(requests: dict[str, CachedRequestState], so: SchedulerOutput, device: torch.device) -> None:
    """Apply what the scheduler says changed: drop finished requests, hold new
    ones (with their seeded generator, if any), extend or (after a
    preemption) replace block tables, and append the tokens this rank has not
    sampled itself."""
    for req_id in so.finished_req_ids:
        requests.pop(req_id, None)
    for new in so.scheduled_new_reqs:
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(new.sampling_params.seed)
        requests[new.req_id] = CachedRequestState(
            new.req_id, new.prompt_token_ids, new.sampling_params,
            list(new.block_ids), new.num_computed_tokens, generator,
        )
    for cached in so.scheduled_cached_reqs:
        state = requests[cached.req_id]
        if cached.resumed_from_preemption:
            state.block_ids = list(cached.new_block_ids)
        else:
            state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens
        state.take_new_tokens(cached.new_token_ids, cached.new_token_index)
