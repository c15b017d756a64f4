"""The unified token-budget scheduler (vLLM V1 shape).

There is no prefill phase and decode phase: each request has computed some of
its tokens and the scheduler hands out a per-step token budget, running
requests first (decodes and remaining prefill chunks), then waiting ones.
A prompt longer than the remaining budget is chunked. When the pool cannot
hold a running request's next tokens, the lowest-priority, latest-arrived
running request is preempted by recompute.

Speculative decoding: a decoding request's drafts (Request.spec_token_ids)
are scheduled after its last verified token, as far as the budget and its
length limits allow; after the step num_computed_tokens is rolled back past
the rejected ones, whose KV slots the next step overwrites.
"""

from __future__ import annotations

import itertools

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine_pod.config import SchedulerConfig, SchedulingPolicy
from engine_pod.core.background import BackgroundShare
from engine_pod.core.kv_cache_block import KVCacheBlock
from engine_pod.core.kv_cache_manager import KVCacheManager
from engine_pod.core.kv_connector import KVConnectorScheduler
from engine_pod.core.lora_slots import AdapterSource, LoRASlotTable
from engine_pod.core.output_builder import build_scheduler_output
from engine_pod.core.request_queue import create_request_queue
from engine_pod.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from engine_pod.core.stats import SchedulerStats, SpecDecodeStats
from engine_pod.core.stop_check import append_until_stop
from engine_pod.request import Request, RequestStatus

if TYPE_CHECKING:  # the manager pulls in xgrammar and torch: the scheduler itself needs neither
    from engine_pod.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides each step which requests compute how many tokens, and applies
    the results.

    Owns every unfinished request (``requests``) and where it is: ``running``,
    the ``waiting`` queue (FCFS or priority), ``waiting_for_fsm`` while its
    grammar compiles or ``waiting_for_lora`` while its adapter is read; the
    KVCacheManager and its block pool; the KV connector's scheduler half, if
    any; the LoRA slot table, if the engine serves adapters. Called by EngineCore on the engine
    thread only: add_request / finish_requests between steps, then
    schedule(), the executor's forward, update_from_output() each step.

    Invariants: an unfinished request is in exactly one of running, waiting,
    waiting_for_fsm or waiting_for_lora, and only running requests hold KV
    blocks; the running requests use at most max_loras adapters; a step
    schedules at most max_num_batched_tokens tokens over at most
    max_num_seqs running requests, and never takes a request past
    max_model_len; schedule() advances num_computed_tokens by what it
    scheduled (update_from_output rolls back rejected drafts), so a request
    whose step is in flight (pipeline parallelism) is not scheduled again
    until its output is applied (only a prompt's next chunk is); a finished or
    aborted request is freed at once and its id reaches the runner in the
    next SchedulerOutput.
    """

    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
        connector: KVConnectorScheduler | None = None,
        structured_output: StructuredOutputManager | None = None,
        adapters: AdapterSource | None = None, max_loras: int = 0,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        if connector is not None:
            kv_cache_manager.block_pool.on_evict = connector.on_evict
        self.block_size = kv_cache_manager.block_size
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        # Ended since the last schedule(); the runner is told to drop them.
        self.finished_req_ids: set[str] = set()
        self._num_new_preemptions = 0
        self.structured_output = structured_output
        # Requests whose grammar is compiling, outside the waiting queue.
        self.waiting_for_fsm: list[Request] = []
        # Requests whose grammar or adapter failed to load: reported by the next update.
        self._failed_to_start: list[Request] = []
        self.adapters = adapters
        self.lora_slots = LoRASlotTable(max_loras) if adapters is not None else None
        # Requests whose adapter is being read into host memory, outside the waiting queue.
        self.waiting_for_lora: list[Request] = []
        self.spec_decode_stats = SpecDecodeStats()
        self.background = BackgroundShare(config)

    # -- requests in and out ----------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if self.kv_cache_manager.enable_caching:
            request.enable_block_hashing(self.block_size)
        if request.lora is not None and self.adapters is None:
            raise ValueError("lora_request: this engine was started without enable_lora")
        self.requests[request.request_id] = request
        if request.lora is not None and self.adapters is not None and not self.adapters.is_ready(request.lora):
            request.status = RequestStatus.WAITING_FOR_LORA
            self.waiting_for_lora.append(request)
            return
        if request.use_structured_output:
            if self.structured_output is None:
                raise ValueError("structured_outputs: this engine has no structured output manager")
            request.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_fsm.append(request)
            self.structured_output.add_request(request)
            return
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (aborts); unknown ids are ignored."""
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_FSM:
                self.waiting_for_fsm.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_LORA:
                self.waiting_for_lora.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if request.use_structured_output:
            self._grammars.free_request(request.request_id)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    @property
    def num_waiting(self) -> int:
        """Requests not yet running, those whose grammar compiles or adapter loads included."""
        return len(self.waiting) + len(self.waiting_for_fsm) + len(self.waiting_for_lora)

    def _unfinished(self) -> Iterable[Request]:
        return itertools.chain(self.running, self.waiting, self.waiting_for_fsm, self.waiting_for_lora)

    def num_waiting_foreground(self) -> int:
        """Waiting requests a new interactive one would queue behind: background
        ones yield to it, so they are left out (all of them count without a
        background class)."""
        queued = itertools.chain(self.waiting, self.waiting_for_fsm, self.waiting_for_lora)
        return self.num_waiting - self.background.count(queued)

    def kv_cache_usage_foreground(self) -> float:
        """The KV pool's usage as an interactive request sees it: blocks only
        background requests hold count as free, since it would preempt them
        for the room (the pool's own usage without a background class)."""
        pool = self.kv_cache_manager.block_pool
        if self.background.threshold is None:
            return pool.get_usage()
        reclaimable = sum(
            b.ref_cnt == 1
            for r in self.running if self.background.is_background(r)
            for b in self.kv_cache_manager.req_to_blocks.get(r.request_id, ())
        )
        return 1.0 - (pool.get_num_free_blocks() + reclaimable) / pool.num_blocks

    def num_pending_prefill_tokens(self) -> int:
        """Tokens the pod must still compute before its requests decode: the
        uncomputed tokens of each request (prompt, and after a preemption its
        output too) beyond the one a decoding request computes per step.
        Prefix-cache hits of waiting requests are not known before they are
        scheduled, so they count in full. Background requests' are left out:
        they wait for the rest. The gateway weighs this backlog against a
        prompt's cached prefix."""
        def pending(r: Request) -> int:
            return max(0, r.num_tokens - 1 - r.num_computed_tokens)
        return sum(pending(r) for r in self._unfinished() if not self.background.is_background(r))

    @property
    def _grammars(self) -> StructuredOutputManager:
        """The structured output manager, for a request that has a grammar
        (add_request admits one only when the engine has a manager)."""
        if self.structured_output is None:
            raise RuntimeError("a request with structured outputs in an engine without a manager")
        return self.structured_output

    def _admit_loaded_adapters(self) -> None:
        """Move requests whose adapter is in host memory on to their grammar
        or into the waiting queue; fail those whose adapter cannot be read."""
        still_loading = []
        for request in self.waiting_for_lora:
            assert request.lora is not None and self.adapters is not None
            try:
                ready = self.adapters.is_ready(request.lora)
            except ValueError as e:
                logger.error("request %s: %s", request.request_id, e)
                request.status = RequestStatus.FINISHED_ABORTED
                self._free_request(request)
                self._failed_to_start.append(request)
                continue
            if not ready:
                still_loading.append(request)
            elif request.use_structured_output:
                request.status = RequestStatus.WAITING_FOR_FSM
                self.waiting_for_fsm.append(request)
                self._grammars.add_request(request)
            else:
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
        self.waiting_for_lora = still_loading

    def _admit_compiled_grammars(self) -> None:
        """Move requests whose grammar is ready into the waiting queue."""
        still_compiling = []
        for request in self.waiting_for_fsm:
            try:
                ready = self._grammars.is_ready(request)
            except Exception:  # noqa: BLE001 - one bad grammar must not take the engine down
                logger.exception("request %s: grammar compilation failed", request.request_id)
                request.status = RequestStatus.FINISHED_ABORTED
                self._free_request(request)
                self._failed_to_start.append(request)
                continue
            if ready:
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
            else:
                still_compiling.append(request)
        self.waiting_for_fsm = still_compiling

    # -- scheduling -------------------------------------------------------
    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """The next step. ``max_seqs``: at most this many requests in it (the
        engine's share per step when steps overlap, so the stages' steps hold
        even shares of the requests; None: max_num_seqs alone bounds it)."""
        step_seqs = max_seqs if max_seqs is not None else self.config.max_num_seqs
        if self.waiting_for_lora:
            self._admit_loaded_adapters()
        if self.waiting_for_fsm:
            self._admit_compiled_grammars()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        scheduled_drafts: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []
        self.background.start_step(self.running, self.waiting.peek() if len(self.waiting) else None)

        idx = 0
        while idx < len(self.running) and budget > 0 and len(num_scheduled) < step_seqs:
            request = self.running[idx]
            limit = self.background.limit(request, budget)
            num_new = self._num_tokens_to_schedule(request, request.num_computed_tokens, limit)
            if num_new <= 0:
                idx += 1
                continue
            num_drafts = self._num_drafts_to_schedule(request, num_new, limit)
            while True:
                blocks = self.kv_cache_manager.allocate_slots(request, num_new + num_drafts)
                if blocks is not None:
                    break
                if num_drafts:
                    # Drafts are optional: drop them before preempting anyone.
                    num_drafts = 0
                    continue
                victim = self._pick_victim()
                if victim in scheduled_running:
                    # Preempting a request already given tokens this step hands
                    # its budget back.
                    scheduled_running.remove(victim)
                    handed_back = num_scheduled.pop(victim.request_id)
                    budget += handed_back
                    self.background.took(victim, -handed_back)
                    new_blocks.pop(victim.request_id, None)
                    scheduled_drafts.pop(victim.request_id, None)
                if self.running.index(victim) < idx:
                    idx -= 1  # removing it shifts the current request left
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                # The request preempted itself (under the priority policy it
                # need not be last); idx already names the next one.
                continue
            scheduled_running.append(request)
            if num_drafts:
                scheduled_drafts[request.request_id] = request.spec_token_ids[:num_drafts]
                num_new += num_drafts
            self._on_scheduled(request, request.num_computed_tokens, num_new)
            num_scheduled[request.request_id] = num_new
            new_blocks[request.request_id] = [b.block_id for b in blocks]
            budget -= num_new
            self.background.took(request, num_new)
            idx += 1

        scheduled_new: list[Request] = []
        # After a preemption the pool is under pressure: admitting waiting
        # requests would only cause more preemptions.
        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, scheduled_new, scheduled_running, preempted,
                                            step_seqs)

        output = build_scheduler_output(
            self.kv_cache_manager, scheduled_new, scheduled_running, num_scheduled, new_blocks, preempted,
            self.finished_req_ids, self.connector.take_metadata() if self.connector is not None else None,
        )
        output.scheduled_spec_decode_tokens = scheduled_drafts
        if self.lora_slots is not None:
            output.lora_slots, output.lora_loads = self.lora_slots.assign(
                self.requests[req_id] for req_id in num_scheduled
            )
        if self.structured_output is not None and self.structured_output.has_matchers:
            output.grammar_bitmask = self.structured_output.grammar_bitmask(
                self._sampling_req_ids(num_scheduled, scheduled_drafts), scheduled_drafts
            )
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
            self.requests[req_id].num_steps_in_flight += 1
        self.finished_req_ids = set()
        return output

    def _sampling_req_ids(self, num_scheduled: dict[str, int], drafts: dict[str, list[int]]) -> list[str]:
        """Requests whose scheduled tokens (past their drafts) reach their
        end: they sample this step."""
        return [
            req_id for req_id, n in num_scheduled.items()
            if self.requests[req_id].num_computed_tokens + n - len(drafts.get(req_id, ()))
            == self.requests[req_id].num_tokens
        ]

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_new > threshold:
            num_new = threshold
        return min(num_new, budget, self.config.max_model_len - num_computed)

    def _num_drafts_to_schedule(self, request: Request, num_new: int, budget: int) -> int:
        """How many of the request's drafts ride along with its ``num_new``
        verified tokens: none unless those reach its last token; never more
        than the budget left, nor more than could be kept (a step emits at
        most drafts + 1 tokens, within max_tokens and max_model_len)."""
        drafts = request.spec_token_ids
        if not drafts or request.num_computed_tokens + num_new < request.num_tokens:
            return 0
        limits = [len(drafts), budget - num_new, self.config.max_model_len - request.num_tokens - 1]
        if request.max_tokens is not None:
            limits.append(request.max_tokens - request.num_output_tokens - 1)
        num_drafts = max(0, min(limits))
        if num_drafts and request.use_structured_output:
            # Drafts the grammar refuses would be rejected anyway; cut them so
            # the runner's masks after each draft prefix stay well defined.
            num_drafts = self._grammars.validate_tokens(request.request_id, drafts[:num_drafts])
        return num_drafts

    def _schedule_waiting(
        self, budget: int, num_scheduled: dict[str, int], scheduled_new: list[Request],
        scheduled_running: list[Request], preempted: list[Request], step_seqs: int,
    ) -> int:
        # Requests passed over because their adapter would need one slot too
        # many, or a step of theirs is still in flight; they keep their place in the queue.
        skipped: list[Request] = []
        while len(self.waiting) and budget > 0 and len(num_scheduled) < step_seqs:
            request = self.waiting.peek()
            if len(self.running) >= self.config.max_num_seqs and not self._preempt_background_for(
                    request, scheduled_running, preempted):
                break
            if self.lora_slots is not None and not self.lora_slots.fits(request, self.running):
                skipped.append(self.waiting.pop())
                continue
            if request.num_steps_in_flight:
                # Preempted while a step of it is still in flight: resumed once that step's
                # tokens are in, or it would compute (and sample) their positions twice.
                skipped.append(self.waiting.pop())
                continue
            hits: list[KVCacheBlock] = []
            num_hit_tokens = 0
            loaded: list[memoryview] = []  # payloads of blocks read from the KV store
            if request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None:
                # A request that asks for its prompt's logprobs computes every prompt token.
                hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                if self.connector is not None:
                    loaded = self.connector.match(request, num_hit_tokens)
            num_computed = num_hit_tokens + len(loaded) * self.block_size
            num_new = self._num_tokens_to_schedule(request, num_computed, self.background.limit(request, budget))
            if num_new <= 0:
                break
            blocks = self.kv_cache_manager.allocate_slots(request, num_new, hits, num_computed)
            while blocks is None and self._preempt_background_for(request, scheduled_running, preempted):
                blocks = self.kv_cache_manager.allocate_slots(request, num_new, hits, num_computed)
            if blocks is None:
                break
            if request.num_computed_tokens == 0:
                # Counted on admission only, so a request that waits several
                # steps is one query, not one per attempt.
                self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            if loaded and self.connector is not None:
                self.connector.on_allocated(blocks, loaded)
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                request.first_scheduled_time = time.time()
            request.num_computed_tokens = num_computed
            self._on_scheduled(request, num_computed, num_new)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled_new.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            self.background.took(request, num_new)
        for request in reversed(skipped):
            self.waiting.prepend(request)
        return budget

    def _on_scheduled(self, request: Request, num_computed: int, num_new: int) -> None:
        if self.connector is not None:
            blocks = self.kv_cache_manager.req_to_blocks[request.request_id]
            self.connector.on_scheduled(request, blocks, num_computed, num_new)

    def _preempt_background_for(self, request: Request, scheduled_running: list[Request],
                                preempted: list[Request]) -> bool:
        """Make room for a waiting foreground request by preempting one
        background request not scheduled this step; False if there is none
        (or `request` is background itself)."""
        if self.background.is_background(request):
            return False
        victim = self.background.victim(self.running, scheduled_running)
        if victim is None:
            return False
        self._preempt(victim)
        preempted.append(victim)
        return True

    def _pick_victim(self) -> Request:
        if self.config.policy == SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return max(self.running, key=lambda r: r.arrival_time)

    def _preempt(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.on_preempted(request)
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_new_preemptions += 1
        self.waiting.prepend(request)

    # -- results ----------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = [EngineCoreOutput(r.request_id, [], finish_reason="abort") for r in self._failed_to_start]
        self._failed_to_start = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is not None:
                request.num_steps_in_flight -= 1
            scored = runner_output.prompt_logprobs.get(req_id)
            if scored is not None and request is not None:
                request.add_prompt_logprobs(*scored)
            sampled = runner_output.sampled_token_ids.get(req_id)
            if request is None or request.is_finished or not sampled:
                continue  # aborted meanwhile, or a prefill chunk short of the end
            if request.status == RequestStatus.RUNNING:
                self._roll_back_rejected(request, scheduler_output.scheduled_spec_decode_tokens.get(req_id), sampled)
                request.spec_token_ids = runner_output.draft_token_ids.get(req_id, [])
            # Otherwise a later step preempted it while this one was in flight (pipeline
            # parallelism): its tokens were sampled from its whole context, so they stand
            # (the sampling rank holds them too); it recomputes from scratch when resumed.
            sampled, status, stop_reason = append_until_stop(
                request, sampled, self.config.max_model_len, self.structured_output
            )
            cached = max(request.num_cached_tokens, 0)
            out = EngineCoreOutput(
                req_id, sampled, runner_output.logprobs.get(req_id),
                num_cached_tokens=cached, first_scheduled_time=request.first_scheduled_time,
                prompt_logprobs=request.take_prompt_logprobs(),
            )
            if status is not None:
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                request.status = status
                request.stop_reason = stop_reason
                self._free_request(request)
                out.finish_reason = status.finish_reason
                out.stop_reason = stop_reason
            outputs.append(out)
        return outputs

    def _roll_back_rejected(self, request: Request, drafts: list[int] | None, sampled: list[int]) -> None:
        """Un-compute the rejected drafts: all but the last emitted token are
        accepted drafts. Their KV slots hold garbage the next step overwrites;
        allocate_slots never caches past request.num_tokens, so no block
        holding them was hashed."""
        if not drafts:
            return
        num_accepted = len(sampled) - 1
        request.num_computed_tokens -= len(drafts) - num_accepted
        self.spec_decode_stats.observe(len(drafts), num_accepted)

    # -- stats ------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        pool = kv.block_pool
        prefix = kv.prefix_cache_stats.reset()
        waste = sum(kv.num_allocated_slots(r.request_id) - r.num_computed_tokens for r in self.running)
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=self.num_waiting,
            num_background_running=self.background.count(self.running),
            num_background_waiting=self.background.count(
                itertools.chain(self.waiting, self.waiting_for_fsm, self.waiting_for_lora)),
            num_kv_blocks_used=pool.num_blocks - pool.get_num_free_blocks(),
            num_kv_blocks_free=pool.get_num_free_blocks(),
            kv_cache_usage=pool.get_usage(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_new_preemptions,
            kv_waste_slots=waste,
            external_prefix_hits=self.connector.take_external_hit_tokens() if self.connector is not None else 0,
            spec_decode=self.spec_decode_stats.take(),
        )
        self._num_new_preemptions = 0
        return stats
