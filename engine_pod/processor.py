"""Turns user inputs into engine requests, rejecting bad input with ValueError."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine_pod.config import EngineConfig
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
    if params.logprobs is not None:
        raise ValueError("logprobs: a simulated engine computes no probabilities")
