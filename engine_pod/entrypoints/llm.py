"""The offline API: ``LLM(model=PATH).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from engine_pod.config import SchedulingPolicy, create_engine_config
from engine_pod.engine.engine_core import EngineCore
from engine_pod.lora_request import AdapterSpec, LoRARequest
from engine_pod.core.stats import EngineTotals
from engine_pod.output_processor import OutputProcessor
from engine_pod.outputs import RequestOutput
from engine_pod.processor import ProcessedPrompt, Processor, PromptType
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from tessera.text import load_eos_token_ids, load_tokenizer


class LLM:
    """An engine in this process, vLLM-compatible names and semantics.

    Keyword arguments are those of ``create_engine_config`` (block_size,
    max_num_batched_tokens, max_num_seqs, num_gpu_blocks,
    kv_cache_memory_bytes, enable_prefix_caching, scheduling_policy, dtype,
    max_model_len, device, speculative_config, ...).
    """

    def __init__(self, model: str, *, tokenizer: str | None = None, tensor_parallel_size: int = 1, **engine_kwargs):
        self.config = create_engine_config(model, tensor_parallel_size=tensor_parallel_size, **engine_kwargs)
        checkpoint = self.config.model.path  # a GGUF file's converted folder
        self.tokenizer = load_tokenizer(tokenizer or checkpoint)
        eos_ids = load_eos_token_ids(checkpoint, self.tokenizer)
        self.processor = Processor(self.config, self.tokenizer, eos_ids)
        self.engine_core = EngineCore(self.config, tokenizer_path=str(tokenizer or checkpoint))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine (and its worker processes under tensor parallelism);
        also done at interpreter exit."""
        self.engine_core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def stats(self) -> EngineTotals:
        return self.engine_core.totals

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.
        ``lora_request``: the adapter every prompt runs on, or one per prompt
        (None: the base model); needs an engine built with enable_lora."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._per_prompt(sampling_params, len(prompts))
        priorities = self._priorities(priority, len(prompts))
        # Validate everything before adding anything: a bad prompt in the
        # middle of a list must not leave half the batch running.
        processed = [self.processor.process_prompt(p) for p in prompts]
        params_list = [self.processor.process_params(p) for p in params_list]
        adapters = [self.processor.process_lora(r) for r in self._per_prompt_lora(lora_request, len(prompts))]
        request_ids = [
            self._add_request(pp, params, prio, cache_salt, adapter)
            for pp, params, prio, adapter in zip(processed, params_list, priorities, adapters)
        ]
        results = self._run_to_completion(len(request_ids), use_tqdm)
        return [results[rid] for rid in request_ids]

    @staticmethod
    def _per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"sampling_params: got {len(params)} for {n} prompts; give one or one per prompt")
        return params

    @staticmethod
    def _per_prompt_lora(lora_request, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        requests = list(lora_request)
        if len(requests) != n:
            raise ValueError(f"lora_request: got {len(requests)} for {n} prompts; give one or one per prompt")
        return requests

    def _priorities(self, priority, n: int) -> list[int]:
        if priority is None:
            return [0] * n
        priority = list(priority)
        if len(priority) != n:
            raise ValueError(f"priority: got {len(priority)} values for {n} prompts")
        if any(p != 0 for p in priority) and self.config.scheduler.policy != SchedulingPolicy.PRIORITY:
            raise ValueError("priority: non-zero priorities need scheduling_policy='priority'")
        return priority

    def _add_request(
        self, pp: ProcessedPrompt, params: SamplingParams, priority: int, salt: str | None,
        adapter: AdapterSpec | None = None,
    ) -> str:
        request_id = str(next(self._request_counter))
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = [(f"{i}_{request_id}", params.clone_for_child(i)) for i in range(params.n)]
        self.output_processor.add_request(
            request_id, pp.prompt, pp.prompt_token_ids, [c for c, _ in children], [p for _, p in children]
        )
        for child_id, child_params in children:
            self.engine_core.add_request(
                Request(child_id, pp.prompt_token_ids, child_params, priority=priority, cache_salt=salt,
                        lora=adapter)
            )
        return request_id

    def _run_to_completion(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=num_requests, desc="Processed prompts", disable=not use_tqdm)
        while self.engine_core.has_unfinished_requests():
            outputs = self.engine_core.step()
            finished, to_abort = self.output_processor.process_outputs(outputs)
            if to_abort:
                self.engine_core.abort_requests(to_abort)
            for out in finished:
                results[out.request_id] = out
            bar.update(len(finished))
        bar.close()
        return results
