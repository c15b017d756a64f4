"""EngineCore: the busy loop's body, schedule -> execute -> update."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine_pod.config import EngineConfig
from engine_pod.core.kv_cache_manager import KVCacheManager
from engine_pod.core.kv_connector import KVConnectorScheduler
from engine_pod.core.prefix_cache_keys import PrefixCacheKeyLog
from engine_pod.core.scheduler import Scheduler
from engine_pod.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from engine_pod.core.stats import EngineTotals, SchedulerStats
from engine_pod.engine.kv_store_factory import build_kv_store
from engine_pod.executor import Executor, create_executor
from engine_pod.request import Request, RequestStatus
from kv_store.block_hash import BlockHash
from tessera.text import load_eos_token_ids

if TYPE_CHECKING:
    from engine_pod.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


# How long an idle step waits for a grammar compile or an adapter read before returning to the
# caller's loop (which takes in new requests and aborts between steps).
_IDLE_WAIT_S = 0.01

# Called after each non-empty step's forward with the step's SchedulerOutput
# and the seconds spent in the executor (`tessera bench profile` fits step times on it);
# not under pipeline parallelism, where steps overlap.
StepObserver = Callable[[SchedulerOutput, float], None]


class EngineCore:
    """One engine: the scheduler, the executor (and through it the model
    runner(s)), the KV store and the structured output manager, built and
    sized together at start-up.

    Owns the Scheduler (and its KVCacheManager), the Executor, the KV store
    and the grammar manager; shuts them all down. Called by the offline LLM
    (entrypoints/llm.py) and, in a pod, by the AsyncEngine's loop
    (server/async_engine.py), always from one thread; only
    ``num_cached_prefix_blocks``, ``prefix_cache_keys`` and the fixed
    ``num_blocks`` and ``block_size`` may be read from another (the pod's
    load reports).

    Invariants: the KV pool holds at least one max_model_len sequence (a
    start-up error otherwise), so a step that schedules nothing while
    requests are pending and none waits for a grammar is a bug, raised as
    one; a failed start stops every worker it began.
    """

    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 tokenizer_path: str | None = None) -> None:
        self.config = config
        self.tokenizer_path = tokenizer_path or str(config.model.path)
        self.executor = executor or create_executor(config)
        self.step_observer: StepObserver | None = None
        # Steps submitted to the executor and not yet taken, oldest first (pipeline parallelism).
        self._in_flight: collections.deque[SchedulerOutput] = collections.deque()
        self.kv_store = None
        try:
            self._start(config)
        except BaseException:
            # No worker, write-behind thread or Redis connection outlives a failed start.
            self.executor.shutdown()
            if self.kv_store is not None:
                self.kv_store.close()
            raise

    def _start(self, config: EngineConfig) -> None:
        num_blocks = config.cache.num_gpu_blocks or self.executor.determine_num_blocks()
        block_size = config.cache.block_size
        max_model_len = config.model.max_model_len
        if num_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens), "
                f"fewer than one max_model_len={max_model_len} sequence; raise num_gpu_blocks / "
                "kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
            )
        self.executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        connector = None
        if config.kv_store.enabled:
            if not config.cache.enable_prefix_caching:
                raise ValueError("the KV store addresses blocks by their prefix hashes: it needs enable_prefix_caching")
            self.kv_store = build_kv_store(config)
            self.executor.attach_kv_store(self.kv_store)
            connector = KVConnectorScheduler(self.kv_store, block_size)
        self.structured_output = None if config.simulated else self._grammar_manager(config)
        self.lora_loader = None
        if config.lora is not None:
            # Imported here: a simulated engine (no LoRA) never loads torch.
            from engine_pod.engine.lora_loader import LoRALoader

            self.lora_loader = LoRALoader(config.lora.host_capacity, config.model.dtype, self._adapters_in_use,
                                          config.lora.read_timeout_s)
        self.scheduler = Scheduler(
            config.scheduler, kv, connector, self.structured_output, self.lora_loader,
            config.lora.max_loras if config.lora is not None else 0,
        )
        self.totals = EngineTotals()
        self.last_stats = SchedulerStats()
        logger.info("engine core ready: %d KV blocks of %d tokens", num_blocks, block_size)

    def _grammar_manager(self, config: EngineConfig) -> StructuredOutputManager:
        # Imported here: grammars need xgrammar and torch; a simulated engine runs none.
        from engine_pod.structured_output.manager import StructuredOutputManager

        return StructuredOutputManager(
            self.tokenizer_path, config.model.arch.vocab_size, load_eos_token_ids(config.model.path)
        )

    def _adapters_in_use(self) -> set[int]:
        return {r.lora.lora_int_id for r in self.scheduler.requests.values() if r.lora is not None}

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def num_cached_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``block_hashes`` this engine's prefix
        cache holds right now; safe from another thread (KVCacheManager)."""
        return self.scheduler.kv_cache_manager.num_cached_prefix_blocks(block_hashes)

    @property
    def prefix_cache_keys(self) -> PrefixCacheKeyLog:
        """The prefix cache's block keys and their changes; thread-safe."""
        return self.scheduler.kv_cache_manager.prefix_cache_keys

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns the progress of every request that moved."""
        if self.executor.max_concurrent_batches > 1:
            return self._step_pipelined()
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self._schedule()
        if self.step_observer is None or scheduler_output.is_empty:
            runner_output = self.executor.execute_model(scheduler_output)
        else:
            start = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output)
            self.step_observer(scheduler_output, time.perf_counter() - start)
        outputs = self._update(scheduler_output, runner_output)
        if scheduler_output.is_empty and not scheduler_output.preempted_req_ids:
            self._wait_while_stalled()
        return outputs

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """One step of an engine whose stages work on different steps at once
        (pipeline parallelism): schedule and submit a step while fewer than
        one per stage are in flight; take the oldest one's output when the
        pipeline is full or nothing more can be scheduled. The requests of a
        step in flight are not scheduled again until its output is taken
        (their next token is not known), so each step holds other requests,
        or the next chunk of a prompt (its tokens are known).

        Returns [] after submitting only: the caller's loop takes in new
        requests and aborts, then calls again. Each step takes at most 1/P of
        the unfinished requests, so the P steps in flight hold even shares: a
        first step holding every request would leave the others nothing to
        overlap with."""
        submitted = False
        stages = self.executor.max_concurrent_batches
        if len(self._in_flight) < stages and self.scheduler.has_unfinished_requests():
            # Each step takes at most its share of the requests: one step holding them all would
            # leave the next with nothing, and the stages would take turns again.
            scheduler_output = self._schedule(max_seqs=-(-len(self.scheduler.requests) // stages))
            if not scheduler_output.is_empty or scheduler_output.finished_req_ids \
                    or scheduler_output.preempted_req_ids:
                # An empty step still tells the runners which requests ended.
                self.executor.submit_model(scheduler_output)
                self._in_flight.append(scheduler_output)
                submitted = not scheduler_output.is_empty
        if self._in_flight and (not submitted or len(self._in_flight) >= stages):
            scheduler_output = self._in_flight.popleft()
            return self._update(scheduler_output, self.executor.take_model_output())
        self._record_stats(steps_done=0)
        if not self._in_flight:
            self._wait_while_stalled()
        return []

    def _schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule(max_seqs)
        if scheduler_output.lora_loads:
            assert self.lora_loader is not None
            scheduler_output.lora_weights = {
                slot: self.lora_loader.get(lora_id) for slot, lora_id in scheduler_output.lora_loads.items()
            }
        return scheduler_output

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._record_stats()
        return outputs

    def _record_stats(self, steps_done: int = 1) -> None:
        # Every step() call publishes the stats since the last one (the pod's metrics add them up).
        self.last_stats = self.scheduler.make_stats()
        self.last_stats.steps_done = steps_done
        self.last_stats.steps_in_flight = len(self._in_flight)
        self.totals.add(self.last_stats)

    def _wait_while_stalled(self) -> None:
        """Nothing could be scheduled and nothing is in flight: wait a little
        for a grammar compile or an adapter read; anything else is a bug."""
        if self.scheduler.waiting_for_fsm:
            # Only requests with grammars still compiling: wait a little for one.
            self.structured_output.wait_for_compiles(_IDLE_WAIT_S)
        elif self.scheduler.waiting_for_lora:
            # Only requests whose adapters are being read: the same.
            self.lora_loader.wait(_IDLE_WAIT_S)
        elif self.scheduler.has_unfinished_requests():
            # Start-up checks guarantee one request always fits, so a step that
            # neither ran nor preempted anything would repeat forever.
            raise RuntimeError("engine step scheduled nothing while requests are pending")

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.structured_output is not None:
            self.structured_output.shutdown()
        if self.lora_loader is not None:
            self.lora_loader.shutdown()
        if self.kv_store is not None:
            self.kv_store.close()
