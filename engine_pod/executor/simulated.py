"""The executor of a simulated engine pod: no model. Each step emits the
deterministic token ids of engine_pod/sim/tokens.py and lasts what the
step-time profile predicts for it, slept in real time.

The profile was fitted on the executor's own time per step (the engine
core's step_observer), so sleeping its prediction here leaves the real
scheduler, KV cache manager and server around it costing what they cost.

With a KV store, the step also does the real store work a worker does
(engine_pod/sim/kv_transfer.py: filler blocks saved to the host tier and
Redis, signed), charged at the profile's per_kv_byte_s; that work is part
of the step, so the sleep is what is left of the prediction after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_pod.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine_pod.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine_pod.executor.abstract import Executor
from engine_pod.model.hf_config import DTYPE_BYTES
from engine_pod.sim.kv_transfer import SimulatedKVTransfer
from engine_pod.sim.step_features import step_features
from engine_pod.sim.step_profile import StepTimeProfile
from engine_pod.sim.tokens import prompt_seed, simulated_token
from kv_store.tiered_store import TieredKVStore
from tessera.text import load_eos_token_ids


@dataclass
class _SimulatedRequest:
    seed: int
    # Prompt plus the outputs sampled so far: the request samples in a step
    # that computes up to this many tokens.
    num_tokens: int


class SimulatedExecutor(Executor):
    def __init__(self, config: EngineConfig, profile: StepTimeProfile,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self.profile = profile
        self._sleep = sleep
        self._vocab_size = config.model.arch.vocab_size
        self._eos = frozenset(load_eos_token_ids(config.model.path))
        self._requests: dict[str, _SimulatedRequest] = {}
        self._forward_seconds = 0.0
        self._kv_transfer: SimulatedKVTransfer | None = None

    def kv_bytes_per_block(self) -> int:
        """What a block of this checkpoint takes, in its stored dtype (K and V, every layer)."""
        arch = self.config.model.arch
        per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
        return per_token * self.config.cache.block_size * DTYPE_BYTES[self.config.model.kv_dtype_name]

    def determine_num_blocks(self) -> int:
        budget = self.config.cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        return max(1, budget // self.kv_bytes_per_block())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass  # the blocks are the KV cache manager's bookkeeping alone

    def attach_kv_store(self, store: TieredKVStore) -> None:
        self._kv_transfer = SimulatedKVTransfer(store)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._requests[new.req_id] = _SimulatedRequest(prompt_seed(new.prompt_token_ids),
                                                           len(new.prompt_token_ids))
        sampled: dict[str, list[int]] = {}
        progress = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        progress += [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_cached_reqs]
        for req_id, num_computed in progress:
            request = self._requests[req_id]
            if num_computed + scheduler_output.num_scheduled_tokens[req_id] < request.num_tokens:
                continue  # a prefill chunk short of the sequence's end samples nothing
            token = simulated_token(request.seed, request.num_tokens, self._vocab_size, self._eos)
            request.num_tokens += 1
            sampled[req_id] = [token]
        duration = self.profile.predict(step_features(scheduler_output, self.kv_bytes_per_block()))
        self._sleep(max(0.0, duration - self._move_kv(scheduler_output)))
        self._forward_seconds += duration
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def _move_kv(self, scheduler_output: SchedulerOutput) -> float:
        """The step's KV store work, done for real; the seconds it took."""
        meta = scheduler_output.kv_connector
        if self._kv_transfer is None or not meta:
            return 0.0
        start = time.perf_counter()
        self._kv_transfer.run(meta)
        return time.perf_counter() - start

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self, method)(*args)]

    @property
    def forward_seconds(self) -> float:
        return self._forward_seconds
