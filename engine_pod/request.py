"""A request inside the engine core: its tokens, state and block hashes."""

from __future__ import annotations

import enum
import time
from typing import Any
from dataclasses import dataclass, field

from engine_pod.lora_request import AdapterSpec
from engine_pod.sampling_params import SamplingParams
from kv_store.block_hash import BlockHash, hash_request_tokens


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Waiting for its grammar to compile (vLLM's WAITING_FOR_FSM): skipped
    # by the scheduler, never blocking the requests behind it.
    WAITING_FOR_FSM = enum.auto()
    # Waiting for its LoRA adapter to be read into host memory: the same.
    WAITING_FOR_LORA = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    # P/D: "produce" (a prefill pod: save prompt blocks to Redis before the
    # first token is reported) or None.
    kv_transfer_mode: str | None = None
    # "produce" over the direct channel: the decode pod (host:port) its blocks are pushed to.
    kv_transfer_target: str | None = None
    # The LoRA adapter it runs on (checked by the Processor); None: the base model.
    lora: AdapterSpec | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Its tokens the model runners have been sent (core/output_builder.py): the
    # prompt with the request, later tokens as it is scheduled again.
    num_tokens_sent: int = 0
    # Steps scheduled with it whose output the scheduler has not applied yet
    # (above 1 only under pipeline parallelism, where steps overlap).
    num_steps_in_flight: int = 0
    # Direct producers: leading blocks queued for the decode pod so far.
    num_kv_blocks_pushed: int = 0
    # Prompt tokens served from the prefix cache when first scheduled (-1: not yet).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Wall-clock time of the step that first scheduled it (None: not yet).
    first_scheduled_time: float | None = None
    stop_reason: int | str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Draft tokens proposed for the next step (speculative decoding): never
    # part of all_token_ids, hashed or cached until the model verifies them.
    # The scheduler may schedule fewer; a constraint on the output (a
    # grammar) trims them here before they are scheduled.
    spec_token_ids: list[int] = field(default_factory=list)
    # prompt_logprobs: one entry (core.scheduler_output.Logprobs) per prompt position scored so far,
    # until they go out with the first output token (then None).
    prompt_logprobs: list[Any] | None = field(default_factory=list)
    # Block size used for block_hashes; 0 when prefix caching is off.
    _hash_block_size: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    def add_prompt_logprobs(self, first_position: int, entries: list[Any]) -> None:
        """Keep the entries for prompt positions not scored yet: a request recomputed after a
        preemption scores its prompt again, and those positions already stand."""
        if self.prompt_logprobs is None:
            return
        have = len(self.prompt_logprobs)
        if first_position > have:
            raise RuntimeError(f"request {self.request_id}: prompt logprobs from position {first_position}, "
                               f"{have} held")
        self.prompt_logprobs.extend(entries[have - first_position:])

    def take_prompt_logprobs(self) -> list[Any] | None:
        """The prompt's logprobs, once (None when not asked for, or already taken)."""
        if self.sampling_params.prompt_logprobs is None or self.prompt_logprobs is None:
            return None
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def enable_block_hashing(self, block_size: int) -> None:
        self._hash_block_size = block_size
        self._extend_block_hashes()

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._hash_block_size:
            self._extend_block_hashes()

    def _extend_block_hashes(self) -> None:
        # Hash only newly completed full blocks: O(new blocks) per step.
        start = len(self.block_hashes)
        if (start + 1) * self._hash_block_size > len(self.all_token_ids):
            return
        parent = self.block_hashes[-1] if start else None
        self.block_hashes.extend(
            hash_request_tokens(
                self.all_token_ids, self._hash_block_size, self.cache_salt, start, parent,
                self.lora.fingerprint if self.lora is not None else None,
            )
        )
