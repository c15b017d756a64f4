"""What the scheduler hands the executor each step, what comes back, and
what it reports to the engine per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_pod.sampling_params import SamplingParams
from engine_pod.structured_output.bitmask import GrammarBitmask


@dataclass
class NewRequestData:
    """A request the runner has not seen: everything it needs to hold it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    # Appended to the runner's block table, or replacing it when resumed.
    new_block_ids: list[int]
    num_computed_tokens: int
    # The prompt's length (the runner knows it; the step-time model of a simulated pod reads it).
    num_prompt_tokens: int
    resumed_from_preemption: bool = False
    # The request's tokens from index ``new_token_index`` on that no SchedulerOutput carried before
    # (its outputs so far): a rank that does not sample appends those it lacks, so its next inputs are
    # right without waiting for the sampling rank (pipeline stages keep several steps in flight).
    new_token_ids: list[int] = field(default_factory=list)
    new_token_index: int = 0


@dataclass
class KVConnectorMetadata:
    """What the runner does with the KV store around this step's forward.

    Order matters: offloads read blocks evicted this step before loads and
    the forward overwrite them; saves read blocks the forward just filled.
    """

    # (block id, block hash): evicted from the prefix cache, copy to the host tier first.
    offloads: list[tuple[int, bytes]] = field(default_factory=list)
    # (block id, the whole block's payload as the store decoded it: kv_store/codec.py) to write in
    # (each rank writes its own KV heads; a view of the stored value, or its bytes once it crossed to a worker).
    loads: list[tuple[int, memoryview | bytes]] = field(default_factory=list)
    # (block id, block hash, write to Redis before the step returns) filled this step.
    saves: list[tuple[int, bytes, bool]] = field(default_factory=list)
    # block hash -> [(request id, decode pod address)]: saves direct producers push to their decode pods.
    transfers: dict[bytes, list[tuple[str, str]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads or self.saves)

    @property
    def reads_blocks(self) -> bool:
        """Whether the runner reads blocks back for the store this step (every rank then replies)."""
        return bool(self.offloads or self.saves)


@dataclass
class KVConnectorOutput:
    """One rank's KV heads of the blocks its step's KVConnectorMetadata
    offloads and saves; the executor assembles every rank's into whole blocks
    and puts them into the store (engine_pod/executor/kv_store_writer.py).
    The values are engine_pod/worker/kv_shards.RankBlocks (core imports no torch)."""

    offloaded: Any = None
    """This rank's heads of the offloaded blocks, in the metadata's order (None: no offloads)."""
    saved: Any = None
    """This rank's heads of the saved blocks, in the metadata's order (None: no saves)."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # request id -> tokens to compute this step, in batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step: the runner keeps their state for resumption.
    preempted_req_ids: set[str] = field(default_factory=set)
    # request id -> the drafts it verifies this step (the last tokens of its
    # num_scheduled_tokens); requests without drafts are absent.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    kv_connector: KVConnectorMetadata | None = None
    # Next-token masks of the guided requests that sample this step.
    grammar_bitmask: GrammarBitmask | None = None
    # LoRA (core/lora_slots.py): the slot of each scheduled request that runs on an adapter,
    # and the adapters (by id) to write into slots before this step's forward.
    lora_slots: dict[str, int] = field(default_factory=dict)
    lora_loads: dict[int, int] = field(default_factory=dict)
    # The weights of lora_loads by slot (engine_pod/lora/adapter.AdapterWeights), attached by
    # the engine core after scheduling: the scheduler holds no tensors.
    lora_weights: dict[int, Any] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class Logprobs:
    """Per sampled token: the top-k ids and logprobs, then the sampled one."""

    token_ids: list[int]  # [k + 1]: sampled token first, then top-k
    logprobs: list[float]
    sampled_rank: int

    @property
    def ranks(self) -> list[int]:
        """Rank of each entry: the sampled token's own, then 1..k."""
        return [self.sampled_rank, *range(1, len(self.token_ids))]


@dataclass
class ModelRunnerOutput:
    # One entry per request that sampled this step (prefill chunks that do not
    # reach the end of the prompt sample nothing).
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # Speculative decoding: request id -> drafts proposed for its next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # prompt_logprobs: request id -> (the prompt position of the first entry, one entry a position,
    # each the prompt's own token first, then the top-k) for the prompt positions this step computed.
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)
    # Blocks read back for the KV store this step (every rank's; the executor consumes it).
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class EngineCoreOutput:
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    # With the first output of a request that asked for them: one entry per prompt token after the first.
    prompt_logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
