"""The model runner: one flattened forward per step, then sampling.

It keeps each request's tokens and block table between steps, so the
scheduler sends only what changed; it flattens every scheduled token of the
step into one batch (no padding; input_batch.py), runs the model, and
samples for the requests whose scheduled tokens reach the end of what they
have (sampling_metadata.py builds their inputs, runner_output.py their
results).

Under tensor parallelism every rank runs one of these on the same scheduler
output: the same batch, its own shard of the model and of the KV heads.
Rank 0 samples from the gathered logits; the other ranks go on at once and
learn the sampled tokens from the next SchedulerOutput that schedules their
request (CachedRequestData.new_token_ids), so no rank waits for another's
sampling.

With speculative decoding a request's scheduled tokens end with its drafts;
logits are computed at the last verified token and at every draft, the
rejection sampler keeps the accepted prefix, and rank 0 proposes the next
drafts from the updated context. The broadcast is then a [B, k + 1] table of
emitted tokens padded with -1, since requests keep different numbers.

Under pipeline parallelism every rank still gets the same scheduler output
and builds the same batch; a stage after the first receives the previous
stage's hidden states and residual stream ([tokens, hidden] each, model
dtype) instead of embedding, a stage before the last sends its own on, and
only the last stage computes logits, and its TP rank 0 samples. Since no
stage waits for the sampled tokens, a stage takes the engine's next step as
soon as it has passed this one on: the engine keeps up to one step per stage
in flight (engine_core.py), and the stages work on different steps at once.
"""

from __future__ import annotations

import time

import torch

from engine_pod.attention.selector import get_attention_backend
from engine_pod.config import EngineConfig
from engine_pod.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine_pod.distributed.parallel_state import PipelineGroup, TensorParallelGroup, single_rank_group, single_stage
from engine_pod.lora.layers import ModelLoRA, attach_lora
from engine_pod.model.loader import build_model
from engine_pod.model.parallel_layers import kv_head_range
from engine_pod.sample.sampler import Sampler, SamplerOutput
from engine_pod.spec_decode.ngram_proposer import NgramProposer
from engine_pod.spec_decode.rejection_sampler import PAD, RejectionSampler
from engine_pod.worker import kv_budget
from engine_pod.worker.cpu_malloc import collapse_heap_to_huge_pages, keep_freed_memory_in_heap
from engine_pod.worker.input_batch import BatchInputs, prepare_inputs
from engine_pod.worker.kv_cache import allocate_kv_caches, bytes_per_block
from engine_pod.worker.kv_connector_worker import KVConnectorWorker
from engine_pod.worker.request_state import CachedRequestState, update_request_states
from engine_pod.worker.runner_output import make_runner_output, score_prompt_rows
from engine_pod.worker.sampling_metadata import build_sampling_metadata, grammar_bitmask_rows
from engine_pod.worker.stage_timing import StageTiming
from kv_store.codec import BlockLayout

# Weights from this size on are moved onto 2 MiB pages once loaded (cpu_malloc.collapse_heap_to_huge_pages):
# the bench model's 165 MB ran 3% faster that way; below it the copy (about 3 ms a MiB) is not worth it.
HUGE_PAGE_WEIGHT_BYTES = 64 << 20


class ModelRunner:
    """One rank's model, KV cache and per-request state; the one entry point
    of the worker side.

    Owns the model shard, the attention backend, the KV cache tensor (and
    its per-layer views), the KV connector's worker half, the sampler and
    rejection sampler, the n-gram drafter, and ``requests``: each request's
    tokens, block table and generator between steps. Called by the executor
    (executor/uniproc.py in process, worker/worker_process.py per rank under
    TP), method by name: determine_num_blocks, initialize_kv_cache,
    attach_kv_store, execute_model, weight_bytes, resident_memory.

    Invariants: at the start of each execute_model ``requests`` holds, on
    every rank, what the scheduler knew when it built that step (new requests
    added, finished ones dropped, every token up to the scheduled ones); the
    sampling rank appends what it samples at once, the others when the
    scheduler sends it (RequestState.take_new_tokens); only the sampling rank's output
    carries results (rank 0; under PP the last stage's TP rank 0); the KV
    cache (of this stage's layers) exists before the first execute_model.
    """

    def __init__(
        self, config: EngineConfig, group: TensorParallelGroup | None = None, pp: PipelineGroup | None = None
    ) -> None:
        self.config = config
        self.group = group or single_rank_group(config.device)
        # This rank's pipeline stage (the only one at PP=1).
        self.pp = pp or single_stage(self.group)
        self.device = self.group.device
        self.dtype = config.model.dtype
        self.arch = config.model.arch
        self.block_size = config.cache.block_size
        self.vocab_size = self.arch.vocab_size
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        self.backend = get_attention_backend(config.attention_backend, self.device, self.arch.head_dim, self.dtype)
        self.model = build_model(
            self.arch, config.model.path, config.model.max_model_len, self.dtype, self.device, self.backend,
            self.group, self.pp,
        )
        # The decoder layers (and so the KV cache layers) of this rank's stage.
        self.num_layers = len(self.model.model.stage_layers)
        self.lora: ModelLoRA | None = None
        if config.lora is not None:
            self.lora = attach_lora(
                self.model, config.lora, self.dtype, self.device, use_triton=self.backend.name == "triton"
            )
        self.sampler = Sampler()
        spec_config = config.speculative
        self.drafter = NgramProposer(spec_config) if spec_config is not None else None
        self.rejection_sampler = RejectionSampler() if spec_config is not None else None
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_cache: torch.Tensor | None = None  # [layers, 2, blocks, block_size, Hkv, D]
        self.kv_caches: list[torch.Tensor] = []  # per-layer views of kv_cache
        self.kv_connector: KVConnectorWorker | None = None
        # Seconds spent in the forward and logits (for the efficiency figure).
        self.forward_seconds = 0.0
        # Pipeline-stage figures (stage_timing.py): steps, their wall time, and the waits within.
        self.stage_steps = 0
        self.stage_step_seconds = 0.0
        self.stage_wait_seconds = 0.0

    # -- KV cache (kv_budget.py) ------------------------------------------
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.arch, self.block_size, self.dtype, self.group.world_size, self.num_layers)

    def weight_bytes(self) -> int:
        return kv_budget.weight_bytes(self.model)

    def resident_memory(self) -> dict[str, int]:
        return kv_budget.resident_memory()

    def determine_num_blocks(self) -> int:
        return kv_budget.determine_num_blocks(self.config, self.model, self.device, self.group.world_size)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = allocate_kv_caches(
            self.arch, num_blocks, self.block_size, self.dtype, self.device, self.group.world_size, self.num_layers
        )
        self.kv_caches = list(self.kv_cache.unbind(0))
        if self.device.type == "cpu" and self.weight_bytes() >= HUGE_PAGE_WEIGHT_BYTES:
            # The weights are packed and in the heap by now; every step streams them.
            collapse_heap_to_huge_pages()

    def attach_kv_store(self, layout: BlockLayout) -> None:
        """Move blocks of the store's ``layout`` (whole blocks) in and out of
        this rank's cache around each step; the store itself stays with the
        executor (the engine core's process)."""
        heads = kv_head_range(self.arch.num_key_value_heads, self.group.world_size, self.group.rank)
        self.kv_connector = KVConnectorWorker(layout, self.kv_cache, heads, self.model.model.stage_layers)

    # -- one step ---------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        update_request_states(self.requests, so, self.device)
        connector_meta = so.kv_connector if self.kv_connector is not None else None
        if connector_meta:
            self.kv_connector.before_forward(connector_meta)
        if self.lora is not None:
            for slot, weights in so.lora_weights.items():
                self.lora.install(slot, weights)
        out = self._forward_and_sample(so)
        if connector_meta:
            # Sampling wrote no KV: the saved blocks read now are the forward's.
            out.kv_connector_output = self.kv_connector.after_forward(connector_meta)
        return out

    def stage_timing(self) -> StageTiming:
        """This rank's pipeline-stage figures so far (collective_rpc reads every rank's)."""
        return StageTiming(self.pp.stage, self.group.rank, self.stage_steps, self.stage_step_seconds,
                           self.stage_wait_seconds)

    def _forward_and_sample(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.is_empty:
            return ModelRunnerOutput({})
        entered = time.perf_counter()
        try:
            return self._run_step(so)
        finally:
            self.stage_steps += 1
            self.stage_step_seconds += time.perf_counter() - entered

    def _run_step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        batch = prepare_inputs(so, self.requests, self.block_size, self.device)
        start = time.perf_counter()
        rows = self._output_rows(batch)
        if self.lora is not None:
            self.lora.set_mapping(batch.token_lora_slots, None if rows is None else batch.output_rows_cpu)
        pp = self.pp
        intermediate = None
        if not pp.is_first_stage:
            shape = (batch.metadata.num_actual_tokens, self.arch.hidden_size)
            waited = time.perf_counter()
            intermediate = tuple(pp.recv_from_previous_stage(2, shape, self.dtype))
            self.stage_wait_seconds += time.perf_counter() - waited
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata, rows, intermediate)
        if not pp.is_last_stage:
            # A send returns once the next stage takes it, which may be after its previous step:
            # waiting, not computing.
            sent = time.perf_counter()
            pp.send_to_next_stage(list(hidden))
            self.stage_wait_seconds += time.perf_counter() - sent
            hidden = None
        wants_logits = bool(batch.sampling_states or batch.prompt_logprobs)
        logits = self.model.compute_logits(hidden) if wants_logits and pp.is_last_stage else None
        self.forward_seconds += time.perf_counter() - start
        if not wants_logits or not pp.is_sampler:
            return ModelRunnerOutput({})
        prompt_logprobs = {}
        if batch.prompt_logprobs:
            # Scored before sampling, which may scale the sampling rows' logits in place.
            num_sampling = len(batch.logits_indices_cpu)
            prompt_logprobs = score_prompt_rows(logits[num_sampling:], batch.prompt_logprobs)
            logits = logits[:num_sampling]
        if not batch.sampling_states:
            return ModelRunnerOutput({}, prompt_logprobs=prompt_logprobs)
        emitted, out = self._sample(logits, batch, grammar_bitmask_rows(so, batch, self.device))
        result = make_runner_output(batch, emitted.tolist(), out, self.drafter)
        result.prompt_logprobs = prompt_logprobs
        return result

    def _output_rows(self, batch: BatchInputs) -> torch.Tensor | None:
        """The rows the last layer computes (None: all of them, as in a decode-only step, where
        every row samples and there is nothing to drop, so no copy)."""
        if batch.prompt_logprobs:
            return torch.from_numpy(batch.output_rows_cpu).to(self.device)
        return None if len(batch.logits_indices) == batch.metadata.num_actual_tokens else batch.logits_indices

    def _sample(
        self, logits: torch.Tensor, batch: BatchInputs, grammar: torch.Tensor | None
    ) -> tuple[torch.Tensor, SamplerOutput | None]:
        """[B, 1 + max drafts] tokens each sampling request emits (PAD-filled),
        and the plain sampler's output for the requests without drafts.
        ``grammar`` holds one bitmask row per logits row (None: no grammar)."""
        states, spec = batch.sampling_states, batch.spec
        if spec is None:
            md = build_sampling_metadata(states, self.device, self.vocab_size)
            md.grammar_bitmask = grammar
            out = self.sampler(logits, md)
            return out.sampled.to(torch.int64).unsqueeze(1), out
        emitted = torch.full((len(states), spec.max_num_drafts + 1), PAD, dtype=torch.int64, device=self.device)
        out = None
        if spec.plain:
            rows = torch.from_numpy(spec.plain_rows()).to(self.device)
            md = build_sampling_metadata([states[i] for i in spec.plain], self.device, self.vocab_size)
            md.grammar_bitmask = grammar[rows] if grammar is not None else None
            out = self.sampler(logits[rows], md)
            emitted[spec.plain, 0] = out.sampled.to(torch.int64)
        verified = spec.speculative
        # One metadata row per logits row: each request's rows share its parameters.
        row_states = [states[i] for i in verified for _ in range(len(spec.draft_token_ids[i]) + 1)]
        rows = torch.from_numpy(spec.speculative_rows()).to(self.device)
        md = build_sampling_metadata(row_states, self.device, self.vocab_size)
        md.grammar_bitmask = grammar[rows] if grammar is not None else None
        tokens = self.rejection_sampler(logits[rows], md, [spec.draft_token_ids[i] for i in verified])
        emitted[verified, : tokens.shape[1]] = tokens
        return emitted, out
