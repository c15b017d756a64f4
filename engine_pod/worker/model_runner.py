"""The model runner: one flattened forward per step, then sampling.

It keeps each request's tokens and block table between steps, so the
scheduler sends only what changed; it flattens every scheduled token of the
step into one batch (no padding), builds positions, slot mapping and block
tables, runs the model, and samples for the requests whose scheduled tokens
reach the end of what they have.

Under tensor parallelism every rank runs one of these on the same scheduler
output: the same batch, its own shard of the model and of the KV heads.
Rank 0 samples from the gathered logits and broadcasts the sampled ids, so
every rank's request states (the tokens of the next step) stay identical.

With speculative decoding a request's scheduled tokens end with its drafts;
logits are computed at the last verified token and at every draft, the
rejection sampler keeps the accepted prefix, and rank 0 proposes the next
drafts from the updated context. The broadcast is then a [B, k + 1] table of
emitted tokens padded with -1, since requests keep different numbers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_pod.attention.backend import AttentionMetadata, get_attention_backend
from engine_pod.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine_pod.distributed.parallel_state import TensorParallelGroup, single_rank_group
from engine_pod.core.scheduler_output import (
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from engine_pod.model.loader import build_model
from engine_pod.sample.metadata import SamplingMetadata
from engine_pod.sample.sampler import Sampler, SamplerOutput
from engine_pod.spec_decode.fallback import can_speculate
from engine_pod.spec_decode.metadata import SpecDecodeMetadata
from engine_pod.spec_decode.ngram_proposer import NgramProposer
from engine_pod.spec_decode.rejection_sampler import PAD, RejectionSampler
from engine_pod.worker.cpu_malloc import keep_freed_memory_in_heap
from engine_pod.worker.kv_cache import allocate_kv_caches, bytes_per_block
from engine_pod.worker.kv_connector_worker import KVConnectorWorker
from engine_pod.worker.request_state import CachedRequestState
from kv_store.tiered_store import TieredKVStore

logger = logging.getLogger(__name__)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    # Set by _prepare_inputs for a real step: rows to compute logits for, and
    # the requests that sample this step, in logits row order.
    logits_indices: torch.Tensor | None = None
    sampling_states: list[CachedRequestState] = field(default_factory=list)
    # Set when a sampling request carries drafts this step.
    spec: SpecDecodeMetadata | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, group: TensorParallelGroup | None = None) -> None:
        self.config = config
        self.group = group or single_rank_group(config.device)
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
            self.group,
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

    # -- KV cache ---------------------------------------------------------
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.arch, self.block_size, self.dtype, self.group.world_size)

    def weight_bytes(self) -> int:
        """Bytes of the parameters this rank holds."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def resident_memory(self) -> dict[str, int]:
        """This process's resident and peak resident bytes (Linux), for the
        per-rank memory benchmark."""
        fields = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}
        out = {}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in fields:
                        out[fields[key]] = int(value.split()[0]) * 1024
        except OSError:
            pass
        return out

    def determine_num_blocks(self) -> int:
        """An explicit byte budget wins on any device; otherwise CUDA profiles
        and the CPU takes its default budget."""
        budget = self.config.cache.kv_cache_memory_bytes
        if budget is None:
            budget = self._profile_cuda_budget() if self.device.type == "cuda" else DEFAULT_CPU_KV_CACHE_BYTES
        return int(budget // self.bytes_per_block())

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> int:
        """Run the largest step the scheduler can produce and give the KV cache
        what remains of the allowed fraction of device memory."""
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        lens = [min(sched.max_model_len, num_tokens - i) for i in range(0, num_tokens, sched.max_model_len)]
        num_blocks = sum(-(-n // self.block_size) for n in lens)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        caches = list(allocate_kv_caches(
            self.arch, num_blocks, self.block_size, self.dtype, self.device, self.group.world_size
        ))
        block_ids, next_block = [], 0
        for n in lens:
            nb = -(-n // self.block_size)
            block_ids.append(list(range(next_block, next_block + nb)))
            next_block += nb
        batch = self._build_batch([[0] * n for n in lens], [0] * len(lens), block_ids)
        hidden = self.model(batch.input_ids, batch.positions, caches, batch.metadata)
        self.model.compute_logits(hidden[-min(sched.max_num_seqs, len(hidden)) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - sum(c.numel() * c.element_size() for c in caches)
        del caches, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = total * self.config.cache.gpu_memory_utilization - peak
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={self.config.cache.gpu_memory_utilization} leaves no memory for the "
                f"KV cache (weights and activations peak at {peak / 2**30:.2f} GiB)"
            )
        logger.info("KV cache budget %.2f GiB after a %.2f GiB profiling peak", budget / 2**30, peak / 2**30)
        return int(budget)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = allocate_kv_caches(
            self.arch, num_blocks, self.block_size, self.dtype, self.device, self.group.world_size
        )
        self.kv_caches = list(self.kv_cache.unbind(0))

    def attach_kv_store(self, store: TieredKVStore) -> None:
        self.kv_connector = KVConnectorWorker(store, self.kv_cache)

    # -- one step ---------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        connector_meta = so.kv_connector if self.kv_connector is not None else None
        if connector_meta:
            self.kv_connector.before_forward(connector_meta)
        if so.is_empty:
            return ModelRunnerOutput({})
        batch = self._prepare_inputs(so)
        start = time.perf_counter()
        # Every row samples in a decode-only step: no rows to drop, so no copy.
        rows = None if len(batch.logits_indices) == batch.metadata.num_actual_tokens else batch.logits_indices
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata, rows)
        logits = self.model.compute_logits(hidden) if batch.sampling_states else None
        self.forward_seconds += time.perf_counter() - start
        if connector_meta:
            self.kv_connector.after_forward(connector_meta)
        if not batch.sampling_states:
            return ModelRunnerOutput({})
        if not self.group.is_first:
            return self._follow_first_rank(batch)
        emitted, out = self._sample(logits, batch, self._grammar_bitmask(so, batch))
        if self.group.world_size > 1:
            self.group.broadcast_from_first(emitted.contiguous())
        return self._to_output(batch, emitted.tolist(), out)

    def _follow_first_rank(self, batch: BatchInputs) -> ModelRunnerOutput:
        """A rank other than 0: take the tokens rank 0 emitted; the engine
        reads its results from rank 0 only."""
        width = 1 + (batch.spec.max_num_drafts if batch.spec is not None else 0)
        emitted = torch.empty(len(batch.sampling_states), width, dtype=torch.int64, device=self.device)
        self._append_emitted(batch.sampling_states, self.group.broadcast_from_first(emitted).tolist())
        return ModelRunnerOutput({})

    @staticmethod
    def _append_emitted(states: list[CachedRequestState], emitted: list[list[int]]) -> list[list[int]]:
        """Append each request's emitted tokens (its row without the PAD fill)
        to its state, identically on every rank; returns them."""
        appended = []
        for state, row in zip(states, emitted):
            tokens = [t for t in row if t != PAD]
            for token in tokens:
                state.append_output(token)
            appended.append(tokens)
        return appended

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, generator,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> BatchInputs:
        # Single-token queries first: the backend runs them as one batched decode.
        order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in order]
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in order]
        token_chunks = []
        for state, state_drafts in zip(states, drafts):
            start = state.num_computed_tokens
            end = start + so.num_scheduled_tokens[state.req_id] - len(state_drafts)
            token_chunks.append(state.token_ids[start:end] + state_drafts)
        batch = self._build_batch(
            token_chunks, [s.num_computed_tokens for s in states], [s.block_ids for s in states]
        )
        ends = batch.metadata.seq_lens_cpu
        sampling_rows = [i for i, s in enumerate(states) if ends[i] == s.num_tokens + len(drafts[i])]
        batch.sampling_states = [states[i] for i in sampling_rows]
        last_token = batch.metadata.query_start_loc_cpu[1:] - 1
        indices = last_token[sampling_rows]
        if any(drafts[i] for i in sampling_rows):
            batch.spec = SpecDecodeMetadata([drafts[i] for i in sampling_rows])
            num_drafts = np.array([len(drafts[i]) for i in sampling_rows], dtype=np.int64)
            indices = SpecDecodeMetadata.logits_indices(indices, num_drafts)
        batch.logits_indices = torch.from_numpy(indices).to(self.device)
        return batch

    def _build_batch(
        self, token_chunks: list[list[int]], starts: list[int], block_ids: list[list[int]]
    ) -> BatchInputs:
        """Flatten per-request token chunks into one batch with its metadata."""
        bs = self.block_size
        q_lens = np.fromiter((len(c) for c in token_chunks), dtype=np.int64, count=len(token_chunks))
        starts_np = np.asarray(starts, dtype=np.int64)
        seq_lens = starts_np + q_lens
        query_start_loc = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        req_idx = np.repeat(np.arange(len(q_lens)), q_lens)
        positions = np.arange(num_tokens) - query_start_loc[:-1][req_idx] + starts_np[req_idx]
        table = np.zeros((len(q_lens), max(len(b) for b in block_ids)), dtype=np.int64)
        for i, ids in enumerate(block_ids):
            table[i, : len(ids)] = ids
        slot_mapping = table[req_idx, positions // bs] * bs + positions % bs
        input_ids = np.fromiter((t for c in token_chunks for t in c), dtype=np.int64, count=num_tokens)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        num_decodes = int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else len(q_lens)
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_decodes=num_decodes,
            slot_mapping=dev(slot_mapping),
            query_start_loc=dev(query_start_loc),
            seq_lens=dev(seq_lens),
            block_table=dev(table),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        return BatchInputs(dev(input_ids), dev(positions), metadata)

    # -- sampling ---------------------------------------------------------
    def _sample(
        self, logits: torch.Tensor, batch: BatchInputs, grammar: torch.Tensor | None
    ) -> tuple[torch.Tensor, SamplerOutput | None]:
        """[B, 1 + max drafts] tokens each sampling request emits (PAD-filled),
        and the plain sampler's output for the requests without drafts.
        ``grammar`` holds one bitmask row per logits row (None: no grammar)."""
        states, spec = batch.sampling_states, batch.spec
        if spec is None:
            md = self._sampling_metadata(states)
            md.grammar_bitmask = grammar
            out = self.sampler(logits, md)
            return out.sampled.to(torch.int64).unsqueeze(1), out
        emitted = torch.full((len(states), spec.max_num_drafts + 1), PAD, dtype=torch.int64, device=self.device)
        out = None
        if spec.plain:
            rows = torch.from_numpy(spec.plain_rows()).to(self.device)
            md = self._sampling_metadata([states[i] for i in spec.plain])
            md.grammar_bitmask = grammar[rows] if grammar is not None else None
            out = self.sampler(logits[rows], md)
            emitted[spec.plain, 0] = out.sampled.to(torch.int64)
        verified = spec.speculative
        # One metadata row per logits row: each request's rows share its parameters.
        row_states = [states[i] for i in verified for _ in range(len(spec.draft_token_ids[i]) + 1)]
        rows = torch.from_numpy(spec.speculative_rows()).to(self.device)
        md = self._sampling_metadata(row_states)
        md.grammar_bitmask = grammar[rows] if grammar is not None else None
        tokens = self.rejection_sampler(logits[rows], md, [spec.draft_token_ids[i] for i in verified])
        emitted[verified, : tokens.shape[1]] = tokens
        return emitted, out

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        dev, V = self.device, self.vocab_size

        def tensor(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        temps = [0.0 if p.is_greedy else p.temperature for p in params]
        all_greedy = all(t == 0.0 for t in temps)
        all_random = all(t > 0.0 for t in temps)
        use_top_k = any(0 < p.top_k < V for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        md = SamplingMetadata(
            temperature=tensor(temps),
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=tensor([p.top_k if 0 < p.top_k < V else V for p in params], torch.int64) if use_top_k else None,
            top_p=tensor([p.top_p for p in params]) if use_top_p else None,
            min_p=tensor([p.min_p for p in params]) if use_min_p else None,
            generators=generators,
            presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
            output_token_ids=None, prompt_token_mask=None,
            min_tokens_mask=self._min_tokens_mask(states),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        )
        if any(p.has_penalties for p in params):
            self._add_penalties(md, states)
        return md

    def _grammar_bitmask(self, so: SchedulerOutput, batch: BatchInputs) -> torch.Tensor | None:
        """The scheduler's grammar masks in this batch's logits row order
        (a request with drafts has one row per draft position and one more)."""
        if so.grammar_bitmask is None:
            return None
        states = batch.sampling_states
        num_rows = [1] * len(states) if batch.spec is None else [len(d) + 1 for d in batch.spec.draft_token_ids]
        rows = so.grammar_bitmask.rows_for([s.req_id for s in states], num_rows)
        return None if rows is None else torch.from_numpy(rows).to(self.device)

    def _min_tokens_mask(self, states: list[CachedRequestState]) -> torch.Tensor | None:
        rows = [
            (i, s.sampling_params.all_stop_token_ids)
            for i, s in enumerate(states)
            if len(s.output_token_ids) < s.sampling_params.min_tokens and s.sampling_params.all_stop_token_ids
        ]
        if not rows:
            return None
        mask = torch.zeros(len(states), self.vocab_size, dtype=torch.bool)
        for i, ids in rows:
            mask[i, [t for t in ids if t < self.vocab_size]] = True
        return mask.to(self.device)

    def _add_penalties(self, md: SamplingMetadata, states: list[CachedRequestState]) -> None:
        params = [s.sampling_params for s in states]
        dev, V = self.device, self.vocab_size
        md.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)
        md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)
        md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
        width = max(1, max(len(s.output_token_ids) for s in states))
        out = torch.full((len(states), width), V, dtype=torch.int64)
        for i, s in enumerate(states):
            out[i, : len(s.output_token_ids)] = torch.tensor(s.output_token_ids, dtype=torch.int64)
        md.output_token_ids = out.to(dev)
        for s in states:
            if s.prompt_mask is None:
                s.prompt_mask = torch.zeros(V, dtype=torch.bool, device=dev)
                s.prompt_mask[torch.tensor(s.prompt_token_ids, device=dev)] = True
        md.prompt_token_mask = torch.stack([s.prompt_mask for s in states])

    def _to_output(
        self, batch: BatchInputs, emitted: list[list[int]], out: SamplerOutput | None
    ) -> ModelRunnerOutput:
        states = batch.sampling_states
        appended = self._append_emitted(states, emitted)
        sampled_ids = {state.req_id: tokens for state, tokens in zip(states, appended)}
        logprobs = {}
        if out is not None and out.logprobs is not None:
            # Only requests without drafts ask for logprobs (spec_decode/fallback.py).
            plain = [states[i] for i in batch.spec.plain] if batch.spec is not None else states
            lp_ids, lp_vals, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
            for i, state in enumerate(plain):
                k = state.sampling_params.logprobs
                if k is not None:
                    logprobs[state.req_id] = [Logprobs(lp_ids[i][: k + 1], lp_vals[i][: k + 1], ranks[i])]
        return ModelRunnerOutput(sampled_ids, logprobs, self._propose_drafts(states))

    def _propose_drafts(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """Next step's drafts, from each request's context as it now stands."""
        if self.drafter is None:
            return {}
        drafts = {}
        for state in states:
            if can_speculate(state.sampling_params, len(state.output_token_ids)):
                proposal = self.drafter.propose(state.token_ids)
                if proposal:
                    drafts[state.req_id] = proposal
        return drafts
