"""Turns user inputs into engine requests, rejecting bad input with ValueError."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine_pod.config import EngineConfig
from engine_pod.lora.adapter import inspect_adapter
from engine_pod.lora_request import AdapterSpec, LoRARequest
from engine_pod.sampling_params import SamplingParams
from tessera.text import encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A prompt is text, or vLLM's token form {"prompt_token_ids": [...]}.
PromptType = str | dict[str, Any]


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class Processor:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = config.model.arch.vocab_size
        self.max_model_len = config.model.max_model_len
        # lora_int_id -> the adapter checked under it: one id names one adapter for the engine's life.
        self._adapters: dict[int, AdapterSpec] = {}

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = encode_prompt(self.tokenizer, prompt)
            text: str | None = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
                raise ValueError("prompt_token_ids must be a list of integers")
            ids = list(ids)
        else:
            raise ValueError("prompt must be a string or a dict with 'prompt_token_ids'")
        self._validate_token_ids(ids)
        return ProcessedPrompt(text, ids)

    def _validate_token_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"prompt: the prompt has {len(ids)} tokens, longer than max_model_len={self.max_model_len}"
            )

    def process_lora(self, lora_request: LoRARequest | None) -> AdapterSpec | None:
        """Check the adapter a request names (read once per id); ValueError
        for an engine without LoRA, a bad folder, or an id reused for another adapter."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        lora = self.config.lora
        if lora is None:
            raise ValueError("lora_request: this engine was started without enable_lora")
        known = self._adapters.get(lora_request.lora_int_id)
        if known is not None:
            if (known.name, known.path) != (lora_request.lora_name, lora_request.lora_path):
                raise ValueError(
                    f"lora_request: lora_int_id {lora_request.lora_int_id} already names adapter {known.name!r} "
                    f"({known.path}); give another adapter another id"
                )
            return known
        spec = inspect_adapter(lora_request, self.config.model.arch, lora.max_lora_rank)
        self._adapters[spec.lora_int_id] = spec
        return spec

    def process_params(self, params: SamplingParams) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad} are outside the vocabulary [0, {self.vocab_size})")
        if self.config.simulated:
            _check_simulable(params)
        elif params.structured_outputs is not None:
            # A malformed schema, regex or grammar is refused here, not found
            # later by a compile thread (xgrammar, imported only by engines that compile).
            from engine_pod.structured_output.backend_xgrammar import validate as validate_structured_outputs

            validate_structured_outputs(params.structured_outputs)
        params = replace(params)  # never mutate the caller's object
        params.resolve_stop_token_ids(self.eos_token_ids)
        return params


def _check_simulable(params: SamplingParams) -> None:
    """A simulated engine (engine_pod/sim) emits deterministic token ids and
    computes no probabilities: what it cannot honour is refused, not faked."""
    if params.structured_outputs is not None:
        raise ValueError("structured_outputs: a simulated engine runs no grammars")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            raise ValueError(f"{name}: a simulated engine computes no probabilities")
